"""The SyncBatchNorm reduction kernels: per-channel statistics (count, mean, M2) and the
backward's per-channel sums, each as row-split partials plus a combine, or one program per
channel (Note [one program per channel]). Their launchers are in syncbn.py.
"""

import triton
import triton.language as tl

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
