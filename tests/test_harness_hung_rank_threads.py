"""The harness reads a hung rank's threads from ``/proc`` before it kills the rank (Note [a hung
rank's threads] in fusedist/testing/thread_states.py): each thread's name, state, the kernel
function it sleeps in and the CPU it used while the stacks were written, so a rank blocked for good
reads differently from one a loaded machine held up. Checked on a plain process standing in for a
hung rank (no launch): a main thread asleep and a second thread blocked on a lock."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from fusedist.testing import multiprocess
from fusedist.testing.thread_states import describe_threads, thread_states

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")

# a process with two threads, both blocked, that ignores the harness's stack signal (a rank writes
# its stacks on it; this stand-in has nothing to write)
_STAND_IN = """
import signal, threading, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
lock = threading.Lock(); lock.acquire()
threading.Thread(target=lock.acquire, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def stand_in():
    proc = subprocess.Popen([sys.executable, "-c", _STAND_IN], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        _until_both_sleep(proc.pid)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _until_both_sleep(pid: int) -> None:
    """Wait (on a loaded machine, a while) until both threads of the stand-in sleep: it printed
    "ready" on its way to its sleep, still running."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = thread_states(pid)
        if len(states) == 2 and all(t.state == "S" for t in states.values()):
            return
        time.sleep(0.01)
    raise AssertionError(f"the stand-in's threads never both slept: {[(t.name, t.state) for t in states.values()]}")


def test_a_hung_ranks_threads_are_read_and_described_as_the_harness_reports_them(stand_in):
    reports = multiprocess._ask_for_stacks([stand_in])
    text = reports[stand_in.pid]
    lines = text.splitlines()
    assert re.fullmatch(r"its threads \(from /proc; load average [\d.]+ [\d.]+ [\d.]+, \d+ cores\):", lines[0]), text
    assert len(lines) == 1 + 2, text  # (the main thread and the one blocked on the lock)
    for line in lines[1:]:
        assert re.fullmatch(r"  thread \d+ '[^']+': sleeping( in \w+)?, [\d.]+ s of CPU "
                            r"\(\+[\d.]+ s in the last 0\.5 s\)", line), text
    assert f"thread {stand_in.pid} " in lines[1], text  # (the main thread's id is the process id)


def test_thread_states_parse_each_thread_and_a_process_gone_reads_as_nothing(stand_in):
    states = thread_states(stand_in.pid)
    assert sorted(states) == sorted(int(t) for t in os.listdir(f"/proc/{stand_in.pid}/task")), states
    main = states[stand_in.pid]
    assert main.state == "S" and main.cpu_s >= 0.0 and main.name, (main.state, main.cpu_s, main.name)
    # a thread that appeared between the two reads is marked so, and a process gone says nothing
    first = dict(states)
    del first[stand_in.pid]
    assert "(new)" in describe_threads(first, states, 0.5).splitlines()[1]
    stand_in.kill()
    stand_in.wait(timeout=10)
    assert thread_states(stand_in.pid) == {}
    assert describe_threads(states, {}, 0.5) == ""
