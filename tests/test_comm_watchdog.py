"""The collective watchdog (Note [stream-ordered waits and the watchdog] in
fusedist/comm/watchdog.py), on stand-in done events: deadlines from launch, in-order
completion, a launch that blocks, asynchronous errors, the failure handler (called once), waiting
for pending collectives at exit, and the thread's lifecycle.
The direct-NCCL communicator's use of it is exercised on a GPU (tests/test_cuda_ext_gpu.py,
tests/test_nccl_multirank_gpu.py)."""

import functools
import threading
import time

import pytest

from fusedist.comm.base import CollectiveError, CommHandle, Communicator
from fusedist.comm.watchdog import CollectiveWatchdog
from script_runs import run_at_once


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


def test_nccl_waits_tighten_the_watchdogs_deadline_only_when_they_move_it(monkeypatch, no_thread):
    """The direct-NCCL communicator's waits, over stand-ins for the extension's stream and communicator:
    a wait without a timeout, or with one longer than what is left of the deadline, leaves the watchdog
    alone; a shorter one tightens its collective's deadline, once. Before, nearly every wait called
    ``tighten`` (it is handed what is left of the deadline, which is shorter than the communicator's
    timeout), to move nothing."""
    import datetime
    import types

    import torch

    from fusedist.comm import nccl_comm

    class Stream:  # the comm stream: orders the waiting stream after the collective's done event
        def make_wait(self, consumer, done):
            pass

    class StandIn:  # the extension's NcclComm, as far as a non-blocking wait uses it
        aborted = False

        def check_async_error(self, what):
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    comm = object.__new__(nccl_comm.NcclCommunicator)
    Communicator.__init__(comm, 0, 2, timeout=datetime.timedelta(seconds=60))
    comm._comm, comm._stream, comm._device, comm.blocking_wait = StandIn(), Stream(), 0, False
    comm.on_watchdog_failure, comm._failure_raised, comm.closed = "raise", False, False
    comm.watchdog = dog = CollectiveWatchdog(lambda reason, failed: None, lambda: None, name="t")
    tightened = []
    tighten = dog.tighten
    monkeypatch.setattr(dog, "tighten", lambda entry, seconds: tightened.append(entry.seq) or tighten(entry, seconds))

    def wait(seq, timeout=None):
        watched = dog.begin("all_reduce", f"bucket {seq}", seq, comm.timeout.total_seconds())
        dog.launched(watched, FakeEvent())
        work = nccl_comm._Work(watched.done, "all_reduce", (), watched)
        CommHandle(comm, work, op="all_reduce", tag=f"bucket {seq}", seq=seq, timeout=comm.timeout).wait(timeout)
        return watched

    launched = [wait(seq, timeout) for seq, timeout in enumerate((None, None, 120.0, 60.0, 0))]
    assert tightened == [] and all(w.timeout_s == 60.0 for w in launched), tightened
    shortened = wait(5, datetime.timedelta(seconds=2))
    assert tightened == [5] and shortened.timeout_s == 2.0, tightened
    assert shortened.deadline - time.monotonic() <= 2.0


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

def prefixed(*exc_info):  # as torch.distributed's hook prefixes each line with the rank
    import traceback
    text = "".join(traceback.format_exception(*exc_info))
    sys.stderr.write("".join(f"[hooked]: {line}\n" for line in text.splitlines()))

sys.excepthook = prefixed
mode, where = sys.argv[1], sys.argv[2]
comm = object.__new__(NcclCommunicator)
Communicator.__init__(comm, 0, 2)
comm._comm, comm.blocking_wait, comm.on_watchdog_failure = StandIn(), False, mode
comm._failure_raised, comm.closed = False, False
comm.watchdog = CollectiveWatchdog(comm._watchdog_failed, comm._poll_async_error, name="t", interval_s=0.01)
comm.watchdog.launched(comm.watchdog.begin("all_reduce", "ddp bucket 0", 7, 0.2), Pending())
if where == "running":
    # the deadline (0.2 s) passes, the watchdog acts: exits (the loop does not end), or aborts
    give_up = time.monotonic() + 30
    while not (comm._comm.aborted and comm.watchdog.failure is not None) and time.monotonic() < give_up:
        time.sleep(0.01)
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


@functools.lru_cache(maxsize=None)
def _policy_runs() -> dict:
    """Every (mode, where) the tests below read, each in its own process, started at once
    (each process mostly imports torch, then waits for the watchdog): a finished
    ``subprocess.CompletedProcess`` by (mode, where)."""
    cases = [(mode, where) for mode in ("exit", "raise") for where in ("running", "exit")]
    return run_at_once({case: (_POLICY, *case) for case in cases})


def _policy(mode, where):
    return _policy_runs()[(mode, where)]


def test_nccl_watchdog_exit_policy_reports_and_exits_1_without_aborting():
    """No abort before the exit: the abort would release a host read blocked behind the
    collective, and it can block itself while the program runs on (Note [stream-ordered
    waits and the watchdog])."""
    out = _policy("exit", "running")
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "NOT REACHED" not in out.stdout and "ABORTED" not in out.stdout, out.stdout
    # Printed through sys.excepthook, as an uncaught exception: torch.distributed's hook adds
    # the rank to every line (here a stand-in hook adds "[hooked]").
    line = ("[hooked]: fusedist.comm.base.CollectiveError: fusedist: all_reduce (tag 'ddp bucket 0', "
            "collective #7) failed on rank 0 of 2: all_reduce [ddp bucket 0] (collective #7) did not complete "
            "within 0.2 s of its launch")
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


# ---- Note [a crashed peer, seen through the store]
def test_a_crashed_peer_fails_the_overdue_collective_and_is_asked_sparingly(no_thread):
    from fusedist.comm.watchdog import PEER_CHECK_AFTER_S, PEER_CHECK_EVERY_S

    asked = []
    answer = {"value": None}

    def crashed_peer():
        asked.append(clock.now)
        return answer["value"]

    dog, rec, clock = _watchdog(crashed_peer=crashed_peer)
    _launch(dog, tag="ddp bucket 3", seq=5, timeout_s=600.0)
    for _ in range(5):  # not overdue yet: the store is not asked
        clock.now += PEER_CHECK_AFTER_S / 10
        assert dog.poll() is None
    assert asked == []
    clock.now += PEER_CHECK_AFTER_S
    assert dog.poll() is None and len(asked) == 1
    for _ in range(3):  # polled every 0.1 s: asked at most once per PEER_CHECK_EVERY_S
        clock.now += PEER_CHECK_EVERY_S / 4
        dog.poll()
    assert len(asked) == 1
    clock.now += PEER_CHECK_EVERY_S
    answer["value"] = "rank 1 on host pid 7 crashed with ValueError: boom"
    reason = dog.poll()
    assert len(asked) == 2 and rec.failures == [reason] and rec.failed_seq == 5
    assert reason.startswith("all_reduce [ddp bucket 3] (collective #5) cannot complete: rank 1 on host pid 7 "
                             "crashed with ValueError: boom (seen through the store after"), reason


def test_no_peer_check_without_pending_collectives(no_thread):
    asked = []
    dog, rec, clock = _watchdog(crashed_peer=lambda: asked.append(1) or "crashed")
    _, event = _launch(dog)
    event.completed = True
    clock.now += 10.0
    assert dog.poll() is None and asked == [] and rec.failures == []


def test_crash_counter_and_survivor_entries_through_a_store():
    """The store side: one call while no peer crashed; the crashed peer named once it did; a
    crashed rank's wait for the survivors' entries ends when they are there, or at its bound."""
    import torch.distributed as dist

    from fusedist.reliability import stall_report

    class CountingStore:
        def __init__(self):
            self.store, self.calls = dist.HashStore(), 0

        def __getattr__(self, name):
            method = getattr(self.store, name)

            def call(*args):
                self.calls += 1
                return method(*args)
            return call

    store = CountingStore()
    assert stall_report.crashed_peer(store, "g", 0, rank=0, world_size=4) is None
    assert store.calls <= 2  # the timeout setting and one counter read
    stall_report.publish(store, "g", 0, 2, {"kind": "exit", "error": ""})
    assert stall_report.crashed_peer(store, "g", 0, rank=0, world_size=4) is None  # an exit is no crash
    stall_report.publish(store, "g", 0, 3, {"kind": "crash", "error": "ValueError: boom"})
    stall_report.count_crash(store, "g", 0)
    found = stall_report.crashed_peer(store, "g", 0, rank=0, world_size=4)
    assert found is not None and found.startswith("rank 3 on ") and found.endswith("crashed with ValueError: boom")
    assert stall_report.crashed_peer(store, "g", 0, rank=3, world_size=4) is None  # its own entry
    assert stall_report.crashed_peer(store, "g", 1, rank=0, world_size=4) is None  # another generation

    start = time.monotonic()
    assert not stall_report.await_entries(store, "g", 0, rank=3, world_size=4, window_s=0.3)  # rank 0, 1 silent
    assert 0.3 <= time.monotonic() - start < 3.0
    for r in (0, 1):
        stall_report.publish(store, "g", 0, r, {"kind": "failure", "error": "x"})
    start = time.monotonic()
    assert stall_report.await_entries(store, "g", 0, rank=3, world_size=4, window_s=30.0)
    assert time.monotonic() - start < 3.0


def test_a_crashed_rank_waits_for_the_survivors_only_where_they_poll_the_store(monkeypatch):
    """A crash entry bumps the counter the survivors poll; the crashed rank then stays until
    the survivors published (NCCL communicators: a watchdog asks the store), and not at all
    over gloo, where the survivors learn of the crash from the closed connections."""
    import datetime
    import gc
    import threading

    import torch.distributed as dist

    from fusedist.reliability import monitor as mon
    from fusedist.reliability import stall_report

    class Comm:  # a communicator, as far as the monitor uses it
        rank, world_size, observer = 1, 2, None
        timeout = datetime.timedelta(seconds=60)

    monkeypatch.setenv("FUSEDIST_STALL_REPORT_S", "0.5")
    comm = Comm()
    monitor = mon.CollectiveMonitor(comm)
    try:
        monitor.store = store = dist.HashStore()
        monitor.publish("crash", "ValueError: boom")
        assert "rank 1 on " in stall_report.crashed_peer(store, monitor.group_name, 0, rank=0, world_size=2)

        start = time.monotonic()
        assert monitor.survivor_wait_s() == 0 and not monitor.await_survivors()  # no watchdog: gloo
        assert time.monotonic() - start < 0.2

        comm.watchdog = object()
        assert monitor.survivor_wait_s() == 0.5 + 1.0 + 1.0 + 1.0  # window + the survivors' check cadence + 1 s
        start = time.monotonic()
        assert not monitor.await_survivors()  # nobody reports: the bound
        assert 3.4 <= time.monotonic() - start < 6.0

        monkeypatch.setattr(mon, "_crashed", False)  # publish_crash sets it for the process
        survivor = threading.Timer(0.3, stall_report.publish,
                                   (store, monitor.group_name, 0, 0, {"kind": "failure", "error": "x"}))
        survivor.start()
        start = time.monotonic()
        mon.publish_crash(ValueError("boom"))  # the survivor's entry: then the time to print its report
        took = time.monotonic() - start
        assert 0.3 + mon.SURVIVOR_PRINT_S <= took < 0.3 + mon.SURVIVOR_PRINT_S + 1.5, took
    finally:
        del monitor
        gc.collect()
