"""Complex parameters stepped as torch's Adam, AdamW and SGD step them: as real tensors of twice
the size (Note [complex parameters])."""

from __future__ import annotations

import operator

import torch

from .._dtypes import compute_dtype
from ._negated import memory_views as negated_memory_views

# Note [complex parameters]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's Adam, AdamW and SGD take complex parameters: the step views the parameter, its
# gradient and every state tensor as real (``torch.view_as_real``, a trailing dimension of two)
# and runs the real update on the real and imaginary parts alike; the states are complex, made
# like the parameter, so its state dicts hold complex moments. The fused optimizers did refuse
# them, advising ``view_as_real`` -- which a program cannot act on: a view of a parameter is no
# leaf, or (taken under ``no_grad``) one that backward never gives a gradient, so it was never
# stepped. So the states are kept complex as torch keeps them, and each step hands the kernels
# real views of the parameters, gradients and states, which share their memory; a state the
# step creates on such a view (a momentum buffer, AMSGrad's maximum switched on later) is kept
# as its complex view. complex32 has no real counterpart the kernels take: refused.

STEPPABLE = (torch.complex64, torch.complex128)


def dtype_refusal(p: torch.Tensor, takes_complex: bool) -> str:
    """Why an optimizer cannot step ``p`` ("" when it can)."""
    if p.is_floating_point() or (takes_complex and p.dtype in STEPPABLE):
        return ""
    if takes_complex:
        return "only float32/float16/bfloat16/float64/complex64/complex128 parameters are supported"
    hint = " (FusedAdam, FusedAdamW and FusedSGD take complex ones)" if p.is_complex() else ""
    return f"only float32/float16/bfloat16/float64 parameters are supported{hint}"


def state_dtype_of(p: torch.Tensor) -> torch.dtype:
    """The dtype of ``p``'s optimizer states: ``compute_dtype``, or the parameter's own where it
    is complex, as torch's."""
    return p.dtype if p.is_complex() else compute_dtype(p.dtype)


_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))
_dtype_of = operator.attrgetter("dtype")


def any_complex(tensors: list) -> bool:
    """(One C-level pass, stopping at the first complex tensor: it runs at every step.)"""
    return not _COMPLEX.isdisjoint(map(_dtype_of, tensors))


def check_gradients(params: list, grads: list, all_params: list, owner: str) -> None:
    """Refuse a real gradient of a complex parameter (possible with its ``grad_dtype`` lifted):
    its real view would be twice the gradient's size. ``all_params`` name its position."""
    for p, g in zip(params, grads):
        if p.is_complex() and not g.is_complex():
            pi = next(i for i, q in enumerate(all_params) if q is p)
            raise TypeError(f"{owner}: gradient of param {pi} has dtype {g.dtype}, the parameter {p.dtype}")


# Note [lazily conjugated gradients]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A complex tensor may carry torch's conjugate bit (``p.grad = z.conj()``): its memory holds the
# conjugate of its values, and it has no real view (``view_as_real`` refuses it: torch's Adam,
# AdamW and SGD raise on it). It is stepped as its values. The step only reads a gradient: the
# real view of a resolved copy serves (:func:`read_views`). The scaler's inf check, sum of
# squares and in-place unscale are blind to the sign of the imaginary parts and commute with a
# real factor: they walk the memory itself (:func:`memory_views`, the conjugate bit cleared by
# ``conj()``, a view), so an unscale writes the gradient. A parameter or state the step writes
# cannot be resolved in place: refused, naming what to do.
def real_view(t):
    if isinstance(t, torch.Tensor) and t.is_complex():
        if t.is_conj():
            raise ValueError(f"a complex {tuple(t.shape)} parameter or optimizer state is a lazily conjugated view "
                             "(``is_conj()``), which the step would write through its real view; pass "
                             "``.resolve_conj()`` of it (for a parameter, a new nn.Parameter made of it)")
        return torch.view_as_real(t)
    return t


def _read_view(t):
    if isinstance(t, torch.Tensor) and t.is_complex():
        return torch.view_as_real(t.resolve_conj() if t.is_conj() else t)
    return t


def memory_view(t):
    """A complex tensor as the real view of its memory (a conjugated one's bit cleared by
    ``conj()``, a view), anything else as it is (Note [lazily conjugated gradients])."""
    if isinstance(t, torch.Tensor) and t.is_complex():
        return torch.view_as_real(t.conj() if t.is_conj() else t)
    return t


def read_views(grads: list) -> list:
    """Gradients as real tensors of their values, for a step that reads them (Note [lazily
    conjugated gradients])."""
    return list(map(_read_view, grads)) if any_complex(grads) else grads


def memory_views(grads: list) -> list:
    """Gradients as real views of their memory, for the sign-blind scaler passes (Note [lazily
    conjugated gradients])."""
    return list(map(memory_view, grads)) if any_complex(grads) else grads


def grads_as_memory(grads: list, may_be_complex: bool) -> list:
    """The gradients the scaler checks, measures and unscales, as the memory they are written
    in: complex ones as real views, conjugated and negated ones unflagged (Note [lazily
    conjugated gradients], Note [lazily negated tensors] in _negated.py)."""
    return negated_memory_views(memory_views(grads) if may_be_complex else grads)


def real_views(tensors: list) -> list:
    """``tensors`` with each complex one replaced by its real view (the list itself when none is
    complex: the common case costs one pass)."""
    return list(map(real_view, tensors)) if any_complex(tensors) else tensors


def real_states(states: list) -> tuple[list, list]:
    """Each state dict as a new dict of real views, and a copy of those dicts as made
    (:func:`keep_created_states` puts back what the step adds or replaces)."""
    views = [{key: real_view(value) for key, value in state.items()} for state in states]
    return views, [dict(view) for view in views]


def keep_created_states(params: list, states: list, views: list, made: list) -> None:
    """Copy into ``states`` the tensors the step put into the real-view dicts ``views`` (new keys
    or replaced tensors), as complex views where the parameter is complex."""
    for p, state, view, before in zip(params, states, views, made):
        for key, value in view.items():
            if key in before and before[key] is value:
                continue
            if p.is_complex() and isinstance(value, torch.Tensor) and value.shape == p.shape + (2,):
                value = torch.view_as_complex(value)
            state[key] = value
