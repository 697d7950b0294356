"""Tensors with torch's negative bit handed to the multi-tensor updates, which read raw memory
(Note [lazily negated tensors])."""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor

# Note [lazily negated tensors]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A real tensor may carry torch's negative bit (``torch._neg_view(x)``; ``z.conj().imag`` of a
# complex ``z``; the real view of a negated complex tensor): its memory holds ``-value`` and
# every torch op reads ``value``. The kernels read raw memory, so a negated gradient was stepped
# the wrong way on every element, silently. Inputs the update only reads (gradients, the
# ``inv_scale``/``clip_coef``/``found_inf`` scalars) are resolved into copies first; a tensor
# it writes cannot be resolved in place and is refused, naming it, before anything is written:
# a parameter at every call, states and masters in a validated call (the fused optimizers make
# their own, with the bit clear, and skip those passes: ~0.1 us per tensor and list). The
# inf/nan check, the sum of squares and an unscale (a product with a real positive factor) give
# the same answer on ``-value``: check_and_norm walks the memory as it is, so an in-place
# unscale writes the gradient's own memory.
_is_neg = torch.Tensor.is_neg


def any_negated(lst) -> bool:
    try:
        return any(map(_is_neg, lst))  # (~70 ns per tensor)
    except TypeError:  # a None (or another non-tensor, which the callers' checks name) among them
        return any(isinstance(t, Tensor) and t.is_neg() for t in lst)


def read_resolved(tensors):
    """Each negated tensor resolved into a copy; the list itself when none is (one pass in C)."""
    if not any_negated(tensors):
        return tensors
    return [t.resolve_neg() if isinstance(t, Tensor) and t.is_neg() else t for t in tensors]


def scalar_resolved(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.resolve_neg() if isinstance(t, Tensor) and t.is_neg() else t


def refuse_negated(op: str, **written) -> None:
    """Refuse a negated tensor the update writes (Note [lazily negated tensors])."""
    for name, lst in written.items():
        if lst is None or not any_negated(lst):
            continue
        i = next(i for i, t in enumerate(lst) if isinstance(t, Tensor) and t.is_neg())
        raise ValueError(
            f"{op}: {name}[{i}] is a lazily negated view (torch's negative bit, e.g. ``z.conj().imag`` or "
            "``torch._neg_view``): its memory holds the values' negation and the update writes it in place; "
            "pass ``.resolve_neg()`` of it (for a parameter, a new nn.Parameter made of it)")


def memory_view(g: Tensor) -> Tensor:
    """A negated gradient as the plain view of its memory (``-value``): Note [lazily negated tensors]."""
    return torch._neg_view(g) if g.is_neg() else g  # (toggles the bit: the memory as it is)


def memory_views(grads):
    """Each negated gradient as the plain view of its memory (:func:`memory_view`)."""
    if not any_negated(grads):
        return grads
    return [memory_view(g) for g in grads]
