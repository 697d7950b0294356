"""The Adam/AdamW multi-tensor kernel (AMSGrad included); its launcher is ``adam`` in multi_tensor.py."""

import triton
import triton.language as tl

from .multi_tensor_helpers import (
    _bias_correction, _chunk_coords, _grad_factor, _ld, _ld_param, _live_numel, _load_step,
    _plus_decay, _role_ptr, _st, _st_param,
)


@triton.jit
def _adam_chunk(
    g_ptr, p_ptr, w_ptr, m_ptr, v_ptr, vmax_ptr, start, n, factor,
    one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay, step_size, bc2_sqrt,
    PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, ADAMW: tl.constexpr, MAXIMIZE: tl.constexpr,
    AMSGRAD: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, MASKED: tl.constexpr,
):
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        g = _ld(g_ptr, offs, n, MASKED).to(tl.float32) * factor
        if MAXIMIZE:
            g = -g
        p = _ld_param(p_ptr, w_ptr, offs, n, HAS_MASTER, MASKED)
        m = _ld(m_ptr, offs, n, MASKED)
        v = _ld(v_ptr, offs, n, MASKED)
        if ADAMW:
            p = p * decay  # decay = 1 - lr * weight_decay, rounded once (on the host for a float lr) like torch
        else:
            g = _plus_decay(g, p, weight_decay)
        m = m + one_minus_beta1 * (g - m)  # torch's lerp form
        v = v * beta2 + (one_minus_beta2 * g) * g  # torch's addcmul order: g * g alone overflows past 1.8e19
        if AMSGRAD:  # the denominator uses the running maximum of v (torch.maximum: nan wins)
            vmax = _ld(vmax_ptr, offs, n, MASKED)
            vmax = tl.where((v > vmax) | (v != v), v, vmax)
            _st(vmax_ptr, offs, n, vmax, MASKED)
            denom = tl.sqrt(vmax) / bc2_sqrt + eps
        else:
            denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p - step_size * (m / denom)
        _st(m_ptr, offs, n, m, MASKED)
        _st(v_ptr, offs, n, v, MASKED)
        _st_param(p_ptr, w_ptr, offs, n, p, PARAM_DTYPE, HAS_MASTER, MASKED)


# Roles of the Adam table: 0 grad, 1 param, 2 master, 3 exp_avg, 4 exp_avg_sq,
# 5 max_exp_avg_sq (AMSGrad), 6 step
@triton.jit
def _adam_kernel(
    ptrs, numels, chunk_t, chunk_start, n_tensors,
    inv_scale_ptr, clip_ptr, found_inf_ptr, lr_ptr, betas_ptr,
    lr, beta1, beta2, log2_beta1, log2_beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step,
    GRAD_DTYPE: tl.constexpr, PARAM_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr, HAS_INV_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, STEP_ROLE: tl.constexpr, LR_ON_DEVICE: tl.constexpr,
    BETAS_ON_DEVICE: tl.constexpr, ADAMW: tl.constexpr, BIAS_CORRECTION: tl.constexpr, MAXIMIZE: tl.constexpr,
    AMSGRAD: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    pid, t, start, n = _chunk_coords(numels, chunk_t, chunk_start, BLOCK * ITERS)
    n = _live_numel(n, found_inf_ptr, HAS_FOUND_INF)
    factor = _grad_factor(inv_scale_ptr, clip_ptr, HAS_INV_SCALE, HAS_CLIP)
    s = _load_step(ptrs, n_tensors, t, step, STEP_ROLE)
    if LR_ON_DEVICE:  # Note [a learning rate on the device]
        lr = tl.load(lr_ptr)
        decay = 1.0 - lr * weight_decay  # in fp32, as torch's ``1 - lr * weight_decay`` on a tensor lr
    if BETAS_ON_DEVICE:  # Note [betas on the device]
        beta1 = tl.load(betas_ptr)
        beta2 = tl.load(betas_ptr + 1)
        log2_beta1 = tl.log2(tl.cast(beta1, tl.float64)).to(tl.float32)  # rounded as the host's argument is
        log2_beta2 = tl.log2(tl.cast(beta2, tl.float64)).to(tl.float32)
        one_minus_beta1 = 1.0 - beta1  # in fp32, as torch's ``1 - beta`` on a tensor beta
        one_minus_beta2 = 1.0 - beta2
    step_size = lr
    bc2_sqrt = 1.0
    if BIAS_CORRECTION:
        step_size = (tl.cast(lr, tl.float64) / _bias_correction(log2_beta1, s)).to(tl.float32)
        bc2_sqrt = tl.sqrt(_bias_correction(log2_beta2, s)).to(tl.float32)
    g_ptr = _role_ptr(ptrs, 0, n_tensors, t, GRAD_DTYPE, ALIGNED)
    p_ptr = _role_ptr(ptrs, 1, n_tensors, t, PARAM_DTYPE, ALIGNED)
    w_ptr = _role_ptr(ptrs, 2, n_tensors, t, tl.float32, ALIGNED)
    m_ptr = _role_ptr(ptrs, 3, n_tensors, t, tl.float32, ALIGNED)
    v_ptr = _role_ptr(ptrs, 4, n_tensors, t, tl.float32, ALIGNED)
    vmax_ptr = _role_ptr(ptrs, 5, n_tensors, t, tl.float32, ALIGNED)
    if start + BLOCK * ITERS <= n:  # Note [full and tail chunks]
        _adam_chunk(g_ptr, p_ptr, w_ptr, m_ptr, v_ptr, vmax_ptr, start, n, factor, one_minus_beta1, beta2,
                    one_minus_beta2, eps, weight_decay, decay, step_size, bc2_sqrt, PARAM_DTYPE, HAS_MASTER,
                    ADAMW, MAXIMIZE, AMSGRAD, BLOCK, ITERS, False)
    else:
        _adam_chunk(g_ptr, p_ptr, w_ptr, m_ptr, v_ptr, vmax_ptr, start, n, factor, one_minus_beta1, beta2,
                    one_minus_beta2, eps, weight_decay, decay, step_size, bc2_sqrt, PARAM_DTYPE, HAS_MASTER,
                    ADAMW, MAXIMIZE, AMSGRAD, BLOCK, ITERS, True)
