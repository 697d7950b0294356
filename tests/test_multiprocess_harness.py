"""The multi-process harness (fusedist.testing.run_distributed) reports native crashes of a rank,
also one during its exit (forked ranks run the exit handlers themselves), and frees a rank's
destroyed group before its exit, collecting only where a reference cycle still holds it."""

import atexit
import ctypes
import os
import signal

import pytest

from fusedist.testing import run_distributed
from fusedist.testing.multiprocess import DistributedRunError


def _segfault_in_native_code(rank, world_size):
    if rank == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV inside a C call
    return rank


def _crash_while_exiting(rank, world_size):
    atexit.register(os.kill, os.getpid(), signal.SIGSEGV)
    return rank


def test_segfault_names_the_rank_and_prints_the_python_stack(capfd, monkeypatch):
    # capfd replaces this process's stderr for this test only; spawned ranks inherit it,
    # forked ones keep the fork server's (Note [ranks forked from a server that imported
    # torch] in fusedist/testing/multiprocess.py).
    monkeypatch.setenv("FUSEDIST_TEST_START", "spawn")
    with pytest.raises(DistributedRunError,
                       match=r"rank 1 was killed by SIGSEGV \(exit code -11\) without reporting") as info:
        run_distributed(_segfault_in_native_code, 2, backend=None, timeout=60)
    assert set(info.value.failures) == {1}
    err = capfd.readouterr().err
    assert "Segmentation fault" in err and "_segfault_in_native_code" in err, err[-2000:]


def _abort_like_a_corrupt_heap(rank, world_size):
    if rank == 1:
        os.abort()  # SIGABRT, as glibc's heap checks raise it
    return rank


def test_a_forked_rank_killed_by_a_signal_has_its_stack_in_the_report():
    # Forked ranks' stderr is the fork server's (a stale capture under pytest): the stack must
    # come back in the report itself (Note [a crashed rank's last words]).
    with pytest.raises(DistributedRunError, match=r"rank 1 was killed by SIGABRT") as info:
        run_distributed(_abort_like_a_corrupt_heap, 2, backend=None, timeout=60)
    report = info.value.failures[1]
    assert "Fatal Python error: Aborted" in report and "_abort_like_a_corrupt_heap" in report, report


def test_crash_during_shutdown_after_answering_fails_the_run():
    with pytest.raises(DistributedRunError,
                       match=r"rank 0 returned its result, then was killed by SIGSEGV \(exit code -11\)") as info:
        run_distributed(_crash_while_exiting, 1, backend=None, timeout=60)
    assert set(info.value.failures) == {0}


def _env_value(rank, world_size, name):
    return os.environ.get(name), "fusedist.ddp" in __import__("sys").modules


def test_ranks_see_the_callers_current_environment(monkeypatch):
    """Forked ranks take the caller's environment as it is at the call, not the fork server's
    (Note [ranks forked from a server that imported torch]); without a GPU they start with
    fusedist's packages imported by the server (as a script that imports fusedist at its top),
    with one only with torch, as spawned ranks do."""
    import torch

    preloaded = not torch.cuda.is_available()
    run_distributed(_env_value, 1, "FUSEDIST_HARNESS_PROBE", backend=None)  # the server exists now
    monkeypatch.setenv("FUSEDIST_HARNESS_PROBE", "set after the server started")
    assert run_distributed(_env_value, 2, "FUSEDIST_HARNESS_PROBE", backend=None) == \
        [("set after the server started", preloaded)] * 2
    monkeypatch.delenv("FUSEDIST_HARNESS_PROBE")
    assert run_distributed(_env_value, 1, "FUSEDIST_HARNESS_PROBE", backend=None) == [(None, preloaded)]
    monkeypatch.setenv("FUSEDIST_TEST_START", "spawn")  # a fresh interpreter: nothing preloaded
    assert run_distributed(_env_value, 1, "FUSEDIST_HARNESS_PROBE", backend=None) == [(None, False)]


class _Cycle:
    """An object that refers to itself: only the cycle collector frees it, and what it holds."""

    def __init__(self, held):
        self.me, self.held = self, held


def test_a_rank_exit_collects_only_where_a_cycle_still_holds_the_group():
    """Note [a collection only for a group still held]: a destroyed group that a reference cycle holds is
    freed before the rank's interpreter shuts down, by one full collection; where nothing holds it, the
    release runs none (each costs a spawned rank 0.1-0.4 s)."""
    import gc
    import sys
    import weakref

    import torch.distributed as dist

    from fusedist.testing.multiprocess import _release_process_group

    assert not dist.is_initialized(), "this test makes and destroys this process's default group"
    if "fusedist.comm" in sys.modules:  # (nothing cached from earlier tests: its collection is not counted)
        sys.modules["fusedist.comm"].release_destroyed_groups()
    full = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(info)

    def release(held_by_a_cycle):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        group = weakref.ref(dist.group.WORLD)
        if held_by_a_cycle:
            _Cycle(dist.group.WORLD)
        del full[:]
        _release_process_group()
        return len(full), group() is None

    gc.disable()  # (no collection of its own meanwhile)
    gc.freeze()  # (as a forked rank's heap: the collection scans only what the test made)
    gc.callbacks.append(count)
    try:
        assert release(held_by_a_cycle=False) == (0, True)
        assert release(held_by_a_cycle=True) == (1, True)
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()
