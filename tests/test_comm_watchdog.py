"""The collective watchdog (Note [stream-ordered waits and the watchdog] in
fusedist/comm/watchdog.py), on stand-in done events: deadlines from launch, in-order
completion, a launch that blocks, asynchronous errors, the failure handler (called once), waiting
for pending collectives at exit, and the thread's lifecycle.
The direct-NCCL communicator's use of it is exercised on a GPU (tests/test_cuda_ext_gpu.py,
tests/test_nccl_multirank_gpu.py)."""

import threading
import time

import pytest

from fusedist.comm.base import CollectiveError, CommHandle, Communicator
from fusedist.comm.watchdog import CollectiveWatchdog


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakeEvent:
    """A done event: completes when told to; ``query()`` can also fail like a CUDA error."""

    def __init__(self):
        self.completed = False
        self.error = None
        self.queries = 0

    def query(self):
        self.queries += 1
        if self.error is not None:
            raise RuntimeError(self.error)
        return self.completed


class Recorder:
    def __init__(self):
        self.failures = []  # (reason, the failed collective's seq or None)
        self.async_error = None

    def fail(self, reason, failed):
        self.failures.append(reason)
        self.failed_seq = None if failed is None else failed.seq

    def poll_error(self):
        if self.async_error is not None:
            raise RuntimeError(self.async_error)


def _watchdog(**kw):
    rec = Recorder()
    clock = FakeClock()
    dog = CollectiveWatchdog(rec.fail, rec.poll_error, name="test", clock=clock, **kw)
    return dog, rec, clock


def _launch(dog, op="all_reduce", tag="bucket 0", seq=0, timeout_s=10.0):
    entry = dog.begin(op, tag, seq, timeout_s)
    event = FakeEvent()
    dog.launched(entry, event)
    return entry, event


@pytest.fixture
def no_thread(monkeypatch):
    """Drive poll() by hand: the thread would race the fake clock."""
    monkeypatch.setattr(CollectiveWatchdog, "_ensure_thread", lambda self: None)


def test_completed_collectives_are_dropped_in_launch_order(no_thread):
    dog, rec, clock = _watchdog()
    (_, first), (_, second) = _launch(dog, seq=0), _launch(dog, seq=1)
    second.completed = True  # a later one cannot have finished first on one stream; stay conservative
    assert dog.poll() is None and dog.pending == 2
    first.completed = True
    assert dog.poll() is None and dog.pending == 0
    clock.now += 1000  # nothing pending: no deadline can pass
    assert dog.poll() is None and rec.failures == []


def test_deadline_from_launch_aborts_and_names_the_collective(no_thread):
    dog, rec, clock = _watchdog()
    _launch(dog, seq=0, timeout_s=10.0)[1].completed = True
    _launch(dog, tag="bucket 3", seq=1, timeout_s=10.0)
    clock.now += 9.9
    assert dog.poll() is None and rec.failures == []
    clock.now += 0.2
    reason = dog.poll()
    assert reason is not None and rec.failures == [reason]
    for needle in ("all_reduce [bucket 3] (collective #1)", "did not complete within 10 s of its launch"):
        assert needle in reason, reason
    assert dog.failed.seq == 1 and dog.failed.tag == "bucket 3"
    assert dog.pending == 0
    clock.now += 100
    assert dog.poll() == reason and len(rec.failures) == 1  # aborted once, failure kept


def test_a_launch_that_blocks_is_watched_before_it_returns(no_thread):
    """NCCL connects lazily inside the first launch of an algorithm; a peer that never comes
    blocks the launch call itself, before any done event exists."""
    dog, rec, clock = _watchdog()
    dog.begin("reduce_scatter", "zero bucket 0", 4, 5.0)  # launch call not returned yet
    clock.now += 5.0
    reason = dog.poll()
    assert "reduce_scatter [zero bucket 0] (collective #4) did not complete within 5 s" in reason
    assert rec.failures == [reason]


def test_cancelled_launch_is_not_watched(no_thread):
    dog, rec, clock = _watchdog()
    entry = dog.begin("all_gather", "", 0, 1.0)
    dog.cancel(entry)
    clock.now += 10
    assert dog.poll() is None and dog.pending == 0 and rec.failures == []


def test_tightened_deadline_fires_first(no_thread):
    dog, rec, clock = _watchdog()
    _launch(dog, seq=0, timeout_s=600.0)
    entry, _ = _launch(dog, seq=1, timeout_s=600.0)
    dog.tighten(entry, 2.0)
    dog.tighten(entry, 50.0)  # never loosens
    clock.now += 2.0
    reason = dog.poll()
    assert reason is not None and "(collective #1) did not complete within 2 s" in reason


def test_async_error_and_failed_event_abort(no_thread):
    dog, rec, _ = _watchdog()
    _launch(dog, seq=7)
    rec.async_error = "asynchronous NCCL error: remote process exited (code 6)"
    reason = dog.poll()
    assert reason == rec.async_error and rec.failures == [reason] and dog.failed.seq == 7

    dog, rec, _ = _watchdog()
    _, event = _launch(dog, seq=2)
    event.error = "CUDA error: an illegal memory access was encountered"
    assert dog.poll() == event.error and rec.failures == [event.error]


def test_thread_enforces_the_deadline_and_then_stops():
    rec = Recorder()
    dog = CollectiveWatchdog(rec.fail, rec.poll_error, name="t1", interval_s=0.01)
    start = time.monotonic()
    _launch(dog, seq=3, timeout_s=0.2)
    # The thread sets dog.failure before it calls the handler and returns: wait for the
    # handler's record and then for the thread's end (bounded, not a fixed sleep that a
    # thread descheduled on a loaded machine can outlast).
    while not rec.failures and time.monotonic() - start < 10:
        time.sleep(0.01)
    took = time.monotonic() - start
    assert dog.failure is not None and 0.19 <= took < 5, took
    assert len(rec.failures) == 1
    while any(t.name == "fusedist-watchdog-t1" for t in threading.enumerate()) and time.monotonic() - start < 10:
        time.sleep(0.01)
    assert not any(t.name == "fusedist-watchdog-t1" for t in threading.enumerate())
    assert len(rec.failures) == 1  # handled once


def test_thread_sleeps_when_idle_and_restarts_after_stop():
    rec = Recorder()
    dog = CollectiveWatchdog(rec.fail, rec.poll_error, name="t2", interval_s=0.01)
    _, event = _launch(dog, timeout_s=30)
    time.sleep(0.05)
    event.completed = True
    deadline = time.monotonic() + 5
    while dog.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.pending == 0
    idle = event.queries
    time.sleep(0.1)
    assert event.queries == idle  # nothing pending: no polling
    dog.stop(join_timeout=5)
    assert not any(t.name == "fusedist-watchdog-t2" for t in threading.enumerate())
    _launch(dog, timeout_s=0.05)
    deadline = time.monotonic() + 5
    while dog.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.failure is not None  # the thread came back with the next launch
    assert sum(t.name == "fusedist-watchdog-t2" for t in threading.enumerate()) <= 1


def test_repeated_stop_and_begin_leave_one_thread():
    rec = Recorder()
    dog = CollectiveWatchdog(rec.fail, rec.poll_error, name="t3", interval_s=0.005)
    for _ in range(20):
        _launch(dog, timeout_s=60)[1].completed = True
        dog.stop()
    _launch(dog, timeout_s=60)
    time.sleep(0.1)
    assert sum(t.name == "fusedist-watchdog-t3" for t in threading.enumerate()) == 1
    dog.stop(join_timeout=5)
    time.sleep(0.05)
    assert sum(t.name == "fusedist-watchdog-t3" for t in threading.enumerate()) == 0


def test_settle_waits_for_pending_collectives_and_handles_a_failure():
    rec = Recorder()
    dog = CollectiveWatchdog(rec.fail, rec.poll_error, name="t4", interval_s=0.01)
    _, event = _launch(dog, timeout_s=30)
    threading.Timer(0.1, lambda: setattr(event, "completed", True)).start()
    assert dog.settle(10) and dog.pending == 0 and rec.failures == []  # completed in time
    _launch(dog, seq=5, timeout_s=60)
    start = time.monotonic()
    assert not dog.settle(0.2) and dog.pending == 1  # still in flight, deadline far away
    assert 0.2 <= time.monotonic() - start < 5
    dog.stop(join_timeout=5)
    _launch(dog, seq=6, timeout_s=0.1)  # (restarts the thread; settle polls too)
    assert dog.settle(10) and len(rec.failures) == 1 and rec.failed_seq == 6  # the one past its deadline
    dog.stop(join_timeout=5)


# ---- the communicator side: an earlier collective's failure, found at a later launch, is
# reported as that collective's (error and stall report), not the launch's.
class _FailedEarlier(Communicator):
    name = "fake"

    def __init__(self):
        super().__init__(rank=1, world_size=2)
        self.failures = []

    def _all_reduce(self, tensor, op):
        raise CollectiveError("fusedist: all_reduce [bucket 3] (collective #5) failed on rank 1 of 2: "
                              "did not complete within 1 s of its launch", op="all_reduce", tag="bucket 3",
                              rank=1, seq=5)

    _reduce_scatter = _all_gather = _broadcast = _all_reduce

    def _wait_work(self, work, timeout):
        pass

    def _on_failure(self, handle: CommHandle, error):
        self.failures.append((handle.op, handle.tag, handle.seq))
        return None


def test_launch_after_a_watchdog_failure_names_the_failed_collective():
    import torch

    comm = _FailedEarlier()
    with pytest.raises(CollectiveError) as info:
        comm.all_reduce(torch.zeros(4), tag="bucket 0")
    assert (info.value.op, info.value.tag, info.value.seq) == ("all_reduce", "bucket 3", 5)
    assert comm.failures == [("all_reduce", "bucket 3", 5)]


# ---- the direct-NCCL communicator's failure policy, on a stand-in for the extension's
# communicator (the policy is Python; the GPU tier runs it on NCCL). In a subprocess: the
# default policy ends the process.
_POLICY = r'''
import sys, time
from fusedist.comm.base import Communicator
from fusedist.comm.nccl_comm import NcclCommunicator
from fusedist.comm.watchdog import CollectiveWatchdog

class StandIn:  # the extension's NcclComm, as far as the policy uses it
    aborted = False
    def abort(self, reason):
        self.aborted = True
        print("ABORTED", flush=True)
        time.sleep(1.0)  # ncclCommAbort can block (it frees device memory behind queued work)
        print("ABORT RETURNED", flush=True)
    def check_async_error(self, what):
        pass

class Pending:
    def query(self):
        return False

mode, where = sys.argv[1], sys.argv[2]
comm = object.__new__(NcclCommunicator)
Communicator.__init__(comm, 0, 2)
comm._comm, comm.blocking_wait, comm.on_watchdog_failure = StandIn(), False, mode
comm._failure_raised, comm.closed = False, False
comm.watchdog = CollectiveWatchdog(comm._watchdog_failed, comm._poll_async_error, name="t", interval_s=0.01)
comm.watchdog.launched(comm.watchdog.begin("all_reduce", "ddp bucket 0", 7, 0.2), Pending())
if where == "running":
    time.sleep(5)
    try:
        comm.raise_if_failed("the step check")
    except Exception as exc:
        print("RAISED", type(exc).__name__, exc.tag, exc.seq, flush=True)
        sys.exit(0)
    print("NOT REACHED", flush=True)
else:  # the program ends while the collective hangs
    print("PROGRAM DONE", flush=True)
    comm.settle_at_exit(10.0)
    print("NOT REACHED", flush=True)
'''


def _policy(mode, where):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", _POLICY, mode, where], capture_output=True, text=True,
                          timeout=120)


def test_nccl_watchdog_exit_policy_reports_and_exits_1_without_aborting():
    """No abort before the exit: the abort would release a host read blocked behind the
    collective, and it can block itself while the program runs on (Note [stream-ordered
    waits and the watchdog])."""
    out = _policy("exit", "running")
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "NOT REACHED" not in out.stdout and "ABORTED" not in out.stdout, out.stdout
    line = ("fusedist.comm.base.CollectiveError: fusedist: all_reduce (tag 'ddp bucket 0', collective #7) "
            "failed on rank 0 of 2: all_reduce [ddp bucket 0] (collective #7) did not complete within 0.2 s "
            "of its launch")
    assert line in out.stderr, out.stderr


def test_nccl_watchdog_raise_policy_aborts_and_the_program_gets_the_error():
    out = _policy("raise", "running")
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert "ABORTED" in out.stdout and "RAISED CollectiveError ddp bucket 0 7" in out.stdout, out.stdout


def test_nccl_failure_in_the_last_collectives_is_reported_at_exit():
    for mode in ("exit", "raise"):
        out = _policy(mode, "exit")
        assert out.returncode == 1, (mode, out.returncode, out.stdout, out.stderr)
        assert "PROGRAM DONE" in out.stdout and "NOT REACHED" not in out.stdout, (mode, out.stdout)
        assert "collective #7) did not complete within 0.2 s" in out.stderr, (mode, out.stderr)
