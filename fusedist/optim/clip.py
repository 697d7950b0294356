"""``clip_grad_norm_`` that matches torch's and, between ``GradScaler.unscale_`` and
``GradScaler.step`` of a fused optimizer, costs no gradient pass at all.

Fast path (Note [scaler protocol] in fusedist/amp/grad_scaler.py): ``unscale_`` on a fused
optimizer recorded the global sum of squares of the unscaled gradients in its check pass (and,
with ``lazy_unscale=True``, left the gradients scaled, recording ``inv_scale`` for the update).
When ``clip_grad_norm_`` is then called with exactly the parameters that optimizer covers and
``norm_type=2``, the total norm is ``sqrt(sumsq)`` and the clip coefficient is recorded in the
optimizer's step context, which its update applies inline. Everything else (other parameter sets, other
norms, fp64 gradients, no recorded norm) runs torch's own ``clip_grad_norm_``, after applying any pending
unscale to the gradients so they hold the values torch expects.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Union

import torch

from ..ownership import any_gradient_holder, gradient_holder
from ..reliability.clip_check import count_clip
from ._eager import CLIP_REASON, eager_under_compile
from ._scaler_protocol import _grad_of, looked_up_once, without_none
from .functional import _dtype_of
from .grad_norms import norm_result_dtype
from .step_context import materialize_unscales, pending_contexts
from .torch_clip import joint_fully_shard_holder, mixed_holders_message, torch_clip_grad_norm_


def _record_clip(opt, grads: list, max_norm: float, error_if_nonfinite: bool) -> torch.Tensor:
    # torch returns the norm in the gradients' dtype and computes the coefficient in it; with
    # gradients of several dtypes it stacks their norms, which promotes (bf16 and fp32 give
    # fp32, whichever comes first), so the promoted dtype, not the first gradient's.
    # (A complex gradient's norm is real, as torch's: Note [complex parameters] in _complex.py.)
    ctx = opt.step_context
    dtype = norm_result_dtype(set(map(_dtype_of, grads)))
    total_norm = ctx.record_clip(ctx.grad_sumsq, max_norm, error_if_nonfinite, dtype)
    opt._fusedist_record_clipped_grads()  # Note [gradients changed after the clip]
    return total_norm


def _any_fp64(grads: list) -> bool:
    return any(g.dtype in (torch.float64, torch.complex128) for g in grads)


def _looked_up_once_each(optimizers: list):
    if len(optimizers) == 1:  # (the common case, without an ExitStack's cost)
        return looked_up_once(optimizers[0])
    stack = contextlib.ExitStack()
    for opt in optimizers:
        stack.enter_context(looked_up_once(opt))
    return stack


# eager in a compiled step: a holder lookup per parameter, and all-reduces (Note [a fused step under
# fullgraph=True] in _eager.py)
@eager_under_compile(CLIP_REASON)
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
    read or written: the clip is applied by the optimizer's update (``.grad`` keeps its
    unclipped values until then, scaled ones with ``lazy_unscale``). The returned norm and the
    final parameters match torch's, also when gradients are replaced before the step; a
    gradient written in place between this clip and the step makes the step raise (Note
    [gradients changed after the clip] in _scaler_protocol.py).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    # Each path counts the call once (Note [a clip on some ranks only] in fusedist/reliability/clip_check.py);
    # torch's, at the end, through its scaling step (fusedist/optim/torch_clip.py).
    # Gradients held sharded across ranks (ZeRO stage 2 keeps only a shard, p.grad is None;
    # fully_shard's p.grad is this rank's shard): the holder computes the global norm.
    holders, unheld = {}, False
    for p in params if any_gradient_holder() else ():
        holder = gradient_holder(p)
        if holder is not None:
            holders.setdefault(id(holder), (holder, []))[1].append(p)
        elif p.requires_grad:  # (a frozen parameter has no gradient to clip anywhere)
            unheld = True
    if holders:
        joint = None if unheld or len(holders) == 1 else joint_fully_shard_holder(list(holders.values()))
        if joint is not None:  # Note [plain units beside tensor-parallel ones] in fusedist/fsdp/holder.py
            count_clip(params, max_norm)
            return joint[0].clip_sharded_grads_(joint[1], max_norm, norm_type, error_if_nonfinite)
        if len(holders) > 1 or unheld:
            raise ValueError(mixed_holders_message(
                "fusedist.clip_grad_norm_: some of these parameters keep their gradients sharded and some do "
                "not, or several sharded owners whose groups differ are mixed", params, unheld))
        holder, held = next(iter(holders.values()))
        # (a stage-2 optimizer also clips some of its parameters: Note [clipping some of the
        # parameters in stage 2] in fusedist/zero/grads.py)
        clip = getattr(holder, "clip_grads_of_", holder.clip_sharded_grads_)
        count_clip(params, max_norm)
        return clip(held, max_norm, norm_type, error_if_nonfinite)
    max_norm = float(max_norm)
    # (whole-list passes: Note [whole-list passes] in _scaler_protocol.py)
    with_grad, grads = without_none(params, list(map(_grad_of, params)))
    ids = set(map(id, with_grad))
    pending = pending_contexts() if ids else []
    with _looked_up_once_each(pending):  # Note [gradients looked up once a call]
        for opt in pending:
            if opt._fusedist_check_grads_since_unscale():  # Note [gradients changed after unscale_]
                opt.step_context.grad_sumsq = None  # stale: measured afresh below
        # A parameter listed twice counts twice in torch's norm (and is scaled twice): torch's
        # path, not the recorded norm of the optimizer's parameters, each once. So do fp64
        # gradients: the update takes the coefficient as fp32 (the kernels' contract), where
        # torch scales them by an fp64 one -- 1e-8 apart, in a model trained in fp64 for its
        # precision.
        if pending and float(norm_type) == 2.0 and len(ids) == len(with_grad) and not _any_fp64(grads):
            for opt in pending:
                if opt.step_context.grad_sumsq is None:
                    continue
                if set(map(id, opt._fusedist_grad_params())) == ids:
                    count_clip(params, max_norm)
                    return _record_clip(opt, grads, max_norm, error_if_nonfinite)
        materialize_unscales(with_grad, pending)
    if foreach is not False and any(g.is_neg() or g.is_conj() for g in grads):
        foreach = False  # Note [a negated or conjugated gradient clipped]
    return torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)


# Note [a negated or conjugated gradient clipped]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A gradient that is a lazily negated view (``z.conj().imag``) or a lazily conjugated one
# (``p.grad = z.conj()``) makes torch's foreach clip raise ("fallback doesn't currently support
# mutable TensorLists with negation inputs"), the default on CPU and CUDA. Its per-tensor path
# reads and scales them as their values (same norm, same coefficient): it is taken for such a
# list, also where ``foreach=True`` was asked for.
