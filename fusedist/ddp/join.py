"""Uneven inputs: ``model.join()`` and ``torch.distributed.algorithms.Join`` for fusedist.

Note [joined ranks]
    A rank whose data ran out leaves its training loop and enters the join context's exit,
    where it *shadows* the collectives of the ranks still training, one training iteration
    at a time, until every rank is out. Per iteration the ranks pair up like this (the
    first two rows are torch's Join protocol: the active ranks' "not joined" all-reduce of
    1, the joined ranks' count of non-joined ranks with 0):

        active rank (training forward)         joined rank (join hooks)
        ------------------------------         -----------------------------------------
        notify "not joined" (1)                count non-joined ranks (0)
        read the last step check               read the last (shadow) step check
        join state all-reduce (below)          join state all-reduce (zeros)
        buffer broadcast from the authority    buffer broadcast from the authority
        SyncBatchNorm statistics gathers       the same gathers with count 0
        backward: SyncBatchNorm all-reduces,   the same all-reduces with zeros, then every
        then every bucket, step check          bucket with zero gradients, step check
                                               (neutral values)
        optimizer.step() (ZeRO: gathers)       ZeroRedundancyOptimizer's hook: a step

    The *join state* all-reduce (int64, SUM, ``4 + 2 * world_size`` values) tells every rank
    what the active ranks do this iteration: how many are active, how many synchronize
    gradients (0: a ``no_sync()`` iteration, no bucket collectives; some but not all: raised
    on every rank, naming them), how many broadcast buffers, how many changed their trainable
    set (then followed by a broadcast of the flags: ``_share_trainable_flags``), which ranks
    are active (a one-hot row: the buffer authority is the highest active rank, as torch's)
    and which synchronize (another row). The gradient divisor is the initial world size or, with
    ``divide_by_initial_world_size=False``, the number of active ranks, on every rank (the
    joined ranks need it too: their buffers receive the average, which ZeRO steps with); with
    a torch communication hook registered it stays the world size, as torch's hooks divide.

    While a join context is enabled the gradient buckets are launched at the end of
    backward when the model has SyncBatchNorm layers (whose backward all-reduces must come
    in the same order on the joined ranks, which cannot know where a bucket became ready),
    and the SyncBatchNorm layers a training forward runs are recorded, so that a rank that
    joins replays its last iteration's layers (a rank that never ran one under the context
    uses the model's SyncBatchNorm layers in registration order).

    The per-step check (Note [step check]) of a joined rank contributes values that are
    neutral for the MAX/MIN comparison: only the active ranks are compared, so a rank that
    skips a step while still training is still reported on every rank. After the last rank
    joined, every rank reads its pending check, the last joiners are compared once more, and
    the counters, parameters and buffers are broadcast from the highest last joiner (torch's
    choice), so training may go on after the context with checks that agree.

    With fusedist's own context (``model.join()`` or :class:`Join`) the two protocol
    all-reduces go through the communicator too (bounded by fusedist's timeout, named in
    stall reports); under torch's generic ``Join`` they are torch's own, on the same group.
    The first joinable sends the protocol all-reduces: put the model before the optimizer,
    ``Join([model, optimizer])``, as with torch. ZeroRedundancyOptimizer's side (its join hook)
    is in ``fusedist/zero/join.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.algorithms.join import Join as _TorchJoin
from torch.distributed.algorithms.join import JoinHook, _JoinConfig

DISABLED = _JoinConfig.construct_disabled_join_config()

# The SyncBatchNorm layers run by the training forward in progress under a join context
# (a list, or None outside such a forward).
_sync_bn_trace: Optional[list] = None


def record_sync_bn(layer, input: torch.Tensor) -> None:
    """Called by SyncBatchNorm's synchronizing forward; cheap (a global read) otherwise."""
    if _sync_bn_trace is not None:
        _sync_bn_trace.append((layer, layer.num_features, input.dtype))


class Join(_TorchJoin):
    """torch's ``Join`` whose own all-reduces (the count of non-joined ranks, the early
    termination notice) go through fusedist's communicator: bounded by its timeout and
    named in stall reports. ``DistributedDataParallel.join()`` returns one; use it like
    torch's: ``with fusedist.Join([model, optimizer]): ...``."""

    def __init__(self, joinables, *args, **kwargs):
        # A replicated module joins through its engine (Note [replicate without a wrapper]), found
        # through its class: a traced construction guards on types only.
        engines = [getattr(type(j), "_fusedist_join_engine", None) for j in joinables]
        super().__init__([j if e is None else e(j) for j, e in zip(joinables, engines)], *args, **kwargs)

    # Note [join under torch.compile]
    #     A join context inside a compiled training step (or around a compiled loop): dynamo
    #     traced its enter and exit into the communicator's all-reduces (the count of ranks
    #     still training, the joined ranks' shadowed collectives), and every rank failed at
    #     the first step ("Attempted to access unregistered member on an OpaqueObject"). Both
    #     run eagerly, a graph break on each side of the ``with`` block; so do the join hooks
    #     (DDPJoinHook here, ZeroJoinHook in zero/join.py), which torch's own ``Join`` calls
    #     from its traced exit.
    @torch.compiler.disable
    def __enter__(self):
        return super().__enter__()

    @torch.compiler.disable
    def __exit__(self, type, value, traceback):
        return super().__exit__(type, value, traceback)

    def _set_joinable_configs(self) -> None:
        super()._set_joinable_configs()
        for joinable in self._joinables:
            # Identity marks the configs of this kind of context (a torch Join made later
            # replaces them with its own objects).
            joinable._fusedist_join_config = joinable._join_config

    def _comm(self):
        for joinable in self._joinables:
            comm = getattr(joinable, "comm", None)
            if comm is not None:
                return comm
        return None

    def _get_num_nonjoined_procs(self):
        comm = self._comm()
        if comm is None:
            return super()._get_num_nonjoined_procs()
        flag = torch.zeros(1, device=comm.device)
        comm.all_reduce(flag, tag="join: count of ranks still training")
        return flag.item()

    def _notify_procs_to_terminate(self):
        comm = self._comm()
        if comm is None:
            return super()._notify_procs_to_terminate()
        comm.all_reduce(torch.ones(1, device=comm.device), tag="join: early termination")
        raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")


def notify(joinable) -> None:
    """``Join.notify_join_context`` for a fusedist joinable: through its communicator in a
    fusedist context, torch's own in torch's (the joined ranks' count pairs with it there)."""
    config = joinable._join_config
    if not config.enable or not config.is_first_joinable:
        return
    if getattr(joinable, "_fusedist_join_config", None) is not config:
        _TorchJoin.notify_join_context(joinable)
        return
    comm = joinable.comm
    comm.all_reduce(torch.ones(1, device=comm.device), tag="join: not joined")
    if config.throw_on_early_termination:
        flag = torch.zeros(1, device=comm.device)
        comm.all_reduce(flag, tag="join: early termination")
        if flag.item():
            raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")


# ----------------------------------------------------------------------------- DDP


class DDPJoinState:
    """Per-model state of a join context (Note [joined ranks])."""

    def __init__(self, ddp, divide_by_initial_world_size: bool):
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.joined = False
        self.grads_at_join: list = []  # (parameter, its gradient when this rank joined): restored after
        self.synced = False  # whether this iteration synchronized gradients (ZeRO's hook reads it)
        self.trace: Optional[list] = None  # SyncBatchNorm layers of the last training forward
        self.has_sync_bn = any(_is_sync_bn(m) for m in ddp.module.modules())
        ddp._joined_once = True  # torch logs that uneven inputs were joined (Note [torch's DDP logging data])


def _is_sync_bn(module) -> bool:
    from ..nn.sync_batch_norm import SyncBatchNorm

    return isinstance(module, SyncBatchNorm)


def exchange_state(ddp, active: bool, sync: bool, wants_buffers: bool) -> tuple[int, int, int]:
    """The join state all-reduce: (active ranks, ranks synchronizing, buffer authority or -1).
    Then, when an active rank's trainable set changes, its flags go to every rank (below)."""
    comm = ddp.comm
    tracker = ddp.reducer.tracker
    world = ddp.world_size
    state = torch.zeros(4 + 2 * world, dtype=torch.int64)
    if active:
        state[0], state[1], state[2], state[4 + ddp.rank] = 1, int(sync), int(wants_buffers), 1
        state[3], state[4 + world + ddp.rank] = int(tracker.target is not None), int(sync)
    from .join_agreement import check_divisors, with_divisor_row  # Note [the join's divisor agreed across ranks]

    state = with_divisor_row(state, ddp).to(comm.device)
    comm.all_reduce(state, tag="ddp join state")
    values = state.tolist()
    check_divisors(ddp, values[4 + 2 * world:])
    ranks = [r for r in range(world) if values[4 + r]]
    if 0 < values[1] < values[0]:
        _mixed_no_sync(ddp, ranks, [r for r in range(world) if values[4 + world + r]])
    if values[3] and ranks:
        _share_trainable_flags(ddp, max(ranks), active)
    authority = max(ranks) if values[2] and ranks else -1
    return values[0], values[1], authority


def _mixed_no_sync(ddp, ranks: list, syncing: list) -> None:
    """Some ranks still training synchronize this iteration's backward, others run it under
    ``no_sync()``: their bucket collectives would not pair up (torch's DDP aborts in gloo or
    hangs). Raised on every rank, which all read the same join state."""
    local = [r for r in ranks if r not in syncing]
    raise RuntimeError(
        f"fusedist.DistributedDataParallel (rank {ddp.rank}) under join: the ranks still training disagree on "
        f"no_sync() at the same iteration: ranks {local} run it under no_sync(), ranks {syncing} synchronize "
        "gradients. Every rank still training must accumulate the same number of micro-batches between "
        "synchronized backwards (a rank that runs out of batches may stop at any point)")


@torch.no_grad()
def _share_trainable_flags(ddp, src: int, active: bool) -> None:
    """Note [trainable set changes] in trainable.py under join: the active ranks changed which
    parameters train, and the end of their backward averages and re-buckets accordingly, with
    collectives a joined rank must shadow. So it takes the flags of the highest active rank and
    follows them as a training forward would; the newly trainable parameters contribute no
    gradient from it (their ``.grad`` set to None)."""
    reducer, tracker = ddp.reducer, ddp.reducer.tracker
    flags = torch.tensor([p.requires_grad for p in tracker.params], dtype=torch.uint8, device=ddp.comm.device)
    ddp.comm.broadcast(flags, src=src, tag="ddp join: trainable flags")
    if active:
        return
    for p, f in zip(tracker.params, flags.tolist()):
        p.requires_grad_(bool(f))
        if f and not reducer.is_active(p):
            p.grad = None
    tracker.observe(reducer)


def before_forward(ddp) -> None:
    """A training forward while a join context is enabled (the active side)."""
    reducer = ddp.reducer
    reducer.check_previous_backward()  # Note [interrupted backward]
    notify(ddp)
    sync = ddp._no_sync_depth == 0
    reducer.prepare_forward(sync=sync)  # before this step's first collective
    state = ddp._join_state
    if state is None:  # torch's Join built without our hook: treat as dividing by the world size
        state = ddp._join_state = DDPJoinState(ddp, True)
    # Note [when buffers are broadcast] in buffer_broadcast.py holds here too: torch's join broadcasts at a
    # forward only after a synchronized one, not at every micro-batch of a no_sync accumulation.
    wants = bool(ddp.config.broadcast_buffers and ddp._buffers_due and ddp.module.training and ddp._module_buffers())
    ddp._buffers_due = sync
    reducer.tracker.observe(reducer)  # Note [trainable set changes]: before the exchange, which shares it
    active, _, authority = exchange_state(ddp, True, sync, wants)
    reducer.grad_divisor = _grad_divisor(ddp, state, active)
    if authority >= 0:
        ddp._broadcast_coalesced(ddp._module_buffers(), tag="ddp buffers", src=authority)
    reducer.defer_launch = state.has_sync_bn


def _grad_divisor(ddp, state: DDPJoinState, active: int) -> int:
    """The initial world size, or the active ranks' count with ``divide_by_initial_world_size=False``
    -- unless a torch communication hook is registered: torch's hooks, the averaging ones fusedist
    runs as its own reduction included, divide by the group's size whatever the join asks."""
    if state.divide_by_initial_world_size or ddp._comm_hook is not None:
        return ddp.world_size
    return max(active, 1)


def run_module(ddp, args, kwargs):
    """The module's forward, recording the SyncBatchNorm layers it runs."""
    global _sync_bn_trace
    state = ddp._join_state
    if state is None or not state.has_sync_bn:
        return ddp.module(*args, **kwargs)
    previous, _sync_bn_trace = _sync_bn_trace, []
    try:
        out = ddp.module(*args, **kwargs)
        state.trace = _sync_bn_trace
    finally:
        _sync_bn_trace = previous
    return out


def begin_module(ddp) -> None:
    """:func:`run_module`'s recording, begun by a replicated module's forward pre-hook (its
    forward runs between the hooks, not inside a call of ours); :func:`end_module` ends it."""
    global _sync_bn_trace
    state = ddp._join_state
    if state is not None and state.has_sync_bn:
        _sync_bn_trace = []


def end_module(ddp) -> None:
    global _sync_bn_trace
    state = ddp._join_state
    if state is not None and state.has_sync_bn and _sync_bn_trace is not None:
        state.trace, _sync_bn_trace = _sync_bn_trace, None


def _static_sync_bn_trace(ddp) -> list:
    """The model's training SyncBatchNorm layers in registration order, for a rank that never
    ran a forward under the context."""
    trace = []
    for module in ddp.module.modules():
        if _is_sync_bn(module) and module.training:
            ref = module.weight if module.weight is not None else module.running_mean
            trace.append((module, module.num_features, ref.dtype if ref is not None else torch.float32))
    return trace


# Note [a joined rank's running statistics]
#     A rank that ran out of inputs takes part in each SyncBatchNorm statistics gather with an
#     empty batch, as a rank whose batch is empty does in a training forward -- and such a
#     forward (torch's SyncBatchNorm too) still counts the batch and blends the global batch's
#     statistics into the running ones. So does the joined rank: without it, a model whose
#     buffers are not broadcast (``broadcast_buffers=False``) left the joined ranks with old
#     running statistics and ``num_batches_tracked``, and the first training forward after the
#     context was refused on every rank as layers mixed up (Note [the same layer on every rank]
#     in nn/_sync_stats.py). The gathered tensor is the active ranks' own, so the blend gives
#     the same values. Its backward plan is read from the gather as well: the joined rank
#     all-reduces in the reverse loop exactly where the active ranks' backwards do.
@torch.no_grad()
def _shadow_sync_bn(ddp, trace: list) -> None:
    """SyncBatchNorm's collectives with an empty batch: count 0 in each statistics gather
    (forward order), with the running statistics updated from it (Note [a joined rank's running
    statistics]), zeros in each backward all-reduce the gathers call for (reverse order)."""
    from .._dtypes import compute_dtype
    from ..nn._sync_stats import GRAD_TAG, IDENTITY_LEN, combine, gather_messages, read_gather

    reduces = []
    for layer, channels, _dtype in trace:
        comm = layer._communicator(ddp.device)
        if comm is None:
            reduces.append(False)
            continue
        # count 0 and an identity of zeros (compared with nothing): Note [the same layer on every rank]
        message = torch.zeros(2 * channels + 1 + IDENTITY_LEN, dtype=torch.float64, device=comm.device)
        gathered = gather_messages(message, comm)
        counts, reduce = read_gather(gathered, channels, comm)  # raises where the active ranks raise
        reduces.append(reduce)
        _track_running_stats(layer, combine(gathered, channels, counts))
    for (layer, channels, dtype), reduce in reversed(list(zip(trace, reduces))):
        if reduce:
            comm = layer._communicator(ddp.device)
            # in the reverse order of the gathers, as the active ranks' backwards: Note [the backward's parts
            # agreed in the forward] in nn/_grad_order.py
            comm.all_reduce(torch.zeros(2 * channels, dtype=compute_dtype(dtype), device=comm.device), tag=GRAD_TAG,
                            parts_checked=True)


def _track_running_stats(layer, stats) -> None:
    """A training forward's update of ``layer``'s running statistics from the global batch's
    ``stats`` (Note [a joined rank's running statistics]): the count, and the blend unless the
    global batch is empty."""
    from ..nn._function import _blend_

    if not layer.track_running_stats or layer.running_mean is None or layer.running_var is None:
        return
    tracked = layer.num_batches_tracked
    factor = 0.0 if layer.momentum is None else layer.momentum
    if tracked is not None:
        tracked.add_(1)
        if layer.momentum is None:
            factor = 1.0 / float(tracked)
    if stats.count > 0:
        _blend_([layer.running_mean, layer.running_var], [stats.mean, stats.m2 / (stats.count - 1)], factor)


def _grads_at_join(params: list) -> list:
    """``(p, g)`` for each parameter: ``g`` None (no gradient), 0 (zeros) or a copy of its gradient
    when this rank joined. The shadowed backwards write the active ranks' averages into the
    gradients (ZeRO steps with them); torch's joined rank keeps its own, so they are given back when
    the context ends, else the first backward after it adds to the last shadowed average."""
    out = []
    for p in params:
        g = p.grad
        out.append((p, None if g is None else 0 if not g.count_nonzero() else g.detach().clone()))
    return out


@torch.no_grad()
def _restore_grads(grads_at_join: list) -> None:
    for p, g in grads_at_join:
        if g is None:
            p.grad = None
        elif p.grad is None:
            p.grad = torch.zeros_like(p) if isinstance(g, int) else g
        elif isinstance(g, int):
            p.grad.zero_()
        else:
            p.grad.copy_(g)


class DDPJoinHook(JoinHook):
    """Shadows a DistributedDataParallel model's collectives on a joined rank."""

    def __init__(self, ddp, divide_by_initial_world_size: bool = True):
        self.ddp = ddp
        ddp._join_state = DDPJoinState(ddp, divide_by_initial_world_size)

    @torch.compiler.disable  # Note [join under torch.compile]
    def main_hook(self) -> None:
        ddp = self.ddp
        reducer = ddp.reducer
        state = ddp._join_state
        if not state.joined:
            state.joined = True
            reducer.joined = True
            reducer.check_previous_backward()
            state.grads_at_join = _grads_at_join(reducer.tracker.params)  # (the frozen ones included)
        reducer.prepare_forward(sync=True)  # the shadowed training forward, before its collectives
        active, syncing, authority = exchange_state(ddp, False, False, False)
        reducer.grad_divisor = _grad_divisor(ddp, state, active)
        if authority >= 0:
            ddp._broadcast_coalesced(ddp._module_buffers(), tag="ddp buffers", src=authority)
        if state.has_sync_bn:
            _shadow_sync_bn(ddp, state.trace if state.trace is not None else _static_sync_bn_trace(ddp))
        state.synced = syncing > 0
        ddp._buffers_due = state.synced  # as on the active ranks, for the forwards after the context
        if state.synced:
            reducer.shadow_backward()
        else:
            reducer.iteration += 1  # a no_sync() backward elsewhere: nothing to send

    @torch.compiler.disable  # Note [join under torch.compile]
    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        reducer = ddp.reducer
        comm = ddp.comm
        # The last joiners compared once more (their last step has no next forward).
        ddp.watch.check_now(reducer, joined=not is_last_joiner)
        source = torch.tensor([ddp.rank if is_last_joiner else -1], dtype=torch.int64, device=comm.device)
        comm.all_reduce(source, op="max", tag="ddp join: final model source")
        src = int(source.item())
        ddp._wait_for_params(True)  # no parameter all-gather may still be writing
        counters = torch.tensor(ddp.watch.counters(), dtype=torch.int64, device=comm.device)
        comm.broadcast(counters, src=src, tag="ddp join: counters")
        ddp.watch.set_counters(counters.tolist())
        ddp._broadcast_state(src=src, tag="ddp join: final model", buffers=ddp.config.broadcast_buffers)
        _restore_grads(ddp._join_state.grads_at_join)
        reducer.joined = False
        reducer.grad_divisor = ddp.world_size
        reducer.defer_launch = False
        ddp._join_state = None
        ddp._join_config = DISABLED  # back to the plain path: every rank gets here together
