"""The spawn harness (fusedist.testing.run_distributed) reports native crashes of a rank."""

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


def test_segfault_names_the_rank_and_prints_the_python_stack(capfd):
    with pytest.raises(DistributedRunError, match=r"rank 1 exited with code -11 without reporting") as info:
        run_distributed(_segfault_in_native_code, 2, backend=None, timeout=60)
    assert set(info.value.failures) == {1}
    err = capfd.readouterr().err
    assert "Segmentation fault" in err and "_segfault_in_native_code" in err, err[-2000:]


def test_crash_during_shutdown_after_answering_fails_the_run():
    with pytest.raises(DistributedRunError, match=r"rank 0 returned its result, then exited with code -11") as info:
        run_distributed(_crash_while_exiting, 1, backend=None, timeout=60)
    assert set(info.value.failures) == {0}
