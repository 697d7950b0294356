"""Chrome-trace timeline of communication events (``FUSEDIST_TIMELINE=<path>``).

Each rank writes ``<path>.rank<R>.json`` (viewable in Perfetto / chrome://tracing) with
instant and duration events such as "bucket 3 ready", "all_reduce launched", "done". It is
the proof that communication overlaps backward. Off (and free) unless the variable is set.
"""

from __future__ import annotations

import json
import os
import threading
import time

from ._process_hooks import at_exit

_EPOCH = time.perf_counter()


def now_us() -> float:
    return (time.perf_counter() - _EPOCH) * 1e6


# (path, rank) -> (events, lock) that every Timeline writing that file appends to: one file, so
# a second model wrapped in the process (or a model wrapped again) adds to the trace, where a
# Timeline of its own would never be flushed (one exit flush per file) and its events were lost.
_shared: dict[tuple[str, int], tuple[list, threading.Lock]] = {}


class Timeline:
    def __init__(self, path: str | None, rank: int):
        self.path = path
        self.rank = rank
        self.events: list[dict] = []
        self._lock = threading.Lock()
        if path:
            self.events, self._lock = _shared.setdefault((path, rank), (self.events, self._lock))
            at_exit(f"flush timeline {path} rank {rank}", self.flush)  # fusedist/_process_hooks.py

    @classmethod
    def from_env(cls, rank: int) -> "Timeline":
        path = os.environ.get("FUSEDIST_TIMELINE") or None
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            # Refused now: the trace is written at exit, where the error would come after the run.
            raise ValueError(f"FUSEDIST_TIMELINE={path!r}: the directory {os.path.dirname(os.path.abspath(path))!r} "
                             "does not exist (the value is a path prefix: <path>.rank<R>.json is written)")
        return cls(path, rank)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def instant(self, name: str, cat: str = "fusedist", **args) -> None:
        if self.path:
            self._add({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": now_us(), "args": args})

    def span(self, name: str, start_us: float, end_us: float, cat: str = "fusedist", tid: int = 1, **args) -> None:
        if self.path:
            self._add({"name": name, "cat": cat, "ph": "X", "ts": start_us, "dur": max(end_us - start_us, 0.0),
                       "tid": tid, "args": args})

    def _add(self, event: dict) -> None:
        event.setdefault("pid", self.rank)
        event.setdefault("tid", 0)
        with self._lock:
            self.events.append(event)

    def flush(self) -> None:
        if not self.path:
            return
        with self._lock:
            events = list(self.events)
        target = f"{self.path}.rank{self.rank}.json"
        tmp = target + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, target)
