"""How a ZeroRedundancyOptimizer connects to its data-parallel world.

It finds the fusedist DDP model owning its parameters (or, without one, the communicator of
the process group), and for stage 2 installs the reduce-scatter strategy on DDP's reducer and
listens to its layout changes. Kept apart because it is the only place that touches DDP's
objects at construction: the rest of the optimizer sees ``ddp``, ``comm`` and the buckets.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch.distributed as dist

from ..comm import get_communicator
from ..ddp.replicate import build_pending
from ..ddp.strategy import AllReduceAverage
from ..ownership import data_parallel_owner, register_gradient_holder, wrapping_owner
from ..reliability import attach_monitor
from .grad_sync import DEFAULT_MAX_BUCKETS_IN_FLIGHT, ReduceScatterToShard


# Note [a subset of a DDP model's parameters]
#     With every trainable parameter of a fusedist DDP model the optimizer shards along the
#     model's gradient buckets (stage 1 aliases them, stage 2 reduce-scatters into its shard).
#     torch's ZeroRedundancyOptimizer also takes a subset of a DDP model's parameters -- two
#     optimizers over two parts of the model (a GAN's generator and discriminator, a backbone
#     and a head with their own algorithms), or only the parameters still trained after some
#     were frozen once the model was wrapped -- and this one refused them. A subset cannot follow
#     the buckets (they hold the other parameters too), but it needs nothing of them in stage 1:
#     DDP all-reduces every gradient whole, so the optimizer takes the subset as it takes the
#     parameters of torch's DDP model -- its own buckets, its slices stepped from the averaged
#     ``p.grad`` and all-gathered over the model's communicator, torch's algorithm. Stage 2 is
#     started over a subset: the model's backward reduce-scatters its buckets into one optimizer's
#     shards, and a bucket holding both optimizers' parameters has no one shard. torch's two-call
#     recipe (the body given to the constructor, the head added with its own lr by
#     ``add_param_group``) completes the set before the first step: stage 2 starts then (Note
#     [stage 2 completed by add_param_group] in ``deferred_stage2.py``).
def find_ddp(trainable: list, params: list):
    """``(ddp, whole, refusal)``: the fusedist DDP model owning the ``trainable`` parameters (None
    without one), whether they are all its trainable parameters (else a subset: Note [a subset of
    a DDP model's parameters]) and the error to raise -- after the ranks have compared their
    parameter lists (Note [the same parameters on every rank]): a rank whose list alone was
    refused raised alone, and the others waited in that comparison.
    Parameters the model does not reduce yet are accepted if they are the model's: trainable
    since it was wrapped, it takes them on at its next training forward. Frozen parameters are
    not DDP's (it reduces only trainable ones) and never communicated."""
    build_pending(trainable)  # a replicated module still waiting for its first forward
    found = [data_parallel_owner(p) for p in trainable]
    if not trainable:  # a model frozen whole: its DDP takes the parameters on once they train
        found = [wrapping_owner(p) for p in params]
    owners = {id(d): d for d in found if d is not None}
    ddp = next(iter(owners.values()), None)
    module_params = set(ddp.module.parameters()) if ddp is not None else set()
    if len(owners) > 1 or any(d is None and p not in module_params
                              for d, p in zip(found, trainable)) and ddp is not None:
        # (refused after the comparison, over the first model's communicator: Note [refusals of one
        # rank's own arguments] in param_checks.py -- a model wrapped twice on one rank only)
        return ddp, False, ValueError(
            f"ZeroRedundancyOptimizer (rank {ddp.rank}): the parameters belong to several fusedist "
            "DistributedDataParallel models (or some to none); give one optimizer the parameters of one DDP model")
    if ddp is None:
        return None, True, None
    held = set(params)
    missing = [name for p, name in zip(ddp.reducer.params, ddp.reducer.names) if p not in held]
    refusal = _refuse_rank_local(ddp, params)
    return ddp, not missing, refusal


def _refuse_rank_local(ddp, params: list) -> Optional[ValueError]:
    """The refusal of parameters the DDP model ignores, or None: they are rank-local (Note
    [parameters and buffers DDP ignores] in ``fusedist/ddp/wrapper.py``), and sharding one would
    overwrite every rank's value with its owner's after each step (or fail on a shape that differs
    between ranks). Returned, to be raised after the ranks compared (a list ignored on one rank only)."""
    ignored = {id(p): n for n, p in ddp.ignored_parameters()}
    names = [ignored[id(p)] for p in params if id(p) in ignored]
    if names:
        return ValueError(
            f"ZeroRedundancyOptimizer (rank {ddp.rank}): parameters {names[:10]} are ignored by their "
            "DistributedDataParallel model (rank-local, _set_params_and_buffers_to_ignore_for_model); the "
            "optimizer shards parameters over the ranks and sends each rank's updated slice to all, which would "
            "overwrite their rank-local values. Step them with a separate, local optimizer.")
    return None


def connect(trainable: list, params: list, process_group, device):
    """``(ddp, comm, process_group, refusal, subset_of)``: the DDP model of the parameters (None
    without one, or for a subset of its parameters: Note [a subset of a DDP model's parameters]),
    the communicator to use -- DDP's, else one for ``process_group`` when torch.distributed is
    initialized, else None (a single process) --, the error the constructor raises once the
    ranks have compared their parameter lists (None: none; see :func:`find_ddp`) and, for a
    subset, the DDP model it is a subset of."""
    ddp, whole, refusal = find_ddp(trainable, params)
    if ddp is not None:  # (a group refused here is refused after the comparison, as find_ddp's refusals)
        refusal = refusal or _check_same_group(process_group, ddp.process_group)
    if ddp is not None and (refusal is not None or not whole):  # its communicator; the optimizer's own buckets
        return None, ddp.comm, ddp.process_group, refusal, (ddp if refusal is None else None)
    if ddp is not None:
        # The shards follow its buckets: fixed from now on, grown only by appending.
        ddp.reducer.fix_layout()
        return ddp, ddp.comm, ddp.process_group, None, None
    if dist.is_available() and dist.is_initialized():
        comm = get_communicator(process_group, device)
        attach_monitor(comm)  # [reliability] stall reports without a DDP model too
        # As torch's ZeroRedundancyOptimizer: the default group itself, not None.
        return None, comm, process_group if process_group is not None else dist.group.WORLD, None, None
    return None, None, process_group, None, None  # a single process without torch.distributed


def _group_ranks(group) -> Optional[list]:
    """The global ranks of ``group`` (None: the default group), or None where this rank is not
    one of them (``new_group`` hands the other ranks a placeholder, which has no ranks)."""
    try:
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except (RuntimeError, ValueError):
        return None


def _check_same_group(process_group, ddp_group) -> Optional[ValueError]:
    """The refusal of a ``process_group`` over other ranks than the DDP model's, or None (raised
    after the ranks compared, as :func:`find_ddp`'s refusals): the shards follow the
    model's gradient buckets, reduce-scattered over its group. A group of the same ranks (another
    ``new_group`` of them, one of another backend) is that group, as it is to torch's
    ZeroRedundancyOptimizer, whose results do not depend on which object names the ranks."""
    if process_group is None or process_group is ddp_group:
        return None
    mine, theirs = _group_ranks(process_group), _group_ranks(ddp_group)
    if mine is not None and mine == theirs:
        return None
    spans = f"spans global ranks {mine}" if mine is not None else "does not include this rank"
    return ValueError(
        # (the first clause is the same on every refusing rank: Note [refusals of one rank's own arguments])
        f"ZeroRedundancyOptimizer (rank {dist.get_rank()}): process_group is not the group of the parameters' "
        f"DistributedDataParallel model; it {spans}, but the model averages over global ranks {theirs}; the "
        "optimizer shards over the "
        "model's group, whose gradient buckets it reduce-scatters. Omit process_group (or pass "
        "model.process_group): sharding over other ranks than the model's is not supported. For a subgroup of "
        "the model's ranks (torch's ZeroRedundancyOptimizer sharded within a node) the model's group gives the "
        "same parameters: every rank holds the same averaged gradients.")


class _LayoutListener:
    """DDP's layout listener for one optimizer, held weakly (Note [an optimizer built again])."""

    def __init__(self, zero):
        self._method = weakref.WeakMethod(zero._on_layout_change)

    def serves(self, zero) -> bool:
        method = self._method()
        return method is not None and method.__self__ is zero

    def alive(self) -> bool:
        return self._method() is not None

    def __call__(self, layout) -> None:
        method = self._method()
        if method is not None:
            method(layout)


# Note [an optimizer built again]
#     Programs build a model's optimizer more than once: ``optimizer = make_optimizer(model)``
#     again to start from a fresh state, a learning-rate finder before the real run, a
#     framework's ``configure_optimizers`` called per fit. With torch's optimizers the old one
#     is simply dropped. The DDP model must not keep it: its layout listener holds the
#     optimizer weakly, so the old one's masters and states are freed with it (held strongly,
#     every optimizer ever built stayed alive, and was grown when parameters were unfrozen), and
#     the forward pre-hooks of its overlapped gathers come off the model with it. Stage 2
#     installs its reduce-scatter on the model; a later stage-2 optimizer of the same model
#     takes it over (:func:`install_stage2`), and the one it replaced refuses to step.
def release_hooks_with(zero) -> None:
    """The overlapped gathers' hooks on the model go with ``zero``, at the model's next forward
    (Note [an optimizer built again]; ``ParamGatherer.orphan``)."""
    weakref.finalize(zero, zero._gatherer.orphan)


def listen_to_layout(zero) -> None:
    """Parameters DDP appends to its layout join ``zero`` at once (Note [growing the partition]
    in ``grow.py``), while ``zero`` lives (Note [an optimizer built again])."""
    listeners = zero.ddp.reducer.layout_listeners
    listeners[:] = [f for f in listeners if not isinstance(f, _LayoutListener) or f.alive()]
    listeners.append(_LayoutListener(zero))


# Note [a dropped wrapper]
#     ``ZeroRedundancyOptimizer(fusedist.DistributedDataParallel(net).parameters(), stage=2)``, or a
#     wrapper built and not assigned: nothing holds the wrapper, so it is freed at once (nothing it holds
#     refers back to it) and its backward hooks come off; the optimizer finds no DDP model. Told to "wrap
#     the model", the user had wrapped it. The parameters' registrations outlive their wrapper (weakly held:
#     ``fusedist.ownership``), so a wrapper that existed and is gone is told apart from none, and the
#     refusals (stage 2 here; stage 1's gradient comparison, Note [gradients nobody averaged] in
#     grad_agreement.py) say to keep a reference to it.
DROPPED_WRAPPER_ADVICE = (
    "Keep a reference to the DistributedDataParallel wrapper (model = fusedist.DistributedDataParallel(net)), "
    "run the forward through it, and build the optimizer from its parameters")


def dropped_wrapper(params) -> bool:
    """Whether a fusedist DistributedDataParallel wrapped some of ``params`` and nothing holds it any
    more (Note [a dropped wrapper])."""
    from ..ownership import wrapper_dropped

    return any(wrapper_dropped(p) for p in params)


# Note [stage-2 refusals compared across ranks]
#     What stage 2 refuses at construction depends on this rank's objects: the DDP wrapper (one
#     dropped, or none), a communication hook registered on the model, an earlier stage-2 optimizer
#     of the model still holding gradients, a backward in progress. These were raised when stage 2
#     was installed, after the ranks had compared their parameter lists: a hook registered on one
#     rank only (a per-host config) refused there alone, and the other rank went on into its first
#     backward and waited there until the stall timeout. The refusal is now found first (nothing
#     changes: :func:`stage2_refusal`) and is an entry of the constructor's comparison (Note
#     [refusals of one rank's own arguments] in param_checks.py): every rank raises at once, the
#     same RankMismatchError naming the refusing rank and its reason where the ranks differ, each
#     its own error, naming its rank, where all refuse alike. A stage 2 that ``add_param_group``
#     completes (Note [stage 2 completed by add_param_group] in deferred_stage2.py) finds the same
#     refusal for its pending model before the group joins, and the group's comparison carries it.
def stage2_refusal(zero, ddp=None) -> Optional[Exception]:
    """Why stage 2 cannot be installed on ``ddp`` (default ``zero``'s DDP model) on this rank, or None
    (Note [stage-2 refusals compared across ranks]); changes nothing. ``ddp``: the model of a stage 2
    that ``add_param_group`` completes (Note [stage 2 completed by add_param_group])."""
    ddp = zero.ddp if ddp is None else ddp
    if ddp is None and dropped_wrapper(zero._params):  # Note [a dropped wrapper]
        return ValueError(
            f"ZeroRedundancyOptimizer(stage=2) (rank {zero.rank}): the fusedist.DistributedDataParallel wrapper "
            "of these parameters was dropped: nothing kept a reference to it, so it was freed and its backward "
            f"hooks, which reduce-scatter the gradients, came off. {DROPPED_WRAPPER_ADVICE}; or use stage=1.")
    if ddp is None:
        return ValueError(
            f"ZeroRedundancyOptimizer(stage=2) (rank {zero.rank}): needs the parameters of a "
            "fusedist.DistributedDataParallel model: gradients are reduce-scattered by its backward hooks. Wrap "
            "the model, or use stage=1.")
    reducer = ddp.reducer
    if reducer.in_backward:
        return RuntimeError(f"ZeroRedundancyOptimizer(stage=2) (rank {zero.rank}): constructed (or completed by "
                            "add_param_group) during a backward pass; the gradient synchronization cannot change "
                            "during a backward pass. Build the optimizer, or add the group, between backward passes")
    if isinstance(reducer.strategy, ReduceScatterToShard):
        old = reducer.strategy.zero
        if old is not zero and old._grads_present:
            return ValueError(
                f"ZeroRedundancyOptimizer(stage=2) (rank {zero.rank}): this DDP model's stage-2 optimizer built "
                "before holds the gradients of a backward it has not stepped (in its shards; p.grad is None in "
                "stage 2). Call its step() or zero_grad() first, then build the new one")
        return None
    if not isinstance(reducer.strategy, AllReduceAverage):
        return ValueError(
            f"ZeroRedundancyOptimizer(stage=2) (rank {zero.rank}): this DDP model's gradients are already "
            f"synchronized by {reducer.strategy.description} (a model has one: a communication hook, or a stage-2 "
            "optimizer); stage=1 works with a hook")
    return None


def install_stage2(zero, max_buckets_in_flight: Optional[int] = DEFAULT_MAX_BUCKETS_IN_FLIGHT) -> None:
    """Stage 2: DDP's reducer reduce-scatters each bucket into ``zero``'s gradient shard
    (Note [stage 2 gradients] in ``grad_sync.py``), at most ``max_buckets_in_flight`` at once."""
    refusal = stage2_refusal(zero)  # (the constructor raised it already, after the comparison)
    if refusal is not None:
        raise refusal
    reducer = zero.ddp.reducer
    if isinstance(reducer.strategy, ReduceScatterToShard):
        _take_over(reducer, zero)  # Note [an optimizer built again]
    reducer.use_strategy(ReduceScatterToShard(zero, max_buckets_in_flight))
    # A global clip (fusedist.clip_grad_norm_) finds the optimizer that holds these
    # parameters' gradients: p.grad is None in stage 2.
    register_gradient_holder(zero._trainable_params(), zero)
    reducer.release_gradients()  # gradients live in shards from now on


def _take_over(reducer, zero) -> None:
    """The stage-2 reduce-scatter of ``reducer``, installed by an earlier optimizer, passes to
    ``zero``; the earlier one refuses to step from now on (Note [an optimizer built again]).
    Refused while the earlier one holds gradients it has not stepped: they live in its shards,
    which ``zero`` does not have (torch's new optimizer would step the old ``p.grad``)."""
    old = reducer.strategy.zero
    if old is zero:
        return
    reducer.release_strategy(reducer.strategy)  # (raises during a backward, before anything changed)
    listeners = reducer.layout_listeners  # (a replaced optimizer is not grown any more)
    listeners[:] = [f for f in listeners if not (isinstance(f, _LayoutListener) and f.serves(old))]
    old._gatherer.release()  # (its last step's all-gathers may still be landing in the parameters)
    old._replaced = (f"ZeroRedundancyOptimizer(stage=2) (rank {old.rank}): a newer stage-2 optimizer was built "
                     "for the same DDP model and synchronizes its gradients now; this one cannot be stepped "
                     "any more. Step the newer one (load this one's state_dict() into it to go on from here)")


def check_not_replaced(zero) -> None:
    """Raise if a newer stage-2 optimizer took ``zero``'s model over (Note [an optimizer built again])."""
    if zero._replaced is not None:
        raise RuntimeError(zero._replaced)
