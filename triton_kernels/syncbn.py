"""Triton kernels of SyncBatchNorm: per-channel statistics, normalize, backward.

Every kernel sees its input as a strided 3-D view ``(N, C, S)`` -- batch, channel, the
flattened spatial dims -- with one stride per dim. Contiguous (NCHW) and channels_last
(NHWC) tensors are both such views, so neither is copied into the other's layout: a tile is
``[BLOCK_S, BLOCK_C]`` and Triton's coalescing follows whichever of ``stride_s`` /
``stride_c`` is 1 (integer arguments equal to 1 are specialized at compile time).
Channels-last and ``(N, C)`` inputs arrive with the batch folded into ``S`` (``N == 1``),
which gives full tiles instead of one short row per sample.

Statistics are fp32 whatever the input dtype (fp32, fp16, bf16). Reductions write one row
of partial results per program along the row axis and a second, small kernel (or a
fixed-order torch sum) combines the rows, so results are deterministic: no atomics anywhere.
Spatially contiguous inputs with few values per channel and many channels (ResNet's late
layers) take one program per channel instead, one launch (Note [one program per channel] in
syncbn_reduce.py).

The kernels live by kind: ``syncbn_reduce.py`` (the statistics and the backward's sums),
``syncbn_elementwise.py`` (normalize, input gradient), ``syncbn_combine.py`` (the forward's
cross-rank combine). This module holds their launchers.

Launchers (the only public functions) take the tensors plus the ``(N, C, S, stride_n,
stride_c, stride_s)`` layout computed by ``fusedist.nn._layout``; they choose block sizes and
grids and nothing else.
"""

from __future__ import annotations

import struct

import torch

from ..backend import triton_interpreting
from . import syncbn_combine
from .launch_cache import cached
from .syncbn_combine import _rank_combine_kernel
from .syncbn_elementwise import _channel_affine_kernel, _input_grad_kernel
from .syncbn_reduce import (
    _backward_reduce_channel_kernel, _backward_reduce_kernel, _welford_channel_kernel, _welford_combine_kernel,
    _welford_partial_kernel,
)

# The combine kernel's fp64 helper, where it was before the kernels moved: the counterpart of
# ``_fp64_parts`` below, for kernels that take fp64 scalars as three fp32 arguments too.
_fp64_from_parts = syncbn_combine._fp64_from_parts

# ----------------------------------------------------------------------------- launchers

_INT32_LIMIT = 2**31 - 1


# Note [launch arithmetic in plain Python]
#     The launchers run on every BatchNorm call, and on ResNet's late layers (7x7 and 14x14
#     maps) the kernels are short enough that the host's time per call can be most of the cost
#     (an H200 run measured 113 us for statistics that torch computes in 11 us; how much of it
#     is host time is what bench_syncbn's host column says). ``triton.cdiv`` and
#     ``triton.next_power_of_2`` are constexpr functions whose host-side call unwraps every
#     argument (about 2 us each on the CI machine, seven per statistics call); these two do the
#     same integer arithmetic directly.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n, as ``triton.next_power_of_2`` (0 for 0)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


def _tile(C: int, S: int, stride_c: int, tile_elems: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_C) for a tile of about ``tile_elems`` elements.

    Channel-contiguous layouts (stride_c == 1) take a wide channel block so that a tile row
    is one coalesced run; otherwise the spatial run is the contiguous one and gets the room.
    """
    c_pow2 = _next_pow2(max(C, 1))
    s_pow2 = _next_pow2(max(S, 1))
    if stride_c == 1 and C > 1:
        block_c = min(c_pow2, 64 if not triton_interpreting() else tile_elems)
        block_s = max(1, min(s_pow2, tile_elems // block_c))
    else:
        block_s = min(s_pow2, tile_elems)
        block_c = max(1, min(c_pow2, tile_elems // block_s))
    return block_s, block_c


# Note [channel blocks on the grid's second axis]
#     The elementwise kernels (normalize, input gradient) run a 2-D grid: (batch x spatial
#     tiles) on the first axis, channel blocks on the second, which CUDA caps at 65535 programs
#     (the first axis takes 2^31 - 1). A contiguous input with a long spatial run gets a one-
#     channel block (the tile goes to the run), so a layer of more than 65535 channels -- an
#     embedding-sized BatchNorm1d over (N, C, L) -- failed to launch on a GPU while the
#     interpreter, which has no such cap, ran it. The launchers widen the channel block (and
#     shorten the spatial one, the tile's size unchanged) until the blocks fit.
_GRID_AXIS1_LIMIT = 65535


def _elementwise_tile(C: int, S: int, stride_c: int, tile_elems: int) -> tuple[int, int]:
    """``_tile`` for the elementwise kernels, whose channel blocks must fit the grid's second
    axis (Note [channel blocks on the grid's second axis])."""
    block_s, block_c = _tile(C, S, stride_c, tile_elems)
    while _cdiv(C, block_c) > _GRID_AXIS1_LIMIT:
        block_c *= 2
        block_s = max(1, block_s // 2)
    return block_s, block_c


def _wide_index(layout, C: int, S: int) -> bool:
    _, _, _, _, stride_c, stride_s = layout
    return (S - 1) * abs(stride_s) + (C - 1) * abs(stride_c) + 1 > _INT32_LIMIT


_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    """The device's multiprocessor count, asked once per device: the launchers run for every
    BatchNorm layer of every step, and the properties lookup costs host time each call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNTS.get(index)
    if count is None:
        count = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def _row_splits(num_units: int, num_c_blocks: int, device: torch.device) -> int:
    """Programs along the row axis: about four waves of programs on a GPU; two on CPU (the
    interpreter), where every program costs ~1 ms regardless of size but the partial-row
    combine should still be exercised."""
    if device.type == "cuda":
        target = max(1, (4 * _sm_count(device)) // max(num_c_blocks, 1))
    else:
        target = 2
    return max(1, min(num_units, target))


def _reduction_tile(device: torch.device) -> int:
    """Elements per reduction tile: 2048 keeps two fp32 accumulator tiles in registers at 4
    warps; the interpreter wants the largest tiles it can get."""
    return 65536 if triton_interpreting() else 2048


# Where one program per channel takes a reduction (Note [one program per channel] in
# syncbn_reduce.py): at most this many values per channel after padding N and S to powers of
# two (the statistics' one tile; the backward reduce walks it as two 4096-value tiles), and
# channels enough to give the GPU's 132 multiprocessors two programs each, up to the widths the
# row-split path is already ahead at (2048x7x7: 1.4x torch's kernels on an H200).
_CHANNEL_PATH_MAX_VALUES = 8192
_CHANNEL_PATH_TILE = 4096
_CHANNEL_PATH_MIN_C = 256
_CHANNEL_PATH_MAX_C = 1024


def _channel_path(layout) -> tuple[int, int] | None:
    """``(BLOCK_N, BLOCK_S)`` when one program per channel takes this input, else None."""
    N, C, S, _, _, stride_s = layout
    if stride_s != 1 or N < 2 or S < 1 or not _CHANNEL_PATH_MIN_C <= C <= _CHANNEL_PATH_MAX_C:
        return None  # (N < 2 also leaves out empty batches and channels_last's folded layouts)
    block_s = _next_pow2(S)
    if _next_pow2(N) * block_s > _CHANNEL_PATH_MAX_VALUES:  # (the statistics' single tile)
        return None
    return max(1, min(_next_pow2(N), _CHANNEL_PATH_TILE // block_s)), block_s


def welford_stats(x: torch.Tensor, layout, mean_out: torch.Tensor, m2_out: torch.Tensor,
                  count_out: torch.Tensor) -> None:
    """Per-channel count, mean and M2 of ``x`` (fp32 math) into 1-element ``count_out`` and
    C-element ``mean_out`` / ``m2_out`` (any float dtype; each contiguous)."""
    N, C, S, stride_n, stride_c, stride_s = layout
    blocks = _channel_path(layout)
    if blocks is not None:
        block_n, block_s = _next_pow2(N), blocks[1]
        cached(_welford_channel_kernel)[(C,)](
            x, mean_out, m2_out, count_out, N * S, N, S, stride_n, stride_c,
            BLOCK_N=block_n, BLOCK_S=block_s, WIDE_INDEX=_wide_index(layout, C, S),
            num_warps=4 if block_n * block_s <= 2048 else 8,
        )
        return
    block_s, block_c = _tile(C, S, stride_c, _reduction_tile(x.device))
    num_s_tiles = _cdiv(S, block_s)
    num_c_blocks = _cdiv(C, block_c)
    split = _row_splits(N * num_s_tiles, num_c_blocks, x.device)
    mean_part = torch.empty((split, C), device=x.device, dtype=torch.float32)
    m2_part = torch.empty_like(mean_part)
    count_part = torch.empty((split,), device=x.device, dtype=torch.int32)
    cached(_welford_partial_kernel)[(num_c_blocks, split)](
        x, mean_part, m2_part, count_part,
        N, C, S, stride_n, stride_c, stride_s, num_s_tiles, split,
        BLOCK_S=block_s, BLOCK_C=block_c, WIDE_INDEX=_wide_index(layout, C, S),
    )
    if triton_interpreting():
        block_p, block_cc = _next_pow2(split), _next_pow2(C)
    else:
        block_p, block_cc = min(_next_pow2(split), 32), min(_next_pow2(C), 64)
    cached(_welford_combine_kernel)[(_cdiv(C, block_cc),)](
        x, mean_part, m2_part, count_part, mean_out, m2_out, count_out, split, C, N * S, stride_c,
        BLOCK_P=block_p, BLOCK_C=block_cc,
    )


def backward_reduce(dy: torch.Tensor, x: torch.Tensor, layout, mean: torch.Tensor,
                    invstd: torch.Tensor) -> torch.Tensor:
    """Per-channel ``[sum(dy), sum(dy * xhat)]`` as a (2, C) fp32 tensor, one pass over dy
    and x (which must share ``layout``)."""
    N, C, S, stride_n, stride_c, stride_s = layout
    blocks = _channel_path(layout)
    if blocks is not None:
        out = torch.empty((2, C), device=x.device, dtype=torch.float32)
        cached(_backward_reduce_channel_kernel)[(C,)](
            dy, x, mean, invstd, out, N, C, S, stride_n, stride_c,
            BLOCK_N=blocks[0], BLOCK_S=blocks[1], WIDE_INDEX=_wide_index(layout, C, S),
        )
        return out
    block_s, block_c = _tile(C, S, stride_c, _reduction_tile(x.device))
    num_s_tiles = _cdiv(S, block_s)
    num_c_blocks = _cdiv(C, block_c)
    split = _row_splits(N * num_s_tiles, num_c_blocks, x.device)
    part = torch.empty((split, 2, C), device=x.device, dtype=torch.float32)
    cached(_backward_reduce_kernel)[(num_c_blocks, split)](
        dy, x, mean, invstd, part,
        N, C, S, stride_n, stride_c, stride_s, num_s_tiles, split,
        BLOCK_S=block_s, BLOCK_C=block_c, WIDE_INDEX=_wide_index(layout, C, S),
    )
    # A fixed-order sum over the split rows: deterministic and a single small launch.
    return part.sum(dim=0)


def channel_affine(out: torch.Tensor, u: torch.Tensor, layout, p: torch.Tensor, q: torch.Tensor,
                   v: torch.Tensor | None = None, r: torch.Tensor | None = None,
                   t: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
    """``out = (u - p) * q [+ (v - r) * t] [+ b]`` with per-channel p, q, r, t, b (fp32,
    contiguous, C elements); out, u and v share ``layout``. Returns ``out``."""
    N, C, S, stride_n, stride_c, stride_s = layout
    block_s, block_c = _elementwise_tile(C, S, stride_c, 65536 if triton_interpreting() else 4096)
    num_s_tiles = _cdiv(S, block_s)
    grid = (N * num_s_tiles, _cdiv(C, block_c))
    has_v, has_b = v is not None, b is not None
    cached(_channel_affine_kernel)[grid](
        out, u, v if has_v else u, p, q, r if has_v else p, t if has_v else q, b if has_b else p,
        C, S, stride_n, stride_c, stride_s, num_s_tiles,
        HAS_V=has_v, HAS_B=has_b,
        BLOCK_S=block_s, BLOCK_C=block_c, WIDE_INDEX=_wide_index(layout, C, S),
    )
    return out


def input_grad(out: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, layout, sums: torch.Tensor,
               mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor | None, count: int) -> torch.Tensor:
    """``out`` = SyncBatchNorm's input gradient from the all-reduced (2, C) ``sums`` over a
    global batch of ``count`` values per channel (out, dy and x share ``layout``; the
    per-channel tensors fp32 and contiguous but ``weight``, any float dtype). Returns ``out``."""
    N, C, S, stride_n, stride_c, stride_s = layout
    block_s, block_c = _elementwise_tile(C, S, stride_c, 65536 if triton_interpreting() else 4096)
    num_s_tiles = _cdiv(S, block_s)
    cached(_input_grad_kernel)[(N * num_s_tiles, _cdiv(C, block_c))](
        out, dy, x, sums, mean, invstd, weight if weight is not None else invstd, count,
        C, S, stride_n, stride_c, stride_s, num_s_tiles,
        HAS_WEIGHT=weight is not None, BLOCK_S=block_s, BLOCK_C=block_c, WIDE_INDEX=_wide_index(layout, C, S),
    )
    return out


def _fp64_parts(value: float) -> tuple[float, float, float]:
    """Three fp32 numbers summing exactly to ``value`` (Note [fp64 scalars as three fp32
    arguments] in syncbn_combine.py)."""
    hi = _to_fp32(value)
    mid = _to_fp32(value - hi)
    return hi, mid, _to_fp32(value - hi - mid)


def _to_fp32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def combine_ranks(gathered: torch.Tensor, C: int, total: int, eps: float, momentum: float,
                  weight: torch.Tensor | None, bias: torch.Tensor | None,
                  running_mean: torch.Tensor | None, running_var: torch.Tensor | None) -> torch.Tensor:
    """The gathered ``(W, row_len)`` fp64 statistics merged into a (4, C) fp32 tensor of the
    mean, invstd, scale (invstd * weight) and shift (bias; unwritten without one), and the
    running statistics blended in place when given (each contiguous). One launch."""
    W, row_len = gathered.shape
    out = torch.empty((4, C), dtype=torch.float32, device=gathered.device)
    block_c = _next_pow2(C) if triton_interpreting() else min(_next_pow2(C), 256)
    update = running_mean is not None
    cached(_rank_combine_kernel)[(_cdiv(C, block_c),)](
        gathered, out, weight if weight is not None else out, bias if bias is not None else out,
        running_mean if update else out, running_var if update else out,
        W, row_len, C, total, *_fp64_parts(eps), *_fp64_parts(momentum),
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, UPDATE_RUNNING=update, BLOCK_C=block_c,
    )
    return out
