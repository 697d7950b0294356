"""What each thread of a hung rank was doing in the kernel, read from ``/proc`` by the harness.

Note [a hung rank's threads]
    A hung rank's Python stacks (Note [a hung rank's stacks] in multiprocess.py) show where its
    Python threads were, not gloo's own threads (its event loop, its collective workers), which
    run no Python, nor whether the rank was blocked or still computing: a rank held up by a
    loaded machine and one blocked for good print the same stack. So before it asks for the
    stacks the harness reads every thread of the hung rank from ``/proc`` -- its name, its state
    (running, sleeping), the kernel function it sleeps in (``futex_do_wait``: a lock, a condition
    or the GIL; ``do_epoll_wait``: gloo's event loop; ``poll_schedule_timeout``: a pipe or socket) and
    its CPU time -- and again after the stacks' wait, so the report says which threads used the
    CPU meanwhile, next to the machine's load average. Nothing runs in the rank for it, and a
    run that passes never reads anything. Where ``/proc`` is missing (not Linux) there is nothing
    to say."""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["ThreadState", "thread_states", "describe_threads"]

#: kernel states as ``/proc/<pid>/task/<tid>/stat`` writes them
_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "traced",
           "Z": "zombie", "X": "dead", "I": "idle"}


class ThreadState:
    """One thread of a process at one moment: ``tid``, ``name``, ``state`` (one letter),
    ``wchan`` (the kernel function it sleeps in, '' when running or unknown), ``cpu_s``."""

    __slots__ = ("tid", "name", "state", "wchan", "cpu_s")

    def __init__(self, tid: int, name: str, state: str, wchan: str, cpu_s: float):
        self.tid, self.name, self.state, self.wchan, self.cpu_s = tid, name, state, wchan, cpu_s


def _read(path: str) -> Optional[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError):
        return 100


def thread_states(pid: int) -> dict:
    """``tid -> ThreadState`` of every thread of process ``pid`` now ({} when it has ended or
    there is no ``/proc``)."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except (OSError, ValueError):
        return {}
    ticks = _ticks_per_second()
    out = {}
    for tid in tids:
        stat = _read(f"/proc/{pid}/task/{tid}/stat")
        if stat is None or ")" not in stat:
            continue  # (it ended meanwhile)
        # "tid (name) state ppid ... utime stime ...": the name may hold spaces and parentheses
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        try:
            state, cpu_s = fields[0], (int(fields[11]) + int(fields[12])) / ticks
        except (IndexError, ValueError):
            continue
        wchan = (_read(f"/proc/{pid}/task/{tid}/wchan") or "").strip()
        out[tid] = ThreadState(tid, name, state, "" if wchan in ("0", "") else wchan, cpu_s)
    return out


def describe_threads(before: dict, after: dict, waited_s: float) -> str:
    """The lines of Note [a hung rank's threads]: each thread of ``after`` (a later
    :func:`thread_states` than ``before``, ``waited_s`` seconds apart) with its state, where it
    sleeps, its CPU time and what it used in between; '' when ``after`` is empty."""
    if not after:
        return ""
    load = (_read("/proc/loadavg") or "").split()[:3]
    lines = [f"its threads (from /proc; load average {' '.join(load) or 'unknown'}, {os.cpu_count()} cores):"]
    for tid, now in after.items():
        was = before.get(tid)
        used = f" (+{now.cpu_s - was.cpu_s:.2f} s in the last {waited_s:g} s)" if was is not None else " (new)"
        where = f" in {now.wchan}" if now.wchan and now.state != "R" else ""
        lines.append(f"  thread {tid} '{now.name}': {_STATES.get(now.state, now.state)}{where}, "
                     f"{now.cpu_s:.2f} s of CPU{used}")
    return "\n".join(lines)
