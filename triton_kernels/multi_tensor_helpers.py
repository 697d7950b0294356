"""The ``@triton.jit`` helpers the multi-tensor kernels share: chunk coordinates, pointer-table
reads, masked and unmasked loads and stores, the gradient factor, the found-inf live range
(Note [found-inf masking] in multi_tensor.py), rounding to the parameter dtype, bias correction.

Under the Triton interpreter a helper a kernel calls must be a global of the kernel's module:
each kernel module imports the helpers it calls by name.
"""

import triton
import triton.language as tl

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
