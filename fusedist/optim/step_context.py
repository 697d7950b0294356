"""The step context: what the GradScaler and clip decided for the next optimizer step.

``GradScaler.unscale_`` and ``fusedist.clip_grad_norm_`` do not touch the gradients of a fused
optimizer (Note [scaler protocol] in fusedist/amp/grad_scaler.py); they record their results
here, and the optimizer's ``step()`` consumes them in its one pass over the gradients and then
clears the context. One object instead of loose attributes, so a sharded optimizer hands the
whole decision to its inner optimizer in one assignment, and a reader finds every field, who
writes it and who reads it, in one place.

(``grad_scale`` and ``found_inf`` stay attributes of the optimizer: they are torch's own
protocol for fused optimizers, set by torch's GradScaler too.)
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional, Sequence

import torch

__all__ = ["StepContext", "inverse_scale", "materialize_unscales", "pending_contexts"]


@dataclasses.dataclass
class StepContext:
    """Written by ``unscale_`` and clip, read by ``step()``, cleared after it.

    Fields (each None when not set):

    * ``inv_scale``: a pending (lazy) unscale: the gradients still hold the scaled values and
      the update multiplies them by this (``GradScaler(lazy_unscale=True).unscale_``).
    * ``clip_coef``: the clip coefficient recorded by ``clip_grad_norm_``'s fast path; the
      update multiplies the gradients by it.
    * ``grad_sumsq``: the global sum of squares of the unscaled gradients, recorded by
      ``unscale_`` for a clip that then needs no pass of its own; dropped once stale.
    * ``grad_versions``: the gradients' (address, version counter) pairs when ``unscale_``
      measured them (Note [gradients changed after unscale_] in
      fusedist/optim/_scaler_protocol.py).
    * ``clipped_grads``: the parameters, weak references to their gradients and the
      gradients' version counters (a ``ClippedGrads`` of parallel lists) for the gradients the
      recorded ``clip_coef`` covers, taken when fusedist's clip recorded it
      (Note [gradients changed after the clip] in fusedist/optim/_scaler_protocol.py; stage 2
      of ZeroRedundancyOptimizer records its gradient shards, fusedist/zero/scaling.py). Not
      copied by ``dataclasses.replace``: it describes the gradients of the optimizer the clip
      measured, and a sharded optimizer hands a copy of its context to an inner optimizer
      that steps other tensors.
    """

    inv_scale: Optional[torch.Tensor] = None
    clip_coef: Optional[torch.Tensor] = None
    grad_sumsq: Optional[torch.Tensor] = None
    grad_versions: Optional[list] = None
    clipped_grads: Optional[Sequence] = dataclasses.field(default=None, init=False)

    def clear(self) -> None:
        self.inv_scale = self.clip_coef = self.grad_sumsq = self.grad_versions = None
        self.clipped_grads = None

    def effective_inv_scale(self, grad_scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The factor that unscales the gradients in the update: ``1 / grad_scale`` when the
        scaler passed the scale itself (no ``unscale_``), else the pending ``inv_scale``."""
        if grad_scale is not None:
            return inverse_scale(grad_scale)
        if self.inv_scale is not None:
            return self.inv_scale.reshape(1)
        return None

    def record_clip(self, sumsq: torch.Tensor, max_norm: float, error_if_nonfinite: bool,
                    norm_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Record the clip coefficient for a global sum of squares; return the total norm
        (before clipping) in ``norm_dtype``, as torch's clip_grad_norm_ does. The optimizer
        applies the coefficient inline in its update: no gradient is touched here."""
        prev = self.clip_coef
        if prev is not None:  # clipped twice: the second norm sees the first clip
            sumsq = sumsq * prev.reshape(sumsq.shape) ** 2
        total_norm = sumsq.sqrt().reshape(())
        if total_norm.dtype != norm_dtype:
            total_norm = total_norm.to(norm_dtype)
        if error_if_nonfinite and bool(torch.logical_or(total_norm.isnan(), total_norm.isinf())):
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite "
                "norm anyway, set `error_if_nonfinite=False`"
            )
        # torch's max_norm / (total_norm + 1e-6), clamped at 1: Tensor.__rdiv__ is reciprocal()
        # times the number, so this is the same value in the norm's dtype, without the Python
        # operator wrapper and with one temporary for the three results (fewer allocations).
        coef = total_norm.add(1e-6).reciprocal_().mul_(max_norm).clamp_(max=1.0).reshape(1)
        if coef.dtype != torch.float64:  # (fp64 gradients' coefficient is fp64, as torch's)
            coef = coef.float()
        self.clip_coef = coef if prev is None else prev.reshape(1) * coef
        return total_norm


def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as a 1-element fp32 tensor, the reciprocal taken in fp64 as torch's
    GradScaler takes it (fp32 division can be imprecise)."""
    return scale.double().reciprocal().float().reshape(1)


# Optimizers whose context holds a norm recorded by ``unscale_`` and not yet used, so that
# ``fusedist.clip_grad_norm_(parameters)`` -- which is given parameters, not an optimizer, as
# torch's is -- can find the one covering exactly those parameters. Held weakly: a dropped
# optimizer leaves by itself.
_pending: "weakref.WeakSet" = weakref.WeakSet()


def mark_pending(optimizer) -> None:
    """Called by GradScaler.unscale_ on a fused optimizer after it recorded ``grad_sumsq``."""
    _pending.add(optimizer)


def pending_contexts() -> list:
    """The optimizers whose recorded norm is still unused (the others are forgotten)."""
    live = []
    for opt in list(_pending):
        if opt.step_context.grad_sumsq is None:
            _pending.discard(opt)
        else:
            live.append(opt)
    return live


def materialize_unscales(params, pending=None) -> None:
    """``GradScaler(lazy_unscale=True)`` leaves ``.grad`` scaled until the step: before a norm
    or a clip reads the gradients of ``params``, the optimizers among ``pending`` (default:
    :func:`pending_contexts`) holding any of them apply the unscale now."""
    ids = {id(p) for p in params}
    for opt in pending_contexts() if pending is None else pending:
        if any(id(p) in ids for p in opt._fusedist_grad_params()):
            opt._fusedist_materialize_unscale()
