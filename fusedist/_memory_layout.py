"""Which tensors can be handled as flat memory: the elementwise optimizer kernels and the
flat gradient / parameter buffers of DDP and ZeRO.

The optimizer kernels (Triton and the C++ CPU Adam) see a tensor as ``data_ptr`` and
``numel``. That is right for any tensor whose elements fill ``numel`` consecutive slots in some
order of its dimensions -- contiguous, channels_last, a transposed weight -- provided every
tensor stepped together with it (gradient, states, master) stores each logical element at the
same offset.
"""

from __future__ import annotations

import torch


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` consecutive elements in some order of its
    dimensions (non-overlapping and dense, in torch's terms)."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def layout_of(t: torch.Tensor) -> tuple:
    """Strides of the dimensions with more than one element: two dense tensors of one shape
    and equal layouts store each logical element at the same memory offset."""
    return tuple(st for sz, st in zip(t.shape, t.stride()) if sz != 1)


def walks_like(t: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``t`` (shaped like ``param``) can be walked as flat memory in step with it: both
    contiguous, or both dense with one layout. The kernels' condition for a parameter's
    gradient, states and master."""
    if param.is_contiguous():
        return t.is_contiguous()
    return is_dense(param) and layout_of(t) == layout_of(param)
