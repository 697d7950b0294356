"""run_distributed refuses arguments that would run nothing or fail inside the harness, naming them, before any
rank starts; a result that cannot be pickled back is named with the rank, the function and the type."""

from __future__ import annotations

import math

import pytest

from fusedist.testing import run_distributed


def _never_started(rank, world):
    raise AssertionError("a rank started under refused arguments")


@pytest.mark.parametrize("kwargs, error, words", [
    ({"world_size": 0}, ValueError, r"run_distributed\(world_size=0\): at least one rank is needed"),
    ({"world_size": -1}, ValueError, r"run_distributed\(world_size=-1\): at least one rank is needed"),
    ({"world_size": 2.0}, TypeError, r"run_distributed\(world_size=2.0\): the number of ranks is a whole number"),
    ({"world_size": True}, TypeError, r"run_distributed\(world_size=True\)"),
    ({"timeout": math.nan}, ValueError, r"run_distributed\(timeout=nan\): give a finite number of seconds > 0"),
    ({"timeout": -1}, ValueError, r"run_distributed\(timeout=-1\)"),
    ({"timeout": math.inf}, ValueError, r"run_distributed\(timeout=inf\)"),
    ({"pg_timeout": 0}, ValueError, r"run_distributed\(pg_timeout=0\): give a finite number of seconds > 0"),
    ({"pg_timeout": math.nan}, ValueError, r"run_distributed\(pg_timeout=nan\)"),
])
def test_arguments_that_would_run_nothing_or_fail_inside_are_refused_first(kwargs, error, words):
    # world_size=0 and -1 returned [] (every test over them passed having run nothing); timeout=nan failed in the
    # harness's wait after starting the ranks; timeout=-1 killed both as "did not finish within -1 s";
    # pg_timeout=nan failed every rank inside timedelta
    world = kwargs.pop("world_size", 2)
    with pytest.raises(error, match=words):
        run_distributed(_never_started, world, **kwargs)


def _returns_a_local_function(rank, world):
    return lambda: rank


def test_a_world_of_one_runs_and_an_unpicklable_result_names_the_rank_and_its_type():
    # torch.multiprocessing.spawn's worker fails the same way, with only "Can't pickle local object"
    [(status, text)] = run_distributed(_returns_a_local_function, 1, expect_failure=True)
    assert status == "error"
    assert ("rank 0: _returns_a_local_function returned a function that cannot be pickled back to the caller "
            "(Can't pickle local object") in text, text


def _rank0_exits_before_a_collective(rank, world):
    import sys

    import torch
    import torch.distributed as dist

    if rank == 0:
        sys.exit(0)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def test_a_peer_failing_after_a_clean_sys_exit_names_the_rank_that_ended():
    # as under torchrun, rank 1's collective fails once rank 0 has gone ("Connection closed by peer"); its report
    # read only that, now it names the rank that had ended and how
    out = run_distributed(_rank0_exits_before_a_collective, 2, pg_timeout=20, expect_failure=True)
    assert out[0] == ("ok", None)
    assert out[1][0] == "error" and "rank(s) [0] had ended with sys.exit(0), result None" in out[1][1], out[1]
