"""The reliability layer's view of one DDP model: an observer of its gradient engine.

Counts what the ranks must agree on (training forwards, synchronized backwards, optimizer
steps), runs the per-step cross-rank check (Note [step check] in ``step_check.py``) at the
point of the collective order the engine announces, stamps the collective monitor's history
with the step, and describes the position in stall reports. The engine itself knows none of
this: it only announces events (``fusedist/ddp/events.py``).
"""

from __future__ import annotations

import functools
import weakref
import zlib
from typing import Optional

import torch

from ..ddp.events import EngineObserver
from .config import checks_enabled, param_check_every
from .monitor import attach_monitor
from .param_check import ParamDigest, replicates
from . import carried_check
from .step_check import FIELDS, JOINED, StepCheck, layout_crc, with_call
from .mode_check import describe_modes, modes_crc
from .scale_check import scale_field

#: The other way to an unsynchronized step: a pipeline schedule's step synchronizes a stage's
#: gradients at its last micro-batch's backward only.
PIPELINE_HINT = (" In a pipeline stage: the schedule's step ran fewer backwards than micro-batches (a "
                 "forward-only step, or one stopped early), so the last one never synchronized.")


# Note [a rank behind at the check]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rank that skips a backward the others run (its batch was empty; its loss was None and the loop
# went on with ``continue``) is found by the per-step check only when it runs another synchronized
# backward afterwards and that backward's collectives pair with the others' skipped one: on DDP and
# ZeRO the two checks then pair too, and a forward without its backward shows in the ``forward``
# field. A rank that skips a whole iteration (forward, backward and step) stays in step by every
# counter -- its buckets pair one batch apart -- until it runs out of iterations first. And on
# ``fully_shard`` (1-D or HSDP) a forward without its backward meets the others' reduce-scatters
# with its next all-gather, before any check. In all of these the rank goes on to a collective the
# others never issue -- its next forward's all-gather, or ``check_consistency()``'s all-reduce (also
# from ``fusedist.checkpoint.save``) -- while the others wait inside the backward it skipped; neither
# side's check can run. Telling a rank that skipped a backward from one that is only slow needs a
# word from every rank at every step (torch's ``Join`` pays an all-reduce per step for it), which
# these checks do not pay, so it ends as a ``StallError`` on every rank at the collective timeout
# (``FUSEDIST_TIMEOUT_S``), not at once. The report says what is known: a rank waiting in
# ``check_consistency()`` leaves its position in the store meanwhile (one entry, removed when the
# check returns: two store calls per check, none per step), so the others' reports hold it even
# when its own collective times out after theirs; and the report compares the ranks' counters --
# backwards (the one in progress included), training forwards, optimizer steps -- naming the ranks
# behind, by how many backwards (or forwards, where a whole iteration was skipped), the ranks that ran
# a forward without its backward, and those waiting in ``check_consistency()``
# (``stall_report.behind``). On HSDP both groups' reports do: the watch
# gives its position to the replicate group's monitor too.


class WatchBase:
    """What every model's watch has: the counters the ranks must agree on, the per-step check,
    the stall-report context, and what the optimizer step guard reads (``rank``,
    ``backward_count()``, ``last_backward_synced``) and says (the class's wording)."""

    #: The model, as the step guard names it, and the ends of its two messages (subclasses).
    owner_name = no_backward_advice = unsynced_advice = ""
    #: The per-step check's collectives, as errors and stall reports name them.
    check_tag = "ddp step check"

    def __init__(self, comm):
        self.rank = comm.rank
        self.sync_steps = 0  # synchronized backwards completed
        self.forwards = 0  # training forwards (grad enabled)
        self.optimizer_steps = 0  # counted by fusedist.reliability.optimizer_guard
        self.cleared_steps = 0  # of those, taken with the gradients cleared (Note [gradients cleared before the step])
        self.clips = 0  # clip_grad_norm_ calls over the model's parameters (Note [a clip on some ranks only])
        self.unscaled_by = 0  # torch's GradScaler's scale, noted since the last check (Note in scale_check.py)
        self.last_backward_synced = True
        self.checking = False  # inside check_consistency() (Note [a rank behind at the check])
        self.step_check = StepCheck(comm, self.check_tag) if checks_enabled() and comm.world_size > 1 else None
        if self.step_check is not None:
            _count_torch_clips()
            _see_torch_scaler()
        self.monitor = attach_monitor(comm)
        if self.monitor is not None:
            self.monitor.add_context_provider(self.position)

    def settle(self) -> None:
        """Read the last step check's verdict (raises ``RankMismatchError`` on divergence)."""
        if self.step_check is not None:
            self.step_check.settle()

    def _check_now(self, launch) -> None:
        """The pending verdict, then ``launch()``'s check of the current counters, waited for, with
        this rank's position left in the store meanwhile (Note [a rank behind at the check])."""
        if self.step_check is None:
            return
        self.checking = True
        monitors = [m for m in self._check_monitors() if m is not None]
        context = self.position()
        left = [(m, len(m.reports)) for m in monitors if m.announce_check(context)]
        try:
            self.step_check.settle()
            launch()
            self.step_check.settle()
        finally:
            self.checking = False
            for monitor, reports_before in left:
                monitor.withdraw_check(reports_before)

    def _check_monitors(self) -> list:
        """The monitors of the groups the check's collectives run on."""
        return [self.monitor]

    def backward_count(self) -> int:
        raise NotImplementedError

    def averaging(self) -> bool:
        """Whether the model's backward is running, its gradients not yet averaged (Note [a step
        inside the backward] in optimizer_guard.py): no optimizer step over its parameters then."""
        return False

    def position(self) -> dict:
        raise NotImplementedError


class StepWatch(WatchBase, EngineObserver):
    """Counters, the step check and the stall-report context of one DDP engine."""

    #: The wrapper's words; a ``fusedist.replicate`` module's are built by :meth:`_words`.
    WRAPPER_WORDS = (
        "DistributedDataParallel model",
        "so there are no averaged gradients to apply. Call loss.backward() (outside no_sync()) "
        "before optimizer.step().",
        "that was not synchronized -- its forward ran under no_sync(), or it did not go through a "
        "forward of the wrapper (a backward through model.module): the gradients are this rank's "
        "local sums, not averaged across ranks, so the ranks would diverge. Run the last "
        "micro-batch's forward (through the wrapper, outside no_sync()) and backward before "
        "stepping." + PIPELINE_HINT)

    def __init__(self, engine):
        self._engine = engine  # (before the base registers position() with the monitor)
        self._layout_crc: Optional[tuple] = None
        self._digest: Optional[ParamDigest] = None  # built at the first check that needs it
        self._sparse_flags: list = []  # requires_grad of the sparse-gradient weights at the last forward
        self._modes = 0  # the modules' train/eval flags at the last training forward (Note in mode_check.py)
        # Note [the check carried by the last bucket]: (layout, strategy, whether it carries), this
        # step's (values, detail, digest) before the launch, and (handle, tail) once launched.
        self._carries: Optional[tuple] = None
        self._carry: Optional[tuple] = None
        self._carried: Optional[tuple] = None
        self._farewell: Optional[weakref.finalize] = None  # (Note [a pending check holds its model weakly])
        super().__init__(engine.comm)
        self.param_every = param_check_every() if self.step_check is not None else 0
        if self.step_check is not None:
            engine.check_carrier = self  # Note [the check carried by the last bucket] in carried_check.py

    # The step guard's words (WatchBase), read only when it refuses a step.
    @property
    def owner_name(self) -> str:
        return self._words()[0]

    @property
    def no_backward_advice(self) -> str:
        return self._words()[1]

    @property
    def unsynced_advice(self) -> str:
        return self._words()[2]

    def _words(self) -> tuple:
        """(name, no-backward advice, unsynced advice). A ``fusedist.replicate`` module is no wrapper:
        it has no ``no_sync()`` and no ``.module``, so its user is told of the module they replicated
        and of ``set_requires_gradient_sync``, named as the guard's other refusals name it."""
        from ..ddp.replicate import ReplicatedModule
        from .optimizer_guard import _model_words

        owner = _wrapper_of(self._engine)
        if owner is None or not isinstance(owner.module, ReplicatedModule):
            return self.WRAPPER_WORDS
        words = _model_words(owner)
        return (
            words["model"],
            f"so there are no averaged gradients to apply. Run forward and backward through {words['forward']} "
            "before optimizer.step().",
            f"through the {words['model']} that was not synchronized -- its forward ran under "
            "set_requires_gradient_sync(False), or it did not go through a forward of the replicated module (a "
            "backward through a submodule called on its own): "
            "the gradients are this rank's local sums, not averaged across ranks, so the ranks would diverge. "
            f"Run the last micro-batch's forward through {words['forward']} and its backward before stepping."
            + PIPELINE_HINT)

    def backward_count(self) -> int:
        return self._engine.iteration  # every backward, synchronized or not

    def averaging(self) -> bool:
        # (in the autograd engine: a backward an exception interrupted leaves the flag set)
        return self._engine.in_backward and torch._C._current_graph_task_id() != -1

    # ------------------------------------------------------------------ engine events
    def forward_begins(self, engine) -> None:
        if self._farewell is None and self.monitor is not None:  # (the wrapper is known from the first forward)
            owner = _wrapper_of(engine)
            if owner is not None:
                # (both weakly: a finalizer's arguments live until the wrapper goes, and the watch reaches the
                # wrapper through its engine -- a ZeRO stage-2 optimizer's strategy holds it -- so a strong one
                # kept the wrapper alive for good)
                self._farewell = weakref.finalize(owner, _leave_position, weakref.ref(self.monitor), weakref.ref(self))
                self._farewell.atexit = False  # (a wrapper alive at exit is still its monitor's provider)
        self.settle()  # the last step's verdict, before this step's first collective
        self.forwards += 1
        self._sparse_flags = [p.requires_grad for p in _sparse_params(engine).values()]
        if self.step_check is not None:
            self._modes = modes_crc(_tree_modules(engine))  # Note [train and eval modes in the step check]

    def backward_begins(self, engine) -> None:
        if self.monitor is not None:  # stamps this step on the collective history
            self.monitor.step_hint = self.sync_steps

    def buckets_launched(self, engine, unused: list) -> None:
        if self.step_check is not None:
            carried, self._carried = self._carried, None
            if carried is not None:  # Note [the check carried by the last bucket]
                values, detail, _ = self._carry
                self._carry = None
                self.step_check.carried(carried[0], carried[1], values, detail)
            else:
                self.launch_check(engine, unused)
            if _sparse_params(engine):
                # Note [sparse weights in the step check]: read the verdict before the
                # sparse gradients' collectives, which ranks that differ would not pair.
                self.settle()

    def backward_ends(self, engine) -> None:
        self.last_backward_synced = engine.sync
        if engine.sync:
            self.sync_steps += 1

    def agreement_point(self, engine) -> None:
        # If only some ranks got here, raise the every-rank mismatch instead (the other ranks
        # read it at their next forward).
        self.settle()

    # ------------------------------------------------------------------ checks
    def check_now(self, engine, joined: bool = False) -> None:
        """Compare where this rank is with every other rank now (Note [step check]): the pending
        verdict, then the current counters with one more tiny all-reduce, waited for."""
        self._check_now(lambda: self.launch_check(engine, [], checked_now=True, joined=joined))

    def launch_check(self, engine, unused: list, checked_now: bool = False, joined: bool = False) -> None:
        values, detail, digest = self._check_values(engine, unused, checked_now, joined)
        self.step_check.launch(values, detail(), digest=digest)

    def _check_values(self, engine, unused: list, checked_now: bool, joined: bool) -> tuple:
        """(values or None for a joined rank, a function that builds the detail, the parameter digest
        or None) of this rank's check."""
        if joined or engine.joined:  # Note [joined ranks]: neutral in the comparison
            detail = {"buckets": len(engine.layout.buckets), "checked_now": checked_now}
            return None, lambda: detail, None
        handles = engine.handles
        last_seq = handles[-1].seq if handles and handles[-1] is not None else -1
        if self._layout_crc is None or self._layout_crc[0] is not engine.layout:
            self._layout_crc = (engine.layout, layout_crc(engine.layout))
        tracker = engine.tracker
        unused_count = 0 if engine.config.tolerates_unused else len(unused)
        digest = None
        if self._params_due(engine, checked_now):
            if checked_now:
                _wait_for_parameters(engine)
            digest = self._param_digest(engine)
        return [
            self.sync_steps,
            self.forwards,
            engine.iteration,  # every backward, synchronized or not
            self.optimizer_steps,
            self._layout_crc[1],
            last_seq,
            unused_count,
            self._trainable_crc(tracker),
            self._modes,  # Note [train and eval modes in the step check]
            scale_field(self),  # Note [loss scale in the step check]
            self.cleared_steps,  # Note [gradients cleared before the step] in optimizer_guard.py
            self.clips,  # Note [a clip on some ranks only] in clip_check.py
            0,  # the parameter digest, when due, is written on the device
            0,  # replicas: fully_shard's (Note [replica check] in sharded_watch.py)
        ], functools.partial(_detail_of, weakref.ref(self), weakref.ref(engine), len(engine.layout.buckets), unused,
                             checked_now, self._digest.describe if digest is not None else None,
                             bool(_sparse_params(engine))), digest

    # Note [a pending check holds its model weakly]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A step's check stays pending until the next forward reads its verdict, and with it what its error
    # would say (this detail). Holding the engine and the watch strongly there made a cycle (watch -> step
    # check -> pending detail -> watch): a wrapper dropped after a backward left its engine -- module,
    # gradients, buckets -- alive until a garbage collection, although everything else of it goes at once
    # (Note [a dropped wrapper goes at once] in fusedist/ddp/wrapper.py). The detail holds both weakly: a
    # verdict is read by the watch, which holds its engine, so they are alive whenever it is read. (That
    # cycle had also kept the model's position for the exit entry of a program that returns from ``main``
    # without destroying its group: the watch now leaves its position with the monitor when the wrapper
    # goes, from a finalizer of the wrapper, which holds the watch weakly.)
    def _detail(self, engine, buckets: int, unused: list, checked_now: bool, describe_params, sparse: bool) -> dict:
        """What an error of this check says besides the values: built only when one is raised."""
        watch, model = weakref.ref(self), weakref.ref(engine)
        return {"buckets": buckets,
                "unused_names": [engine.names[engine.index_of[p]] for p in unused],
                "checked_now": checked_now,
                "describe_trainable": lambda comm: _describe_live(watch, model, comm, trainable=True),
                "describe_modes": lambda comm: _describe_live(watch, model, comm, trainable=False),
                "describe_params": describe_params,
                # Note [sparse weights in the step check]
                "reported_at": "the end of that backward" if sparse else "the next training forward"}

    # ------------------------------------------------------------------ the check carried by the last bucket
    # Note [the check carried by the last bucket] in carried_check.py; the engine asks these.
    def carries(self, engine) -> bool:
        """Whether the engine's last bucket carries the step check (cached per layout and strategy)."""
        cached = self._carries  # (weakly: a strategy taken over, and its optimizer, must be freed at once)
        if cached is None or cached[0]() is not engine.layout or cached[1]() is not engine.strategy:
            yes = self.step_check is not None and carried_check.can_carry(engine, self.step_check.comm)
            cached = self._carries = (weakref.ref(engine.layout), weakref.ref(engine.strategy), yes)
        return cached[2]

    def prepare_carry(self, engine, unused: list) -> None:
        """This step's values, before the last bucket is launched with them."""
        self._carry = self._check_values(engine, unused, False, False)

    def carry_tail(self, engine, dtype: torch.dtype) -> torch.Tensor:
        """The tail of the last bucket's message: this rank's values in its row."""
        values, detail, digest = self._carry
        comm = self.step_check.comm
        if values is not None:
            values[FIELDS.index("collective_seq")] = comm.last_seq + 1  # the bucket's, launched next
            if digest is not None:
                values[FIELDS.index("params")] = int(digest)
        row = values if values is not None else [JOINED] * len(FIELDS)
        return carried_check.encode(row, comm.rank, comm.world_size, dtype)

    def carried(self, engine, handle, tail: torch.Tensor) -> None:
        """The last bucket was launched with the tail (``tail``: its part of the reduced message)."""
        self._carried = (handle, tail)

    # Note [sparse weights in the step check]
    #     The weights with sparse gradients (nn.Embedding(sparse=True)) are averaged outside the
    #     buckets (Note [sparse gradients] in fusedist/ddp/sparse.py), so their requires_grad
    #     flags are not in the tracker's layout flags; a rank that froze one sends no sparse
    #     gradient (or none at all while every such weight is frozen) and the ranks' sparse
    #     collectives no longer pair: a timeout naming a collective, not the cause. So their
    #     flags at the forward are folded into the ``trainable`` field, and a model with such
    #     weights reads the check's verdict right after launching it, before those collectives
    #     (every rank there, as it sits after the last bucket): a mismatch raises on every rank
    #     naming the weight and the ranks. The wait costs nothing extra while such a weight
    #     trains (the sparse averaging reads its size exchange on the host right after anyway);
    #     while all of them are frozen it is one wait for the step's reductions per synchronized
    #     backward -- kept, as every rank must read the verdict at the same point.
    def _trainable_crc(self, tracker) -> int:
        crc = tracker.crc if tracker is not None else 0
        if not self._sparse_flags:
            return crc  # (as before: no sparse-gradient weights)
        return zlib.crc32(bytes(self._sparse_flags), crc) & 0x7FFFFFFF

    def _describe_trainable(self, engine, comm) -> list[str]:
        """The tracker's lines and those of the sparse-gradient weights (a collective, as the
        tracker's: every rank calls it on the same verdict)."""
        tracker = engine.tracker
        lines = tracker.describe_mismatch(comm) if tracker is not None else []
        sparse = list(_sparse_params(engine))
        if sparse:
            mine = torch.tensor(self._sparse_flags or [True] * len(sparse), dtype=torch.uint8, device=comm.device)
            everyone = torch.empty(comm.world_size * len(sparse), dtype=torch.uint8, device=comm.device)
            comm.all_gather(everyone, mine, tag="ddp sparse weights' trainable flags")
            table = everyone.view(comm.world_size, len(sparse)).tolist()
            for i, name in enumerate(sparse):
                column = [row[i] for row in table]
                if len(set(column)) > 1:
                    on = [r for r, v in enumerate(column) if v]
                    off = [r for r, v in enumerate(column) if not v]
                    lines.append(f"  parameter '{name}' (sparse gradients): requires_grad=True on ranks {on}, "
                                 f"False on ranks {off}")
        return lines

    def _params_due(self, engine, checked_now: bool) -> bool:
        """Whether this check compares the parameters (Note [parameter check] in param_check.py):
        at ``check_consistency()`` and every ``param_every`` synchronized backwards (never with 0)."""
        if self.param_every == 0 or not replicates(engine):
            return False
        return checked_now or self.sync_steps % self.param_every == 0

    def names_changed(self) -> None:
        """The engine's parameters were renamed (a renumbering of the module's tree): the parameter
        check's digest is rebuilt under the new names when next due, so its messages name them."""
        self._digest = None

    def _param_digest(self, engine) -> torch.Tensor:
        if self._digest is None:
            tracker = engine.tracker
            named = (list(zip(tracker.names, tracker.params)) + list(tracker.sparse.items()) if tracker is not None
                     else list(zip(engine.names, engine.params)))
            self._digest = ParamDigest(named)
        return self._digest.compute(self.step_check.comm.device)

    # ------------------------------------------------------------------ joined ranks
    def counters(self) -> list:
        """Every counter the step check compares that a joined rank does not advance while it shadows."""
        return [self.sync_steps, self.forwards, self._engine.iteration, self.optimizer_steps, self.cleared_steps,
                self.clips]

    def set_counters(self, values: list) -> None:
        """Take the last joiner's counters (Note [joined ranks] in fusedist/ddp/join.py): a joined rank
        skipped the steps it shadowed, their clips (Note [a clip on some ranks only]) and their steps on
        cleared gradients (Note [gradients cleared before the step]) included. A torch GradScaler's scale
        noted on a joined rank at its own last step was never read (its checks since were neutral), and
        the last joiner's was read by the context's final check: dropped on every rank, the next check
        carries the next unscale's on all alike (Note [torch's GradScaler in the step check])."""
        (self.sync_steps, self.forwards, self._engine.iteration, self.optimizer_steps, self.cleared_steps,
         self.clips) = values
        self.unscaled_by = 0

    def position(self) -> dict:
        """Where training is, for stall reports (fusedist.reliability)."""
        engine = self._engine
        position = {
            "ddp_step": self.sync_steps,
            "ddp_backward": engine.iteration,
            "ddp_forwards": self.forwards,
            "optimizer_steps": self.optimizer_steps,
            "in_backward": engine.in_backward,
            "in_check": self.checking,
            "buckets_launched": f"{getattr(engine, 'next_launch', 0)}/{len(engine.layout.buckets)}",
            "buckets_finished": f"{getattr(engine, 'next_finish', 0)}/{len(engine.layout.buckets)}",
        }
        return with_call(position)


def _leave_position(monitor_ref, watch_ref) -> None:
    """The wrapper went: its monitor keeps where the model was (Note [a pending check holds its model weakly]);
    nothing where the watch went first (collected with the wrapper in one cycle)."""
    monitor, watch = monitor_ref(), watch_ref()
    if monitor is not None and watch is not None:
        try:
            monitor.keep_position(watch.position())
        except Exception:  # noqa: BLE001 - a finalizer never raises; the report just says less
            pass


def _detail_of(watch_ref, engine_ref, buckets: int, unused: list, checked_now: bool, describe_params,
               sparse: bool) -> dict:
    """The watch's detail of a check (Note [a pending check holds its model weakly]); only the values'
    part once the model is gone."""
    watch, engine = watch_ref(), engine_ref()
    if watch is None or engine is None:
        return {"buckets": buckets, "unused_names": [], "checked_now": checked_now}
    return watch._detail(engine, buckets, unused, checked_now, describe_params, sparse)


def _describe_live(watch_ref, engine_ref, comm, trainable: bool) -> list[str]:
    """The trainable parameters' or the modes' lines of a detail (none once the model is gone)."""
    watch, engine = watch_ref(), engine_ref()
    if watch is None or engine is None:
        return []
    if trainable:
        return watch._describe_trainable(engine, comm)
    return describe_modes(comm, _named_tree_modules(engine))


def _sparse_params(engine) -> dict:
    """name -> weight of the model's sparse-gradient weights (Note [sparse gradients] in
    fusedist/ddp/sparse.py), as the wrapper's tracker lists them."""
    tracker = getattr(engine, "tracker", None)
    return getattr(tracker, "sparse", None) or {}


def _wrapper_of(engine):
    """The DistributedDataParallel built over the engine (None once it is gone)."""
    return getattr(getattr(engine, "tracker", None), "owner", lambda: None)()


def _wait_for_parameters(engine) -> None:
    """Wait for the wrapper's parameters to be final: after a step of a ZeroRedundancyOptimizer
    with ``overlap_param_gather=True`` their all-gathers may still be in flight until the next
    forward (Note [overlapped parameter gathers] in fusedist/zero/gather.py)."""
    wait = getattr(_wrapper_of(engine), "_wait_for_params", None)
    if wait is not None:
        wait(True)  # (as before a traced forward: every gather)


def _count_torch_clips() -> None:
    """torch's ``clip_grad_norm_`` replaced (Note [torch's clip on sharded gradients] in
    fusedist/optim/torch_clip.py), so that its calls are counted (Note [a clip on some ranks only]
    in clip_check.py); over parameters without a gradient holder it is torch's own function."""
    from ..optim import torch_clip  # (here, not at import: fusedist.optim imports the reliability layer)

    if not torch_clip.installed():
        torch_clip.install()


def _see_torch_scaler() -> None:
    """torch's ``GradScaler._unscale_grads_`` replaced (Note [torch's scaler on sharded gradients] in
    fusedist/amp/torch_scaler.py), so that its scale is noted (Note [torch's GradScaler in the step
    check] in scale_check.py)."""
    from ..amp import torch_scaler  # (here, not at import: fusedist.amp imports the reliability layer)

    if not torch_scaler.installed():
        torch_scaler.install()


def _tree_modules(engine) -> list:
    """The wrapped module's modules as the wrapper last saw its tree (Note [submodules written
    without the registration hook] in fusedist/ddp/module_tree.py), in a rank-independent order."""
    tracker = engine.tracker
    return tracker.tree.modules() if tracker is not None else []


def _named_tree_modules(engine) -> list:
    """(path, module) for :func:`_tree_modules`, for an error's lines."""
    tracker = engine.tracker
    owner = tracker.owner() if tracker is not None else None
    root = getattr(owner, "module", None)
    names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
    return [(names.get(id(m), "?"), m) for m in _tree_modules(engine)]
