"""A thread that watches a communicator's launched collectives, so that waiting for one never
has to block the host.

Note [stream-ordered waits and the watchdog]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On the direct-NCCL path ``handle.wait()`` only makes the caller's stream wait for the
collective (Note [comm stream ordering] in ``csrc/cuda/comm_stream.h``): the host runs ahead
and queues the next kernels while the GPU still reduces, which is the CPU/GPU overlap a
training step lives on. Blocking the host in every bucket wait -- the only place a timeout
could otherwise be enforced -- costs that overlap, and with overlapped parameter all-gathers it
stalls every forward pre-hook too. So the timeouts are enforced where torch enforces its own,
on a watchdog thread:

* every launch is registered *before* the launch call (a launch can itself block: NCCL
  connects lazily inside the first collective of each algorithm) with a deadline of launch
  time + the communicator's timeout; its done event is attached once the launch returned;
* the thread polls the oldest pending entries' done events (one stream runs them in launch
  order, so they complete in order) and NCCL's asynchronous error state, every
  ``POLL_INTERVAL_S`` while anything is pending, and sleeps otherwise;
* an entry past its deadline, an asynchronous error or a failed event is a failure, handed
  once to the communicator's failure handler.

What the handler does matters because the host has run ahead: while the collective hangs,
nothing that depends on it can be read on the host (such a read blocks), but aborting the
NCCL communicator ends its kernels, and a host read after that returns garbage -- which the
program might save before it reaches another collective that could raise. So by default
(``FUSEDIST_NCCL_WATCHDOG=exit``) the handler reports, while the results are still
unreadable -- the error and fusedist's stall report (which collective, which ranks got how
far), printed as an uncaught exception would be -- and ends the process with status 1 at
once, as torch's NCCL watchdog tears its process down; torchrun then stops the other ranks.
It does not abort NCCL first: the abort is what would release a blocked host read, and
``ncclCommAbort`` itself can block while device work is queued (it frees device memory),
long enough for the program to run on with what it read (seen on an H200: a read behind a
timed-out collective returned while the abort was still running). Process exit ends the
kernels, and the peers see their connections close. With ``raise`` it aborts, and the next
``wait()`` or collective on the communicator raises the error instead (for programs that
rebuild their process groups in-process; they must not use results read in between). At
interpreter exit the communicator waits for its pending collectives (bounded), so a failure in
the last step is reported too, not lost with the process. A ``wait(timeout=...)`` shorter than
the communicator's own tightens the deadline of that collective.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

from .checks import describe_collective

__all__ = ["CollectiveWatchdog", "POLL_INTERVAL_S", "WatchedCollective"]

log = logging.getLogger(__name__)

#: How often pending collectives are polled (torch's NCCL watchdog polls every 100 ms).
POLL_INTERVAL_S = 0.1

# Note [a crashed peer, seen through the store]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rank that dies of an uncaught exception publishes a "crash" entry in the store before it
# exits (reliability/monitor.py). Over gloo the survivors learn of the death at once (its
# connections close) and their stall reports name it; over NCCL nothing tells them until their
# timeout (an H200 run saw no error in the 1.6 s before torchrun ended the survivor), and
# torchrun ends the survivors as soon as the crashed worker has exited (it polls every 0.1 s by
# default), so no report naming the crash is ever printed. So the watchdog also asks whether a
# peer crashed -- one store call (a counter) every PEER_CHECK_EVERY_S, only while a collective
# has been pending for PEER_CHECK_AFTER_S -- and a crash is a failure of the oldest pending
# collective, reported as any other; and a crashed rank with NCCL communicators lingers
# (bounded) until the survivors have published their entries. A peer's clean exit is not a
# failure here: a rank that left cleanly has completed its collectives, while ours may still
# be landing; a peer that left early shows up in the report at the timeout.
PEER_CHECK_AFTER_S = 1.0
PEER_CHECK_EVERY_S = 1.0

# Note [probing stream-ordered waits for divergence]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The divergence probe (Note [divergence probe] in fusedist/reliability/divergence.py) runs between
# the slices of a wait that blocks the host; on the direct-NCCL path no wait blocks (Note
# [stream-ordered waits and the watchdog]), so ranks stuck in collectives that can never pair were
# found only at the timeout. The watchdog is where such a collective is seen pending: while the
# oldest pending collective has been pending long enough for the communicator's observer
# (``divergence_probe(entry, pending_s)`` returns a probe then, None before or when probing is off),
# its probe publishes where this rank waits and reads the peers' entries every ``probe.every_s``;
# a verdict is a failure of that collective, handled as a timeout is (reported, then the process
# ends or the communicator aborts). Only the oldest pending collective is probed: the stream runs
# collectives in launch order, so it is the one every later one waits behind, and the one the
# peers' entries must match. Its probe is closed (its entry withdrawn) once it completes; after a
# verdict its entry stays, so that the peers' probes reach theirs, until the failure report
# replaces it.


class WatchedCollective:
    """One watched collective: which it is, its deadline and, once launched, its done event."""

    __slots__ = ("op", "tag", "seq", "timeout_s", "deadline", "done", "started")

    def __init__(self, op: str, tag: str, seq: int, timeout_s: float, deadline: float):
        self.op, self.tag, self.seq = op, tag, seq
        self.timeout_s, self.deadline, self.done = timeout_s, deadline, None
        self.started = deadline - timeout_s

    @property
    def what(self) -> str:
        return describe_collective(self.op, self.tag, self.seq)


class CollectiveWatchdog:
    """Enforce deadlines on launched collectives from a daemon thread.

    Args:
        on_failure: ``on_failure(reason, failed)`` handles the one failure: ``failed`` is the
            collective past its deadline (for an asynchronous error: the oldest pending one,
            or None). It must at least abort the communicator (see the Note).
        poll_error: raises when the communicator hit an asynchronous error (and aborts it);
            returns otherwise.
        crashed_peer: returns why a peer can no longer join (a crash it published), else
            None; asked only while a collective is overdue (Note [a crashed peer, seen
            through the store]).
        divergence_probe: ``divergence_probe(entry, pending_s)`` returns the probe of the
            oldest pending collective once it has been pending long enough, else None (Note
            [probing stream-ordered waits for divergence]): an object with ``check()`` (a
            verdict, or None), ``close()`` and ``every_s``.
        name: how the thread and the messages name the communicator.
        clock: seconds, monotonic (tests pass a fake one).
        interval_s: polling period while collectives are pending.
    """

    def __init__(self, on_failure: Callable[[str, Optional["WatchedCollective"]], None],
                 poll_error: Callable[[], None], *, name: str,
                 crashed_peer: Optional[Callable[[], Optional[str]]] = None,
                 divergence_probe: Optional[Callable[["WatchedCollective", float], Optional[object]]] = None,
                 clock: Callable[[], float] = time.monotonic, interval_s: float = POLL_INTERVAL_S):
        self._on_failure, self._poll_error, self._crashed_peer = on_failure, poll_error, crashed_peer
        self._next_peer_check = 0.0
        self._probe_for = divergence_probe
        # (the probed collective, its probe, when to check next); None while none is probed. Its
        # own lock: poll() runs on the thread and in settle(), and a check does store calls.
        self._probing: Optional[tuple] = None
        self._probe_lock = threading.RLock()
        self.name = name
        self._clock, self._interval = clock, interval_s
        self._pending: collections.deque[WatchedCollective] = collections.deque()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        #: Why a watched collective failed (None while none has) ...
        self.failure: Optional[str] = None
        #: ... and the collective that failed (None: an asynchronous error with none pending).
        self.failed: Optional[WatchedCollective] = None

    # ---- the launching side
    def begin(self, op: str, tag: str, seq: int, timeout_s: float) -> WatchedCollective:
        """Register a collective about to be launched (before the launch call)."""
        entry = WatchedCollective(op, tag, seq, timeout_s, self._clock() + timeout_s)
        with self._cond:
            self._pending.append(entry)
            self._ensure_thread()
            self._cond.notify()
        return entry

    def launched(self, entry: WatchedCollective, done) -> None:
        """The launch returned; ``done.query()`` says when the collective completed."""
        entry.done = done

    def cancel(self, entry: WatchedCollective) -> None:
        """The launch failed before anything was enqueued: nothing to watch."""
        with self._cond:
            try:
                self._pending.remove(entry)
            except ValueError:
                pass

    def tighten(self, entry: WatchedCollective, timeout_s: float) -> None:
        """A waiter asked for a shorter bound than the deadline set at launch."""
        deadline = self._clock() + timeout_s
        if deadline < entry.deadline:
            entry.deadline, entry.timeout_s = deadline, timeout_s

    @property
    def pending(self) -> int:
        return len(self._pending)

    def oldest(self) -> str:
        """The oldest pending collective, described ('' when none)."""
        with self._cond:
            return self._pending[0].what if self._pending else ""

    # ---- the watching side
    def poll(self) -> Optional[str]:
        """One round of checks (the thread's body; tests call it directly). Returns the
        failure it found, if any, after handing it to ``on_failure``."""
        if self.failure is not None:
            return self.failure
        reason = failed = None
        try:
            self._drop_completed()
            now = self._clock()
            with self._cond:
                watched = list(self._pending)
            self._retire_probe(watched)
            failed = next((e for e in watched if now >= e.deadline), None)
            if failed is not None:
                reason = (f"{failed.what} did not complete within {failed.timeout_s:g} s of its launch; "
                          "usual causes: a rank that never joined this collective (it crashed, or took "
                          "another code path), or ranks issuing collectives in different orders or sizes")
            else:
                self._poll_error()
                crash = self._peer_crash(watched, now)
                if crash is not None:
                    failed = watched[0]
                    reason = (f"{failed.what} cannot complete: {crash} (seen through the store after "
                              f"{now - failed.started:.1f} s)")
                else:
                    verdict = self._probe_oldest(watched, now)
                    if verdict is not None:
                        failed = watched[0]
                        reason = f"{failed.what} cannot complete on this rank: {verdict}"
        except Exception as exc:  # noqa: BLE001 - an async NCCL error or a failed kernel
            reason = str(exc)
            with self._cond:
                failed = self._pending[0] if self._pending else None
        if reason is None:
            return None
        with self._cond:
            if self.failure is not None:  # found by a concurrent poll (settle() and the thread)
                return self.failure
            self.failure, self.failed = reason, failed
        log.error("fusedist watchdog (%s): %s", self.name, reason)
        try:
            self._on_failure(reason, failed)
        except Exception:  # noqa: BLE001 - the handler's own trouble must not hide the failure
            log.exception("fusedist watchdog (%s): handling the failure failed", self.name)
        with self._cond:
            self._pending.clear()
            self._cond.notify_all()
        with self._probe_lock:  # (left published: this rank stays stuck there, and the peers' probes
            self._probing = None  # must go on seeing it until its failure report replaces the entry)
        return reason

    def _probe_oldest(self, watched: list, now: float) -> Optional[str]:
        """Note [probing stream-ordered waits for divergence]: the verdict of the oldest pending
        collective's probe, checked at most every ``probe.every_s``; None while there is none."""
        if self._probe_for is None or not watched:
            return None
        oldest = watched[0]
        with self._probe_lock:
            if self._probing is None:
                probe = self._probe_for(oldest, now - oldest.started)
                if probe is None:
                    return None
                self._probing = (oldest, probe, now)
            entry, probe, due = self._probing
            if entry is not oldest or now < due:
                return None
            self._probing = (entry, probe, now + probe.every_s)
            return probe.check()

    def _retire_probe(self, watched: list) -> None:
        """Close the probe of a collective that is no longer the oldest pending one (it completed,
        or failed): its entry must not outlive the wait, or the peers would read it as stuck."""
        if self._probing is not None and (not watched or watched[0] is not self._probing[0]):
            self._close_probe()

    def _close_probe(self) -> None:
        with self._probe_lock:
            probing, self._probing = self._probing, None
        if probing is not None:
            try:
                probing[1].close()
            except Exception:  # noqa: BLE001 - withdrawing an entry from the store must not fail a poll
                log.debug("fusedist watchdog (%s): closing a divergence probe failed", self.name, exc_info=True)

    def _peer_crash(self, watched: list, now: float) -> Optional[str]:
        """Note [a crashed peer, seen through the store]: asked only while the oldest pending
        collective is overdue, at most every PEER_CHECK_EVERY_S."""
        if self._crashed_peer is None or not watched or now - watched[0].started < PEER_CHECK_AFTER_S \
                or now < self._next_peer_check:
            return None
        self._next_peer_check = now + PEER_CHECK_EVERY_S
        return self._crashed_peer()

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until nothing is pending or a failure was handled
        (polling here too, so it also works with the thread stopped). True when settled."""
        end = self._clock() + timeout_s
        while True:
            if self.poll() is not None or not self._pending:
                return True
            if self._clock() >= end:
                return False
            time.sleep(min(self._interval, 0.05))

    def _drop_completed(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    return
                oldest = self._pending[0]
            if oldest.done is None or not oldest.done.query():
                return
            with self._cond:
                if self._pending and self._pending[0] is oldest:
                    self._pending.popleft()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._pending and self._thread is me:
                    self._cond.wait()
                if self._thread is not me:
                    return  # stopped (a later begin() may have started a successor)
            if self.poll() is not None:
                with self._cond:
                    if self._thread is me:
                        self._thread = None
                return
            with self._cond:
                if self._thread is not me:
                    return
                self._cond.wait(self._interval)

    def _ensure_thread(self) -> None:
        if self._thread is None and self.failure is None:
            self._thread = threading.Thread(target=self._run, name=f"fusedist-watchdog-{self.name}",
                                            daemon=True)
            self._thread.start()

    def stop(self, join_timeout: Optional[float] = None) -> None:
        """Stop the thread (it starts again at the next :meth:`begin`)."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)
        self._close_probe()
