"""The two LAMB multi-tensor kernels: stage 1 (moments, raw update and the per-chunk norms) and
stage 2 (the trust-ratio update); their launchers are ``lamb_stage1`` / ``lamb_stage2`` in
multi_tensor.py.
"""

import triton
import triton.language as tl

from .multi_tensor_helpers import (
    _bias_correction, _chunk_coords, _grad_factor, _ld, _ld_param, _live_numel, _load_step,
    _plus_decay, _role_ptr, _st, _st_param,
)


@triton.jit
def _lamb_stage1_chunk(
    g_ptr, p_ptr, w_ptr, m_ptr, v_ptr, u_ptr, start, n, factor,
    beta1, beta2, one_minus_beta2, beta3, eps, weight_decay, bc1, bc2,
    HAS_MASTER: tl.constexpr, ADAMW: tl.constexpr,
    BLOCK: tl.constexpr, ITERS: tl.constexpr, MASKED: tl.constexpr,
):
    acc_p = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        g = _ld(g_ptr, offs, n, MASKED).to(tl.float32) * factor
        p = _ld_param(p_ptr, w_ptr, offs, n, HAS_MASTER, MASKED)
        m = _ld(m_ptr, offs, n, MASKED)
        v = _ld(v_ptr, offs, n, MASKED)
        if not ADAMW:
            g = _plus_decay(g, p, weight_decay)
        m = m * beta1 + beta3 * g
        v = v * beta2 + (one_minus_beta2 * g) * g  # torch's addcmul order: g * g alone overflows past 1.8e19
        u = (m / bc1) / (tl.sqrt(v / bc2) + eps)
        if ADAMW:
            u = _plus_decay(u, p, weight_decay)
        _st(m_ptr, offs, n, m, MASKED)
        _st(v_ptr, offs, n, v, MASKED)
        _st(u_ptr, offs, n, u, MASKED)
        acc_p += p * p
        acc_u += u * u
    return tl.sum(acc_p, axis=0), tl.sum(acc_u, axis=0)


# Roles of the LAMB stage-1 table: 0 grad, 1 param, 2 master, 3 exp_avg, 4 exp_avg_sq,
# 5 update (fp32 scratch), 6 step
@triton.jit
def _lamb_stage1_kernel(
    ptrs, numels, chunk_t, chunk_start, n_tensors,
    inv_scale_ptr, clip_ptr, found_inf_ptr, global_div_ptr,
    partial_p2, partial_u2,
    beta1, beta2, log2_beta1, log2_beta2, one_minus_beta2, beta3, eps, weight_decay, step,
    GRAD_DTYPE: tl.constexpr, PARAM_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr, HAS_INV_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, STEP_ROLE: tl.constexpr,
    ADAMW: tl.constexpr, BIAS_CORRECTION: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    pid, t, start, n = _chunk_coords(numels, chunk_t, chunk_start, BLOCK * ITERS)
    n = _live_numel(n, found_inf_ptr, HAS_FOUND_INF)
    factor = _grad_factor(inv_scale_ptr, clip_ptr, HAS_INV_SCALE, HAS_CLIP)
    factor = factor / tl.load(global_div_ptr)
    s = _load_step(ptrs, n_tensors, t, step, STEP_ROLE)
    bc1 = 1.0
    bc2 = 1.0
    if BIAS_CORRECTION:
        bc1 = _bias_correction(log2_beta1, s).to(tl.float32)
        bc2 = _bias_correction(log2_beta2, s).to(tl.float32)
    g_ptr = _role_ptr(ptrs, 0, n_tensors, t, GRAD_DTYPE, ALIGNED)
    p_ptr = _role_ptr(ptrs, 1, n_tensors, t, PARAM_DTYPE, ALIGNED)
    w_ptr = _role_ptr(ptrs, 2, n_tensors, t, tl.float32, ALIGNED)
    m_ptr = _role_ptr(ptrs, 3, n_tensors, t, tl.float32, ALIGNED)
    v_ptr = _role_ptr(ptrs, 4, n_tensors, t, tl.float32, ALIGNED)
    u_ptr = _role_ptr(ptrs, 5, n_tensors, t, tl.float32, ALIGNED)
    if start + BLOCK * ITERS <= n:  # Note [full and tail chunks]
        p2, u2 = _lamb_stage1_chunk(g_ptr, p_ptr, w_ptr, m_ptr, v_ptr, u_ptr, start, n, factor, beta1, beta2,
                                    one_minus_beta2, beta3, eps, weight_decay, bc1, bc2, HAS_MASTER, ADAMW,
                                    BLOCK, ITERS, False)
    else:
        p2, u2 = _lamb_stage1_chunk(g_ptr, p_ptr, w_ptr, m_ptr, v_ptr, u_ptr, start, n, factor, beta1, beta2,
                                    one_minus_beta2, beta3, eps, weight_decay, bc1, bc2, HAS_MASTER, ADAMW,
                                    BLOCK, ITERS, True)
    tl.store(partial_p2 + pid, p2)
    tl.store(partial_u2 + pid, u2)


@triton.jit
def _lamb_stage2_chunk(p_ptr, w_ptr, u_ptr, start, n, lr_ratio, PARAM_DTYPE: tl.constexpr,
                       HAS_MASTER: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, MASKED: tl.constexpr):
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        p = _ld_param(p_ptr, w_ptr, offs, n, HAS_MASTER, MASKED)
        u = _ld(u_ptr, offs, n, MASKED)
        p = p - lr_ratio * u
        _st_param(p_ptr, w_ptr, offs, n, p, PARAM_DTYPE, HAS_MASTER, MASKED)


# Roles of the LAMB stage-2 table: 0 param, 1 master, 2 update
@triton.jit
def _lamb_stage2_kernel(
    ptrs, numels, chunk_t, chunk_start, n_tensors,
    found_inf_ptr, ratio_ptr, lr_ptr, lr,
    PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    pid, t, start, n = _chunk_coords(numels, chunk_t, chunk_start, BLOCK * ITERS)
    n = _live_numel(n, found_inf_ptr, HAS_FOUND_INF)
    if LR_ON_DEVICE:  # Note [a learning rate on the device]
        lr = tl.load(lr_ptr)
    lr_ratio = lr * tl.load(ratio_ptr + t)
    p_ptr = _role_ptr(ptrs, 0, n_tensors, t, PARAM_DTYPE, ALIGNED)
    w_ptr = _role_ptr(ptrs, 1, n_tensors, t, tl.float32, ALIGNED)
    u_ptr = _role_ptr(ptrs, 2, n_tensors, t, tl.float32, ALIGNED)
    if start + BLOCK * ITERS <= n:  # Note [full and tail chunks]
        _lamb_stage2_chunk(p_ptr, w_ptr, u_ptr, start, n, lr_ratio, PARAM_DTYPE, HAS_MASTER, BLOCK, ITERS, False)
    else:
        _lamb_stage2_chunk(p_ptr, w_ptr, u_ptr, start, n, lr_ratio, PARAM_DTYPE, HAS_MASTER, BLOCK, ITERS, True)
