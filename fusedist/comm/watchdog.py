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
* an entry past its deadline, an asynchronous error or a failed event aborts the NCCL
  communicator -- its kernels then end, so a host blocked on the GPU (``.item()``, a
  synchronize) is released -- logs the reason at once, and records it: the next ``wait()`` or
  launch on the communicator raises :class:`~fusedist.comm.base.CollectiveError` with it
  (through the reliability observer, so the stall report names the bucket and the ranks).

What is read on the host before that error surfaces is garbage from an aborted collective;
it is never written anywhere durable, because every checkpoint write and every step runs
collectives first. A ``wait(timeout=...)`` shorter than the communicator's own tightens the
deadline of that collective.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

from .base import describe_collective

__all__ = ["CollectiveWatchdog", "POLL_INTERVAL_S", "WatchedCollective"]

log = logging.getLogger(__name__)

#: How often pending collectives are polled (torch's NCCL watchdog polls every 100 ms).
POLL_INTERVAL_S = 0.1


class WatchedCollective:
    """One watched collective: which it is, its deadline and, once launched, its done event."""

    __slots__ = ("op", "tag", "seq", "timeout_s", "deadline", "done")

    def __init__(self, op: str, tag: str, seq: int, timeout_s: float, deadline: float):
        self.op, self.tag, self.seq = op, tag, seq
        self.timeout_s, self.deadline, self.done = timeout_s, deadline, None

    @property
    def what(self) -> str:
        return describe_collective(self.op, self.tag, self.seq)


class CollectiveWatchdog:
    """Enforce deadlines on launched collectives from a daemon thread.

    Args:
        abort: ``abort(reason)`` stops the communicator's in-flight work (ncclCommAbort);
            later launches on it fail naming ``reason``.
        poll_error: raises when the communicator hit an asynchronous error (and aborts it);
            returns otherwise.
        name: how the thread and the messages name the communicator.
        clock: seconds, monotonic (tests pass a fake one).
        interval_s: polling period while collectives are pending.
    """

    def __init__(self, abort: Callable[[str], None], poll_error: Callable[[], None], *, name: str,
                 clock: Callable[[], float] = time.monotonic, interval_s: float = POLL_INTERVAL_S):
        self._abort, self._poll_error = abort, poll_error
        self.name = name
        self._clock, self._interval = clock, interval_s
        self._pending: collections.deque[WatchedCollective] = collections.deque()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        #: Why the watchdog aborted the communicator (None while it has not) ...
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

    # ---- the watching side
    def poll(self) -> Optional[str]:
        """One round of checks (the thread's body; tests call it directly). Returns the
        failure it found, if any, after aborting the communicator."""
        if self.failure is not None:
            return self.failure
        reason = failed = None
        try:
            self._drop_completed()
            now = self._clock()
            with self._cond:
                watched = list(self._pending)
            failed = next((e for e in watched if now >= e.deadline), None)
            if failed is not None:
                reason = (f"{failed.what} did not complete within {failed.timeout_s:g} s of its launch; "
                          "usual causes: a rank that never joined this collective (it crashed, or took "
                          "another code path), or ranks issuing collectives in different orders or sizes")
            else:
                self._poll_error()
        except Exception as exc:  # noqa: BLE001 - an async NCCL error or a failed kernel
            reason = str(exc)
            with self._cond:
                failed = self._pending[0] if self._pending else None
        if reason is None:
            return None
        self.failure, self.failed = reason, failed
        log.error("fusedist watchdog (%s): %s; the NCCL communicator is aborted and the next "
                  "collective on it raises", self.name, reason)
        try:
            self._abort(reason)
        except Exception:  # noqa: BLE001 - the abort's own status adds nothing to act on
            log.exception("fusedist watchdog (%s): aborting the communicator failed", self.name)
        with self._cond:
            self._pending.clear()
        return reason

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
