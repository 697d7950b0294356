"""Pure-PyTorch SyncBatchNorm math: the CPU fallback and the oracle of the Triton kernels.

Each function computes exactly what its kernel launcher in ``triton_kernels/syncbn.py``
computes (same inputs, same outputs), in ``acc_dtype`` (fp32 for fp16/bf16/fp32 inputs,
fp64 for fp64 inputs). They work on any strides: reductions run over every dim but 1, and
elementwise results keep the input's memory format.
"""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (x.dim() - 2))


def welford_stats(x: torch.Tensor, mean_out: torch.Tensor, m2_out: torch.Tensor,
                  count_out: torch.Tensor) -> None:
    """Per-channel count, mean and M2 = sum((x - mean)^2) of ``x`` into the output tensors."""
    count = x.numel() // x.shape[1]
    count_out.fill_(count)
    if count == 0:
        mean_out.zero_()
        m2_out.zero_()
        return
    # var_mean is a single-pass, numerically stable (Welford) reduction on CPU and CUDA.
    var, mean = torch.var_mean(x.to(acc_dtype(x.dtype)), dim=_reduce_dims(x), correction=0)
    mean_out.copy_(mean)
    m2_out.copy_(var * count)


def backward_reduce(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                    invstd: torch.Tensor) -> torch.Tensor:
    """Per-channel ``[sum(dy), sum(dy * xhat)]`` as a (2, C) tensor in the accumulation dtype."""
    acc = acc_dtype(x.dtype)
    dims = _reduce_dims(x)
    dy_acc = dy.to(acc)
    xhat = (x.to(acc) - _per_channel(mean.to(acc), x)) * _per_channel(invstd.to(acc), x)
    return torch.stack([dy_acc.sum(dims), (dy_acc * xhat).sum(dims)])


def channel_affine(out: torch.Tensor, u: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                   v: torch.Tensor | None = None, r: torch.Tensor | None = None,
                   t: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
    """``out = (u - p) * q [+ (v - r) * t] [+ b]`` with per-channel p, q, r, t, b."""
    acc = acc_dtype(u.dtype)
    res = (u.to(acc) - _per_channel(p.to(acc), u)) * _per_channel(q.to(acc), u)
    if v is not None:
        res = res + (v.to(acc) - _per_channel(r.to(acc), u)) * _per_channel(t.to(acc), u)
    if b is not None:
        res = res + _per_channel(b.to(acc), u)
    out.copy_(res)
    return out
