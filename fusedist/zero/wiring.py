"""How a ZeroRedundancyOptimizer connects to its data-parallel world.

It finds the fusedist DDP model owning its parameters (or, without one, the communicator of
the process group), and for stage 2 installs the reduce-scatter strategy on DDP's reducer and
listens to its layout changes. Kept apart because it is the only place that touches DDP's
objects at construction: the rest of the optimizer sees ``ddp``, ``comm`` and the buckets.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from ..comm import get_communicator
from ..ddp.replicate import build_pending
from ..ownership import data_parallel_owner, register_gradient_holder, wrapping_owner
from ..reliability import attach_monitor
from .grad_sync import DEFAULT_MAX_BUCKETS_IN_FLIGHT, ReduceScatterToShard


def find_ddp(trainable: list, params: list):
    """The fusedist DDP model owning the ``trainable`` parameters (None without one). Parameters
    the model does not reduce yet are accepted if they are the model's: trainable since it
    was wrapped, it takes them on at its next training forward. Frozen parameters are not
    DDP's (it reduces only trainable ones) and never communicated."""
    build_pending(trainable)  # a replicated module still waiting for its first forward
    found = [data_parallel_owner(p) for p in trainable]
    if not trainable:  # a model frozen whole: its DDP takes the parameters on once they train
        found = [wrapping_owner(p) for p in params]
    owners = {id(d): d for d in found if d is not None}
    ddp = next(iter(owners.values()), None)
    module_params = set(ddp.module.parameters()) if ddp is not None else set()
    if len(owners) > 1 or any(d is None and p not in module_params
                              for d, p in zip(found, trainable)) and ddp is not None:
        raise ValueError(
            "ZeroRedundancyOptimizer: the parameters belong to several fusedist DistributedDataParallel "
            "models (or some to none); give one optimizer the parameters of one DDP model"
        )
    if ddp is None:
        return None
    _refuse_rank_local(ddp, params)
    held = set(params)
    missing = [name for p, name in zip(ddp.reducer.params, ddp.reducer.names) if p not in held]
    if missing:
        raise ValueError(
            f"ZeroRedundancyOptimizer: the optimizer must own every trainable parameter of its DDP model "
            f"(it shards along DDP's gradient buckets); missing: {missing[:10]}. Set requires_grad=False "
            "on parameters you do not train before wrapping the model in DistributedDataParallel."
        )
    return ddp


def _refuse_rank_local(ddp, params: list) -> None:
    """Parameters the DDP model ignores are rank-local (Note [parameters and buffers DDP
    ignores] in ``fusedist/ddp/wrapper.py``): sharding one would overwrite every rank's value
    with its owner's after each step (or fail on a shape that differs between ranks)."""
    ignored = {id(p): n for n, p in ddp.ignored_parameters()}
    names = [ignored[id(p)] for p in params if id(p) in ignored]
    if names:
        raise ValueError(
            f"ZeroRedundancyOptimizer (rank {ddp.rank}): parameters {names[:10]} are ignored by their "
            "DistributedDataParallel model (rank-local, _set_params_and_buffers_to_ignore_for_model); the "
            "optimizer shards parameters over the ranks and sends each rank's updated slice to all, which would "
            "overwrite their rank-local values. Step them with a separate, local optimizer.")


def connect(trainable: list, params: list, process_group, device):
    """``(ddp, comm, process_group)``: the DDP model of the parameters (None without one) and the
    communicator to use -- DDP's, else one for ``process_group`` when torch.distributed is
    initialized, else None (a single process)."""
    ddp = find_ddp(trainable, params)
    if ddp is not None:
        # The shards follow its buckets: fixed from now on, grown only by appending.
        ddp.reducer.fix_layout()
        _check_same_group(process_group, ddp.process_group)
        return ddp, ddp.comm, ddp.process_group
    if dist.is_available() and dist.is_initialized():
        comm = get_communicator(process_group, device)
        attach_monitor(comm)  # [reliability] stall reports without a DDP model too
        # As torch's ZeroRedundancyOptimizer: the default group itself, not None.
        return None, comm, process_group if process_group is not None else dist.group.WORLD
    return None, None, process_group  # a single process without torch.distributed


def _group_ranks(group) -> Optional[list]:
    """The global ranks of ``group`` (None: the default group), or None where this rank is not
    one of them (``new_group`` hands the other ranks a placeholder, which has no ranks)."""
    try:
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except (RuntimeError, ValueError):
        return None


def _check_same_group(process_group, ddp_group) -> None:
    """Refuse a ``process_group`` over other ranks than the DDP model's: the shards follow the
    model's gradient buckets, reduce-scattered over its group. A group of the same ranks (another
    ``new_group`` of them, one of another backend) is that group, as it is to torch's
    ZeroRedundancyOptimizer, whose results do not depend on which object names the ranks."""
    if process_group is None or process_group is ddp_group:
        return
    mine, theirs = _group_ranks(process_group), _group_ranks(ddp_group)
    if mine is not None and mine == theirs:
        return
    spans = f"spans global ranks {mine}" if mine is not None else "does not include this rank"
    raise ValueError(
        f"ZeroRedundancyOptimizer (rank {dist.get_rank()}): process_group {spans}, but the parameters' "
        f"DistributedDataParallel model averages over global ranks {theirs}; the optimizer shards over the "
        "model's group, whose gradient buckets it reduce-scatters. Omit process_group (or pass "
        "model.process_group): sharding over other ranks than the model's is not supported. For a subgroup of "
        "the model's ranks (torch's ZeroRedundancyOptimizer sharded within a node) the model's group gives the "
        "same parameters: every rank holds the same averaged gradients.")


def install_stage2(zero, max_buckets_in_flight: Optional[int] = DEFAULT_MAX_BUCKETS_IN_FLIGHT) -> None:
    """Stage 2: DDP's reducer reduce-scatters each bucket into ``zero``'s gradient shard
    (Note [stage 2 gradients] in ``grad_sync.py``), at most ``max_buckets_in_flight`` at once."""
    if zero.ddp is None:
        raise ValueError(
            "ZeroRedundancyOptimizer(stage=2) needs the parameters of a fusedist.DistributedDataParallel "
            "model: gradients are reduce-scattered by its backward hooks. Wrap the model, or use stage=1."
        )
    reducer = zero.ddp.reducer
    try:
        reducer.use_strategy(ReduceScatterToShard(zero, max_buckets_in_flight))
    except ValueError:
        raise ValueError(
            f"ZeroRedundancyOptimizer(stage=2): this DDP model's gradients are already synchronized by "
            f"{reducer.strategy.description} (a model has one: one stage-2 optimizer, or a communication "
            "hook; stage=1 works with a hook)"
        ) from None
    except RuntimeError as exc:
        raise RuntimeError(f"ZeroRedundancyOptimizer(stage=2) constructed during a backward pass: {exc}") from None
    # A global clip (fusedist.clip_grad_norm_) finds the optimizer that holds these
    # parameters' gradients: p.grad is None in stage 2.
    register_gradient_holder(zero._trainable_params(), zero)
    reducer.release_gradients()  # gradients live in shards from now on
