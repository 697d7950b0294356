"""Outputs of a unit that are views of its gathered parameters, copied before the unit reshards.

Note [outputs that are views of the gathered parameters]
    A unit whose forward returns a view of one of its own parameters -- a learned position
    table's ``self.weight[:n]``, a module handing out its weight -- returns a view of the
    gathered buffer. The reshard after forward frees that buffer's storage under the view, and
    the caller then reads freed memory: the process crashes, or computes on garbage (torch's
    FSDP2 crashes too). The unsharded model hands out the live values. So before a reshard after
    forward, an output sharing storage with the unit's gathered parameters is replaced by a
    copy, as the caller would write ``.clone()``: the copy's backward is the view's, so its
    gradient still reaches the parameter (through the unit's backward, which gathers again).
    Only such outputs are copied, and the check is one storage comparison per output tensor,
    made where the unit will reshard after forward: at the end of its outermost call, and at the
    end of each member's call of a list of modules sharded as one unit (the list reshards after
    its last member, while the earlier members' outputs are in use). A call that keeps the unit
    gathered copies nothing."""

from __future__ import annotations

from typing import Any

import torch

from .containers import all_tensors, map_tensors

__all__ = ["copy_views_of_gathered"]


def copy_views_of_gathered(unit, output: Any) -> Any:
    """``output`` with each tensor that shares storage with ``unit``'s gathered parameters
    replaced by a copy (Note [outputs that are views of the gathered parameters]); ``output``
    itself where none does."""
    if not unit.is_unsharded:
        return output
    outputs = all_tensors(output, [])
    if not outputs:
        return output
    freed = _freed_by_reshard(unit)
    if not any(_storage_ptr(t) in freed for t in outputs):
        return output
    return map_tensors(lambda t: t.clone() if _storage_ptr(t) in freed else t, output)


def _freed_by_reshard(unit) -> set:
    """Where the storages a reshard frees start: the gathered buffers (one per section, all in one
    storage where the unit has one dtype), the copy-out buffers of dim-sharded sections and the
    parameters an all-gather extension built (what ``_resize_full`` frees, buffers.py)."""
    buffers = list(unit.fulls) + [o for o in unit.outs if o is not None]
    buffers += [u for u, ext in zip(unit.unsharded, unit.ext) if ext is not None and u is not None]
    return {_storage_ptr(b) for b in buffers} - {None}


def _storage_ptr(t: torch.Tensor):
    """Where ``t``'s storage starts; None for a tensor without one of its own (a wrapper
    subclass, an empty or meta storage)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return ptr or None
