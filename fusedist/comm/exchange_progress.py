"""An exchange in flight and who drives it: :class:`ExchangeWork` and the progress thread.

The gloo exchange (``gloo_exchange.py``) builds each reduce-scatter and all-gather from
point-to-point messages; this module is what happens after the launch: posting the deferred
sends, waiting for every message with the communicator's deadline, running each chunk's
completion step as it lands, and reporting completion truthfully to callers that poll
(Note [exchange progress]). The exchange's own notes are in ``gloo_exchange.py`` (Note
[receives first, sends later]) and ``exchange_fold.py`` (Note [in-place fold]).
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
import traceback
from typing import Callable, Optional, Sequence

import torch

from .closed_connections import PeerClosedConnection, explained

__all__ = ["ExchangeWork", "ProgressThread"]


#: How long after its deadline a waiter waits for the thread driving an exchange to report
#: its failure.
VERDICT_GRACE_S = 1.0


def _remaining(deadline: float) -> datetime.timedelta:
    # gloo reads a zero timeout as "no timeout": never pass less than a millisecond.
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))


class ExchangeWork:
    """An in-flight exchange, shaped like a torch ``Work`` for the communicator.

    Note [exchange progress]
        gloo's point-to-point works report completion only through ``wait`` (``is_completed``
        stays False until someone waits; measured), and waiting with a short timeout makes
        gloo drop the connection, so polling them is not possible. Instead an exchange
        launched with ``async_op=True`` is driven by its group's *progress thread*
        (:class:`ProgressThread`), in launch order: it posts the sends (Note [receives first,
        sends later] in ``gloo_exchange.py``), waits for the receives in a fixed order, runs
        each one's completion step (the reduction of a chunk) as it lands, then waits for the
        sends, and sets the work's completion flag. So ``is_completed()`` is a truthful
        non-blocking query -- DDP finishes buckets during backward when it turns True -- and
        the reduction runs while the caller
        computes (torch's kernels release the GIL). A caller that waits before the thread
        got to the exchange drives it itself (whoever starts first finishes it; the other
        skips it). A synchronous launch never reaches the thread: its caller drives it at
        once: waking the thread for it anyway would make the two threads contend for the GIL
        on every collective, a cost that dominates small ones.

    ``wait(timeout)`` waits for that flag. The progress thread's own deadline is the launch
    time plus the communicator's timeout; on failure or timeout it records a ``RuntimeError``
    naming the peer and chunk it was waiting for, which ``wait`` raises. A failed exchange is
    not retried, and its landing buffer is not reused: a late message may still land in it (or
    in the output, which receives one peer's part directly; Note [in-place fold] in
    ``exchange_fold.py``). A ``wait`` with a timeout shorter than that deadline that runs out
    raises ``TimeoutError`` and leaves the exchange going (as a torch gloo work's wait does):
    a later ``wait`` returns its result.
    """

    def __init__(self, op: str, receives: list, sends: list, keep_alive: Sequence[torch.Tensor],
                 on_success: Optional[Callable[[], None]] = None, timeout_s: float = 30 * 60.0,
                 on_failure: Optional[Callable[[], None]] = None,
                 background: Optional[Callable[["ExchangeWork"], None]] = None):
        self.op = op
        # hands this work to the progress thread (for a wait shorter than the launch deadline)
        self._background = background
        self._on_success = on_success  # runs once, after every message has completed
        self._on_failure = on_failure  # runs once, if the exchange failed
        # (recv work, peer group rank, peer global rank, chunk index, completion step or None)
        self._receives = receives
        # (send to post: () -> work, peer group rank, peer global rank, chunk index); posted
        # when the exchange is driven, not at launch (Note [receives first, sends later]).
        self._sends = sends
        self._keep_alive = keep_alive  # buffers gloo reads or writes until the work finishes
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._finished = threading.Event()
        self._runner = threading.Lock()  # held by whichever thread drives the exchange
        self._error: Optional[BaseException] = None
        self._waiting_for = "not started"  # what the progress thread waits for (for errors)
        #: Publishes this exchange's failure and explains a connection a peer closed (Note
        #: [connections a peer closed] in closed_connections.py); None: neither.
        self.closing = None
        #: Why the divergence probe ended this exchange (Note [probing waits that cannot be sliced] in
        #: watched_wait.py); None: it did not.
        self.ended_by: Optional[str] = None
        #: Told this exchange's failure as it happens (the group then refuses collectives); None: nobody.
        self.on_given_up: Optional[Callable[[str], None]] = None

    def is_completed(self) -> bool:
        return self._finished.is_set()

    @property
    def failure(self) -> Optional[BaseException]:
        """The error the exchange failed with, once it finished failing (None otherwise; a
        wait that ran out while the exchange goes on is no failure)."""
        return self._error if self._finished.is_set() else None

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        seconds = timeout.total_seconds() if timeout is not None else None
        if seconds is not None and self._background is not None and time.monotonic() + seconds < self._deadline:
            # A wait shorter than the launch deadline must not fail the exchange: a gloo wait
            # that times out closes the connection to the peer (the whole group is unusable
            # after it), while a torch gloo work whose wait timed out completes all the same
            # and a later wait succeeds. So the progress thread drives it to the launch
            # deadline, and this waits for it at most ``timeout`` (Note [exchange progress]).
            self._background(self)
        else:
            # Drive it here unless the progress thread already is (saves a thread hand-off),
            # for no longer than ``timeout``.
            self.run(None if seconds is None else time.monotonic() + seconds)
            if seconds is not None and time.monotonic() + seconds >= self._deadline:
                # The driving thread gives up at the deadline: wait for its verdict (the
                # failure, naming the peer) rather than race it and report the exchange as
                # still going.
                seconds = max(seconds, self._deadline - time.monotonic() + VERDICT_GRACE_S)
        if not self._finished.wait(seconds):
            raise TimeoutError(f"{self.op} exchange did not complete within {seconds:g} s (still "
                               f"{self._waiting_for}); it goes on until its deadline")
        if self._error is not None:
            raise self._error
        return True

    def run(self, until: Optional[float] = None) -> None:
        """Drive the exchange to completion, unless another thread does or did (Note [exchange
        progress]): the progress thread, or a caller of ``wait`` that got there first; by the
        launch deadline, or ``until`` (a ``time.monotonic()``) if that is sooner."""
        if self._finished.is_set() or not self._runner.acquire(blocking=False):
            return
        try:
            # its frame, and the gloo works it held, are gone when it returns
            self._drive(self._deadline if until is None else min(until, self._deadline))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            _drop_frame_locals(exc)
            self._error = exc
            if self.on_given_up is not None:
                self.on_given_up(str(exc))
            if self.closing is not None:
                self.closing.publish(str(exc))
            # The group refuses collectives from now on (Note [no collectives after a failed exchange]
            # in gloo_exchange.py): its communicator gave up, so a program that catches the error and
            # ends by sys.exit(n) ends at once with n (Note [ending after given-up collectives]).
            from . import given_up_exit

            given_up_exit.watch_exit_requests()
            if self._on_failure is not None:
                self._on_failure()
        finally:
            self._receives, self._sends, self._keep_alive = [], [], ()
            self._on_success = self._on_failure = None
            self._finished.set()
            self._runner.release()

    def _drive(self, deadline: float) -> None:
        posted = []
        for post, peer, global_peer, chunk in self._sends:
            self._waiting_for = f"posting the send of chunk {chunk} to {_where(peer, global_peer)}"
            try:
                posted.append((post(), peer, global_peer, chunk))
            except Exception as exc:  # noqa: BLE001 - a peer that closed the connection is named, as for a wait
                why = explained(self.closing, exc, _where(peer, global_peer), global_peer)
                if why is None:
                    raise
                raise PeerClosedConnection(f"{self.op} exchange: {self._waiting_for} failed: {why}") from exc
        for work, peer, global_peer, chunk, complete in self._receives:
            self._wait_one(work, "receiving", peer, global_peer, chunk, deadline)
            if complete is not None:
                complete()
        for work, peer, global_peer, chunk in posted:
            self._wait_one(work, "sending", peer, global_peer, chunk, deadline)
        self._waiting_for = "done"
        if self._on_success is not None:
            self._on_success()

    def _wait_one(self, work, what, peer, global_peer, chunk, deadline: float) -> None:
        where = _where(peer, global_peer)
        self._waiting_for = f"{what} chunk {chunk} {'from' if what == 'receiving' else 'to'} {where}"
        try:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out after {self._timeout_s - (self._deadline - deadline):g} s")
            work.wait(timeout=_remaining(deadline))
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError; say what we waited on
            if self.ended_by is not None:
                raise RuntimeError(f"{self.op} exchange: {self._waiting_for} was ended: {self.ended_by}") from exc
            why = explained(self.closing, exc, where, global_peer)
            failed = RuntimeError if why is None else PeerClosedConnection
            raise failed(f"{self.op} exchange: {self._waiting_for} did not complete: {why or exc}") from exc


# Note [work references]
# ~~~~~~~~~~~~~~~~~~~~~~
# Every reference the driving thread holds to a torch ``Work`` is dropped *before* the
# exchange's completion flag is set. Why: torch destroys a ``Work`` with the GIL released,
# then takes the GIL back. Once the caller sees the flag it may return, and the interpreter
# may begin to shut down. Then the progress thread, a daemon, would drop its last references
# while that happens. A daemon thread that takes the GIL back during shutdown is ended with
# pthread_exit, and unwinding through torch's no-GIL destructor aborts the process
# ("terminate called without an active exception"). The aborts at exit actually seen came
# from gloo's own worker threads in a group left to interpreter shutdown (Note [releasing
# destroyed groups] in fusedist/comm/__init__.py); this closes the same door for the
# progress thread. The work is driven in its own method (``_drive``), whose locals are gone
# when it returns, and a failure's traceback has its frames' locals cleared before the
# error is stored.
def _drop_frame_locals(exc: BaseException) -> None:
    """Clear the locals of the finished frames in ``exc``'s traceback and those of its causes
    (Note [work references]); the messages and line numbers stay."""
    seen: set = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _where(peer: int, global_peer: int) -> str:
    return f"rank {peer}" + (f" (global rank {global_peer})" if global_peer != peer else "")


class ProgressThread:
    """One daemon thread per exchange group that runs launched exchanges in launch order
    (Note [exchange progress]). Started on first use, and again after a fork."""

    def __init__(self):
        self._queue: "queue.SimpleQueue[ExchangeWork]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._pid = None
        self._lock = threading.Lock()

    def submit(self, work: ExchangeWork) -> None:
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._loop, args=(self._queue,),
                                                name="fusedist-gloo-exchange", daemon=True)
                self._pid = os.getpid()
                self._thread.start()
            self._queue.put(work)

    def stop(self, join_timeout: Optional[float] = None) -> None:
        """Let the thread finish what it was given, then end; the next ``submit`` starts a
        fresh one (with its own queue, so nothing lands behind the stop). With
        ``join_timeout``, wait up to that many seconds for it to end."""
        with self._lock:
            thread = self._thread if self._pid == os.getpid() else None
            if thread is not None:
                self._queue.put(None)
            self._thread = None
        if thread is not None and join_timeout is not None:
            thread.join(join_timeout)

    @staticmethod
    def _loop(q) -> None:
        while (work := q.get()) is not None:
            work.run()
            del work  # the exchange is dropped at once: it holds no gloo work any more
