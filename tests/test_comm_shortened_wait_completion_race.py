"""A caller's ``wait(timeout)`` shorter than the collective's deadline that runs out just as its work completes
takes the work's own outcome (``CommHandle._outcome_once_completed`` in fusedist/comm/base.py, the race of Note
[a slice that runs out as the work completes] in sliced_wait.py): before, the wait's timeout was recorded as the
collective's failure, the handle dead on this rank alone, although the peers had completed it. Only on gloo,
whose waits leave a work running; the direct-NCCL communicator aborts at a wait's timeout, which stays the
failure."""

from __future__ import annotations

import datetime

import pytest

from fusedist.comm.base import CollectiveError, CommHandle, Communicator
from fusedist.comm.torch_comm import TorchCommunicator

SHORT = datetime.timedelta(seconds=1)


class _Work:
    """Completes as its first wait runs out (``timed_out``), or raises ``first`` there, as it completes; later
    waits raise ``error`` or return."""

    def __init__(self, error=None, first=None):
        self.done, self.waits, self.error, self.first = False, 0, error, first

    def is_completed(self):
        return self.done


class _Observer:
    probe_delay_s = 0.0  # (no probe: one call of _wait_work per wait)


class _Comm:
    """The parts of a communicator a handle's wait uses; the gloo predicates are TorchCommunicator's own."""
    rank, world_size, backend, observer = 0, 2, "gloo", _Observer()
    _sliced_waits = TorchCommunicator._sliced_waits
    _watched_waits = TorchCommunicator._watched_waits
    _wait_can_resume = TorchCommunicator._wait_can_resume

    def _group_while_in_flight(self):
        return None

    def _global_note(self, ranks):
        return ""

    def _on_failure(self, handle, error):
        return None

    def _ended_under_collective(self):
        return None

    def _transport_timeout(self, work):
        return None

    def _wait_work(self, work, timeout):
        work.waits += 1
        if work.waits == 1:  # the wait runs out, and the work completes right after
            work.done = True
            raise work.first or RuntimeError("Operation timed out!")
        if work.error is not None:
            raise work.error


class _NcclComm(_Comm):
    """The direct-NCCL communicator's answers (the base class's): a wait that runs out aborts the collective."""
    backend = "nccl"
    _sliced_waits = Communicator._sliced_waits
    _watched_waits = Communicator._watched_waits
    _wait_can_resume = Communicator._wait_can_resume


def _handle(comm, work):
    handle = CommHandle(comm, work, op="all_reduce", tag="ddp bucket 0", seq=3, timeout=datetime.timedelta(seconds=30))
    handle.async_op = True
    return handle


def test_a_shortened_wait_that_runs_out_as_the_work_completes_returns_its_result():
    work, ran = _Work(), []
    handle = _handle(_Comm(), work)
    handle.add_done_callback(lambda: ran.append("callback"))
    handle.wait(timeout=SHORT)  # (before: CollectiveError "timed out ... (the timeout of this wait, 1 s)")
    assert work.waits == 2 and ran == ["callback"] and handle.is_completed()
    handle.wait()  # (the handle is not dead)


def test_a_shortened_wait_that_runs_out_as_the_work_fails_raises_the_works_own_error():
    work = _Work(RuntimeError("Connection closed by peer [127.0.0.1]:4242"))
    handle = _handle(_Comm(), work)
    with pytest.raises(CollectiveError) as raised:
        handle.wait(timeout=SHORT)
    text = str(raised.value)
    assert "failed on rank 0 of 2: Connection closed by peer" in text, text
    assert "timeout of this wait" not in text, text
    with pytest.raises(CollectiveError, match="Connection closed by peer"):
        handle.wait()  # (the failure is recorded)


def test_a_shortened_wait_that_raised_the_works_own_error_does_not_wait_again():
    """A wait that raised the work's own error as it completed (a part mismatch) stands: a second wait of
    such a work may return as if it had succeeded."""
    work = _Work(first=RuntimeError("fusedist: the ranks' parts differ: rank 0: op max; rank 1: op sum"))
    handle = _handle(_Comm(), work)
    with pytest.raises(CollectiveError, match="parts differ"):
        handle.wait(timeout=SHORT)
    assert work.waits == 1


def test_on_the_direct_nccl_communicator_a_shortened_wait_that_runs_out_stays_the_failure():
    work = _Work()
    handle = _handle(_NcclComm(), work)
    with pytest.raises(CollectiveError, match=r"timed out .*\(the timeout of this wait, 1 s\)"):
        handle.wait(timeout=SHORT)
    assert work.waits == 1
