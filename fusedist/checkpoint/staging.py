"""The snapshot half of an asynchronous save: copy state into host buffers the training loop
no longer writes, so serialization can run in the background.

Buffers are kept between saves and reused when a tensor keeps its place, shape and dtype
(as torch DCP's staging cache does): a fresh allocation per save would pay page faults on
every byte, which costs more than the copy itself. On CUDA the host buffers are pinned and
the copies are asynchronous, with one synchronization at the end. The caller must not stage
again while a previous snapshot is still being written (one save in flight).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .._wrapper import values_of


class StagingBuffers:
    """Reusable host copies of a nested state (dicts, lists, tuples of tensors and values)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._used: set = set()
        self._cuda = False
        self.bytes = 0  # bytes copied by the last stage()

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this object's host buffers."""
        self._used, self._cuda, self.bytes = set(), False, 0
        self._seen: dict[tuple, torch.Tensor] = {}  # tied tensors (shared embeddings) stay shared
        out = self._copy(state, ())
        for key in [k for k in self._buffers if k not in self._used]:
            del self._buffers[key]  # state that went away (e.g. a parameter group removed)
        if self._cuda:
            torch.cuda.synchronize()
        return out

    def _copy(self, obj: Any, path: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if isinstance(obj, dict):
            out = {k: self._copy(v, path + (k,)) for k, v in obj.items()}
            return out if type(obj) is dict else _same_kind(obj, out)
        if isinstance(obj, list):
            return [self._copy(v, path + (i,)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._copy(v, path + (i,)) for i, v in enumerate(obj))
        if isinstance(obj, (int, float, str, bool, bytes, type(None), torch.dtype, torch.device)):
            return obj
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, path: tuple) -> torch.Tensor:
        t = values_of(t).detach()  # (a wrapper subclass has no storage of its own: its wrapped tensor)
        if is_traceable_wrapper_subclass(t):
            return self._subclass(t, path)
        if t.is_sparse or t.layout != torch.strided or t.numel() == 0:
            return t.to("cpu", copy=True)
        alias = (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if alias in self._seen:
            return self._seen[alias]
        pin = t.device.type == "cuda"
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        self._used.add(path)
        buf.copy_(t, non_blocking=pin)
        self._cuda |= pin
        self.bytes += t.numel() * t.element_size()
        self._seen[alias] = buf
        return buf

    def _subclass(self, t: torch.Tensor, path: tuple) -> torch.Tensor:
        """Quantized storage (an NF4 weight of a DDP model) staged as its inner tensors, the
        subclass rebuilt over their host copies: ``copy_`` into a plain buffer would go through
        the subclass's own ops, which refuse it (or quantize again)."""
        from ..fsdp.packed import ctx_on

        names, ctx = t.__tensor_flatten__()
        inner = {n: self._tensor(getattr(t, n), path + (n,)) for n in names}
        return type(t).__tensor_unflatten__(inner, ctx_on(ctx, torch.device("cpu")), t.shape, t.stride())


def _same_kind(original: dict, items: dict) -> dict:
    """``items`` in a dict of ``original``'s type and attributes -- a ``Counter`` (MultiStepLR's
    milestones), a ``defaultdict``'s factory, an ``OrderedDict`` -- as ``torch.save`` keeps them:
    a plain dict came back from a restore, and MultiStepLR's ``step(epoch)`` failed on it."""
    try:
        kept = copy.copy(original)
        kept.clear()
        kept.update(items)
    except Exception:  # noqa: BLE001 - a subclass that cannot be copied so: its items, as a dict
        return items
    return kept
