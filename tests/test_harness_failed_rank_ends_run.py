"""Once a rank has failed, ``run_distributed`` gives the others the process group's timeout and
``grace_after_failure`` (10 s by default) more, then kills them and says so (Note [a failed rank
ends the run] in fusedist/testing/multiprocess.py), as torchrun's agent ends a job's workers once
one failed: a survivor stuck on its dead peer no longer holds the run to its whole ``timeout``.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from fusedist.testing import DistributedRunError, run_distributed

PG_TIMEOUT = 1.0
GRACE = 1.0  # (the default 10 s is room for a survivor's own report; this one never reports)
TIMEOUT = 90.0


def _peer_dies_survivor_stuck(rank, world_size):
    dist.barrier()  # (both past the group's set-up)
    if rank == 1:
        os._exit(3)
    time.sleep(3 * TIMEOUT)  # stuck on the dead peer in a wait that has no timeout of its own
    return rank


def test_a_survivor_stuck_after_a_peer_died_is_killed_after_the_groups_timeout_and_named():
    # Both modes at once, each launch waited for on its own thread (one wait, not two). The
    # bound is generous: the survivor has 2 s here (timeout and grace), the run's timeout 90 s.
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        lenient = pool.submit(run_distributed, _peer_dies_survivor_stuck, 2, timeout=TIMEOUT, pg_timeout=PG_TIMEOUT,
                              grace_after_failure=GRACE, expect_failure=True)
        strict = pool.submit(run_distributed, _peer_dies_survivor_stuck, 2, timeout=TIMEOUT, pg_timeout=PG_TIMEOUT,
                             grace_after_failure=GRACE)
        results = lenient.result()
        with pytest.raises(DistributedRunError, match=r"2 of 2 ranks failed; hung: \[0\]") as info:
            strict.result()
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT - 30, elapsed
    killed = ("rank 0 was still running 2 s after rank 1 failed (killed: a failed rank ends the run, as torchrun "
              "ends a job; the group's timeout was 1 s)")
    # (the killed rank's report goes on with where its threads were: Note [a hung rank's stacks])
    assert [status for status, _ in results] == ["error", "error"], results
    assert results[0][1].startswith(killed + "\nwhere its threads were when it was killed:\n"), results
    assert results[1][1] == "rank 1 exited with code 3 without reporting", results
    assert info.value.failures[0].startswith(killed + "\n"), info.value.failures
    assert info.value.failures[1] == results[1][1], info.value.failures


@pytest.mark.parametrize("grace", [-1.0, float("nan"), "5", None])
def test_a_grace_that_is_not_seconds_is_refused_before_any_rank_starts(grace):
    with pytest.raises(ValueError, match=rf"grace_after_failure={grace!r}\): give the seconds .* default 10.0"):
        run_distributed(_peer_dies_survivor_stuck, 2, grace_after_failure=grace)
