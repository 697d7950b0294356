"""Per-tensor norms of gradients that are spread over the ranks.

A logger's per-parameter gradient norms (Lightning's ``grad_norm``) over sharded gradients --
``fully_shard`` pieces, a ZeRO stage-2 optimizer's slices -- are each a reduction over the
ranks' parts. One all-reduce of one number per tensor gives them all; the gradient holders
that know which part is whose call this with their own communicator.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch

from ._complex import memory_view

__all__ = ["flag_nan", "magnitudes", "norm_result_dtype", "per_tensor_global_norms", "tensor_norms", "unflag_nan"]


def norm_result_dtype(dtypes) -> torch.dtype:
    """The dtype torch's clip returns the total norm in: the promotion of the gradients' dtypes,
    real (the norm of complex gradients is real)."""
    return functools.reduce(torch.promote_types, dtypes).to_real() if dtypes else torch.float32


def magnitudes(tensors: Sequence[torch.Tensor], norm_type: float) -> list:
    """``tensors`` with each complex one replaced by a real tensor of the same ``norm_type``-norm,
    as torch's clip measures complex gradients (by their magnitudes): its real pairs for the
    2-norm (a view), its magnitudes otherwise. The norm kernels take real tensors only. A lazily
    conjugated tensor (``z.conj()``), which has no real view, gives that of its memory: the
    conjugate's, of the same norm."""
    if not any(t.is_complex() for t in tensors):
        return list(tensors)
    if float(norm_type) == 2.0:
        return [memory_view(t) for t in tensors]  # (a conjugated one: its memory's, the conjugate's)
    return [t.abs() if t.is_complex() else t for t in tensors]


def tensor_norms(tensors: Sequence[torch.Tensor], norm_type: float = 2.0,
                 at_least: torch.dtype = torch.float32) -> torch.Tensor:
    """The norm of each tensor, stacked (in the widest dtype among them), each computed in its
    own dtype or ``at_least`` if that is wider -- torch's clip takes each gradient's norm in the
    gradient's dtype, so an fp32 gradient's norm is rounded to fp32 also beside fp64 ones. A
    complex tensor's norm is that of its magnitudes (:func:`magnitudes`).

    Not below ``at_least``: a bf16/fp16 part's norm rounded to 8 (11) bits before the
    parts are combined makes a total over sharded gradients depend on where the shards are cut
    (a bf16 global norm 6e-4 off at 2 ranks, 2e-3 at 3, for the same gradients), and an fp16
    norm overflows where no element does."""
    tensors = magnitudes(tensors, norm_type)  # (complex128 becomes float64 here)
    computed_in = [torch.promote_types(t.dtype, at_least) for t in tensors]
    norms: list = [None] * len(tensors)
    for dtype in dict.fromkeys(computed_in):
        at = [i for i, d in enumerate(computed_in) if d == dtype]
        for i, norm in zip(at, torch._foreach_norm([tensors[i] for i in at], norm_type, dtype=dtype)):
            norms[i] = norm
    return torch.stack(norms)  # (promotes to the widest)


@torch.no_grad()
def per_tensor_global_norms(parts: Sequence[Optional[torch.Tensor]], norm_type: float, device: torch.device,
                            all_reduce: Callable[[torch.Tensor, str], None]) -> torch.Tensor:
    """One float64 norm per entry of ``parts`` (on ``device``) over every rank's part of it:
    ``parts[i]`` is this rank's part of tensor ``i`` (None or empty where it holds none). Each
    rank takes the sum of ``|x|^p`` of its parts (the max of ``|x|`` for ``p = inf``, the
    negated min for ``-inf``, the count of nonzeros for ``p = 0``: every order torch's norms
    take) and ``all_reduce(t, op)`` combines them in place. A collective: every rank passes
    the same entries in the same order."""
    norm_type = float(norm_type)
    by_max = abs(norm_type) == float("inf")
    # (an empty part has no elements: nothing to add, no max, and +inf as its min)
    partial = torch.full((len(parts),), -float("inf") if norm_type == -float("inf") else 0.0,
                         dtype=torch.float64, device=device)
    at = [i for i, t in enumerate(parts) if t is not None and t.numel()]  # (an empty part has no inf-norm)
    if at:
        local = tensor_norms([parts[i] for i in at], norm_type, at_least=torch.float64).to(device)
        partial[torch.tensor(at, device=device)] = _to_reducible(local, norm_type)
    all_reduce(partial, "max" if by_max else "sum")
    return _from_reducible(partial, norm_type)


def _to_reducible(norms: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Parts' norms as what adds up (or maxes) over the parts: ``|x|^p`` summed for a finite
    ``p != 0`` (also a negative one: ``sum |x|^p`` is additive), the count itself for ``p = 0``,
    the max for ``inf``, the negated min for ``-inf``."""
    if norm_type == float("inf") or norm_type == 0.0:
        return norms
    return -norms if norm_type == -float("inf") else norms.pow(norm_type)


def _from_reducible(reduced: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The inverse of :func:`_to_reducible` on the reduced values."""
    if norm_type == float("inf") or norm_type == 0.0:
        return reduced
    return -reduced if norm_type == -float("inf") else reduced.pow(1.0 / norm_type)


# Note [a NaN through a max all-reduce]
#     A max all-reduce may drop a NaN (NCCL's max is fmax), where torch's norm of the whole
#     gradient keeps it. So a norm reduced by max travels with a flag beside it: [value, isnan],
#     both reduced by max (a sum reduces the flag as well as a max does), and read back as NaN
#     wherever any rank's flag was set.
def flag_nan(local: torch.Tensor) -> torch.Tensor:
    """``[local, isnan(local)]`` (flat, the values then one flag each) to all-reduce (Note [a NaN
    through a max all-reduce])."""
    local = local.reshape(-1)
    return torch.cat([local, local.isnan().to(local.dtype)])


def unflag_nan(packed: torch.Tensor) -> torch.Tensor:
    """The reduced values of :func:`flag_nan`'s packing, NaN where a rank's flag was set (flat)."""
    n = packed.numel() // 2
    return torch.where(packed[n:] > 0, float("nan"), packed[:n])
