"""The shared launch of shared_rank_launch.py when a scenario fails on one rank only: the
other ranks' part ends promptly (not at the process group's timeout), only that scenario's
test fails, and the next scenarios run on a working group (Note [a scenario that fails on
some ranks] in scenario_agreement.py)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from scenario_agreement import AFTER_ABORT
from shared_rank_launch import launch_for_selected, results_of

# Long enough that waiting it out instead of being told would show in the timings below.
PG_TIMEOUT_S = 60.0
_STARTED: dict = {}  # this rank's start of the first scenario


def _fails_on_rank_1_while_rank_0_waits(rank, world):
    _STARTED["at"] = time.monotonic()
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(3))  # rank 1 never joins: without an abort, waits PG_TIMEOUT_S
    return "rank 0 finished a collective it had no partner for"


def _fails_on_rank_1_after_its_collectives(rank, world):
    dist.all_reduce(torch.ones(3))
    if rank == 1:
        raise ValueError("deliberate late failure on rank 1")
    return "passed"


def _sums_after_the_failures(rank, world):
    total = torch.full((4,), float(rank + 1))
    dist.all_reduce(total)
    subgroup = dist.new_group(list(range(world)))  # the recovered group also makes subgroups
    again = torch.ones(2)
    dist.all_reduce(again, group=subgroup)
    since_first = time.monotonic() - _STARTED["at"] if _STARTED else None  # (None: the failures were not selected)
    timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    return total.tolist(), again.tolist(), since_first, (dist.get_world_size(), timeout)


SCENARIOS = {
    "test_a_rank_waiting_for_a_failed_rank_is_released_at_once": {
        "early": (_fails_on_rank_1_while_rank_0_waits, ())},
    "test_a_failure_after_the_collectives_fails_only_that_rank": {
        "late": (_fails_on_rank_1_after_its_collectives, ())},
    "test_the_next_scenario_runs_on_a_working_group_promptly": {
        "after": (_sums_after_the_failures, ())},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, 2, timeout=150, pg_timeout=PG_TIMEOUT_S)


def test_a_rank_waiting_for_a_failed_rank_is_released_at_once(launched):
    (passed0, text0), (passed1, text1) = launched["early"]
    assert not passed1 and text1.startswith("rank 1:\n") and "deliberate failure on rank 1" in text1, text1
    # rank 0's collective was ended by rank 1's abort, and says whose failure that was
    assert not passed0 and text0.startswith(f"rank 0, {AFTER_ABORT} [1] failed"), text0
    with pytest.raises(AssertionError) as info:
        results_of(launched, "early")
    message = str(info.value)
    assert message.index("deliberate failure on rank 1") < message.index("rank 0,"), message


def test_a_failure_after_the_collectives_fails_only_that_rank(launched):
    (passed0, value0), (passed1, text1) = launched["late"]
    assert passed0 and value0 == "passed", value0
    assert not passed1 and "deliberate late failure on rank 1" in text1, text1


def test_the_next_scenario_runs_on_a_working_group_promptly(launched):
    for total, again, seconds, group in results_of(launched, "after"):
        # (the launch's world and timeout, whether the group is the first or a fresh one)
        assert (total, again, group) == ([3.0] * 4, [2.0] * 2, (2, PG_TIMEOUT_S))
        if seconds is not None:  # the failures ran before, in this launch
            assert seconds < PG_TIMEOUT_S / 3, f"{seconds:.1f} s since the first scenario started"
