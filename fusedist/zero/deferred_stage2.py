"""Stage 2 over a subset of a DDP model's parameters, completed by ``add_param_group``.

Note [stage 2 completed by add_param_group]
    torch's ZeroRedundancyOptimizer recipe for per-part hyperparameters builds the optimizer over
    some of the model's parameters and adds the others with ``add_param_group`` (the head with its
    own learning rate). Stage 2 shards the model's gradient buckets -- its backward reduce-scatters
    each bucket into the optimizer's gradient shard -- and a bucket holding parameters the
    optimizer does not have has no shard to go to, so stage 2 cannot start over a subset. It does
    not have to: the constructor only records the model (:class:`PendingStage2`), and the
    ``add_param_group`` after which the optimizer holds every parameter the model reduces cuts the
    shards along the model's buckets and installs the reduce-scatter, as the constructor does for
    the whole model. Until then the model all-reduces into ``p.grad`` as it does without a
    sharded optimizer, and ``step()`` refuses, naming the parameters still missing (so do two
    stage-2 optimizers over two parts of one model: use stage 1 for those). The shards are built
    along the buckets once, when there is no optimizer state yet: a group that would complete the
    set after a step or a load (which created the state over the subset) is refused, on every
    rank, before it is added.

    A group added between a backward and its step (``loss.backward()``, then the head's group,
    then ``step()``) completes the set while the model's averaged gradients sit in ``p.grad``;
    installing the reduce-scatter releases them, and the step found no gradient and stepped
    nothing, where torch's steps every parameter of the optimizer with them. They are carried
    into the new gradient shards (this rank's slices of the averages, as the reduce-scatter
    would have left them). A no_sync backward's gradients are this rank's own, not averaged yet:
    a group completing the set after one is refused, on every rank, before it is added.

    A subset also arises where parameters were frozen after the model was wrapped and the
    optimizer was given only the trainable ones (``[p for p in model.parameters() if
    p.requires_grad]``): the model still reduced them when the optimizer was built, and stops at
    its next backward (Note [trainable set changes] in ``fusedist/ddp/trainable.py``), after which
    nothing is missing any more but stage 2 was never installed: ``step()`` refused, naming no
    parameter ("missing: []"), where torch's optimizers train. The first reader of the gradients
    (the step, the scaler's unscale or check, a clip) now completes stage 2 there, as
    ``add_param_group`` does, with that backward's gradients carried into the shards;
    where it cannot (the optimizer state exists already, a no_sync backward) it names the
    parameters frozen since the wrap and the ways out: give them to the optimizer while frozen
    (kept unstepped, trained once unfrozen), or freeze them before wrapping the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from . import wiring


@dataclasses.dataclass
class PendingStage2:
    """What the constructor was given for stage 2 over a subset of ``ddp``'s parameters."""

    ddp: Any  # the fusedist DistributedDataParallel model the parameters belong to
    max_buckets_in_flight: Optional[int]
    overlap_param_gather: bool
    # names of the model's reduced parameters the optimizer was not given that were frozen then
    frozen_since_wrap: list = dataclasses.field(default_factory=list)


def record_pending(ddp, held: list, max_buckets_in_flight: Optional[int], overlap_param_gather: bool) -> PendingStage2:
    """The constructor's record of stage 2 over a subset ``held`` of ``ddp``'s parameters."""
    held_set = set(held)
    frozen = [n for p, n in zip(ddp.reducer.params, ddp.reducer.names) if p not in held_set and not p.requires_grad]
    return PendingStage2(ddp, max_buckets_in_flight, overlap_param_gather, frozen)


def _missing(zero, pending: PendingStage2, extra=()) -> list:
    """Names of the parameters ``pending.ddp`` reduces that the optimizer (with ``extra``) does not hold."""
    held = set(zero._params).union(extra)
    reducer = pending.ddp.reducer
    return [n for p, n in zip(reducer.params, reducer.names) if p not in held]


def check_complete(zero) -> None:
    """``step()``: refuse while the stage-2 optimizer still misses some of its model's parameters;
    complete it where it misses none any more (the model dropped parameters frozen since the wrap)."""
    pending = zero._stage2_pending
    if pending is None:
        return
    if complete_settled(zero):
        return
    missing = _missing(zero, pending)
    frozen = [n for n in pending.frozen_since_wrap if n not in missing]
    if frozen:
        raise RuntimeError(
            f"ZeroRedundancyOptimizer(stage=2) (rank {zero.rank}): the optimizer was built over a subset of its DDP "
            f"model's parameters: {frozen[:10]} were frozen after the model was wrapped and not given to the "
            "optimizer" + (f" (nor {missing[:10]})" if missing else "") + "; stage 2 cuts its shards along the "
            "model's gradient buckets, which held them then. Give the optimizer those parameters too, while they "
            "are frozen (e.g. a param group of their own: they are kept unstepped and train once unfrozen), or "
            "freeze them before wrapping the model and add them with add_param_group once unfrozen; stage=1 "
            "takes the subset as it is")
    raise RuntimeError(
        f"ZeroRedundancyOptimizer(stage=2) (rank {zero.rank}): the optimizer holds a subset of its DDP model's "
        f"trainable parameters (missing: {missing[:10]}); stage 2 reduce-scatters the model's gradient buckets into "
        "one optimizer's shards, so it needs all of them. Add the rest with optimizer.add_param_group({'params': "
        "[...]}) before the first step (torch's recipe: the shards are cut once the optimizer holds every "
        "parameter), or pass every part as a param group to the constructor; for two optimizers over two parts "
        "of one model use stage=1 (DDP all-reduces, each optimizer shards its own parameters)")


def complete_settled(zero) -> bool:
    """Complete stage 2 where the optimizer misses none of its model's parameters any more (the
    model stopped reducing parameters frozen since the wrap) and it can (Note [stage 2 completed by
    add_param_group]); called first by whatever reads the gradients (the step, the scaler, a clip)."""
    pending = zero._stage2_pending
    if pending is None or _missing(zero, pending) or _gradients_or_state_refusal(zero, pending) is not None:
        return False
    return complete_if_whole(zero)


def refusal_to_complete(zero, new: list) -> Optional[Exception]:
    """The refusal of a group that completes the set (Note [stage 2 completed by add_param_group]),
    or None: where the optimizer state exists already, after a no_sync backward, or where stage 2
    cannot be installed on the model on this rank (a communication hook on it, a backward running:
    Note [stage-2 refusals compared across ranks] in wiring.py). Found before the group joins, so
    the group's comparison raises it on every rank at once, naming the refusing rank."""
    pending = zero._stage2_pending
    if pending is None or _missing(zero, pending, new):
        return None
    return _gradients_or_state_refusal(zero, pending) or wiring.stage2_refusal(zero, pending.ddp)


def _gradients_or_state_refusal(zero, pending: PendingStage2) -> Optional[ValueError]:
    """Why this rank's gradients or optimizer state cannot go into the shards cut now, or None."""
    reducer = pending.ddp.reducer
    if reducer.generation != reducer.synced_generation:
        return ValueError(
            f"ZeroRedundancyOptimizer(stage=2).add_param_group (rank {zero.rank}): this group completes the DDP "
            "model's parameters, and stage 2 then reduce-scatters the model's gradient buckets, but the last "
            "backward ran under no_sync: its gradients are this rank's own, not averaged yet, and cannot be "
            "carried into the shards. Add the group before that backward, or after a synchronized one")
    if zero.inner is None:
        return None
    return ValueError(
        f"ZeroRedundancyOptimizer(stage=2).add_param_group (rank {zero.rank}): this group completes the DDP "
        "model's parameters, and stage 2 then cuts the shards along the model's gradient buckets, but the "
        "optimizer state was created over the subset already (a step, a load_state_dict or a read of `optim` "
        "before the group was added). Add the group right after the constructor, before loading or stepping")


def complete_if_whole(zero) -> bool:
    """After ``add_param_group`` added its parameters: if the optimizer now holds every parameter
    of its DDP model, shard along the model's buckets and install the reduce-scatter. Returns
    whether it did."""
    pending = zero._stage2_pending
    if pending is None or _missing(zero, pending):
        return False
    ddp = pending.ddp
    held = {i: p.grad.detach().clone() for i, p in enumerate(zero._params) if p.grad is not None}
    ddp.reducer.fix_layout()  # (the constructor's wiring.connect, for a whole model)
    zero._stage2_pending = None
    zero.ddp = ddp
    zero.overlap_param_gather = zero._gatherer.overlap = pending.overlap_param_gather
    zero._grads_present = False
    zero._partition = zero._build_partition()
    wiring.listen_to_layout(zero)
    wiring.install_stage2(zero, pending.max_buckets_in_flight)
    zero._sharded_state.invalidate()
    _carry_gradients(zero, held)
    return True


def _carry_gradients(zero, held: dict) -> None:
    """The averaged gradients of a backward before the group was added (index -> a copy of its
    ``p.grad``) into this rank's new gradient shards (Note [stage 2 completed by add_param_group])."""
    if not held:
        return
    from ..ddp.layout import flat_like

    part = zero._partition
    for index, grad in held.items():
        entry = part.entry_of.get(index)
        if entry is not None:
            shard = zero._grad_shards[entry.dtype]
            shard[entry.pos:entry.pos + entry.numel].copy_(flat_like(grad, zero._params[index])[entry.lo:entry.hi])
    trainable = set(zero._trainable)
    zero._stage2_with_grad = {index for index in held if index in trainable}
    zero._grads_present = True
