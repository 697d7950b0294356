"""The SGD multi-tensor kernel (momentum, Nesterov); its launcher is ``sgd`` in multi_tensor.py."""

import triton
import triton.language as tl

from .multi_tensor_helpers import (
    _chunk_coords, _grad_factor, _ld, _ld_param, _live_numel, _load_step, _plus_decay, _role_ptr,
    _st, _st_param,
)


@triton.jit
def _sgd_chunk(
    g_ptr, p_ptr, w_ptr, b_ptr, start, n, factor, s, lr, momentum, one_minus_dampening, weight_decay,
    PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
    BLOCK: tl.constexpr, ITERS: tl.constexpr, MASKED: tl.constexpr,
):
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        d = _ld(g_ptr, offs, n, MASKED).to(tl.float32) * factor
        if MAXIMIZE:
            d = -d
        p = _ld_param(p_ptr, w_ptr, offs, n, HAS_MASTER, MASKED)
        d = _plus_decay(d, p, weight_decay)
        if HAS_MOMENTUM:
            buf = _ld(b_ptr, offs, n, MASKED)
            # First step of this tensor: torch initializes the buffer with the gradient.
            # (1 - dampening arrives computed in float64 on the host, as torch's ``alpha=1 - dampening``)
            buf = tl.where(s == 1.0, d, buf * momentum + one_minus_dampening * d)
            _st(b_ptr, offs, n, buf, MASKED)
            if NESTEROV:
                d = d + momentum * buf
            else:
                d = buf
        p = p - lr * d
        _st_param(p_ptr, w_ptr, offs, n, p, PARAM_DTYPE, HAS_MASTER, MASKED)


# Roles of the SGD table: 0 grad, 1 param, 2 master, 3 momentum_buffer, 4 step
@triton.jit
def _sgd_kernel(
    ptrs, numels, chunk_t, chunk_start, n_tensors,
    inv_scale_ptr, clip_ptr, found_inf_ptr, lr_ptr,
    lr, momentum, one_minus_dampening, weight_decay, step,
    GRAD_DTYPE: tl.constexpr, PARAM_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr, HAS_INV_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, STEP_ROLE: tl.constexpr, LR_ON_DEVICE: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    pid, t, start, n = _chunk_coords(numels, chunk_t, chunk_start, BLOCK * ITERS)
    n = _live_numel(n, found_inf_ptr, HAS_FOUND_INF)
    factor = _grad_factor(inv_scale_ptr, clip_ptr, HAS_INV_SCALE, HAS_CLIP)
    s = _load_step(ptrs, n_tensors, t, step, STEP_ROLE)
    if LR_ON_DEVICE:  # Note [a learning rate on the device]
        lr = tl.load(lr_ptr)
    g_ptr = _role_ptr(ptrs, 0, n_tensors, t, GRAD_DTYPE, ALIGNED)
    p_ptr = _role_ptr(ptrs, 1, n_tensors, t, PARAM_DTYPE, ALIGNED)
    w_ptr = _role_ptr(ptrs, 2, n_tensors, t, tl.float32, ALIGNED)
    b_ptr = _role_ptr(ptrs, 3, n_tensors, t, tl.float32, ALIGNED)
    if start + BLOCK * ITERS <= n:  # Note [full and tail chunks]
        _sgd_chunk(g_ptr, p_ptr, w_ptr, b_ptr, start, n, factor, s, lr, momentum, one_minus_dampening,
                   weight_decay, PARAM_DTYPE, HAS_MASTER, HAS_MOMENTUM, NESTEROV, MAXIMIZE, BLOCK, ITERS, False)
    else:
        _sgd_chunk(g_ptr, p_ptr, w_ptr, b_ptr, start, n, factor, s, lr, momentum, one_minus_dampening,
                   weight_decay, PARAM_DTYPE, HAS_MASTER, HAS_MOMENTUM, NESTEROV, MAXIMIZE, BLOCK, ITERS, True)
