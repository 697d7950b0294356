"""The divergence probe on stream-ordered (direct-NCCL) waits, run by the collective watchdog
(Note [probing stream-ordered waits for divergence] in fusedist/comm/watchdog.py): no wait blocks
the host there, so the watchdog probes the oldest pending collective once it has been pending for
the observer's delay, and a verdict fails that collective at once instead of at its timeout.

On CPU with stand-ins for what NCCL provides (done events) and, first, for the probe itself (a fake
clock); then with the real probe (fusedist.reliability.divergence.WaitProbe) of two ranks sharing
a store, as two communicators' watchdogs in one process would use it. The reference behaviour is
the probe's on blocking gloo waits: the same verdict, about a second past the delay."""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from fusedist.comm.watchdog import CollectiveWatchdog
from fusedist.reliability.divergence import WaitProbe


class _Done:
    """A done event: ``query()`` says whether the collective completed."""

    def __init__(self):
        self.completed = False

    def query(self) -> bool:
        return self.completed


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Probe:
    """Answers ``verdicts`` in turn; records its checks and whether it was closed."""

    every_s = 0.25

    def __init__(self, verdicts):
        self.verdicts, self.checks, self.closed = list(verdicts), 0, False

    def check(self):
        self.checks += 1
        return self.verdicts.pop(0) if self.verdicts else None

    def close(self):
        self.closed = True


def _watchdog(probes: list, delay_s: float, clock: _Clock):
    """A watchdog whose observer hands out ``probes`` in turn once a collective is ``delay_s`` old;
    returns it, the failures it handled, and the (entry, pending seconds) of each probe handed out."""
    failures, asked = [], []

    def divergence_probe(entry, pending_s):
        if pending_s < delay_s:
            return None
        asked.append((entry, pending_s))
        return probes.pop(0)

    wd = CollectiveWatchdog(lambda reason, failed: failures.append((reason, failed)), lambda: None, name="test",
                            divergence_probe=divergence_probe, clock=clock)
    return wd, failures, asked


def _launch(wd, seq: int):
    entry = wd.begin("all_reduce", "grads", seq, 600.0)
    done = _Done()
    wd.launched(entry, done)
    return entry, done


def test_a_collective_pending_past_the_delay_is_probed_and_its_verdict_fails_it_long_before_the_timeout():
    clock = _Clock()
    probe = _Probe([None, "ranks [1] wait in a different collective"])
    wd, failures, asked = _watchdog([probe], delay_s=5.0, clock=clock)
    wd.stop()  # (polled by hand here)
    first, _ = _launch(wd, 7)
    _launch(wd, 8)  # (later collectives wait behind the oldest: only it is probed)
    clock.now += 4.9
    assert wd.poll() is None and not asked, "probed before the delay"
    clock.now += 0.2
    assert wd.poll() is None and probe.checks == 1 and asked[0][0] is first
    clock.now += 0.1
    assert wd.poll() is None and probe.checks == 1, "checked again before every_s"
    clock.now += 0.2
    reason = wd.poll()
    assert probe.checks == 2
    assert reason == ("all_reduce [grads] (collective #7) cannot complete on this rank: ranks [1] wait in a "
                      "different collective"), reason
    assert failures == [(reason, first)] and wd.failed is first and wd.failure == reason
    # (its entry stays for the peers' probes until the failure report replaces it)
    assert not probe.closed and wd.pending == 0
    wd.stop()
    assert not probe.closed


def test_a_probed_collective_that_completes_withdraws_its_probe_and_the_next_one_gets_its_own():
    clock = _Clock()
    probes = [_Probe([None]), _Probe([None])]
    first_probe, second_probe = probes
    wd, failures, asked = _watchdog(probes, delay_s=1.0, clock=clock)
    wd.stop()
    _, first_done = _launch(wd, 1)
    second, second_done = _launch(wd, 2)
    clock.now += 1.5
    assert wd.poll() is None and first_probe.checks == 1 and not first_probe.closed
    first_done.completed = True
    assert wd.poll() is None and first_probe.closed, "the completed collective's entry stayed published"
    # the second collective is as old as the first: probed at once, with its own probe
    assert asked[1][0] is second and second_probe.checks == 1
    second_done.completed = True
    assert wd.poll() is None and second_probe.closed and wd.pending == 0
    assert not failures
    wd.stop()


class _Monitor:
    """What WaitProbe reads of the reliability monitor (fusedist/reliability/monitor.py)."""

    def __init__(self, store, rank: int, delay_s: float):
        self.store, self.reports, self.check_announced, self.history = store, [], False, []
        self.group_name, self.generation, self.probe_delay_s = "default", 0, delay_s
        self.comm = type("Comm", (), dict(rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600)))()

    def context(self) -> dict:
        return {}

    def divergence_probe(self, entry, pending_s):
        """As a direct-NCCL communicator would hand the watchdog its observer's probe."""
        if pending_s < self.probe_delay_s:
            return None
        return WaitProbe(self, entry.op, entry.tag, entry.seq, self.probe_delay_s)


def test_two_ranks_watchdogs_stuck_in_collectives_that_cannot_pair_both_get_the_probes_verdict():
    store = dist.HashStore()
    delay = 0.2
    watchdogs, failures = [], {}
    for rank, seq in ((0, 5), (1, 6)):  # rank 1 issued one more collective than rank 0
        monitor = _Monitor(store, rank, delay)
        wd = CollectiveWatchdog(lambda reason, failed, rank=rank: failures.setdefault(rank, reason), lambda: None,
                                name=f"rank{rank}", divergence_probe=monitor.divergence_probe)
        wd.stop()
        _launch(wd, seq)
        watchdogs.append(wd)
    start = time.monotonic()
    while len(failures) < 2 and time.monotonic() - start < 10.0:
        for wd in watchdogs:
            wd.poll()
        time.sleep(0.02)
    took = time.monotonic() - start
    assert sorted(failures) == [0, 1], (failures, f"{took:.1f} s")
    for rank, seq in ((0, 5), (1, 6)):
        assert failures[rank].startswith(f"all_reduce [grads] (collective #{seq}) cannot complete on this rank: "
                                         "every rank of the group has been blocked in a collective for over 0.2 s"), \
            failures[rank]
        assert ("they wait in different collectives -- ranks [0] in all_reduce (collective #5); ranks [1] in "
                "all_reduce (collective #6)") in failures[rank], failures[rank]
    # (the delay, then the same evidence for a quarter second: seconds at most, never the 600 s timeout)
    assert took < 5.0, took


# ---- the direct-NCCL communicator's part: its observer's probe, handed to its watchdog. Built on
# CPU with stand-ins for what the construction reaches outside Python (the process group's exchange of
# the NCCL id, the extension's communicator and comm stream); the GPU tier runs it on NCCL.
class _StandInNccl:
    """The extension's NcclComm, as far as the communicator's watchdog policy uses it."""

    def __init__(self, *args):
        self.aborted_for = []

    @property
    def aborted(self) -> bool:
        return bool(self.aborted_for)

    def abort(self, reason):
        self.aborted_for.append(reason)

    def check_async_error(self, what):
        pass


class _StandInExtension:
    NcclComm = _StandInNccl

    @staticmethod
    def get_unique_id():
        return b"unique id"

    @staticmethod
    def nccl_version():
        return (2, 28, 9)

    @classmethod
    def require(cls, name):
        assert name == "_C", name
        return cls


class _TwoRanks:
    """What the construction asks of torch.distributed: rank 0 of 2, both ready."""

    @staticmethod
    def is_initialized():
        return True

    @staticmethod
    def get_rank(group=None):
        return 0

    @staticmethod
    def get_world_size(group=None):
        return 2

    @staticmethod
    def all_gather_object(gathered, obj, group=None):
        gathered[:] = [obj] * len(gathered)


class _Observer:
    """The reliability monitor's part: its delay, and the probe it hands out (recorded)."""

    def __init__(self, delay_s: float, verdicts=()):
        self.probe_delay_s, self.verdicts, self.asked = delay_s, verdicts, []

    def divergence_probe(self, op, tag, seq, part=None):
        self.asked.append((op, tag, seq))
        return _Probe(self.verdicts)


def _nccl_communicator(monkeypatch):
    from fusedist.comm import nccl_comm

    monkeypatch.delenv("FUSEDIST_COMM", raising=False)
    monkeypatch.delenv("FUSEDIST_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.setenv("FUSEDIST_NCCL_WATCHDOG", "raise")  # a failure aborts NCCL; the process goes on
    monkeypatch.setattr(nccl_comm, "local_problem", lambda: None)
    monkeypatch.setattr(nccl_comm, "dist", _TwoRanks)
    monkeypatch.setattr(nccl_comm, "_extension", _StandInExtension)
    monkeypatch.setattr(nccl_comm, "take_comm_stream", lambda C, device: ("comm stream", "torch stream"))
    return nccl_comm.NcclCommunicator(device=0)


def test_the_nccl_communicators_probe_is_its_observers_once_the_oldest_collective_is_past_the_delay(monkeypatch):
    from fusedist.comm.watchdog import WatchedCollective

    comm = _nccl_communicator(monkeypatch)
    entry = WatchedCollective("all_gather", "zero params", 12, 600.0, 700.0)
    assert comm.observer is None and comm._divergence_probe(entry, 1e6) is None  # unmonitored
    comm.observer = _Observer(delay_s=0.0)
    assert comm._divergence_probe(entry, 1e6) is None and not comm.observer.asked  # probing off
    comm.observer = observer = _Observer(delay_s=5.0)
    assert comm._divergence_probe(entry, 4.9) is None and not observer.asked
    probe = comm._divergence_probe(entry, 5.0)
    assert isinstance(probe, _Probe) and observer.asked == [("all_gather", "zero params", 12)]


def test_the_nccl_communicators_watchdog_probes_its_collectives_and_a_verdict_aborts_nccl(monkeypatch):
    comm = _nccl_communicator(monkeypatch)
    comm.observer = observer = _Observer(delay_s=0.05, verdicts=["ranks [1] wait in check_consistency()"])
    try:
        comm.watchdog.launched(comm.watchdog.begin("all_reduce", "ddp bucket 0", 7, 600.0), _Done())
        start = time.monotonic()
        while not comm._comm.aborted and time.monotonic() - start < 10.0:
            time.sleep(0.01)
        took = time.monotonic() - start
    finally:
        comm.watchdog.stop(join_timeout=5)
    assert observer.asked == [("all_reduce", "ddp bucket 0", 7)], observer.asked
    # (the probe's verdict, in the watchdog's thread, a fraction of a second past the delay: not the 600 s timeout)
    assert comm._comm.aborted_for == ["all_reduce [ddp bucket 0] (collective #7) cannot complete on this rank: "
                                      "ranks [1] wait in check_consistency()"], (comm._comm.aborted_for, took)
    assert comm.aborted and took < 5.0, took
