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
layers) take one program per channel instead, one launch (Note [one program per channel]).

Launchers (the only public functions) take the tensors plus the ``(N, C, S, stride_n,
stride_c, stride_s)`` layout computed by ``fusedist.nn._layout``; they choose block sizes and
grids and nothing else.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from ..backend import triton_interpreting
from .launch_cache import cached
from .multi_tensor import _to_param

# ----------------------------------------------------------------------------- kernels

# Note [non-finite statistics]
#     torch's CPU BatchNorm takes the batch mean as sum / n, so a channel holding +inf (and
#     no -inf or NaN) has mean +inf, and its running mean becomes +inf; the variance is NaN
#     ((inf - inf)^2), so the output and input gradient are NaN either way. A Welford
#     recurrence instead turns an inf mean into NaN at the next value (inf + (v - inf) / n).
#     So each lane sums its non-finite values apart (``lane_special``: 0, +inf, -inf or NaN,
#     with IEEE rules giving inf + -inf = NaN) and the recurrence sees them as delta 0; the
#     result is ``mean + special`` and M2 is NaN wherever ``special != 0``, which is what
#     sum / n and sum((x - mean)^2) give. (torch's CUDA kernel is a Welford recurrence and
#     reports NaN there: we follow the CPU result, the one the arithmetic defines.)


# Note [statistics about a shift]
#     Each kernel takes its statistics of ``x - K``, K a value of the channel (its first
#     element, or 0 where that is not finite), and adds K back to the mean as it stores it
#     (in the output's dtype: fp64 in the forward's payload). An fp32 mean rounds by about
#     eps * |mean|; where |mean| >> std that rounding is a large part of the spread, and M2
#     taken about a mean off by d gains n * d^2 (the CPU reference was 30-100x torch's
#     running-variance error at |mean| = 1e4 std). Shifted values have a mean within a few
#     std of 0, so the same fp32 arithmetic keeps the mean to eps * std.


# Note [overflowing squares]
#     Values past about 1.8e19 (fp32 and bf16 inputs) square past fp32's range: M2 is +inf, so
#     the variance is inf, invstd 0 and the output the bias, as torch's BatchNorm gives (its
#     running variance inf too). A lane or partial row that saw no value has a count of 0 and a
#     mean of 0, whose squared distance from such a mean is inf as well, and 0 * inf is NaN:
#     the output, the gradients and the running variance were NaN. Empty lanes and rows add an
#     explicit 0 instead.


@triton.jit
def _channel_shift(x_ptr, c_off, c_mask):
    """K per channel (Note [statistics about a shift]): element (0, c, 0), 0 if not finite."""
    k = tl.load(x_ptr + c_off, mask=c_mask, other=0.0).to(tl.float32)
    return tl.where((k - k) == 0.0, k, 0.0)


@triton.jit
def _welford_partial_kernel(
    x_ptr, mean_part_ptr, m2_part_ptr, count_part_ptr,
    N, C, S, stride_n, stride_c, stride_s, num_s_tiles, SPLIT,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, WIDE_INDEX: tl.constexpr,
):
    """Program (c-block, r) -> count, mean, M2 of its channels over rows u = r, r+SPLIT, ...
    (the mean of ``x - K``: Note [statistics about a shift]; the combine adds K back).

    Each lane of the [BLOCK_S, BLOCK_C] tile runs its own Welford recurrence (no cross-lane
    traffic in the loop); the lanes are merged once at the end with the parallel formula
    M2 = sum M2_l + sum n_l (mean_l - mean)^2, which subtracts the global mean rather than
    squaring raw values, so it stays stable when |mean| >> std.

    Lane counts need no per-element bookkeeping: every tile covers all lanes except the last
    tile of each sample, which covers lanes < ``rem``. So a lane has seen ``seen_full +
    seen_last`` values if it is below ``rem`` and ``seen_full`` otherwise, and the Welford
    step 1/count costs two divisions per tile instead of one per element.
    """
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    s_lane = tl.arange(0, BLOCK_S)
    if WIDE_INDEX:
        c_off = c.to(tl.int64) * stride_c
    else:
        c_off = c * stride_c
    shift = _channel_shift(x_ptr, c_off, c_mask)
    rem = S - (num_s_tiles - 1) * BLOCK_S
    in_last_tile = s_lane < rem
    seen_full = tl.zeros([1], dtype=tl.float32)
    seen_last = tl.zeros([1], dtype=tl.float32)
    lane_mean = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    lane_m2 = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    lane_special = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for u in range(pid_r, N * num_s_tiles, SPLIT):
        n = u // num_s_tiles
        s_tile = u - n * num_s_tiles
        is_last = (s_tile == num_s_tiles - 1).to(tl.float32)
        s = s_tile * BLOCK_S + s_lane
        s_mask = s < S
        if WIDE_INDEX:
            s_off = s.to(tl.int64) * stride_s
        else:
            s_off = s * stride_s
        ptrs = x_ptr + n.to(tl.int64) * stride_n + s_off[:, None] + c_off[None, :]
        v = tl.load(ptrs, mask=s_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        # Note [non-finite statistics]: inf/NaN go to lane_special, the recurrence sees delta 0
        finite = (v - v) == 0.0
        lane_special += tl.where(finite, 0.0, v)
        v = tl.where(finite, v - shift[None, :], lane_mean)
        seen_last += is_last
        seen_full += 1.0 - is_last
        step_low = 1.0 / tl.maximum(seen_full + seen_last, 1.0)
        step_high = 1.0 / tl.maximum(seen_full, 1.0)
        # Rows past S keep their state: a zero step, and no M2 contribution.
        step = tl.where(s_mask, tl.where(in_last_tile, step_low, step_high), 0.0)
        delta = v - lane_mean
        lane_mean += delta * step[:, None]
        lane_m2 += tl.where(s_mask[:, None], delta * (v - lane_mean), 0.0)
    lane_count = seen_full + tl.where(in_last_tile, seen_last, 0.0)
    # lane counts are small exact integers; their total is summed as an integer so that it
    # stays exact past 2**24
    count = tl.sum(lane_count.to(tl.int32), axis=0)
    mean = tl.sum(lane_mean * lane_count[:, None], axis=0) / tl.maximum(count.to(tl.float32), 1.0)
    dev = lane_mean - mean[None, :]
    # (an explicit 0 for an empty lane: Note [overflowing squares])
    spread = tl.where(lane_count[:, None] > 0.0, dev * dev * lane_count[:, None], 0.0)
    m2 = tl.sum(lane_m2, axis=0) + tl.sum(spread, axis=0)
    special = tl.sum(lane_special, axis=0)  # 0, +inf, -inf or NaN per channel
    mean += special
    m2 = tl.where(special == 0.0, m2, float("nan"))
    tl.store(mean_part_ptr + pid_r * C + c, mean, mask=c_mask)
    tl.store(m2_part_ptr + pid_r * C + c, m2, mask=c_mask)
    if pid_c == 0:
        tl.store(count_part_ptr + pid_r, count)


@triton.jit
def _welford_combine_kernel(
    x_ptr, mean_part_ptr, m2_part_ptr, count_part_ptr, mean_out_ptr, m2_out_ptr, count_out_ptr,
    P, C, total_count, stride_c, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Merge P partial (count, mean, M2) rows with the k-way parallel formula

        n = sum n_p,  mean = sum n_p mean_p / n,  M2 = sum M2_p + sum n_p (mean_p - mean)^2

    in two vectorized passes over the rows (a row-by-row Chan update would be a chain of P
    dependent global loads). Rows with n_p = 0 contribute nothing; the order of the sums is
    fixed, so the result is deterministic. Outputs are cast to the output pointers' dtype;
    ``total_count`` (known exactly on the host) is written to ``count_out``. The partial means
    are of ``x - K``: K, read again from ``x``, is added in the output's dtype (Note
    [statistics about a shift]).
    """
    pid = tl.program_id(0)
    c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    p_lane = tl.arange(0, BLOCK_P)
    weighted = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    counts = tl.zeros([BLOCK_P], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + p_lane
        p_mask = p < P
        n_p = tl.load(count_part_ptr + p, mask=p_mask, other=0).to(tl.float32)
        m_p = tl.load(mean_part_ptr + p[:, None] * C + c[None, :],
                      mask=p_mask[:, None] & c_mask[None, :], other=0.0)
        weighted += n_p[:, None] * m_p
        counts += n_p
    mean = tl.sum(weighted, axis=0) / tl.maximum(tl.sum(counts, axis=0), 1.0)
    m2_acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + p_lane
        p_mask = p < P
        mask = p_mask[:, None] & c_mask[None, :]
        n_p = tl.load(count_part_ptr + p, mask=p_mask, other=0).to(tl.float32)
        m_p = tl.load(mean_part_ptr + p[:, None] * C + c[None, :], mask=mask, other=0.0)
        m2_p = tl.load(m2_part_ptr + p[:, None] * C + c[None, :], mask=mask, other=0.0)
        dev = m_p - mean[None, :]
        # (an explicit 0 for an empty row: Note [overflowing squares])
        m2_acc += m2_p + tl.where(n_p[:, None] > 0.0, n_p[:, None] * dev * dev, 0.0)
    shift = _channel_shift(x_ptr, c.to(tl.int64) * stride_c, c_mask)
    out_dtype = mean_out_ptr.dtype.element_ty
    tl.store(mean_out_ptr + c, shift.to(out_dtype) + mean.to(out_dtype), mask=c_mask)
    tl.store(m2_out_ptr + c, tl.sum(m2_acc, axis=0), mask=c_mask)
    if pid == 0:
        tl.store(count_out_ptr, total_count)


@triton.jit
def _backward_reduce_kernel(
    dy_ptr, x_ptr, mean_ptr, invstd_ptr, part_ptr,
    N, C, S, stride_n, stride_c, stride_s, num_s_tiles, SPLIT,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, WIDE_INDEX: tl.constexpr,
):
    """Program (c-block, r) -> partial sum(dy) and sum(dy * xhat) of its channels, one pass.

    dy and x share one layout (the launcher makes sure). Row r of ``part`` is laid out as
    [sum_dy (C) | sum_dy_xhat (C)].
    """
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    s_lane = tl.arange(0, BLOCK_S)
    if WIDE_INDEX:
        c_off = c.to(tl.int64) * stride_c
    else:
        c_off = c * stride_c
    mean = tl.load(mean_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    invstd = tl.load(invstd_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    acc_dy = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    acc_dy_xhat = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for u in range(pid_r, N * num_s_tiles, SPLIT):
        n = u // num_s_tiles
        s = (u - n * num_s_tiles) * BLOCK_S + s_lane
        s_mask = s < S
        if WIDE_INDEX:
            s_off = s.to(tl.int64) * stride_s
        else:
            s_off = s * stride_s
        offs = n.to(tl.int64) * stride_n + s_off[:, None] + c_off[None, :]
        mask = s_mask[:, None] & c_mask[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc_dy += dy
        # masked lanes add an explicit 0: dy == 0 there, but 0 * xhat is NaN when the
        # (running) mean or invstd is infinite
        acc_dy_xhat += tl.where(mask, dy * ((x - mean[None, :]) * invstd[None, :]), 0.0)
    row = part_ptr + pid_r * 2 * C
    tl.store(row + c, tl.sum(acc_dy, axis=0), mask=c_mask)
    tl.store(row + C + c, tl.sum(acc_dy_xhat, axis=0), mask=c_mask)


# Note [one program per channel]
#     The row-split kernels above issue two launches per reduction (the partial rows, then the
#     combine or a torch sum) and write and re-read the partials; on ResNet's late layers
#     (7x7 maps with 512 channels and the like) that floor is most of the time -- an H200
#     measured 9-10 us against torch's 5-7 us for the kernels alone, at batch 32 and 64 alike.
#     When a spatially contiguous input (NCHW, stride_s == 1) has few values per channel and
#     enough channels to fill the GPU, one program per channel reads its whole (N, S) slab
#     and writes the result itself: one launch, no partials. The statistics hold the slab in
#     registers as one tile and take the mean, then M2 about it (two passes over registers);
#     a first version ran the row-split kernels' per-lane Welford recurrence over the tile
#     instead and took 16 us against torch's 8 on an H200 (64x512x7x7), the per-value division
#     its cost. The backward reduce sums its two terms over one or two tiles.
@triton.jit
def _welford_channel_kernel(
    x_ptr, mean_out_ptr, m2_out_ptr, count_out_ptr, total_count,
    N, S, stride_n, stride_c,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, WIDE_INDEX: tl.constexpr,
):
    """Program c -> count, mean, M2 of channel c over all its N * S values (stride_s == 1),
    into the outputs (Note [one program per channel]). The whole (N, S) slab is one tile
    (BLOCK_N >= N), so the mean and M2 come from two passes over registers: exact centering,
    and no per-value division as in a Welford recurrence; about a shift (Note [statistics
    about a shift])."""
    c = tl.program_id(0)
    if WIDE_INDEX:
        base = x_ptr + c.to(tl.int64) * stride_c
    else:
        base = x_ptr + c * stride_c
    n = tl.arange(0, BLOCK_N)
    s = tl.arange(0, BLOCK_S)
    mask = (n < N)[:, None] & (s < S)[None, :]
    v = tl.load(base + n.to(tl.int64)[:, None] * stride_n + s[None, :], mask=mask, other=0.0).to(tl.float32)
    finite = (v - v) == 0.0  # (the masked lanes hold 0: finite)
    special = tl.sum(tl.sum(tl.where(finite, 0.0, v), axis=1), axis=0)  # Note [non-finite statistics]
    shift = _channel_shift(base, 0, True)
    v = tl.where(mask & finite, v - shift, 0.0)
    n_finite = tl.sum(tl.sum((mask & finite).to(tl.float32), axis=1), axis=0)
    mean = tl.sum(tl.sum(v, axis=1), axis=0) / tl.maximum(n_finite, 1.0)
    dev = tl.where(mask & finite, v - mean, 0.0)
    m2 = tl.sum(tl.sum(dev * dev, axis=1), axis=0)
    out_dtype = mean_out_ptr.dtype.element_ty
    tl.store(mean_out_ptr + c, shift.to(out_dtype) + (mean + special).to(out_dtype))
    tl.store(m2_out_ptr + c, tl.where(special == 0.0, m2, float("nan")))
    if c == 0:
        tl.store(count_out_ptr, total_count)


@triton.jit
def _backward_reduce_channel_kernel(
    dy_ptr, x_ptr, mean_ptr, invstd_ptr, out_ptr,
    N, C, S, stride_n, stride_c,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, WIDE_INDEX: tl.constexpr,
):
    """Program c -> sum(dy) and sum(dy * xhat) of channel c into ``out[0, c]``, ``out[1, c]``
    (stride_s == 1; Note [one program per channel])."""
    c = tl.program_id(0)
    if WIDE_INDEX:
        c_off = c.to(tl.int64) * stride_c
    else:
        c_off = c * stride_c
    mean = tl.load(mean_ptr + c).to(tl.float32)
    invstd = tl.load(invstd_ptr + c).to(tl.float32)
    n_lane = tl.arange(0, BLOCK_N)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < S
    acc_dy = tl.zeros([BLOCK_N, BLOCK_S], dtype=tl.float32)
    acc_dy_xhat = tl.zeros([BLOCK_N, BLOCK_S], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + n_lane
        mask = (n < N)[:, None] & s_mask[None, :]
        offs = c_off + n.to(tl.int64)[:, None] * stride_n + s[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc_dy += dy
        # (an explicit 0 where masked, as in _backward_reduce_kernel)
        acc_dy_xhat += tl.where(mask, dy * ((x - mean) * invstd), 0.0)
    tl.store(out_ptr + c, tl.sum(tl.sum(acc_dy, axis=1), axis=0))
    tl.store(out_ptr + C + c, tl.sum(tl.sum(acc_dy_xhat, axis=1), axis=0))


# Note [fp64 scalars as three fp32 arguments]
#     Triton passes a Python float to a kernel as fp32, but the forward combine works in fp64
#     as the PyTorch path does (``momentum`` and ``eps`` are Python floats, i.e. fp64, there):
#     0.1 rounded to fp32 would move a running mean by 1.5e-8 relative each step. A float64 is
#     the exact sum of three fp32 numbers (24 + 24 + 24 bits cover its 53, and each remainder
#     is exact in fp64), so the launcher splits it (``_fp64_parts``) and the kernel adds the
#     parts back in fp64: the same number, without a host-to-device copy per call.


@triton.jit
def _fp64_from_parts(hi, mid, lo):
    return tl.cast(hi, tl.float64) + tl.cast(mid, tl.float64) + tl.cast(lo, tl.float64)


@triton.jit
def _rank_combine_kernel(
    gathered_ptr, out_ptr, weight_ptr, bias_ptr, running_mean_ptr, running_var_ptr,
    W, row_len, C, total,
    eps_hi, eps_mid, eps_lo, momentum_hi, momentum_mid, momentum_lo,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, UPDATE_RUNNING: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The forward's cross-rank step after the statistics all-gather, one launch: merge the W
    ranks' rows ``[count, mean (C), M2 (C), ...]`` of ``gathered`` (fp64) with the k-way
    parallel formula (Note [bit-identical statistics] in fusedist/nn/_sync_stats.py), in
    fp64 and in rank order, and write ``out`` (4, C) fp32: the mean, invstd = 1/sqrt(M2/n +
    eps), the normalization's scale (invstd * weight) and shift (bias); with
    ``UPDATE_RUNNING`` also blend the running statistics in place, in fp64 (the unbiased
    variance M2/(n-1)) as the PyTorch path does, rounded to their dtype (through fp32 for a
    half-precision buffer: the comment at the stores). ``total`` is the
    global count n, read on the host by the caller's checks."""
    pid = tl.program_id(0)
    c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    n = tl.cast(total, tl.float64)
    weighted = tl.zeros([BLOCK_C], dtype=tl.float64)
    for r in range(W):
        row = gathered_ptr + r * row_len
        n_r = tl.load(row)
        weighted += n_r * tl.load(row + 1 + c, mask=c_mask, other=0.0)
    mean = weighted / n
    m2_ranks = tl.zeros([BLOCK_C], dtype=tl.float64)
    spread = tl.zeros([BLOCK_C], dtype=tl.float64)
    for r in range(W):
        row = gathered_ptr + r * row_len
        n_r = tl.load(row)
        dev = tl.load(row + 1 + c, mask=c_mask, other=0.0) - mean
        m2_ranks += tl.load(row + 1 + C + c, mask=c_mask, other=0.0)
        spread += n_r * (dev * dev)
    m2 = m2_ranks + spread
    eps = _fp64_from_parts(eps_hi, eps_mid, eps_lo)
    invstd = (1.0 / tl.sqrt(m2 / n + eps)).to(tl.float32)
    scale = invstd
    if HAS_WEIGHT:
        scale = invstd * tl.load(weight_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + c, mean.to(tl.float32), mask=c_mask)
    tl.store(out_ptr + C + c, invstd, mask=c_mask)
    tl.store(out_ptr + 2 * C + c, scale, mask=c_mask)
    if HAS_BIAS:
        tl.store(out_ptr + 3 * C + c, tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32), mask=c_mask)
    if UPDATE_RUNNING:
        momentum = _fp64_from_parts(momentum_hi, momentum_mid, momentum_lo)
        keep = 1.0 - momentum
        rm = tl.load(running_mean_ptr + c, mask=c_mask, other=0.0)
        rv = tl.load(running_var_ptr + c, mask=c_mask, other=0.0)
        new_rm = rm.to(tl.float64) * keep + mean * momentum
        new_rv = rv.to(tl.float64) * keep + (m2 / (n - 1.0)) * momentum
        # (Through fp32, rounded to nearest by _to_param: Triton's interpreter turns fp64 into
        # bf16 wrongly and truncates fp32 into bf16. Two roundings differ from one only when
        # the fp32 value falls exactly halfway between two half-precision numbers -- then by
        # one unit of the buffer.)
        tl.store(running_mean_ptr + c, _to_param(new_rm.to(tl.float32), running_mean_ptr.dtype.element_ty),
                 mask=c_mask)
        tl.store(running_var_ptr + c, _to_param(new_rv.to(tl.float32), running_var_ptr.dtype.element_ty),
                 mask=c_mask)


# Note [rounding to bf16]
#     The elementwise kernels compute in fp32 and store the output's dtype. Triton's interpreter
#     (the CPU path, TRITON_INTERPRET=1) truncates fp32 -> bf16 casts instead of rounding them
#     to nearest: every bf16 output and input gradient came out up to one unit low in
#     magnitude, an error that is biased, so it does not cancel where the next layer sums it.
#     Through two conv + BatchNorm blocks the input gradient of a bf16 model was measured 20x
#     further from fp64 than torch's bf16 BatchNorm's. ``_to_param`` rounds to nearest even with
#     integer ops, the result torch's ``.to(torch.bfloat16)`` gives, on every backend alike.


@triton.jit
def _elementwise_tile(C, S, stride_n, stride_c, stride_s, num_s_tiles,
                      BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, WIDE_INDEX: tl.constexpr):
    """The elementwise kernels' tile: program (u, c-block) covers spatial tile u of its sample
    and BLOCK_C channels. Returns the element offsets, their mask, the channels and theirs."""
    pid_u = tl.program_id(0)
    pid_c = tl.program_id(1)
    n = pid_u // num_s_tiles
    s = (pid_u - n * num_s_tiles) * BLOCK_S + tl.arange(0, BLOCK_S)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    s_mask = s < S
    c_mask = c < C
    if WIDE_INDEX:
        offs = n.to(tl.int64) * stride_n + s.to(tl.int64)[:, None] * stride_s + c.to(tl.int64)[None, :] * stride_c
    else:
        offs = n.to(tl.int64) * stride_n + s[:, None] * stride_s + c[None, :] * stride_c
    return offs, s_mask[:, None] & c_mask[None, :], c, c_mask


@triton.jit
def _input_grad_kernel(
    out_ptr, dy_ptr, x_ptr, sums_ptr, mean_ptr, invstd_ptr, weight_ptr, count,
    C, S, stride_n, stride_c, stride_s, num_s_tiles,
    HAS_WEIGHT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, WIDE_INDEX: tl.constexpr,
):
    """The input gradient from the all-reduced ``sums`` (2, C) = [sum(dy), sum(dy * xhat)]:

        k = weight * invstd,   grad_x = (dy - sum(dy)/n) * k + (x - mean) * (-k * invstd * sum(dy*xhat)/n)

    the per-channel factors made by each program from the sums (Note [the backward's factors
    in the kernel]), in fp32 with correctly rounded divisions by n rounded to fp32, as the
    PyTorch ops make them; then the same arithmetic as ``_channel_affine_kernel``'s."""
    offs, mask, c, c_mask = _elementwise_tile(C, S, stride_n, stride_c, stride_s, num_s_tiles,
                                              BLOCK_S, BLOCK_C, WIDE_INDEX)
    n = tl.cast(count, tl.float32)
    invstd = tl.load(invstd_ptr + c, mask=c_mask, other=0.0)
    k = invstd
    if HAS_WEIGHT:
        k = invstd * tl.load(weight_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    mean_dy = tl.math.div_rn(tl.load(sums_ptr + c, mask=c_mask, other=0.0), n)
    mean_dy_xhat = tl.math.div_rn(tl.load(sums_ptr + C + c, mask=c_mask, other=0.0), n)
    t = -k * invstd * mean_dy_xhat
    mean = tl.load(mean_ptr + c, mask=c_mask, other=0.0)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (dy - mean_dy[None, :]) * k[None, :]
    out += (x - mean[None, :]) * t[None, :]
    tl.store(out_ptr + offs, _to_param(out, out_ptr.dtype.element_ty), mask=mask)  # Note [rounding to bf16]


@triton.jit
def _channel_affine_kernel(
    out_ptr, u_ptr, v_ptr, p_ptr, q_ptr, r_ptr, t_ptr, b_ptr,
    C, S, stride_n, stride_c, stride_s, num_s_tiles,
    HAS_V: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, WIDE_INDEX: tl.constexpr,
):
    """out = (u - p[c]) * q[c] + (v - r[c]) * t[c] + b[c], elementwise; out/u/v share a layout.

    Forward: u = x, p = mean, q = weight * invstd, b = bias.
    Backward: u = dy, p = mean(dy), q = weight * invstd, v = x, r = mean, t = -q * invstd *
    mean(dy * xhat). Centering before scaling keeps fp32 accuracy when |mean| >> std.
    """
    offs, mask, c, c_mask = _elementwise_tile(C, S, stride_n, stride_c, stride_s, num_s_tiles,
                                              BLOCK_S, BLOCK_C, WIDE_INDEX)
    p = tl.load(p_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (u - p[None, :]) * q[None, :]
    if HAS_V:
        r = tl.load(r_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        t = tl.load(t_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out += (v - r[None, :]) * t[None, :]
    if HAS_B:
        b = tl.load(b_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        out += b[None, :]
    tl.store(out_ptr + offs, _to_param(out, out_ptr.dtype.element_ty), mask=mask)  # Note [rounding to bf16]


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


# Where one program per channel takes a reduction (Note [one program per channel]): at most
# this many values per channel after padding N and S to powers of two (the statistics' one
# tile; the backward reduce walks it as two 4096-value tiles), and
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
    block_s, block_c = _tile(C, S, stride_c, 65536 if triton_interpreting() else 4096)
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
    block_s, block_c = _tile(C, S, stride_c, 65536 if triton_interpreting() else 4096)
    num_s_tiles = _cdiv(S, block_s)
    cached(_input_grad_kernel)[(N * num_s_tiles, _cdiv(C, block_c))](
        out, dy, x, sums, mean, invstd, weight if weight is not None else invstd, count,
        C, S, stride_n, stride_c, stride_s, num_s_tiles,
        HAS_WEIGHT=weight is not None, BLOCK_S=block_s, BLOCK_C=block_c, WIDE_INDEX=_wide_index(layout, C, S),
    )
    return out


def _fp64_parts(value: float) -> tuple[float, float, float]:
    """Three fp32 numbers summing exactly to ``value`` (Note [fp64 scalars as three fp32
    arguments])."""
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
