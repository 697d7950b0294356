"""The ``(N, C, S)`` strided view that the SyncBatchNorm kernels work on.

A BatchNorm input ``(N, C, *spatial)`` is reduced over every dim but C. When the spatial
dims can be walked with one stride, the tensor *is* a 3-D strided view ``(N, C, S)``: that
holds for contiguous (NCHW) and channels_last (NHWC / NDHWC) tensors alike, so the kernels
read either layout in place. Only a layout that is neither (e.g. a transposed spatial dim or
a strided slice) is copied to contiguous first.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch._prims_common import suggest_memory_format


class NCSLayout(NamedTuple):
    """Sizes and element strides of the ``(N, C, S)`` view; ``N == 1`` when the batch dim was
    folded into ``S`` (channels-last and ``(N, C)`` inputs)."""

    N: int
    C: int
    S: int
    stride_n: int
    stride_c: int
    stride_s: int


def _spatial_stride(x: torch.Tensor) -> int | None:
    """The single stride that walks all spatial dims in order, or None if there is none."""
    dims = [(size, stride) for size, stride in zip(x.shape[2:], x.stride()[2:]) if size != 1]
    if not dims:
        return 1
    for (_, outer_stride), (inner_size, inner_stride) in zip(dims, dims[1:]):
        if outer_stride != inner_stride * inner_size:
            return None
    return dims[-1][1]


def _is_dense(layout: NCSLayout) -> bool:
    """True if the three dims tile their storage exactly once (no gaps, no overlap): then
    ``torch.empty_like`` gives an output with the very same strides."""
    dims = sorted((stride, size) for size, stride in
                  ((layout.N, layout.stride_n), (layout.C, layout.stride_c), (layout.S, layout.stride_s))
                  if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def ncs_layout(x: torch.Tensor) -> NCSLayout | None:
    """The dense ``(N, C, S)`` view of ``x``, or None when ``x`` must be copied first."""
    N, C = x.shape[0], x.shape[1]
    S = math.prod(x.shape[2:])
    stride_s = _spatial_stride(x)
    if stride_s is None:
        return None
    stride_n, stride_c = x.stride(0), x.stride(1)
    if S == 1:
        stride_s = stride_n  # rows are the samples themselves
    layout = NCSLayout(N, C, S, stride_n, stride_c, stride_s)
    if not _is_dense(layout):
        return None
    # Fold the batch into the spatial run when it continues it (channels-last, (N, C)):
    # one long row axis fills tiles that would otherwise be one short row per sample.
    if N > 1 and (S == 1 or stride_n == S * stride_s):
        layout = NCSLayout(1, C, N * S, N * S * stride_s, stride_c, stride_s)
    return layout


def as_ncs(x: torch.Tensor) -> tuple[torch.Tensor, NCSLayout]:
    """``x`` (copied to contiguous only if its layout has no dense ``(N, C, S)`` view) and
    its layout."""
    if x.numel() == 0:  # nothing is read or written; any strides will do
        N, C, S = x.shape[0], x.shape[1], math.prod(x.shape[2:])
        return x, NCSLayout(N, C, S, C * S, S, 1)
    layout = ncs_layout(x)
    if layout is None:
        x = x.contiguous()
        layout = ncs_layout(x)
        assert layout is not None, "a contiguous tensor always has an (N, C, S) view"
    return x, layout


def like_layout(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` with exactly ``ref``'s strides (a copy only when they differ): the elementwise
    kernels index all their operands with one set of strides."""
    if t.stride() == ref.stride():
        return t
    out = torch.empty_like(ref, dtype=t.dtype)
    out.copy_(t)
    return out


# Note [the output's memory format]
#     The kernels read an input in place whenever it has a dense (N, C, S) view, and wrote an
#     output of the very same strides: an (N, C, L) input stored as (N, L, C), or a transposed
#     (N, C) one, gave an output of those strides. torch's BatchNorm on CPU returns the input's
#     suggested memory format instead -- channels_last for such 4-D and 5-D inputs, contiguous
#     for everything else -- and so does torch.nn.SyncBatchNorm's synchronized forward on CUDA,
#     which makes its input contiguous (unless channels_last) before its kernels run. The output
#     takes that format on every device (one copy, for those unusual layouts only); the values
#     are the same. torch's BatchNorm on CUDA may keep the input's strides, depending on the
#     kernel it picks: code should not rely on an output's strides matching its input's.
def torch_output_format(x: torch.Tensor) -> torch.memory_format:
    """The memory format torch's BatchNorm gives its output for ``x`` (Note [the output's
    memory format])."""
    return suggest_memory_format(x)
