"""The SyncBatchNorm elementwise kernels: the normalization (and the backward's affine form) and
the input gradient. Their launchers are in syncbn.py.
"""

import triton
import triton.language as tl

from .multi_tensor_helpers import _to_param

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
