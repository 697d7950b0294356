"""``clip_grad_norm_`` that matches torch's and, between ``GradScaler.unscale_`` and
``GradScaler.step`` of a fused optimizer, costs no gradient pass at all.

Fast path (Note [scaler protocol] in fusedist/amp/grad_scaler.py): ``unscale_`` on a fused
optimizer did not touch the gradients; it recorded ``inv_scale`` and the global sum of squares
of the unscaled gradients in one read-only pass. When ``clip_grad_norm_`` is then called with
exactly the parameters that optimizer covers and ``norm_type=2``, the total norm is
``sqrt(sumsq)`` and the clip coefficient is recorded on the optimizer, which applies it inline
in its update. Everything else (other parameter sets, other norms, no pending unscale) runs
torch's own ``clip_grad_norm_``, after applying any pending unscale to the gradients so they
hold the values torch expects.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Union

import torch

_pending_unscale: "weakref.WeakSet" = weakref.WeakSet()


def register_pending_unscale(optimizer) -> None:
    """Called by GradScaler.unscale_ on a fused optimizer: its gradients are logically
    unscaled but still hold the scaled values."""
    _pending_unscale.add(optimizer)


def _pending_optimizers() -> list:
    live = []
    for opt in list(_pending_unscale):
        if getattr(opt, "_fusedist_inv_scale", None) is None:
            _pending_unscale.discard(opt)
        else:
            live.append(opt)
    return live


def _record_clip(opt, grads: list, max_norm: float, error_if_nonfinite: bool) -> torch.Tensor:
    sumsq = opt._fusedist_grad_sumsq
    prev = opt._fusedist_clip_coef
    if prev is not None:  # clipped twice: the second norm sees the first clip
        sumsq = sumsq * prev.reshape(sumsq.shape) ** 2
    # torch returns the norm in the gradients' dtype and computes the coefficient in it.
    total_norm = sumsq.sqrt().reshape(()).to(grads[0].dtype)
    if error_if_nonfinite and bool(torch.logical_or(total_norm.isnan(), total_norm.isinf())):
        raise RuntimeError(
            "The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite "
            "norm anyway, set `error_if_nonfinite=False`"
        )
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0).float().reshape(1)
    opt._fusedist_clip_coef = clip_coef if prev is None else prev.reshape(1) * clip_coef
    return total_norm


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Drop-in for :func:`torch.nn.utils.clip_grad_norm_`: clips the gradients to a total norm
    of ``max_norm`` and returns the total norm (before clipping) as a tensor.

    With a fused optimizer whose gradients were just ``GradScaler.unscale_``-d, and
    ``parameters`` equal to that optimizer's parameters with gradients, the gradients are not
    read or written: the clip is applied by the optimizer's update (``.grad`` keeps the scaled
    values until then). The returned norm and the final parameters match torch's.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    max_norm = float(max_norm)
    with_grad = [p for p in params if p.grad is not None]
    ids = {id(p) for p in with_grad}
    pending = _pending_optimizers() if ids else []
    if pending and float(norm_type) == 2.0:
        for opt in pending:
            if opt._fusedist_grad_sumsq is None:
                continue
            if {id(p) for p in opt._fusedist_grad_params()} == ids:
                return _record_clip(opt, [p.grad for p in with_grad], max_norm, error_if_nonfinite)
    for opt in pending:
        if any(id(p) in ids for p in opt._fusedist_grad_params()):
            opt._fusedist_materialize_unscale()
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
