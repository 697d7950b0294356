"""The divergence probe for waits that cannot be sliced, run from one watcher thread.

Note [probing waits that cannot be sliced]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A synchronous exchange (SyncBatchNorm's statistics gathers, the small all-reduces, the object
exchanges) and a synchronous all-reduce whose parts are agreed first are waited for in one gloo wait
with one deadline: a gloo wait that runs out closes the group's connections, so they cannot be
waited for in slices, and the divergence probe (Note [divergence probe] in
fusedist/reliability/divergence.py) never ran for them. Ranks whose programs diverged into such
waits -- a layer in ``train()`` on one rank and in ``eval()`` on another, a model converted to
SyncBatchNorm on one rank only, a layer run fewer times on one rank -- waited out the collective
timeout (minutes). Now the caller registers its wait with one watcher thread per process (an entry
in a dict under a lock: the whole cost of a wait that ends before the delay), and the watcher runs
the same probe for it, ``probe_delay_s`` after the wait began and every ``every_s`` after that. On a
verdict it ends the wait: the communicator closes the group's connections (Note [closing the
connections of an abandoned collective] in torch_comm.py), which makes the caller's gloo wait fail
at once, and the caller raises the verdict, as a sliced wait does. The watcher wakes only when a
registered wait is due: a thread woken for every collective would contend with the caller for the
GIL (Note [exchange progress] in exchange_progress.py).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Callable, Optional


class _Watcher:
    """One daemon thread that calls each registered ``step`` when it is due; ``step`` returns when to
    call it again (a ``time.monotonic()``), or None when it is done. Started on first use, and again
    after a fork."""

    def __init__(self):
        self._cond = threading.Condition()
        self._due: dict = {}  # key -> (due, step)
        self._next = float("inf")  # the earliest due time the thread sleeps until
        self._keys = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._pid = None

    def watch(self, due: float, step: Callable[[], Optional[float]]) -> int:
        if self._pid is not None and self._pid != os.getpid():
            self._cond = threading.Condition()  # (a fork child: the parent's thread may have held the lock)
        with self._cond:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._due, self._next = {}, float("inf")
                self._thread = threading.Thread(target=self._loop, name="fusedist-wait-watcher", daemon=True)
                self._pid = os.getpid()
                self._thread.start()
            key = next(self._keys)
            self._due[key] = (due, step)
            if due < self._next:  # (else the thread wakes in time anyway: no hand-off on the common path)
                self._next = due
                self._cond.notify()
            return key

    def unwatch(self, key: int) -> None:
        with self._cond:
            self._due.pop(key, None)

    def stop(self, wait_s: float = 1.0) -> None:
        """End the thread (at interpreter exit: Note [draining at exit] in __init__.py), waiting up to
        ``wait_s`` for a probe it is running; a later ``watch`` starts a new one."""
        if self._pid != os.getpid():
            return  # (a fork child never started the parent's thread)
        with self._cond:
            thread, self._thread = self._thread, None
            self._due, self._next = {}, float("inf")
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    def _loop(self) -> None:
        # Only the due time is held while sleeping: a step holds its wait's communicator, and through it the
        # process group, which must be freed when the program destroys it (Note [releasing destroyed groups]
        # in __init__.py).
        while True:
            with self._cond:
                while True:
                    if self._thread is not threading.current_thread():
                        return  # (stopped: ``stop``)
                    now = time.monotonic()
                    self._next = due = min((d for d, _ in self._due.values()), default=float("inf"))
                    if due <= now:
                        key = next(k for k, (d, _) in self._due.items() if d == due)
                        step = self._due[key][1]
                        break
                    self._cond.wait(None if due == float("inf") else due - now)
            try:
                again = step()
            except Exception:  # noqa: BLE001 - a probe never takes the watcher down
                again = None
            with self._cond:
                if key in self._due:
                    if again is None:
                        del self._due[key]
                    else:
                        self._due[key] = (again, step)
            step = None


_WATCHER = _Watcher()


def stop_watcher() -> None:
    """End the watcher thread, if one runs (at interpreter exit)."""
    _WATCHER.stop()


class WatchedWait:
    """The probe of one wait that cannot be sliced (Note [probing waits that cannot be sliced]): the
    watcher runs :meth:`_step` while the caller waits; :meth:`close` when the wait ends either way.
    ``verdict``: why the probe ended the wait (None: it did not)."""

    def __init__(self, handle, delay_s: float):
        self._handle, self._comm = handle, handle._comm
        self._lock = threading.Lock()  # the probe is made and checked by the watcher, closed by the caller
        self._probe = None
        self._closed = False
        self.verdict: Optional[str] = None
        self._key = _WATCHER.watch(time.monotonic() + delay_s, self._step)

    def _step(self) -> Optional[float]:
        handle, comm = self._handle, self._comm
        with self._lock:
            if self._closed or handle._work is None or handle._work.is_completed():
                return None
            if self._probe is None:
                probe = getattr(comm.observer, "divergence_probe", None)  # (an observer detached since: none)
                if probe is None:
                    return None
                self._probe = probe(handle.op, handle.tag, handle.seq, handle.part)
            verdict = self._probe.check()
            if verdict is None:
                return time.monotonic() + self._probe.every_s
            self.verdict = verdict  # (before the caller's wait fails: its handler reads it)
            if not comm._end_watched_wait(handle._work, verdict):
                self.verdict = None  # (it completed meanwhile: the ranks did pair)
                retract = getattr(self._probe, "retract", None)
                if retract is not None:
                    retract()
        return None

    def close(self) -> None:
        _WATCHER.unwatch(self._key)
        with self._lock:
            self._closed = True
            if self._probe is not None:
                self._probe.close()
