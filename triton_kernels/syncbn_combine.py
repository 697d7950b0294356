"""The SyncBatchNorm forward's cross-rank combine kernel: the all-gathered statistics merged in
fp64, the normalization's factors and the running statistics in one launch. Its launcher is
``combine_ranks`` in syncbn.py.
"""

import triton
import triton.language as tl

from .multi_tensor_helpers import _to_param

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
