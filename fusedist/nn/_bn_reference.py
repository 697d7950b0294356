"""Pure-PyTorch SyncBatchNorm math: the CPU fallback and the oracle of the Triton kernels.

Each function computes what its kernel launcher in ``triton_kernels/syncbn.py`` computes
(same inputs, same outputs) in ``compute_dtype`` (fp32 for fp16/bf16/fp32 inputs, fp64 for fp64
inputs), on any strides: reductions run over every dim but 1 and elementwise results keep
the input's memory format.

Where an fp32/fp64 input allows it, the work is handed to torch's own fused, multithreaded
BatchNorm primitives used in *inference form*, which evaluate exactly the expression needed:
with running_mean = p, running_var = 1 and eps = 0, ``F.batch_norm`` returns
``(u - p) / sqrt(1) * q + b = (u - p) * q + b``, and ``native_batch_norm_backward`` with
p = 0 returns ``sum(a)`` and ``sum(a * b)``, each in one pass. (``torch.var_mean`` over several
dims and chains of broadcast elementwise ops make several passes and temporaries, and are many
times slower on CPU.) Half-precision inputs take the plain upcast-to-fp32 path, because those
primitives would round intermediate sums to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._dtypes import compute_dtype


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (x.dim() - 2))


def _fused_ok(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in (torch.float32, torch.float64) for t in tensors)


def _centered_scaled(u: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                     b: torch.Tensor | None = None) -> torch.Tensor:
    """(u - p) * q (+ b) per channel in one fused pass; u is fp32 or fp64."""
    acc = u.dtype
    ones = torch.ones_like(p, dtype=acc)
    return F.batch_norm(u, p.to(acc), ones, q.to(acc), None if b is None else b.to(acc),
                        training=False, momentum=0.0, eps=0.0)


def _channel_dot(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (sum(a * b), sum(a)) in one fused pass (fp32/fp64 a and b).

    torch's kernel may evaluate sum(dy * (x - p)) as sum(dy * x) - p * sum(dy), which
    cancels catastrophically when |p| >> std; with p = 0 both forms are the plain dot product,
    so callers center their operand first."""
    zeros = torch.zeros(a.shape[1], dtype=a.dtype, device=a.device)
    ones = torch.ones_like(zeros)
    _, dot, total = torch.ops.aten.native_batch_norm_backward(
        a, b, None, zeros, ones, None, None, False, 0.0, [False, True, True])
    return dot, total


def _all_finite(*tensors: torch.Tensor | None) -> bool:
    """Whether every given per-channel coefficient is finite (C elements each: cheap).

    The inference form evaluates ``u * q + (b - p * q)``, which equals ``(u - p) * q`` only
    while p and q are finite: an inf in the upstream gradient makes mean(dy) and the x
    coefficient of the input gradient infinite, and ``x * t - r * t`` then turns elements
    that torch's centered backward leaves at +-inf into NaN (Note [non-finite statistics]
    in ``triton_kernels/syncbn_reduce.py``)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


def welford_stats(x: torch.Tensor, mean_out: torch.Tensor, m2_out: torch.Tensor,
                  count_out: torch.Tensor) -> None:
    """Per-channel count, mean and M2 = sum((x - mean)^2) of ``x`` into the output tensors.

    Two passes, the mean and then the deviations from it, with the correction of the
    corrected two-pass algorithm (Chan, Golub and LeVeque): the fp32 sum rounds the mean by
    about ``eps * |mean|``, which is most of a channel's spread when ``|mean| >> std``, and the
    deviations' own sum ``s`` measures that rounding, so ``mean + s / n`` and
    ``M2 = sum(d^2) - s^2 / n`` are as accurate as Welford's lanes in the kernels.
    """
    count = x.numel() // x.shape[1]
    count_out.fill_(count)
    if count == 0:
        mean_out.zero_()
        m2_out.zero_()
        return
    xa = x.to(compute_dtype(x.dtype))
    mean = xa.sum(_reduce_dims(x)) / count
    centered = _centered_scaled(xa, mean, torch.ones_like(mean))
    squares, drift = _channel_dot(centered, centered)
    # (the payload is fp64: the corrected mean stays exact; an infinite mean keeps its value,
    # Note [non-finite statistics] in triton_kernels/syncbn_reduce.py, where the drift is NaN)
    drift = torch.where(torch.isfinite(mean), drift, 0.0).to(mean_out.dtype)
    mean_out.copy_(mean).add_(drift / count)
    m2_out.copy_(squares).sub_(drift * drift / count)


def backward_reduce(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                    invstd: torch.Tensor) -> torch.Tensor:
    """Per-channel ``[sum(dy), sum(dy * xhat)]`` as a (2, C) tensor in the accumulation dtype,
    with ``xhat = (x - mean) * invstd``."""
    acc = compute_dtype(x.dtype)
    if _fused_ok(dy, x) and dy.dtype == x.dtype and _all_finite(mean, invstd):  # (see _all_finite)
        # x - mean, then invstd on the sum: the inference form's x * invstd - mean * invstd
        # would cancel most of xhat's digits where |mean| >> std
        centered = _centered_scaled(x, mean, torch.ones_like(invstd))
        sum_dy_centered, sum_dy = _channel_dot(dy, centered)
        return torch.stack([sum_dy, sum_dy_centered * invstd.to(sum_dy.dtype)])
    dims = _reduce_dims(x)
    dy_acc = dy.to(acc)
    xhat = (x.to(acc) - _per_channel(mean.to(acc), x)) * _per_channel(invstd.to(acc), x)
    return torch.stack([dy_acc.sum(dims), (dy_acc * xhat).sum(dims)])


def channel_affine(u: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                   v: torch.Tensor | None = None, r: torch.Tensor | None = None,
                   t: torch.Tensor | None = None, b: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(u - p) * q [+ (v - r) * t] [+ b]`` with per-channel p, q, r, t, b, as a new tensor
    of ``out_dtype`` (default u's) in u's memory format."""
    out_dtype = out_dtype or u.dtype
    if _fused_ok(u, *(() if v is None else (v,))) and (v is None or _all_finite(p, q, r, t, b)):
        if v is None:
            return _centered_scaled(u, p, q, b).to(out_dtype)
        # v - r first (exact where |r| >> v's spread, as torch's backward kernel centers x;
        # the inference form v t - r t would cancel), then * t + (b - p q) and + u q in place
        acc = u.dtype
        shift = -(p.to(acc) * q.to(acc))
        if b is not None:
            shift += b.to(acc)
        res = _centered_scaled(v.to(acc), r, torch.ones_like(t, dtype=acc))
        torch.addcmul(_per_channel(shift, u), res, _per_channel(t.to(acc), u), out=res)
        return res.addcmul_(u, _per_channel(q.to(acc), u)).to(out_dtype)
    acc = compute_dtype(u.dtype)
    res = (u.to(acc) - _per_channel(p.to(acc), u)) * _per_channel(q.to(acc), u)
    if v is not None:
        res = res + (v.to(acc) - _per_channel(r.to(acc), u)) * _per_channel(t.to(acc), u)
    if b is not None:
        res = res + _per_channel(b.to(acc), u)
    return res.to(out_dtype)
