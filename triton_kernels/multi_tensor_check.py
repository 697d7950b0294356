"""The check-and-norm pass of the multi-tensor kernels: the found-inf flag and the squared
norm of a bucket of gradients in one read, optionally unscaling them in place.
"""

import triton
import triton.language as tl

from .multi_tensor_helpers import _chunk_coords, _ld, _role_ptr, _st, _to_param


@triton.jit
def _check_and_norm_chunk(g_ptr, start, n, scale, GRAD_DTYPE: tl.constexpr, WRITE_BACK: tl.constexpr,
                          BLOCK: tl.constexpr, ITERS: tl.constexpr, MASKED: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    bad = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        g = _ld(g_ptr, offs, n, MASKED).to(tl.float32)
        # The flag looks at the gradient as stored (like torch's unscale check); inf and
        # nan both fail `abs(g) < inf`.
        bad = tl.maximum(bad, tl.where(tl.abs(g) < float("inf"), 0.0, 1.0))
        g = g * scale
        if WRITE_BACK:  # the unscaled gradient, as torch's unscale_ writes it (inf/nan too)
            _st(g_ptr, offs, n, _to_param(g, GRAD_DTYPE), MASKED)
        acc += g * g
    return tl.max(bad, axis=0), tl.sum(acc, axis=0)


@triton.jit
def _check_and_norm_kernel(
    ptrs, numels, chunk_t, chunk_start, n_tensors,
    inv_scale_ptr, partial_bad, partial_sumsq,
    GRAD_DTYPE: tl.constexpr, HAS_INV_SCALE: tl.constexpr, WRITE_BACK: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    pid, t, start, n = _chunk_coords(numels, chunk_t, chunk_start, BLOCK * ITERS)
    g_ptr = _role_ptr(ptrs, 0, n_tensors, t, GRAD_DTYPE, ALIGNED)
    scale = 1.0
    if HAS_INV_SCALE:
        scale = tl.load(inv_scale_ptr)
    if start + BLOCK * ITERS <= n:  # Note [full and tail chunks]
        bad, sumsq = _check_and_norm_chunk(g_ptr, start, n, scale, GRAD_DTYPE, WRITE_BACK, BLOCK, ITERS, False)
    else:
        bad, sumsq = _check_and_norm_chunk(g_ptr, start, n, scale, GRAD_DTYPE, WRITE_BACK, BLOCK, ITERS, True)
    tl.store(partial_bad + pid, bad)
    tl.store(partial_sumsq + pid, sumsq)
