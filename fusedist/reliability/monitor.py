"""The always-on collective monitor: a few microseconds per collective, a report on failure.

:class:`CollectiveMonitor` plugs into ``Communicator.observer``. On every launch it appends
``(seq, op, tag, step)`` to a short ring buffer -- nothing else, so the steady state costs
one tuple per collective. When a collective fails or times out it builds a stall report
through the store (:mod:`.stall_report`) and hands the communicator a :class:`StallError`
carrying it, so the error every rank raises names who reached what.

A rank that dies from an uncaught Python exception never reaches a collective failure of its
own; :func:`publish_crash` (called from a chained ``sys.excepthook``, or by hand from a
training loop's ``except``) leaves a "crashed" entry so the survivors' reports name it.
"""

from __future__ import annotations

import collections
import time
import weakref
from typing import Callable, Optional

from ..comm.base import CollectiveError, CommHandle, Communicator, global_ranks
from ..comm.exchange_progress import ExchangeWork
from .._process_hooks import at_exit, chain_excepthook
from . import group_left, stall_report, wait_cycle
from .config import divergence_probe_s
from .divergence import WaitProbe, peer_verdict, waiting_on

#: Collectives remembered per communicator for the report.
HISTORY = 16

#: The exchange collectives whose messages are matched by the caller's label (its tag unless it chose
#: another): an all-reduce's and a broadcast's are by size, op and source alone (Note [exchange tags]).
_LABELLED_OPS = frozenset(("all_gather", "reduce_scatter", "gather", "all_to_all"))

#: How long a crashed rank stays after the survivors published their entries: they render and
#: print their reports right after (Note [a crashed peer, seen through the store]).
SURVIVOR_PRINT_S = 0.5

_monitors: "weakref.WeakSet[CollectiveMonitor]" = weakref.WeakSet()
_crashed = False


class StallError(CollectiveError):
    """A collective failed or timed out; ``report`` says what every rank was doing."""

    def __init__(self, message: str, *, report: Optional[str], cause: BaseException, **where):
        super().__init__(message, **where)
        self.report = report
        self.cause = cause


class CollectiveMonitor:
    """Observer of one communicator: recent-collective history and failure reports.

    Context providers (:meth:`add_context_provider`) are callables returning a small dict
    describing where training is (DDP step, backward number, optimizer steps); they run only
    when a report is built.
    """

    def __init__(self, comm: Communicator, group_name: str = "world"):
        self.comm = comm
        self.group_name = group_name
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        # slot -> (seq, launch time): a slot holds the latest of the collectives sharing it.
        self.launch_times: dict[int, tuple] = {}
        #: Training position stamped into each history entry (set by DDP, cheap int).
        self.step_hint: int = -1
        self._context_providers: list[Callable[[], Optional[Callable[[], dict]]]] = []
        self.generation = 0
        self.reports: list[str] = []
        # Held from the start: the process group (and its store handle) may be destroyed by the
        # time a crash or exit entry is published.
        self.store = stall_report.default_store()
        # A bad FUSEDIST_STALL_REPORT_S is refused now, not in place of a later collective's error.
        stall_report.report_window_s(comm.timeout.total_seconds())
        #: After how long a blocking wait starts the divergence probe (0: never; Note [divergence
        #: probe] in divergence.py); read by the communicator's handles.
        self.probe_delay_s = divergence_probe_s() if comm.world_size > 1 else 0.0
        #: Where the last dropped model was (:meth:`keep_position`), for a report built once none is left.
        self.last_position: Optional[dict] = None
        #: The kind of the last entry :meth:`publish` left ("crash", "exit"; "" while none).
        self.published = ""
        #: Whether this rank's ``checking`` entry is in the store (Note [a rank behind at the check]).
        self.check_announced = False
        #: The group's members (global ranks) and torch's name of it, for the entries its last rank to leave
        #: deletes; whether this process has left it (Note [the last rank to leave a group clears its entries]).
        self.members = global_ranks(comm) or list(range(comm.world_size))
        self.torch_group_name = getattr(getattr(comm, "_closing", None), "group_name", "")
        self.has_left = False
        #: What runs once before this monitor's next launch, by key (Note [work at a monitor's next launch]).
        self._before_launch: dict = {}
        if wait_cycle.kept is not None:  # (a group made after a verdict: its first launch is the process's too)
            self.before_next_launch(wait_cycle.KEPT_KEY, wait_cycle.drop_kept)
        _monitors.add(self)

    # ---- observer interface (see Communicator._launch / CommHandle.wait)
    def on_launch(self, comm: Communicator, handle: CommHandle) -> None:
        self.history.append((handle.seq, handle.op, handle.tag, self.step_hint))
        # Note [exchange labels in the divergence probe] in divergence.py: the label, only where it pairs the messages.
        label = comm.last_label if handle.op in _LABELLED_OPS and isinstance(handle._work, ExchangeWork) \
            and comm.last_seq == handle.seq else None
        # Note [reduce ops and roots in the divergence probe]: the variant, wherever the launch gave one.
        variant = getattr(handle, "variant", None)
        self.launch_times[handle.seq % HISTORY] = (handle.seq, time.monotonic(), label, variant)

    def on_release(self, comm: Communicator) -> None:
        """The communicator's group was destroyed on this rank: the peers still in it read that this rank
        left, as they would at its exit (where the released monitor may no longer exist to say so); the last rank
        to leave deletes the group's entries (Note [the last rank to leave a group clears its entries])."""
        if not _crashed:
            self.publish("exit", "")
        group_left.leave(self)

    # ---- work at the next launch (Note [work at a monitor's next launch])
    def before_next_launch(self, key: str, action: Callable[[], None]) -> None:
        """Run ``action()`` once, when this monitor's communicator next launches a collective, before the launch
        is recorded: for a store record that stays true only until this rank issues its next collective. One
        action per ``key``: a later one replaces it."""
        self.__dict__.setdefault("_before_launch", {})[key] = action
        self.on_launch = self._run_before_launch  # (shadows the class's on_launch until that launch)

    def cancel_before_next_launch(self, key: str) -> None:
        """Forget the action :meth:`before_next_launch` left under ``key`` (its record went another way)."""
        pending = self.__dict__.get("_before_launch")
        if pending:
            pending.pop(key, None)
        if not pending:
            self.__dict__.pop("on_launch", None)

    def _run_before_launch(self, comm: Communicator, handle: CommHandle) -> None:
        """The launch hook while actions are pending: run them (each once), then the class's own hook."""
        self.__dict__.pop("on_launch", None)
        pending, self._before_launch = self._before_launch, {}
        for action in pending.values():
            action()
        self.on_launch(comm, handle)

    def on_failure(self, comm: Communicator, handle: CommHandle, error: BaseException) -> BaseException:
        """Publish this rank's state (its first failure only: Note [one entry per rank]), gather the others',
        return the error to raise."""
        if isinstance(error, StallError):
            return error
        # The collective that failed: the error's own, when it names one (a failure the
        # NCCL watchdog found after that collective's wait had returned), else the handle's.
        named = isinstance(error, CollectiveError) and error.seq >= 0
        op, tag, seq = (error.op, error.tag, error.seq) if named else (handle.op, handle.tag, handle.seq)
        store = self.store or stall_report.default_store()
        if self.reports:
            # Note [one entry per rank]: a later failure (the remaining buckets of the same backward)
            # reads what the store holds, this rank's first entry included, and writes nothing.
            report = stall_report.read_report(store, self.group_name, self.generation, comm.rank, comm.world_size,
                                              0.0, global_ranks(comm))
        else:
            report = stall_report.exchange(
                store, self.group_name, self.generation, comm.rank, comm.world_size,
                # (the handle's part where the error names the handle's own collective: a probe's verdict)
                self._failure_entry(comm, error, op, tag, seq, None if named and seq != handle.seq else handle.part),
                stall_report.report_window_s(comm.timeout.total_seconds(), stall_report.peer_gone(error)),
                global_ranks(comm),
            )
        if report is None:
            report = "Stall report unavailable: the torch.distributed store could not be reached."
        self.reports.append(report)
        return StallError(
            f"{error}\n{report}", report=report, cause=error,
            op=op, tag=tag, rank=comm.rank, seq=seq,
        )

    def _failure_entry(self, comm: Communicator, error: BaseException, op: str, tag: str, seq: int,
                       part=None) -> dict:
        """This rank's entry for its first failure: the backend's reason, and the collective it waited on --
        with its part and label, as a probe's entry had them (Note [divergence probe] in divergence.py: a peer
        still probing compares them with its own)."""
        started = self.launched_at(seq)
        # The entry keeps only the backend's reason; op/tag/seq are in "waiting_on".
        reason = str(error).split(f" of {comm.world_size}: ", 1)[-1]
        entry = self._entry(kind="failure", error=_short(RuntimeError(reason)).split(": ", 1)[-1])
        entry["waiting_on"] = dict(waiting_on(op, tag, seq, part, self.label_of(seq), self.variant_of(seq)),
                                   age_s=(time.monotonic() - started) if started is not None else None)
        if getattr(error, "verdict", None):  # (kept for the peers: Note [the verdict before the closed connections])
            entry["verdict"], entry["verdict_of"] = error.verdict, getattr(error, "verdict_of", comm.rank)
        return entry

    def label_of(self, seq: int) -> Optional[str]:
        """The label collective ``seq``'s messages are matched by, where they are (Note [exchange labels in the
        divergence probe] in divergence.py); None elsewhere, or once HISTORY later collectives took its slot."""
        launched = self.launch_times.get(seq % HISTORY)
        return launched[2] if launched is not None and launched[0] == seq else None

    def variant_of(self, seq: int) -> Optional[str]:
        """Collective ``seq``'s reduce op or root (Note [reduce ops and roots in the divergence probe] in
        divergence.py); None where it has none, or once HISTORY later collectives took its slot."""
        launched = self.launch_times.get(seq % HISTORY)
        return launched[3] if launched is not None and launched[0] == seq else None

    def launched_at(self, seq: int) -> Optional[float]:
        """When collective ``seq`` was launched (``time.monotonic()``); None once HISTORY later
        collectives took its slot (a model of many buckets): the time of a later one would
        understate how long it has waited."""
        launched = self.launch_times.get(seq % HISTORY)
        return launched[1] if launched is not None and launched[0] == seq else None

    def add_context_provider(self, provider: Callable[[], dict]) -> None:
        """Call ``provider()`` for the training position whenever a report is built. A bound
        method is held weakly. Why: the monitor lives as long as its communicator, which the
        communicator cache keeps for as long as the process group exists; holding a DDP
        reducer's method strongly kept every DDP model ever built on the group -- module,
        gradients, buckets -- alive after the user dropped it."""
        if hasattr(provider, "__self__") and hasattr(provider, "__func__"):
            self._context_providers.append(weakref.WeakMethod(provider))
        else:
            self._context_providers.append(lambda: provider)

    # ---- helpers
    def context(self) -> dict:
        """The training position for a report: that of the one model on this communicator, or
        (Note [several models on one communicator]) that of the model inside backward."""
        positions = []
        live = []
        for ref in self._context_providers:
            provider = ref()
            if provider is None:
                continue  # its owner is gone
            live.append(ref)
            try:
                positions.append(dict(provider()))
            except Exception:  # noqa: BLE001 - the report must not fail on a bad provider
                pass
        self._context_providers = live
        if not positions and self.last_position:  # (every model gone: where the last one was left)
            return dict(self.last_position)
        return _pick_position(positions)

    def keep_position(self, position: dict) -> None:
        """A model on this communicator was dropped at ``position``: what a report built once no model is
        left (an exit entry after ``main`` returned) says (Note [a pending check holds its model weakly] in
        engine_watch.py)."""
        self.last_position = position

    def _entry(self, kind: str, error: str) -> dict:
        return {"kind": kind, "error": error, "context": self.context(), "recent": list(self.history)}

    def publish(self, kind: str, error: str) -> None:
        """Leave a ``crash`` or ``exit`` entry for the survivors' stall reports."""
        if self.reports or self.has_left:
            return  # this rank already published a failure entry (keep it), or left the group (no one reads it)
        if kind == "exit" and self.published:
            return  # (its crash, or its exit left at the group's destroy with the position then: kept)
        self.published = kind
        if self.store is not None:
            stall_report.publish(self.store, self.group_name, self.generation, self.comm.rank,
                                 self._entry(kind=kind, error=error))
            if kind == "crash":
                stall_report.count_crash(self.store, self.group_name, self.generation)

    def announce_check(self, context: dict) -> bool:
        """Leave a ``checking`` entry while this rank waits in ``check_consistency()`` (Note [a rank
        behind at the check] in engine_watch.py); False when none was left (one of its own is there,
        or no store)."""
        if self.reports or self.store is None:
            return False
        entry = {"kind": "checking", "error": "", "context": context, "recent": list(self.history)}
        self.check_announced = stall_report.publish(self.store, self.group_name, self.generation, self.comm.rank,
                                                    entry)
        return self.check_announced

    def withdraw_check(self, reports_before: int) -> None:
        """Remove the ``checking`` entry once the check returned or raised its own verdict; kept when a
        failure of this group published its entry in its place since (``reports_before``)."""
        self.check_announced = False
        if len(self.reports) == reports_before and self.store is not None:
            stall_report.withdraw(self.store, self.group_name, self.generation, self.comm.rank)

    def divergence_probe(self, op: str, tag: str, seq: int, part=None) -> WaitProbe:
        """The probe of a wait that has blocked for ``probe_delay_s`` (Note [divergence probe] in
        divergence.py); ``part``: this rank's tensor of the collective, or None."""
        return WaitProbe(self, op, tag, seq, self.probe_delay_s, part, self.label_of(seq), self.variant_of(seq))

    def peer_verdict(self) -> Optional[tuple]:
        """(rank, verdict) of a peer whose divergence probe gave up on this group's collectives, else None (Note
        [the verdict before the closed connections] in divergence.py)."""
        return peer_verdict(self)

    def crashed_peer(self) -> Optional[str]:
        """Which peer published a crash (Note [a crashed peer, seen through the store] in
        comm/watchdog.py), else None."""
        if self.store is None:
            return None
        return stall_report.crashed_peer(self.store, self.group_name, self.generation, self.comm.rank,
                                         self.comm.world_size)

    def survivor_wait_s(self) -> float:
        """How long a crashed rank waits for this group's survivors (0: it need not): only
        where they learn of crashes through the store alone (communicators with a watchdog:
        NCCL), and only while this rank has not published a failure of its own."""
        if self.store is None or self.reports or getattr(self.comm, "watchdog", None) is None \
                or self.comm.world_size < 2:
            return 0.0
        from ..comm.watchdog import PEER_CHECK_AFTER_S, PEER_CHECK_EVERY_S

        return stall_report.report_window_s(self.comm.timeout.total_seconds()) + PEER_CHECK_AFTER_S \
            + PEER_CHECK_EVERY_S + 1.0

    def await_survivors(self, deadline: Optional[float] = None) -> bool:
        """Wait until the group's other ranks have published their entries, so that this
        crashed rank is still alive while they report (torchrun ends them once it has exited);
        bounded by :meth:`survivor_wait_s` or ``deadline`` (``time.monotonic()``). True when
        they all did."""
        bound = self.survivor_wait_s()
        if bound <= 0:
            return False
        if deadline is not None:
            bound = max(0.0, deadline - time.monotonic())
        return stall_report.await_entries(self.store, self.group_name, self.generation, self.comm.rank,
                                          self.comm.world_size, bound)


# Note [work at a monitor's next launch]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some records in the store say where this rank waits, and stay true only until it issues its next collective:
# a failure entry published for a failure outside the group's collectives (failed_elsewhere.py), a wait record
# kept after a cycle's verdict (wait_cycle.py). Each goes at that launch. ``on_launch`` runs at every collective,
# so it tests nothing for them: :meth:`CollectiveMonitor.before_next_launch` sets an instance attribute that
# shadows the class's ``on_launch``, and the first launch removes it, runs the pending actions, then the
# class's hook. This is the one place a monitor's launch hook is rebound; with nothing pending a launch costs
# what it did without them.

# Note [one entry per rank]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rank leaves one entry per group in the store, at its first failure: which collective it waited on,
# after how long, at which training position. The failures that follow on the same communicator -- the
# remaining buckets of the same backward, each failing in turn -- used to publish an entry each, every one
# overwriting the one before, so a peer's report (built later, or waiting for this rank's entry) named the
# last bucket and its shorter wait, not the collective where this rank stopped. They now read the store and
# write nothing, as a refusal and a crash entry already did (``publish`` keeps a rank's failure entry).

# Note [several models on one communicator]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Models built on one process group share its communicator and so its monitor: a GAN's two
# nets, an encoder and a head wrapped apart. Their positions have the same keys (step,
# forwards, optimizer steps, in backward), and merging them let the last model built overwrite
# the others: a stall in one model's bucket was reported at the other model's step, not
# inside backward. The report takes the position of the model inside backward (the one whose
# buckets or units are in flight); with none or several there, the last one built, as before;
# either way it says how many models share the group and which position it shows.
def _pick_position(positions: list) -> dict:
    if len(positions) <= 1:
        return positions[0] if positions else {}
    inside = [p for p in positions if p.get("in_backward")]
    chosen = dict(inside[0] if len(inside) == 1 else positions[-1])
    chosen["models_on_group"] = len(positions)
    chosen["position_of"] = "the model inside backward" if len(inside) == 1 else "the last model built"
    return chosen


def _short(error: BaseException, limit: int = 400) -> str:
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    text = text.splitlines()[0] if text else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def publish_crash(error: BaseException) -> None:
    """Tell the other ranks, through the store, that this rank is dying of ``error``.

    Called automatically for uncaught exceptions once a monitor exists (chained
    ``sys.excepthook``); call it yourself from an ``except`` that ends a rank's training.
    Never raises. With NCCL communicators it then waits, bounded by the report window plus a
    few seconds, for the survivors' entries (Note [a crashed peer, seen through the store] in
    comm/watchdog.py).
    """
    global _crashed
    _crashed = True
    monitors = list(_monitors)
    for monitor in monitors:
        try:
            monitor.publish("crash", _short(error))
        except Exception:  # noqa: BLE001
            pass
    # Note [a crashed peer, seen through the store] in comm/watchdog.py: one deadline for all
    # the groups that need it, then a moment for the survivors to print what they published.
    waits = [(m, m.survivor_wait_s()) for m in monitors]
    waits = [(m, w) for m, w in waits if w > 0]
    if waits:
        deadline = time.monotonic() + max(w for _, w in waits)
        reported = True
        for monitor, _ in waits:
            try:
                reported = monitor.await_survivors(deadline) and reported
            except Exception:  # noqa: BLE001
                reported = False
        if reported:
            time.sleep(SURVIVOR_PRINT_S)


def _publish_exit() -> None:
    """atexit: a rank that leaves the training loop early (fewer iterations than the others)
    shows up in their reports as "exited" with its last position, not as a mystery."""
    if _crashed:
        return
    for monitor in list(_monitors):
        try:
            monitor.publish("exit", "")
        except Exception:  # noqa: BLE001
            pass


def _publish_uncaught(exc_type, exc, tb) -> None:
    """A KeyboardInterrupt is published too: without an entry the atexit hook would report the
    interrupted rank as one that "EXITED without an error" after running fewer iterations. So is
    a collective failure: its own group keeps the entry it published (``publish`` leaves a monitor
    with a report alone), the rank's other groups get a crash entry naming it -- on an HSDP mesh a
    shard group's stall ended the rank, and the replicate group's report said it had exited
    cleanly after running fewer iterations."""
    publish_crash(exc)


def _install_excepthook() -> None:
    """Publish a crash for an uncaught exception, and an exit for a clean one (the other
    ranks' stall reports read them); both process-wide (fusedist/_process_hooks.py)."""
    chain_excepthook("publish a crashed rank", _publish_uncaught)
    at_exit("publish a rank's exit", _publish_exit)


def _group_name(comm: Communicator) -> str:
    """The group's key in the store. torch's group name is part of it: two groups of the same
    ranks (say, one per model, or a fresh one after a failure) must not read each other's
    stall entries, which would name ops of the other group."""
    group = getattr(comm, "group", None)
    if group is None:
        return "world"
    try:
        import torch.distributed as dist

        name = getattr(group, "group_name", "")
        return "ranks-" + "-".join(str(r) for r in dist.get_process_group_ranks(group)) + (f"-pg{name}" if name else "")
    except Exception:  # noqa: BLE001
        return f"group-{id(group)}"


def monitor_of(comm: Communicator) -> Optional[CollectiveMonitor]:
    observer = comm.observer
    return observer if isinstance(observer, CollectiveMonitor) else None


def attach_monitor(comm: Communicator) -> Optional[CollectiveMonitor]:
    """The communicator's monitor, created on first use (None when checks are disabled or a
    different observer is installed: that observer is left alone)."""
    from .config import checks_enabled

    existing = monitor_of(comm)
    if existing is not None:
        # The monitor outlives fusedist._process_hooks.uninstall(), which removes its crash
        # and exit entries; a later model on the communicator puts them back ("later use
        # installs them again"), or its rank would die unnamed in the others' reports.
        _install_excepthook()
        return existing
    if not checks_enabled():
        return None
    if comm.observer is not None:
        return None
    monitor = CollectiveMonitor(comm, _group_name(comm))
    comm.observer = monitor
    _install_excepthook()
    return monitor
