"""The tensors inside a unit's inputs and outputs, and copies of those with tensors replaced.

A unit hooks the tensors its forward returns (its backward gathers the unit again from
them) and casts its inputs and outputs (``MixedPrecisionPolicy``), so it must find them in
whatever container a forward takes or returns. As torch's FSDP2: tensors, lists and tuples,
namedtuples, dicts and dataclasses, nested. A tensor missed in an output is worse than a
missed cast: nothing regathers the unit before its backward, which then reads freed
parameters. Copies keep the container's type (an ``OrderedDict`` or a model-output dict
subclass stays one, a dataclass stays that dataclass), so attribute access on a cast output
still works.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch

__all__ = ["all_tensors", "map_tensors", "grad_tensors"]


def _is_dataclass_instance(obj) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` inside it replaced by ``fn(t)`` (new containers, same types)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if _is_dataclass_instance(obj):  # (before dict: a model output may be both)
        return dataclasses.replace(obj, **{f.name: map_tensors(fn, getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: map_tensors(fn, v) for k, v in obj.items()}
        out = copy.copy(obj)  # a subclass (OrderedDict, defaultdict, ...) keeps its type and settings
        for k, v in obj.items():
            out[k] = map_tensors(fn, v)
        return out
    return obj


def all_tensors(obj: Any, out: list) -> list:
    """Append to ``out`` every tensor inside ``obj`` (in traversal order)."""
    return _collect(obj, out, lambda t: True)


def grad_tensors(obj: Any, out: list) -> list:
    """Append to ``out`` the tensors inside ``obj`` that require gradients (in traversal order)."""
    return _collect(obj, out, lambda t: t.requires_grad)


def _collect(obj: Any, out: list, keep: Callable[[torch.Tensor], bool]) -> list:
    if isinstance(obj, torch.Tensor):
        if keep(obj):
            out.append(obj)
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name), out, keep)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, out, keep)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out, keep)
    return out
