"""The precision rules shared across the library: the dtype math runs in (optimizers,
SyncBatchNorm) and how an fp16 average over ranks splits its division (DDP, ZeRO,
fully_shard)."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that math on ``dtype`` tensors runs and accumulates in, and that optimizer
    state for them is kept in: fp64 stays fp64, every other floating dtype (fp32, fp16, bf16)
    widens to fp32.

    Sums of many fp16/bf16 terms and Adam's small per-step updates are lost below fp32's
    precision, so nothing narrower is used; a model trained in fp64 asked for fp64 and keeps
    it, as torch's optimizers and batch norm do."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def real_pairs(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the collectives carry it: a complex one flat, as its (real, imaginary) pairs (a
    view: the same bytes), anything else as it is.

    NCCL has no complex types (torch's NCCL backend sends complex tensors the same way, and the
    direct-NCCL communicator refuses them); rank ``r``'s slice of the flat real view is the real
    view of its complex slice, and a sum or average acts on the parts alone, so an all-gather,
    reduce-scatter or all-reduce of the views is the complex one.

    A lazily negated or conjugated tensor (torch's negative or conjugate bit) is refused: its
    memory holds the negation or conjugate of its values, and a collective reads and writes
    memory, so its values would be carried negated (silently: ``view_as_real`` refuses only the
    conjugate bit) and a result written into it read back negated. Gradients so flagged are
    copied into plain buffers before they get here (a copy reads the values); this guards that.
    """
    if t.is_neg() or t.is_conj():
        raise ValueError(
            f"fusedist: a {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} tensor handed to a collective is "
            f"a lazily {'negated' if t.is_neg() else 'conjugated'} view (torch's "
            f"{'negative' if t.is_neg() else 'conjugate'} bit): its memory holds the "
            f"{'negation' if t.is_neg() else 'conjugate'} of its values, which the collective would carry; "
            "pass t.resolve_neg().resolve_conj() (a copy holding the values)")
    return torch.view_as_real(t).view(-1) if t.is_complex() else t


def fp16_divisors(factor: float) -> tuple[float, float]:
    """``(pre, post)`` with ``pre * post == factor``: an fp16 gradient average over ranks
    divides by ``pre`` before the sum and by ``post`` after it.

    A sum of N fp16 gradients overflows (65504) where their average would not, and dividing
    fully first flushes small gradients to zero, so the division is split: ``pre`` doubles from
    1 while it divides ``factor`` and is below ``factor / pre`` (about sqrt(N), a power of two,
    so exact). The rule is torch FSDP2's; at N = 2 it divides fully first, as torch DDP does.
    """
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre
