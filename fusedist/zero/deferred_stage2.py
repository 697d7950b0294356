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


def _missing(zero, pending: PendingStage2, extra=()) -> list:
    """Names of the parameters ``pending.ddp`` reduces that the optimizer (with ``extra``) does not hold."""
    held = set(zero._params).union(extra)
    reducer = pending.ddp.reducer
    return [n for p, n in zip(reducer.params, reducer.names) if p not in held]


def check_complete(zero) -> None:
    """``step()``: refuse while the stage-2 optimizer still misses some of its model's parameters."""
    pending = zero._stage2_pending
    if pending is None:
        return
    missing = _missing(zero, pending)
    raise RuntimeError(
        f"ZeroRedundancyOptimizer(stage=2) (rank {zero.rank}): the optimizer holds a subset of its DDP model's "
        f"trainable parameters (missing: {missing[:10]}); stage 2 reduce-scatters the model's gradient buckets into "
        "one optimizer's shards, so it needs all of them. Add the rest with optimizer.add_param_group({'params': "
        "[...]}) before the first step (torch's recipe: the shards are cut once the optimizer holds every "
        "parameter), or pass every part as a param group to the constructor; for two optimizers over two parts "
        "of one model use stage=1 (DDP all-reduces, each optimizer shards its own parameters)")


def refusal_to_complete(zero, new: list) -> Optional[ValueError]:
    """The refusal of a group that completes the set when the optimizer state exists already
    (Note [stage 2 completed by add_param_group]), or None."""
    pending = zero._stage2_pending
    if pending is None or _missing(zero, pending, new) or zero.inner is None:
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
    ddp.reducer.fix_layout()  # (the constructor's wiring.connect, for a whole model)
    zero._stage2_pending = None
    zero.ddp = ddp
    zero.overlap_param_gather = zero._gatherer.overlap = pending.overlap_param_gather
    zero._grads_present = False
    zero._partition = zero._build_partition()
    wiring.listen_to_layout(zero)
    wiring.install_stage2(zero, pending.max_buckets_in_flight)
    zero._sharded_state.invalidate()
    return True
