"""Multi-tensor Triton kernels for the optimizer phase: check-and-norm, Adam/AdamW, SGD, LAMB.

One launch covers a whole list of tensors that share a dtype combination. The host builds a
*chunk table* (like apex's ``multi_tensor_apply``): every program owns one chunk of
``BLOCK * ITERS`` elements of one tensor and finds its tensor's addresses in a pointer table.

Table layout (one int64 device tensor per launch, see :class:`ChunkTable`)::

    ptrs[role, t]   data_ptr of tensor t for each role (grad, param, master, exp_avg, ...)
    numels[t]       element count of tensor t
    chunk_t[c]      tensor index of chunk c
    chunk_start[c]  first element of chunk c inside its tensor

# Note [found-inf masking]
The update kernels never branch on the found-inf flag on the host: each program loads the
flag and folds ``found_inf == 0`` into its load/store mask, so when it is set every load and
store is masked off and nothing is written. This is what keeps the AMP step free of host
synchronization: the decision is made on the device, after the flag has been computed by an
earlier kernel in the same stream.

The math lives in the kernels below and, identically, in ``fusedist/optim/_reference.py``
(the pure-PyTorch path and test oracle). Keep the two in step.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from ..backend import triton_interpreting
from .launch_cache import cached

_TORCH_TO_TL = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def launch_config() -> tuple[int, int, int]:
    """(BLOCK, ITERS, num_warps) for the elementwise kernels.

    Under the interpreter every program costs ~1 ms of Python, so chunks are made large
    there; on a GPU a 4096-element chunk (4 x 1024) keeps enough programs in flight for small
    tensors while amortizing the table lookups for large ones.
    """
    if triton_interpreting():
        return 65536, 1, 1
    return 1024, 4, 4


def tl_dtype(dtype: torch.dtype):
    try:
        return _TORCH_TO_TL[dtype]
    except KeyError:
        raise TypeError(f"fusedist multi-tensor kernels support float32/float16/bfloat16, got {dtype}") from None


class ChunkTable:
    """Pointer + chunk table of one launch, uploaded to the device in a single copy.

    ``roles`` is a list of tensor lists (all the same length); a role entry may be a list of
    tensors whose ``data_ptr`` is taken, or None to fill the row with zeros (unused role).
    """

    def __init__(self, roles: list, numels: list[int], chunk: int, device: torch.device):
        n = len(numels)
        chunk_t: list[int] = []
        chunk_start: list[int] = []
        for t, numel in enumerate(numels):
            for start in range(0, numel, chunk):
                chunk_t.append(t)
                chunk_start.append(start)
        rows: list[int] = []
        for role in roles:
            rows.extend([0] * n if role is None else [x.data_ptr() for x in role])
        # Every address 16-byte aligned: the kernels may then promise it to the compiler,
        # which turns full chunks into 128-bit vector loads and stores.
        self.aligned = all(ptr % 16 == 0 for ptr in rows)
        host = torch.tensor(rows + list(numels) + chunk_t + chunk_start, dtype=torch.int64)
        if device.type == "cuda":
            # Pinned + non_blocking: the upload is queued on the stream, no host sync.
            host = host.pin_memory()
            table = host.to(device, non_blocking=True)
        else:
            table = host
        self._host = host  # keeps the pinned source alive until the copy has run
        self.table = table
        self.n_tensors = n
        self.n_roles = len(roles)
        self.n_chunks = len(chunk_t)
        self.ptrs = table[: self.n_roles * n]
        self.numels = table[self.n_roles * n : (self.n_roles + 1) * n]
        base = (self.n_roles + 1) * n
        self.chunk_t = table[base : base + self.n_chunks]
        self.chunk_start = table[base + self.n_chunks :]


_data_ptr = torch.Tensor.data_ptr  # (mapped over each role: the key is built at every launch)
_numel = torch.Tensor.numel
_dtype_of = operator.attrgetter("dtype")
_device_of = operator.attrgetter("device")
_FP32 = {torch.float32}
_TABLE_CACHE: "OrderedDict[tuple, ChunkTable]" = OrderedDict()
_TABLE_CACHE_SIZE = 64


def chunk_table(roles: list, numels: list[int], chunk: int, device: torch.device) -> ChunkTable:
    """Cached :class:`ChunkTable`: an optimizer steps the same tensors every iteration, so
    after the first step a launch costs no table upload. The key is the addresses and sizes
    themselves, so a hit is correct even if the tensors behind an address changed."""
    key = (device, chunk, tuple(numels)) + tuple(
        None if role is None else tuple(map(_data_ptr, role)) for role in roles
    )
    table = _TABLE_CACHE.get(key)
    if table is None:
        table = ChunkTable(roles, numels, chunk, device)
        _TABLE_CACHE[key] = table
        if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
            _TABLE_CACHE.popitem(last=False)
    else:
        _TABLE_CACHE.move_to_end(key)
    return table


# ----------------------------------------------------------------------------- kernels


# Note [full and tail chunks]
# A chunk that lies entirely inside its tensor is processed without masks (MASKED=False), so
# that, with 16-byte aligned addresses (ALIGNED), the compiler can emit vector loads/stores;
# only the last chunk of a tensor, or every chunk when the found-inf flag is set (its live
# range is then empty), takes the masked path. Each kernel's body is therefore a helper
# instantiated twice.


@triton.jit
def _chunk_coords(numels, chunk_t, chunk_start, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_t + pid)
    start = tl.multiple_of(tl.load(chunk_start + pid), CHUNK)  # chunks start at multiples of CHUNK
    n = tl.load(numels + t)
    return pid, t, start, n


@triton.jit
def _role_ptr(ptrs, role: tl.constexpr, n_tensors, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    ptr = tl.load(ptrs + role * n_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _ld(ptr, offs, n, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=offs < n, other=0.0)
    else:
        return tl.load(ptr + offs)


@triton.jit
def _st(ptr, offs, n, value, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value, mask=offs < n)
    else:
        tl.store(ptr + offs, value)


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


@triton.jit
def _grad_factor(inv_scale_ptr, clip_ptr, HAS_INV_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr):
    factor = 1.0
    if HAS_INV_SCALE:
        factor = factor * tl.load(inv_scale_ptr)
    if HAS_CLIP:
        factor = factor * tl.load(clip_ptr)
    return factor


@triton.jit
def _live_numel(n, found_inf_ptr, HAS_FOUND_INF: tl.constexpr):
    # Note [found-inf masking]: a set flag shrinks the live range to zero elements.
    if HAS_FOUND_INF:
        n = tl.where(tl.load(found_inf_ptr) == 0.0, n, 0)
    return n


@triton.jit
def _load_step(ptrs, n_tensors, t, step, STEP_ROLE: tl.constexpr):
    if STEP_ROLE >= 0:
        s = tl.load(_role_ptr(ptrs, STEP_ROLE, n_tensors, t, tl.float32, False))
    else:
        s = step
    return s


@triton.jit
def _to_param(x, DTYPE: tl.constexpr):
    """fp32 -> parameter dtype, rounding to nearest even like torch's ``.to()``.

    bf16 is rounded with integer ops: Triton's interpreter truncates fp32 -> bf16 casts, and
    doing it by hand gives bit-identical results on every backend. Finite values that round
    past the largest bf16 become inf, as they should; NaN is mapped to the canonical bf16 NaN
    (adding the rounding bias to a NaN payload could carry into the sign bit)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16)
    else:
        return x


@triton.jit
def _plus_decay(g, p, weight_decay):
    # g + weight_decay * p, left out when weight_decay is 0 as torch leaves it out: 0 * p is nan
    # for an inf or nan parameter, and would turn a finite gradient and the states into nan.
    return tl.where(weight_decay != 0.0, g + weight_decay * p, g)


@triton.jit
def _ld_param(p_ptr, w_ptr, offs, n, HAS_MASTER: tl.constexpr, MASKED: tl.constexpr):
    """The FP32 value being optimized: the master weight, or the parameter upcast."""
    if HAS_MASTER:
        p = _ld(w_ptr, offs, n, MASKED)
    else:
        p = _ld(p_ptr, offs, n, MASKED).to(tl.float32)
    return p


@triton.jit
def _st_param(p_ptr, w_ptr, offs, n, p, PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
              MASKED: tl.constexpr):
    """Write the updated FP32 value back: the master (when there is one) and the parameter,
    rounded to its dtype in the same pass."""
    if HAS_MASTER:
        _st(w_ptr, offs, n, p, MASKED)
    _st(p_ptr, offs, n, _to_param(p, PARAM_DTYPE), MASKED)


@triton.jit
def _bias_correction(log2_beta, s):
    # 1 - beta**s, evaluated in fp64 (one scalar per program, so free): in fp32 the
    # cancellation in 1 - 0.999**s costs ~5e-6 relative error early in training, while torch
    # computes it in double on the host. log2(beta) is computed in double and reaches the kernel
    # as an fp32 argument (its relative rounding, 6e-8, moves beta**s by s * 6e-8 * |log2 beta|).
    return 1.0 - tl.exp2(tl.cast(s, tl.float64) * tl.cast(log2_beta, tl.float64))


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


# ----------------------------------------------------------------------------- launchers
#
# Each launcher takes one *bucket*: lists of tensors that share device and dtypes, all
# contiguous. Bucketing and validation happen in fusedist/optim/functional.py.


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else float("-inf")


def _scalar_or_dummy(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    return dummy if t is None else t


# Note [a learning rate on the device]
#     A tensor ``lr`` (torch's optimizers take one; schedulers change it in place) is read by
#     the kernels from device memory: reading its value on the host to pass a number would
#     synchronize the host with the device at every step. The launchers get the tensor and
#     pass a pointer to an fp32 copy on the parameters' device (a copy made without a host
#     wait; none when it is there already), and the kernels form ``1 - lr * weight_decay``
#     in fp32 as torch does on a tensor lr. A float ``lr`` stays a kernel argument.
def _lr_args(lr, device: torch.device, dummy: torch.Tensor) -> tuple:
    """``(pointer operand, host value)`` for the kernels' ``lr_ptr`` and ``lr`` arguments."""
    if isinstance(lr, torch.Tensor):
        on_device = lr.detach().reshape(1).to(device=device, dtype=torch.float32, non_blocking=True)
        return on_device, 0.0
    return dummy, float(lr)


# Note [betas on the device]
#     Tensor ``betas`` (torch's Adam takes two 1-element tensors, e.g. for a beta schedule
#     under ``torch.compile``) are read by the Adam kernel from a 2-element fp32 copy on the
#     parameters' device, for the reason a tensor lr is (Note [a learning rate on the device]).
#     The kernel forms ``log2(beta)`` in fp64 from the fp32 value and rounds it to fp32, as
#     the host's double reaches the kernel as an fp32 argument, so the bias corrections (the
#     comment on ``_bias_correction``) and the update equal those of float betas holding the
#     tensors' values (and the branch keeps the argument's type, as Triton requires).
def _betas_args(beta1, beta2, device: torch.device, dummy: torch.Tensor) -> tuple:
    """``(pointer operand, beta1, beta2, log2 beta1, log2 beta2, 1 - beta1, 1 - beta2)`` for the
    Adam kernel: the host numbers are placeholders when the betas are tensors. ``1 - beta`` is
    formed here in double and rounded once, as torch rounds its Python-float ``1 - beta``: in the
    kernel it would be ``1 - fp32(beta)``, off by up to 2^-24 / (1 - beta) relative (1.7e-4 for
    beta2 = 0.9999) on a GPU, where float arguments arrive as fp32."""
    if isinstance(beta1, torch.Tensor):
        on_device = torch.cat([b.detach().reshape(1).to(device=device, dtype=torch.float32, non_blocking=True)
                               for b in (beta1, beta2)])
        return on_device, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    return dummy, float(beta1), float(beta2), _log2(beta1), _log2(beta2), 1.0 - float(beta1), 1.0 - float(beta2)


def check_and_norm(grads, inv_scale, unscale_in_place=False):
    """Return (bad, sumsq) fp32 1-element tensors for one bucket; reads the grads only, or with
    ``unscale_in_place`` also writes ``grad * inv_scale`` back in the same pass."""
    device = grads[0].device
    block, iters, warps = launch_config()
    table = chunk_table([grads], list(map(_numel, grads)), block * iters, device)
    if table.n_chunks == 0:  # only empty tensors
        zero = torch.zeros(1, dtype=torch.float32, device=device)
        return zero, zero.clone()
    partial_bad = torch.empty(table.n_chunks, dtype=torch.float32, device=device)
    partial_sumsq = torch.empty(table.n_chunks, dtype=torch.float32, device=device)
    cached(_check_and_norm_kernel)[(table.n_chunks,)](
        table.ptrs, table.numels, table.chunk_t, table.chunk_start, table.n_tensors,
        _scalar_or_dummy(inv_scale, partial_bad), partial_bad, partial_sumsq,
        GRAD_DTYPE=tl_dtype(grads[0].dtype), HAS_INV_SCALE=inv_scale is not None,
        WRITE_BACK=unscale_in_place and inv_scale is not None,
        ALIGNED=table.aligned, BLOCK=block, ITERS=iters, num_warps=warps,
    )
    return partial_bad.amax(0, keepdim=True), partial_sumsq.sum(0, keepdim=True)  # (1-element: no reshape)


def _step_role(step, n_roles_before: int, device: torch.device):
    """Steps are either one host number for the bucket or a list of fp32 device tensors."""
    if isinstance(step, (list, tuple)):
        return _fp32_steps(step, device), n_roles_before, 0.0
    return None, -1, float(step)


def _fp32_steps(steps, device: torch.device):
    """The step counts as the kernels read them: fp32 tensors on ``device``, which is how the
    optimizers keep them. A count the program put in a state itself (an fp64 tensor, one on
    the CPU as torch's Adam keeps them) is read through an fp32 copy on ``device`` -- its memory
    read as fp32, or from another device, gave a wrong bias correction or a fault. (The kernels
    only read the counts: a copy loses no write.)"""
    if set(map(_dtype_of, steps)) == _FP32 and set(map(_device_of, steps)) == {device}:
        return steps
    return [s.detach().reshape(()).to(device=device, dtype=torch.float32) for s in steps]


def adam(params, grads, masters, exp_avgs, exp_avg_sqs, step, *, lr, beta1, beta2, eps,
         weight_decay, adamw, bias_correction, maximize, inv_scale, clip_coef, found_inf,
         max_exp_avg_sqs=None):
    device = params[0].device
    block, iters, warps = launch_config()
    steps, step_role, step_scalar = _step_role(step, 6, device)
    roles = [grads, params, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs]
    if steps is not None:
        roles.append(steps)
    table = chunk_table(roles, list(map(_numel, params)), block * iters, device)
    if table.n_chunks == 0:
        return
    dummy = exp_avgs[0]
    lr_ptr, lr_host = _lr_args(lr, device, dummy)
    betas_ptr, *betas_host = _betas_args(beta1, beta2, device, dummy)
    cached(_adam_kernel)[(table.n_chunks,)](
        table.ptrs, table.numels, table.chunk_t, table.chunk_start, table.n_tensors,
        _scalar_or_dummy(inv_scale, dummy), _scalar_or_dummy(clip_coef, dummy),
        _scalar_or_dummy(found_inf, dummy), lr_ptr, betas_ptr,
        lr_host, *betas_host, float(eps), float(weight_decay),
        1.0 - lr_host * float(weight_decay), step_scalar,
        GRAD_DTYPE=tl_dtype(grads[0].dtype), PARAM_DTYPE=tl_dtype(params[0].dtype),
        HAS_MASTER=masters is not None, HAS_INV_SCALE=inv_scale is not None,
        HAS_CLIP=clip_coef is not None, HAS_FOUND_INF=found_inf is not None,
        STEP_ROLE=step_role, LR_ON_DEVICE=isinstance(lr, torch.Tensor),
        BETAS_ON_DEVICE=isinstance(beta1, torch.Tensor), ADAMW=bool(adamw), BIAS_CORRECTION=bool(bias_correction),
        MAXIMIZE=bool(maximize), AMSGRAD=max_exp_avg_sqs is not None, ALIGNED=table.aligned,
        BLOCK=block, ITERS=iters, num_warps=warps,
    )


def sgd(params, grads, masters, momentum_buffers, step, *, lr, momentum, dampening,
        weight_decay, nesterov, maximize, inv_scale, clip_coef, found_inf):
    device = params[0].device
    block, iters, warps = launch_config()
    steps, step_role, step_scalar = _step_role(step, 4, device)
    roles = [grads, params, masters, momentum_buffers]
    if steps is not None:
        roles.append(steps)
    table = chunk_table(roles, list(map(_numel, params)), block * iters, device)
    if table.n_chunks == 0:
        return
    dummy = torch.empty(1, dtype=torch.float32, device=device)
    cached(_sgd_kernel)[(table.n_chunks,)](
        table.ptrs, table.numels, table.chunk_t, table.chunk_start, table.n_tensors,
        _scalar_or_dummy(inv_scale, dummy), _scalar_or_dummy(clip_coef, dummy),
        _scalar_or_dummy(found_inf, dummy), *_lr_args(lr, device, dummy),
        float(momentum), 1.0 - float(dampening), float(weight_decay), step_scalar,
        GRAD_DTYPE=tl_dtype(grads[0].dtype), PARAM_DTYPE=tl_dtype(params[0].dtype),
        HAS_MASTER=masters is not None, HAS_INV_SCALE=inv_scale is not None,
        HAS_CLIP=clip_coef is not None, HAS_FOUND_INF=found_inf is not None,
        STEP_ROLE=step_role, LR_ON_DEVICE=isinstance(lr, torch.Tensor), HAS_MOMENTUM=momentum_buffers is not None,
        NESTEROV=bool(nesterov), MAXIMIZE=bool(maximize),
        ALIGNED=table.aligned, BLOCK=block, ITERS=iters, num_warps=warps,
    )


def lamb_stage1(params, grads, masters, exp_avgs, exp_avg_sqs, updates, step, global_div, *,
                beta1, beta2, beta3, eps, weight_decay, adamw, bias_correction,
                inv_scale, clip_coef, found_inf):
    """Moments + raw update ``u`` into ``updates``; returns per-tensor (||p||^2, ||u||^2)."""
    device = params[0].device
    block, iters, warps = launch_config()
    steps, step_role, step_scalar = _step_role(step, 6, device)
    roles = [grads, params, masters, exp_avgs, exp_avg_sqs, updates]
    if steps is not None:
        roles.append(steps)
    table = chunk_table(roles, list(map(_numel, params)), block * iters, device)
    if table.n_chunks == 0:
        zeros = torch.zeros(table.n_tensors, dtype=torch.float32, device=device)
        return zeros, zeros.clone()
    partial_p2 = torch.empty(table.n_chunks, dtype=torch.float32, device=device)
    partial_u2 = torch.empty(table.n_chunks, dtype=torch.float32, device=device)
    dummy = partial_p2
    cached(_lamb_stage1_kernel)[(table.n_chunks,)](
        table.ptrs, table.numels, table.chunk_t, table.chunk_start, table.n_tensors,
        _scalar_or_dummy(inv_scale, dummy), _scalar_or_dummy(clip_coef, dummy),
        _scalar_or_dummy(found_inf, dummy), global_div, partial_p2, partial_u2,
        float(beta1), float(beta2), _log2(beta1), _log2(beta2), 1.0 - float(beta2), float(beta3),
        float(eps), float(weight_decay),
        step_scalar,
        GRAD_DTYPE=tl_dtype(grads[0].dtype), PARAM_DTYPE=tl_dtype(params[0].dtype),
        HAS_MASTER=masters is not None, HAS_INV_SCALE=inv_scale is not None,
        HAS_CLIP=clip_coef is not None, HAS_FOUND_INF=found_inf is not None,
        STEP_ROLE=step_role, ADAMW=bool(adamw), BIAS_CORRECTION=bool(bias_correction),
        ALIGNED=table.aligned, BLOCK=block, ITERS=iters, num_warps=warps,
    )
    chunk_t = table.chunk_t
    p2 = torch.zeros(table.n_tensors, dtype=torch.float32, device=device).index_add_(0, chunk_t, partial_p2)
    u2 = torch.zeros(table.n_tensors, dtype=torch.float32, device=device).index_add_(0, chunk_t, partial_u2)
    return p2, u2


def lamb_stage2(params, masters, updates, ratios, *, lr, found_inf):
    device = params[0].device
    block, iters, warps = launch_config()
    table = chunk_table([params, masters, updates], list(map(_numel, params)), block * iters, device)
    if table.n_chunks == 0:
        return
    cached(_lamb_stage2_kernel)[(table.n_chunks,)](
        table.ptrs, table.numels, table.chunk_t, table.chunk_start, table.n_tensors,
        _scalar_or_dummy(found_inf, ratios), ratios, *_lr_args(lr, device, ratios),
        PARAM_DTYPE=tl_dtype(params[0].dtype), HAS_MASTER=masters is not None,
        HAS_FOUND_INF=found_inf is not None, LR_ON_DEVICE=isinstance(lr, torch.Tensor),
        ALIGNED=table.aligned, BLOCK=block, ITERS=iters, num_warps=warps,
    )
