"""The reliability layer's view of one ``fully_shard`` model (ZeRO-3), as ``engine_watch.py``
is for a DDP model.

Note [stage-3 step check]
    Unit all-gathers and reduce-scatters pair up by issue order, like DDP's buckets: a rank that
    skips a step, runs an extra forward, or steps its optimizer on a different iteration leaves
    the ranks out of step, and with sharded parameters nothing fails until the numbers are
    wrong. One case is easy to hit: ``torch.amp.GradScaler`` decides to skip a step from this
    rank's pieces of the gradients only, so the rank whose piece overflowed skips alone.

    So at the end of every synchronized backward, after the last unit's reduce-scatter (the
    same point of every rank's collective order), the root launches the per-step check of
    Note [step check] in ``step_check.py`` with the same fields -- synchronized backwards,
    training forwards, all backwards, optimizer steps (counted by the optimizer step guard),
    a CRC of the wrapping, the sequence number of the last collective, a digest of which
    parameters had a gradient in each unit's reduction (Note [rank-independent reductions] in
    ``fusedist/fsdp/grads.py``) -- and reads its verdict
    at the next training forward. A divergence is a ``RankMismatchError`` on every rank, one
    step after it happened. ``check_now()`` checks at once (``fusedist.checkpoint.save``
    calls it before writing). ``FUSEDIST_CHECKS=0`` turns it off.

    At world size 1 the root has its watch too, as a DDP model has its ``StepWatch``: the
    counters and the optimizer step guard apply; the cross-rank check (and the wrapping
    check) are off, so the watch issues no collective there.

Note [replica check]
    On a 2-D (replicate, shard) mesh (HSDP) the ranks of one shard group hold different pieces,
    so the step check, which runs over the shard group, has no replicated parameters to
    compare; the ranks that hold the same piece sit in different shard groups, and a rank that
    changes its piece (in place, by a checkpoint load or an optimizer step of its own) trains
    on with replicas that differ, silently. So every ``FUSEDIST_PARAM_CHECK_EVERY``
    synchronized backwards (Note [parameter check] in ``param_check.py``) and at every
    ``check_now()``, each rank all-gathers ``[d, sync_steps, forwards, backwards, optimizer
    steps]`` over its replicate group, ``d`` the digest of its pieces, right after the last
    unit's reduce-scatter (the same point of every rank's order). The counters matter as much
    as the digest: the step check compares them over the shard group only, so a whole shard
    group that skips an optimizer step, or runs a forward without its backward, agrees with
    itself, and the replicate all-reduce averages gradients of different steps with nothing
    reported (the parameters may even stay equal). Where this rank's replicas ran different
    steps, the step check's ``replicas`` field carries the rank's shard position + 1 (and
    ``params`` 0: digests of different steps say nothing more); else, where their digests
    differ, ``params`` carries it; 0 where they agree. Every shard group holds one rank of
    every replicate group, so every shard group sees the same field values, and the verdict
    (a mismatch on every rank) is the same everywhere; each rank then names the counters its
    replicas disagree on and the global ranks at each value (from the table it holds), or,
    over its replicate group, the parameters whose pieces differ and the global ranks that
    agree. So a skip is found within ``FUSEDIST_PARAM_CHECK_EVERY`` synchronized backwards
    (or at the next ``check_now()``), not at once; ``=0`` turns this comparison off too. A
    shard group that skips a whole iteration (forward, backward and step) stays in step with
    its replicas by every counter -- their gradients pair one batch apart -- and only runs
    out of iterations first (its replicas then stall, with a stall report naming the ranks behind:
    Note [a rank behind at the check] in ``engine_watch.py``). On a (replicas, 1)
    mesh the shard groups are single ranks: the step check itself runs over the replicate
    group there, its ``params`` field the digest (the counters are compared across the
    replicas at every step).

    Cost: the digest of the rank's pieces and one small all-gather (5 int64 per rank),
    waited for (its result goes into the step check's vector: the host waits for the slowest
    replica there), once per period. Measured on CPU (gloo, 2 x 2 mesh, 4 ranks on a loaded
    2-core machine, one thread each, 2026-12-06), 4 units of Linear + Tanh, batch 16: the
    digest and exchange took 3-6 ms at 8.4K parameters per rank and 6.5 ms at 0.53M (the
    all-gather with the counters cost the same as the 2-element all-reduce of the digest
    alone it replaced: 4.1-4.6 ms against 4.3-5.7, 5.9-7.0 against 6.2-7.4, alternated in one
    run); with ``FUSEDIST_PARAM_CHECK_EVERY=1`` a step took 84 ms instead of 75, and 123
    instead of 79 (most of it the wait for the other replica, which the oversubscribed cores
    make long); at the default period of 100, 0.1% and 0.6% of a step.
"""

from __future__ import annotations

import functools
import weakref
import zlib
from typing import Optional

import torch

from ..comm.base import global_ranks
from ..ownership import register_step_watch
from .config import checks_enabled, param_check_every
from .engine_watch import PIPELINE_HINT, WatchBase
from .monitor import attach_monitor, monitor_of
from .param_check import ParamDigest
from .step_check import StepCheck, with_call
from .mode_check import describe_modes, modes_crc
from .scale_check import scale_field

SUBJECT = {"subject": "fully_shard", "model": "fully_shard model", "reduced": "units", "explain": {
    "unused": "a different set of parameters received gradients (a branch of a unit ran on some ranks only): "
    "the ranks would step different pieces of one parameter; use every trainable parameter in the loss on "
    "every rank (e.g. add 0 * the branch's output on the ranks that skip it), or call "
    "model.set_reduce_scatter_unused_params(True) on the root so that every rank reduces every trainable "
    "parameter of a unit that ran (zeros where a rank computed no gradient), as torch's FSDP2 requires",
    "trainable": "the ranks ran different units in forward (a unit skipped, repeated or reordered on some ranks: "
    "rank-dependent control flow such as a per-rank layer drop), so their all-gathers and reduce-scatters "
    "paired one unit's with another's; every rank must call the same units in the same order"}}


class ShardedStepWatch(WatchBase):
    """Counters, the per-step check and the stall-report context of one fully_shard root."""

    owner_name = "fully_shard model"
    check_tag = "fully_shard step check"
    no_backward_advice = "so there are no reduced gradients to apply. Call loss.backward() before optimizer.step()."
    unsynced_advice = ("under set_requires_gradient_sync(False): the gradients are this rank's unreduced local "
                       "sums, so the ranks would diverge. Turn gradient synchronization back on for the last "
                       "micro-batch's backward before stepping." + PIPELINE_HINT)

    def __init__(self, comm, wrapping: list, params: list, units: list = (), members: list = ()):
        self.comm = comm
        self.units = len(wrapping)
        self.wrapping_crc = zlib.crc32(repr(wrapping).encode()) & 0x7FFFFFFF
        self.backwards = 0
        self.in_backward = False
        self._gradients_crc, self._without_grad = 0, []  # the last synchronized backward's reductions
        self._units_crc, self._units = 0, []  # the units its forward ran, in order
        super().__init__(comm)
        #: Note [replica check]: the replicate group's communicator (HSDP), else None
        self.replicate_comm = next((u.replicate_comm for u in units if u.replicate_comm is not None), None)
        if self.replicate_comm is None or self.replicate_comm.world_size < 2 or not checks_enabled():
            self.replicate_comm = None
        #: a (replicas, 1) mesh: every rank holds the whole parameters, the check runs over the replicas
        self.replicas_only = self.replicate_comm is not None and self.step_check is None
        if self.replicas_only:
            self.step_check = StepCheck(self.replicate_comm, self.check_tag)
        self.param_every = param_check_every() if self.replicate_comm is not None else 0
        if self.replicate_comm is not None:  # the replicate group's reports give the position too
            replicas = attach_monitor(self.replicate_comm)
            if replicas is not None and replicas is not self.monitor:
                replicas.add_context_provider(self.position)
        self._replicas: Optional[ParamDigest] = None  # the digests of this rank's pieces, built when first due
        self._replica_table: Optional[torch.Tensor] = None  # the last exchange with the replicas (digest, counters)
        self._units_of = units
        # Note [every module's mode under a fully_shard root]: (path, module) of every module under the
        # root's members (``members``), taken again when the tree changes; their flags at the last training forward
        # The root's members weakly, first (their modules hold this watch: Note [a dropped model freed at once]
        # in fusedist/fsdp/state.py); the modules below them do not lead back to them
        self._member_refs = [weakref.ref(m) for m in members]
        self._member_names: list = []
        if members:
            self._take_modes(list(members))
        else:
            self._mode_modules = _holding_modules(units)
            self._read_modes = [m for _, m in self._mode_modules]
        # the step check's report callbacks, made once; weak (the check keeps them while pending)
        me = weakref.ref(self)
        self._describe_units_weakly = functools.partial(_weakly, me, ShardedStepWatch._describe_units)
        self._describe_modes_weakly = functools.partial(_weakly, me, ShardedStepWatch._describe_modes)
        self._describe_pieces_weakly = functools.partial(_weakly, me, ShardedStepWatch._describe_pieces)
        self._describe_replicas_weakly = functools.partial(_weakly, me, ShardedStepWatch._describe_replicas)
        self._describe_replica_steps_weakly = functools.partial(_weakly, me, ShardedStepWatch._describe_replica_steps)
        self._modes = 0
        self._names: dict = {}  # piece -> its current path (weak keys), once the module's tree changed
        from . import optimizer_guard

        if checks_enabled():  # FUSEDIST_CHECKS=0 turns the guard off, as for a DDP model
            optimizer_guard.install()  # counts optimizer steps over these parameters
        register_step_watch(params, self)

    # ------------------------------------------------------------------ events of the root
    def forward_begins(self) -> None:
        """A training forward of the root, before its first all-gather."""
        self.settle()
        self.forwards += 1
        if self.step_check is not None:
            self._modes = modes_crc([ref() for ref in self._member_refs] + self._read_modes)

    def backward_begins(self) -> None:
        self.in_backward = True
        if self.monitor is not None:
            self.monitor.step_hint = self.sync_steps

    def backward_aborted(self) -> None:
        """The backward that began raised before its end (``reset_iter_state``, or Note [aborted
        backward] in ``fusedist/fsdp/state.py``): no longer in it. It is not counted as a
        backward: it reduced nothing the step check could compare."""
        self.in_backward = False

    def backward_ends(self, synced: bool, reductions: list = (), units: list = ()) -> None:
        """After the last unit's reduce-scatter was issued (and finished). ``reductions``: the
        backward's (unit, section, parameters with a gradient, names of those without) log
        (Note [rank-independent reductions] in ``fusedist/fsdp/grads.py``); ``units``: the
        units its forward ran, in order (their paths), compared too: ranks that ran different
        alike units pair gathers of equal sizes silently."""
        self.in_backward = False
        if synced and self.step_check is not None:
            log = sorted(entry[:3] for entry in reductions)
            self._gradients_crc = zlib.crc32(repr(log).encode()) & 0x7FFFFFFF
            self._without_grad = [name for entry in reductions for name in entry[3]]
            self._units = list(units)
            self._units_crc = zlib.crc32(repr(self._units).encode()) & 0x7FFFFFFF
            self._launch(checked_now=False)
        self.backwards += 1
        self.last_backward_synced = synced
        if synced:
            self.sync_steps += 1

    # ------------------------------------------------------------------ checks
    def check_now(self) -> None:
        """Compare where the ranks are now (a collective: every rank calls it at the same point)."""
        self._check_now(lambda: self._launch(checked_now=True))

    def _check_monitors(self) -> list:
        """The shard group's monitor and, on HSDP, the replicate group's (the replica check's)."""
        replicas = monitor_of(self.replicate_comm) if self.replicate_comm is not None else None
        return [self.monitor] + ([replicas] if replicas is not None and replicas is not self.monitor else [])

    def _launch(self, checked_now: bool) -> None:
        detail = dict(SUBJECT, buckets=self.units, checked_now=checked_now, unused_names=self._without_grad,
                      describe_trainable=self._describe_units_weakly, describe_modes=self._describe_modes_weakly)
        flag = replicas = None
        if self.param_every and (checked_now or self.sync_steps % self.param_every == 0):
            detail.update(explain=dict(SUBJECT["explain"], params=REPLICAS_DIFFER))
            if self.replicas_only:  # (the step check's ranks are the replicas: the digest itself)
                flag = self._pieces().compute(self.replicate_comm.device)
                detail.update(describe_params=self._describe_pieces_weakly)
            else:
                flag, replicas = self._replica_flags()  # Note [replica check]
                detail.update(describe_params=self._describe_replicas_weakly, params_listed=False,
                              describe_replicas=self._describe_replica_steps_weakly)
        self.step_check.launch(
            [self.sync_steps, self.forwards, self.backwards, self.optimizer_steps, self.wrapping_crc,
             self.comm.last_seq, self._gradients_crc, self._units_crc, self._modes,  # (Note in mode_check.py)
             scale_field(self), self.cleared_steps, self.clips,  # (Notes in scale_check, optimizer_guard, clip_check)
             0, 0],  # (the replica flags, if due)
            detail, digest=flag, replicas=replicas)

    @torch.no_grad()
    def _replica_flags(self) -> tuple:
        """Note [replica check]: the ``params`` and ``replicas`` flags (0-dim int64 tensors on
        the device): 0 where the replicas of this rank's pieces agree, else the rank's shard
        position + 1 -- ``replicas`` where they ran different steps, else ``params`` where their
        pieces differ. Keeps the exchanged table for the report."""
        comm = self.replicate_comm
        counters = torch.tensor([self.sync_steps, self.forwards, self.backwards, self.optimizer_steps],
                                dtype=torch.int64)
        if comm.device.type == "cuda":  # pinned + non_blocking: a pageable copy would synchronize the host
            counters = counters.pin_memory()
        mine = torch.cat([self._pieces().compute(comm.device).view(1), counters.to(comm.device, non_blocking=True)])
        table = torch.empty(comm.world_size, mine.numel(), dtype=torch.int64, device=comm.device)
        comm.all_gather(table.view(-1), mine, tag="fully_shard replica check").wait()
        self._replica_table = table
        differ = table.amax(0) != table.amin(0)
        steps = differ[1:].any()  # (then the digests are of different steps: a consequence)
        position = self.rank + 1
        return (differ[0] & ~steps).to(torch.int64) * position, steps.to(torch.int64) * position

    def _pieces(self) -> ParamDigest:
        if self._replicas is None:
            self._replicas = ParamDigest(_named_pieces(self._units_of, self._names))
        return self._replicas

    def names_changed(self, current: dict) -> None:
        """The module's tree changed (Note [unit paths follow the module] in fusedist/fsdp/tree_names.py):
        ``current`` maps a parameter (by identity) to its path now; the replica check's messages name the
        pieces so, not by the paths they had when its digest was built (those may be other blocks')."""
        self._names = current
        if self._member_refs:  # Note [every module's mode under a fully_shard root]
            self._take_modes([ref() for ref in self._member_refs])
        if self._replicas is not None:
            self._replicas.names = [n for n, _ in _named_pieces(self._units_of, current)]

    def _describe_replicas(self, comm, skip=()) -> list:
        """The lines naming the pieces whose replicas differ (a collective over the replicate
        group: every rank calls it on the same verdict, Note [replica check])."""
        replicas = self.replicate_comm
        if self._replica_steps_differ():  # (the same on every rank of the group: none of them calls)
            return []
        lines = self._replicas.describe(replicas, labels=global_ranks(replicas))
        if not lines:
            return []
        shown = global_ranks(replicas) or list(range(replicas.world_size))
        return [f"  replicas of rank {_global(self.comm, self.rank)}'s pieces (ranks {shown}):"] + lines

    def _replica_steps_differ(self) -> bool:
        """Whether this rank's replicas sent different counters in the last exchange (the same
        answer on every rank of the replicate group: they hold the same table)."""
        table = self._replica_table
        return bool((table[:, 1:].amax(0) != table[:, 1:].amin(0)).any())

    def _describe_replica_steps(self) -> list:
        """The lines naming the counters on which this rank's replicas differ and the global
        ranks at each value, from the table exchanged with them (local: no collective)."""
        if not self._replica_steps_differ():
            return []
        table = self._replica_table.tolist()
        shown = global_ranks(self.replicate_comm) or list(range(self.replicate_comm.world_size))
        lines = [f"  replicas of rank {_global(self.comm, self.rank)}'s pieces (ranks {shown}) ran different steps:"]
        for column, name in enumerate(REPLICA_COUNTERS, start=1):
            groups: dict = {}
            for position, row in enumerate(table):
                groups.setdefault(row[column], []).append(shown[position])
            if len(groups) > 1:
                listing = "; ".join(f"ranks {ranks}: {value}"
                                    for value, ranks in sorted(groups.items(), key=lambda kv: kv[1]))
                lines.append(f"    {name}: {listing}")
        return lines

    def _take_modes(self, members: list) -> None:
        """The modules whose modes are compared: the members (held weakly), then every module under
        them (Note [every module's mode under a fully_shard root])."""
        named = _every_module([m for m in members if m is not None])
        ids = set(map(id, members))
        self._member_names = [next((n for n, m in named if m is member), "?") for member in members]
        self._mode_modules = [(n, m) for n, m in named if id(m) not in ids]
        self._read_modes = [m for _, m in self._mode_modules]

    def _describe_modes(self, comm) -> list:
        named = [(n, ref()) for n, ref in zip(self._member_names, self._member_refs)] + self._mode_modules
        return describe_modes(comm, named)

    def _describe_pieces(self, comm, skip=()) -> list:
        return self._replicas.describe(comm, skip, labels=global_ranks(comm))

    def _describe_units(self, comm) -> list:
        """This rank's units in forward order, for the mismatch report (every rank prints its own)."""
        units = self._units
        shown = ", ".join(units[:12]) + (f", ... ({len(units)} calls)" if len(units) > 12 else "")
        return [f"  units run in forward on rank {self.rank}: {shown}"]

    def backward_count(self) -> int:
        return self.backwards

    def position(self) -> dict:
        return with_call({
            "fully_shard_step": self.sync_steps,
            "fully_shard_backward": self.backwards,
            "fully_shard_forwards": self.forwards,
            "optimizer_steps": self.optimizer_steps,
            "in_backward": self.in_backward,
            "in_check": self.checking,
        })


#: The ``params`` field's explanation on a (replicate, shard) mesh (Note [replica check]).
REPLICAS_DIFFER = ("the replicas of a shard (the ranks holding the same pieces along the mesh's replicate "
                   "dimension) hold different values: a rank changed its gradients after they were reduced (code "
                   "between backward() and optimizer.step() that writes p.grad on some ranks only), changed weights "
                   "in place, loaded a checkpoint, or stepped an optimizer or a learning-rate scheduler on its own; "
                   "the replicas now train different models (change gradients and weights on every rank alike)")


#: The counters the replicas compare at the parameter-check period (Note [replica check]).
REPLICA_COUNTERS = ("synchronized backwards", "training forwards", "backwards", "optimizer steps")


def _named_pieces(units, current: dict) -> list:
    """(name under the root, piece) of every parameter the units shard, for the replica check:
    its path in ``current`` (by identity), else its unit's path and its name in the unit."""
    named = []
    for u in units:
        for fqn, piece in zip(u.names, u.sharded):
            named.append((current.get(piece) or (f"{u.path}.{fqn}" if u.path else fqn), piece))
    return named


def _global(comm, position: int) -> int:
    """The global rank of ``position`` in ``comm``'s group."""
    ranks = global_ranks(comm)
    return ranks[position] if ranks is not None else position


def _weakly(watch_ref, fn, *args, **kwargs):
    """``fn(watch, ...)`` while the watch lives (a report callback the step check keeps); nothing after."""
    watch = watch_ref()
    return fn(watch, *args, **kwargs) if watch is not None else []


# Note [every module's mode under a fully_shard root]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The modes field (Note [train and eval modes in the step check] in mode_check.py) reads every
# module under the root's members, not only those holding parameters: a Dropout (no parameters)
# put in eval mode on one rank only changes that rank's loss as much as a whole model.eval(). The
# list is kept, not walked per forward (a kept list of 1,200 modules costs 35 us per forward, a
# walk of root.modules() 569 us), and taken again where the root follows a change of its tree
# (Note [unit paths follow the module] in fusedist/fsdp/tree_names.py calls names_changed), so a
# module inserted, replaced or removed after the first forward is read as the tree is now.
def _every_module(members: list) -> list:
    """(path under the root, module) of every module under ``members``, once each, in the order
    ``named_modules()`` walks them (the same on every rank whose tree is the same)."""
    found: dict = {}
    for member in members:
        for name, module in member.named_modules():
            found.setdefault(id(module), (name, module))
    return list(found.values())


def _holding_modules(units) -> list:
    """(path, module) of each module holding a parameter of ``units``, once each, in the units'
    order (the same on every rank: the wrapping check compared it)."""
    seen, out = set(), []
    for unit in units:
        for name, holders in zip(unit.names, unit.registrations):
            for module, attr in holders:
                if id(module) not in seen:
                    seen.add(id(module))
                    local = name.rsplit(".", 1)[0] if "." in name else ""
                    path = ".".join(p for p in (unit.path or "", local) if p)
                    out.append((path, module))
    return out
