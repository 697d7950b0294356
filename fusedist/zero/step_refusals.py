"""What ``ZeroRedundancyOptimizer.step()`` refuses before anything runs: the optimizer's own
refusals, ahead of the step hooks (Note [a sharded optimizer's refusals before the step hooks]),
and the calls of torch's state-dict helpers (Note [torch's state-dict helpers on a sharded
optimizer])."""

from __future__ import annotations

import torch

from . import deferred_stage2, wiring


# Note [a sharded optimizer's refusals before the step hooks]
#     torch runs the global step pre-hooks before an optimizer's ``step`` body, and fusedist's
#     reliability guard is one: it refuses a ``step()`` before any backward through the DDP
#     model. A stage-2 optimizer over a subset of the model's parameters can never step until
#     ``add_param_group`` adds the rest, but its refusal naming the missing parameters came only
#     after a backward -- before one, the guard's "no backward" sent the user to run a backward
#     that was bound to fail with the real error next. The refusals that depend on the optimizer
#     alone (a stage-2 optimizer replaced by a newer one, a subset not completed yet, torch's
#     GradScaler, which cannot step a sharded optimizer) now run first, in ``step``; the step
#     hooks then run around the step body (``_hooked_step``, torch's own hook runner), and
#     ``step`` is marked as hooked so that torch does not wrap it again.
def refuse_first(zero, grad_scaler) -> None:
    """Raise the most specific refusal of a ``step()`` that cannot run, before the step hooks."""
    wiring.check_not_replaced(zero)  # Note [an optimizer built again] in wiring.py
    deferred_stage2.check_complete(zero)  # Note [stage 2 completed by add_param_group]
    if grad_scaler is not None:
        raise RuntimeError(
            "ZeroRedundancyOptimizer(stage=2) cannot be stepped by torch.amp.GradScaler: stage 2 keeps "
            "only this rank's shard of the gradients, so p.grad is None where torch's scaler unscales "
            "and checks for inf/nan. "
            "Use fusedist.amp.GradScaler (same API) and fusedist.clip_grad_norm_ or "
            "optimizer.clip_grad_norm_, or stage=1"
        )


# Note [torch's state-dict helpers on a sharded optimizer]
#     torch's ``get_state_dict`` / ``set_state_dict`` (and ``get_optimizer_state_dict`` /
#     ``set_optimizer_state_dict``) read ``optimizer.state_dict()`` as the whole state in torch's
#     format on every rank, keyed by parameter index; this optimizer's is its rank's shard, so
#     they failed inside torch with a bare ``KeyError: 'state'``. Worse, they first call
#     ``step()`` with zero gradients and a zero learning rate when ``optimizer.state`` is empty
#     (``_init_optim_state``: to create the state of a fresh optimizer), and a sharded
#     optimizer's ``state`` is always empty (its inner optimizer holds the state, as torch's
#     ZeroRedundancyOptimizer's does): that step advanced Adam's moments and step counts before
#     the failure. So ``step()``, ``state_dict()`` and ``load_state_dict()`` called by those
#     helpers (found on the call stack, as ``fusedist/fsdp/torch_helpers.py`` finds them) raise
#     a clear error before anything changes, naming what saves and loads a sharded optimizer.
def refuse_torch_helpers(what: str, helper: str) -> None:
    """Raise when ``what`` runs under torch's state-dict helper function ``helper`` (Note
    [torch's state-dict helpers on a sharded optimizer])."""
    from ..fsdp.torch_helpers import _torch_helper_locals

    if _torch_helper_locals(helper) is None:
        return
    raise RuntimeError(
        f"ZeroRedundancyOptimizer.{what}: called by torch's get_state_dict / set_state_dict (or "
        "get_/set_optimizer_state_dict), which need an optimizer whose state_dict() is the whole state on "
        "every rank; this optimizer's is its rank's shard. Save and load the model and this optimizer with "
        "fusedist.checkpoint.save(dir, model, optimizer) / fusedist.checkpoint.load(dir, model, optimizer) "
        "(any world size; load also reads DCP checkpoints of torch's optimizers), or gather the whole "
        "state with consolidate_state_dict(to=0) and then state_dict() on rank 0. The optimizer's state was not "
        "changed")


def all_rates_zero(groups) -> bool:
    """Whether every group's learning rate is 0, as torch's ``_init_optim_state`` sets them before
    its step (a rate on a device counts as 0: reading it would synchronize)."""
    for group in groups:
        lr = group.get("lr", 0.0)
        if isinstance(lr, torch.Tensor):
            if lr.device.type == "cpu" and bool(lr != 0):
                return False
        elif lr != 0:
            return False
    return True
