"""A probed wait whose slice runs out just as its work completes takes the work's own outcome
(Note [a slice that runs out as the work completes] in fusedist/comm/sliced_wait.py): before,
the slice's timeout was raised as the collective's failure on that rank alone."""

from __future__ import annotations

import datetime

import pytest

from fusedist.comm import sliced_wait


class _Work:
    def __init__(self, error=None):
        self.done, self.waits, self.error = False, 0, error

    def is_completed(self):
        return self.done


class _Probe:
    every_s = 0.001

    def check(self):
        return None

    def close(self):
        pass


class _Observer:
    probe_delay_s = 0.001

    def divergence_probe(self, *args):
        return _Probe()


class _Comm:
    """gloo's behaviour as TorchCommunicator has it: a work goes on after a slice ran out, unless completed."""
    observer = _Observer()

    def _sliced_waits(self, work, async_op):
        return True

    def _wait_can_resume(self, work):
        return not work.is_completed()

    def _wait_work(self, work, timeout):
        work.waits += 1
        if work.waits == 1:  # the slice runs out, and the work completes right after
            work.done = True
            raise TimeoutError("all_gather exchange did not complete within 0.001 s (still done)")
        if work.error is not None:
            raise work.error


class _Handle:
    op, tag, seq, part, async_op = "all_gather", "fully_shard gather blocks.0", 7, None, True

    def __init__(self, work):
        self._comm, self._work = _Comm(), work


def test_a_slice_that_runs_out_as_the_work_completes_returns_its_success():
    handle = _Handle(_Work())
    sliced_wait._wait_probed(handle, datetime.timedelta(seconds=30))
    assert handle._work.waits == 2  # (waited once more: its outcome, not the slice's timeout)


def test_a_slice_that_runs_out_as_the_work_fails_raises_the_works_own_error():
    handle = _Handle(_Work(RuntimeError("Connection closed by peer")))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        sliced_wait._wait_probed(handle, datetime.timedelta(seconds=30))


class _FailingComm(_Comm):
    """A work whose wait raises its own error once as it completes (a part mismatch found by its wait), and
    whose second wait would return as if it had succeeded."""

    def _wait_work(self, work, timeout):
        work.waits += 1
        if work.waits == 1:
            work.done = True
            raise RuntimeError("fusedist: the ranks' parts differ: rank 0: op max; rank 1: op sum")


def test_a_slice_that_raised_the_works_own_error_raises_it_and_does_not_wait_again():
    handle = _Handle(_Work())
    handle._comm = _FailingComm()
    with pytest.raises(RuntimeError, match="parts differ"):
        sliced_wait._wait_probed(handle, datetime.timedelta(seconds=30))
    assert handle._work.waits == 1
