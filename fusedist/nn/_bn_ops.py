"""SyncBatchNorm's local (per-rank) computations, each routed to one implementation.

``fusedist.backend.select_backend`` picks Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``)
or the pure-PyTorch reference. The kernels compute in fp32, so fp64 inputs always take the
reference path (which computes in fp64). Empty inputs never launch a kernel.
"""

from __future__ import annotations

import torch

from .._dtypes import compute_dtype
from ..backend import select_backend
from . import _bn_reference as reference
from ._layout import NCSLayout

OP_NAME = "sync_batch_norm"
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kernels(x: torch.Tensor):
    """The Triton launcher module when it should run ``x``, else None (imported lazily:
    importing it imports triton)."""
    if x.dtype not in _KERNEL_DTYPES:
        return None
    if select_backend(OP_NAME, x.device) != "triton":
        return None
    from ..triton_kernels import syncbn

    return syncbn


def stats_payload(x: torch.Tensor, layout: NCSLayout, tail: int = 0) -> torch.Tensor:
    """This rank's ``[count, mean (C), M2 (C)]`` as one flat fp64 tensor on x's device: the
    message the forward all-gather carries (fp64 so that counts stay exact and the
    cross-rank combine adds no rounding of its own), followed by ``tail`` elements left for
    the caller to write (the layer's identity: no concatenation to send both)."""
    C = layout.C
    payload = torch.empty(2 * C + 1 + tail, dtype=torch.float64, device=x.device)
    count, mean, m2 = payload[:1], payload[1:C + 1], payload[C + 1:2 * C + 1]
    kernels = _kernels(x)
    if kernels is None or x.numel() == 0:
        reference.welford_stats(x, mean, m2, count)
    else:
        kernels.welford_stats(x, layout, mean, m2, count)
    return payload


def backward_reduce(dy: torch.Tensor, x: torch.Tensor, layout: NCSLayout, mean: torch.Tensor,
                    invstd: torch.Tensor) -> torch.Tensor:
    """Per-channel ``[sum(dy), sum(dy * xhat)]``, (2, C); dy must share x's strides."""
    kernels = _kernels(x)
    if x.numel() == 0:
        return torch.zeros((2, layout.C), dtype=compute_dtype(x.dtype), device=x.device)
    if kernels is None:
        return reference.backward_reduce(dy, x, mean, invstd)
    return kernels.backward_reduce(dy, x, layout, mean, invstd)


def channel_affine(u: torch.Tensor, layout: NCSLayout, p, q, v=None, r=None, t=None, b=None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(u - p) * q [+ (v - r) * t] [+ b]`` per channel, in a new tensor (v, when given,
    must share u's strides). The kernels write u's strides; the reference path returns what
    torch's ops return (the same memory format for contiguous/channels_last tensors)."""
    kernels = _kernels(u)
    if kernels is None or u.numel() == 0:
        return reference.channel_affine(u, p, q, v, r, t, b, out_dtype=out_dtype)
    out = torch.empty_like(u, dtype=out_dtype or u.dtype)
    assert out.stride() == u.stride(), "dense inputs give empty_like outputs with equal strides"
    return kernels.channel_affine(out, u, layout, p, q, v, r, t, b)


def combine_ranks(gathered: torch.Tensor, x: torch.Tensor, C: int, total: int, eps: float, momentum: float,
                  weight, bias, running_mean, running_var):
    """The global batch's ``(mean, invstd, scale, shift)`` for normalizing ``x`` (fp32;
    ``shift`` None without a bias), merged from the gathered per-rank statistics, with the
    running statistics blended in place when given, in one kernel launch -- or None where the
    kernels do not take ``x`` (then the caller combines with torch ops). ``total`` > 0."""
    kernels = _kernels(x)
    if kernels is None or not _kernels_read(x, weight, bias, running_mean, running_var):
        return None  # (fp64 buffers keep their precision on the torch path)
    out = kernels.combine_ranks(gathered, C, total, eps, momentum, weight, bias, running_mean, running_var)
    return out[0], out[1], out[2], (out[3] if bias is not None else None)


def input_grad(dy: torch.Tensor, x: torch.Tensor, layout: NCSLayout, sums: torch.Tensor, mean: torch.Tensor,
               invstd: torch.Tensor, weight, count: int):
    """SyncBatchNorm's input gradient from the all-reduced (2, C) ``sums``, the per-channel
    factors made inside one kernel launch (Note [the backward's factors in the kernel] in
    _function.py) -- or None where the kernels do not take ``x`` (the caller then makes them
    with torch ops and calls :func:`channel_affine`). dy must share x's strides."""
    kernels = _kernels(x)
    if kernels is None or x.numel() == 0 or not _kernels_read(x, sums, weight):
        return None
    out = torch.empty_like(x)
    assert out.stride() == x.stride(), "dense inputs give empty_like outputs with equal strides"
    return kernels.input_grad(out, dy, x, layout, sums, mean, invstd, weight, count)


def _kernels_read(x: torch.Tensor, *per_channel) -> bool:
    """Whether the kernels can read these per-channel tensors (None: absent) for ``x``:
    contiguous, on x's device, of a kernel dtype."""
    return all(t is None or (t.is_contiguous() and t.device == x.device and t.dtype in _KERNEL_DTYPES)
               for t in per_channel)
