"""A DDP wrapper retired, and what a newer wrapper over the same parameters takes over from it.

Kept apart from the wrapper: retiring is also done from outside (a framework's teardown), and the
take-over reaches the consumers that follow a wrapper's buckets (ZeRO's sharded optimizers).
"""

from __future__ import annotations

from .. import ownership
from ..comm.released_group import is_alive
from .agreement import LayoutAgreementCheck
from .layout import layout_of
from .strategy import AllReduceAverage


def retire(ddp, reason: str) -> None:
    """``ddp`` stops reducing gradients: its hooks come off, and a forward through it raises
    ``reason`` (the first reason given stays). Safe to call more than once."""
    ddp.reducer.remove_hooks()
    if ddp._superseded_by is None:
        ddp._superseded_by = reason


def release_engine(reducer_ref) -> None:
    """The wrapper of the reducer ``reducer_ref`` refers to was freed: its gradient hooks come off,
    and its observers let go of it, so that the engine goes at once as well, not at a garbage
    collection (Note [a dropped wrapper goes at once] in wrapper.py). Held weakly: a stage-2
    optimizer the reducer reduces into refers to the wrapper, which a strong reference from the
    finalizer would keep alive for good."""
    reducer = reducer_ref()
    if reducer is None:
        return
    reducer.remove_hooks()
    reducer.observers.clear()
    reducer.check_carrier = None


# Note [an optimizer over a module wrapped again]
#     A ZeroRedundancyOptimizer built over a DDP model follows that wrapper's buckets: its shards
#     are ranges of them, and at stage 2 the wrapper's backward reduce-scatters each bucket into
#     the optimizer's gradient shard. When the module is wrapped again (Note [a module wrapped
#     again] in wrapper.py) the older wrapper is retired, and the optimizer the program built
#     stepped shards nothing reduced into any more: its steps changed nothing, without a word
#     (0.13 off torch in three steps). torch's ZeroRedundancyOptimizer does not depend on the
#     wrapper, so over torch DDP wrapped again it trains on: that is what a program expects here.
#     The newer wrapper therefore takes the older one's buckets over -- the same buckets, in the
#     same order, under the newer wrapper's names -- when it reduces exactly the same parameters
#     over the same ranks, and with them the optimizer's reduce-scatter, layout listeners and
#     parameter waiters: the optimizer, its state and its schedulers go on unchanged. (Its own
#     bucket caps give way: the buckets are fixed once an optimizer shards them, Note [layout
#     fixed by a sharded consumer] in rebucket.py.) Where the parameters differ (the module
#     wrapped inside a larger one, parameters replaced, some frozen since) or the ranks do, the
#     shards cannot follow; a stage-2 optimizer then refuses its next step, saying to build one
#     over the newer wrapper. A stage-1 optimizer reads ``p.grad``, which the newer wrapper
#     averages, and needs nothing more in that case.
def take_over(older: list, newer) -> None:
    """``newer`` (built, its reducer made) takes over from the retired wrappers ``older`` what
    follows their buckets (Note [an optimizer over a module wrapped again])."""
    for old in older:
        if _can_follow(old, newer):
            _follow(old, newer)
        else:
            _refuse_stage2(old, newer)


def same_ranks(a, b) -> bool:
    """Whether process groups ``a`` and ``b`` span the same ranks (two wrappers' averages agree). None is
    the default group torch.distributed has now; a group it destroyed spans no ranks any more (Note [a
    destroyed group in a comparison])."""
    import torch.distributed as dist

    if a is b:
        return True
    if not (_live(a) and _live(b)):
        return False
    try:
        return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)
    except (RuntimeError, ValueError):
        return False


# Note [a destroyed group in a comparison]
#     torch keeps the ranks of the groups it has; a group it destroyed is no longer among them, so asking
#     for its ranks raised a bare KeyError naming the group object (a torch DistributedDataParallel built
#     before destroy_process_group(), wrapped inside a fusedist wrapper after a new init_process_group(),
#     failed the construction with it). It matches no live group: its collectives are refused whatever the
#     ranks. A fusedist wrapper's ``process_group`` reads None once its group was destroyed, which
#     same_ranks would read as the new default group: a newer wrapper over it took over the retired one's
#     stage-2 buckets, and its backward failed on a reduce-scatter sized for the old world (re-initialized
#     over other ranks) or reduced into the old optimizer's shards, leaving p.grad None (over the same
#     ranks). So the wrappers are compared by their groups only while both live (``_can_follow``), and the
#     old optimizer's refusal names the destroy.
def _live(group) -> bool:
    """Whether ``group`` (None: the default group) is one torch.distributed has now."""
    import torch.distributed as dist

    if group is None:
        return dist.is_initialized()
    return is_alive(group)


def followers_of(reducer) -> list:
    """The layout listeners of ``reducer`` that are not its wrapper's own check."""
    return [f for f in reducer.layout_listeners if not isinstance(f, LayoutAgreementCheck)]


def _can_follow(old, newer) -> bool:
    """Whether ``newer`` can take ``old``'s buckets as they are: the same parameters (objects,
    dtypes, devices) reduced over the same ranks."""
    if stage2_consumer(old) is None and not followers_of(old.reducer):
        return False  # nothing follows its buckets
    if newer.reducer.in_backward or old.reducer.in_backward:
        return False
    mine, theirs = old.reducer.params, newer.reducer.params
    if len(mine) != len(theirs) or set(mine) != set(theirs):
        return False
    if old.reducer.inactive or newer.reducer.inactive:
        return False
    if any(b.params and (b.params[0].dtype != b.dtype) for b in old.reducer.layout.buckets):
        return False  # converted since: the old buckets do not fit the parameters
    old_group, new_group = old.process_group, newer.process_group
    if old_group is None or new_group is None:  # Note [a destroyed group in a comparison]
        return False
    return same_ranks(old_group, new_group) and old.device == newer.device


def _follow(old, newer) -> None:
    """``newer`` reduces into ``old``'s buckets, for the consumers that follow them."""
    names = dict(zip(newer.reducer.params, newer.reducer.names))
    buckets = [b.copy_for(names) for b in old.reducer.layout.buckets]
    strategy = old.reducer.strategy
    newer.reducer.adopt_layout(layout_of(buckets, newer.device, bucket_storage=old.reducer.layout.bucket_storage),
                               fixed=old.reducer.append_only)
    followers = followers_of(old.reducer)
    old.reducer.layout_listeners[:] = [f for f in old.reducer.layout_listeners if f not in followers]
    newer.reducer.layout_listeners.extend(followers)
    newer._param_waiters.extend(old._param_waiters)
    old._param_waiters.clear()
    for consumer in _consumers(followers, strategy):
        if getattr(consumer, "ddp", None) is old:
            consumer.ddp = newer  # (what the optimizer asks about its model from now on)
    if stage2_consumer(old) is not None:  # (a communication hook stays with the wrapper it was registered on)
        old.reducer.release_strategy(strategy)
        newer.reducer.use_strategy(strategy)
        if all(p.grad is None for p in newer.reducer.params):  # (else a no_sync backward's: the step refuses)
            newer.reducer.release_gradients()  # the consumer keeps them (stage 2: p.grad is None)


def stage2_consumer(ddp):
    """The optimizer ``ddp``'s backward reduce-scatters into (ZeRO stage 2), or None."""
    return _zero_of(ddp.reducer.strategy)


def _zero_of(strategy):
    """The stage-2 optimizer a reducer ``strategy`` reduce-scatters into, or None."""
    return None if isinstance(strategy, AllReduceAverage) else getattr(strategy, "zero", None)


def _consumers(followers: list, strategy) -> list:
    """The objects behind ``followers`` (weak bound methods or bound methods) and ``strategy``."""
    found = {}
    zero = _zero_of(strategy)
    if zero is not None:
        found[id(zero)] = zero
    for f in followers:
        method = getattr(f, "_method", None)
        bound = method() if callable(method) else f
        owner = getattr(bound, "__self__", None)
        if owner is not None:
            found.setdefault(id(owner), owner)
    return list(found.values())


def release_holder(ddp, holder) -> None:
    """``ddp`` averages into ``p.grad`` again if it reduced into ``holder``'s shards: the holder
    was retired (a framework swapped another optimizer in for it)."""
    strategy = ddp.reducer.strategy
    if getattr(strategy, "zero", None) is holder and not ddp.reducer.in_backward:
        ddp.reducer.release_strategy(strategy)


def _refuse_stage2(old, newer) -> None:
    """A stage-2 consumer of ``old`` that cannot follow refuses its next step."""
    zero = stage2_consumer(old)
    if zero is None:
        return
    # its shards no longer hold these gradients: a clip measures p.grad, the newer wrapper's average
    ownership.release([p for group in zero.param_groups for p in group["params"]], [zero])
    module = type(newer.module).__name__
    if old.process_group is None:  # Note [a destroyed group in a comparison]
        how = ("its DistributedDataParallel model's process group was destroyed "
               "(torch.distributed.destroy_process_group()) and its module was wrapped again by a newer "
               f"DistributedDataParallel (of a module of type {module})")
        then = ("Build a new ZeroRedundancyOptimizer over the newer wrapper's parameters (to go on from here, "
                "load into it a consolidate_state_dict() saved before the destroy: the destroyed group can no "
                "longer gather this one's shards)")
    else:
        how = ("its DistributedDataParallel model was wrapped again by a newer DistributedDataParallel (of a "
               f"module of type {module}) over other parameters or ranks")
        then = ("Build a new ZeroRedundancyOptimizer over the newer wrapper's parameters (load this one's "
                "consolidate_state_dict() into it to go on from here), or wrap the same module with the same "
                "trainable parameters, which this optimizer follows")
    zero._replaced = (
        f"ZeroRedundancyOptimizer(stage=2) (rank {old.rank}): {how}, which now reduces their gradients into "
        "p.grad; this optimizer's gradient shards follow the retired wrapper's buckets, which nothing reduces "
        f"into any more, so it cannot be stepped. {then}")
