"""A peer that aborts its process groups, or whose process ends, fails a rank's exchange at once.

* Rank 1 aborts its groups (``_abort_process_group()``, or one subgroup) while rank 0 waits in a fusedist all-reduce
  small enough for the exchange -- synchronous, ``async_op=True`` and waited for, and a DDP bucket in
  backward: rank 0 fails within seconds, naming rank 1 and its abort. Before, rank 0 waited out the
  group's timeout (30 s here): gloo's abort closes nothing, and fusedist's communicator kept rank 1's
  group, and its connections, alive (torch's own all-reduce failed at once: torch held no reference).
* Rank 1's process ends (``os._exit``) while rank 0 waits: rank 0 fails within seconds, naming rank 1
  and that its process may have ended.

One launch for all four (the synchronous one aborts a subgroup of its own; the others rebuild the default
group after each abort; the exit scenario is last): each breaks its group, which a shared launch's scenarios
must not do.
"""

import datetime
import os
import time

import pytest
import torch

from fusedist.testing import run_distributed

#: the process group's timeout: a survivor that waited it out took at least this long
GROUP_TIMEOUT_S = 30.0
#: how soon a survivor must fail (well under the group's timeout, room for a loaded machine)
PROMPT_S = 8.0
SCENARIOS = ("sync", "async", "ddp bucket", "process exit")


def _meet(store, name: str, rank: int, world: int) -> None:
    """Both ranks reach ``name`` (through the store: no collective that could pair with another)."""
    store.set(f"peer-abort/{name}/{rank}", b"")
    store.wait([f"peer-abort/{name}/{r}" for r in range(world)], datetime.timedelta(seconds=60))


def _fresh_group(store, index: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.PrefixStore(f"peer-abort/group/{index}/", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def _collective(scenario: str, group):
    """What rank 0 runs, rank 1 leaves; built on both ranks (as a program holds its communicator and model)."""
    import torch.distributed as dist

    from fusedist.comm import get_communicator

    if scenario == "ddp bucket":
        from fusedist.ddp import DistributedDataParallel

        model = DistributedDataParallel(torch.nn.Linear(4, 8))  # (40 gradients: one small bucket)
        loss = model(torch.ones(2, 4)).sum()

        def run():
            loss.backward()
            return model  # (held to the end: a DDP model dropped before backward does not reduce)
    else:
        comm = get_communicator(group if group is not None else dist.group.WORLD)
        x = torch.ones(32)
        comm.all_reduce(x)  # (one that pairs: the exchange is set up on both ranks)
        if scenario == "async":
            def run():
                comm.all_reduce(x, async_op=True).wait()
        else:
            def run():
                comm.all_reduce(x)
    return run


def _peer_abort(rank, world):
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    measured = {}
    for index, scenario in enumerate(SCENARIOS, start=1):
        # (the synchronous all-reduce on a group of its own, which alone is aborted: the default group goes on)
        group = dist.new_group([0, 1]) if scenario == "sync" else None
        run = _collective(scenario, group)
        _meet(store, f"{scenario}/ready", rank, world)
        if rank == 1:
            time.sleep(0.3)  # (rank 0 is waiting by then)
            if scenario == "process exit":
                os._exit(3)
            dist.distributed_c10d._abort_process_group(group)
            del run
            # stays alive (its communicator cached, its groups aborted) until rank 0 is done
            store.wait([f"peer-abort/{scenario}/done"], datetime.timedelta(seconds=120))
        else:
            start = time.monotonic()
            try:
                run()
                measured[scenario] = (time.monotonic() - start, "completed")
            except Exception as exc:  # noqa: BLE001 - the failure under test
                measured[scenario] = (time.monotonic() - start, str(exc))
            del run
            dist.distributed_c10d._abort_process_group(group)
            store.set(f"peer-abort/{scenario}/done", b"")
        if group is None and scenario != SCENARIOS[-1]:
            _fresh_group(store, index, rank, world)
    return measured


@pytest.fixture(scope="module")
def measured():
    # (a short stall-report window: the report waits for the ranks that can answer, and rank 1 cannot)
    results = run_distributed(_peer_abort, 2, timeout=240, expect_failure=True, pg_timeout=GROUP_TIMEOUT_S,
                              env={"FUSEDIST_STALL_REPORT_S": "0.5"})
    (status0, value0), (status1, value1) = results
    assert status0 == "ok", value0
    assert status1 == "error" and "3" in value1, value1  # (its os._exit(3), nothing before)
    return value0


@pytest.mark.parametrize("scenario", SCENARIOS[:3])
def test_peer_abort_fails_the_survivor_at_once_naming_the_peer(measured, scenario):
    seconds, error = measured[scenario]
    assert seconds < PROMPT_S, (f"{scenario}: rank 0 failed after {seconds:.1f} s (group timeout "
                                f"{GROUP_TIMEOUT_S} s): {error}")
    assert "rank 1 closed the connection: it aborted its process groups" in error, error


def test_peer_process_exit_fails_the_survivor_at_once_naming_the_peer(measured):
    seconds, error = measured["process exit"]
    assert seconds < PROMPT_S, f"rank 0 failed after {seconds:.1f} s: {error}"
    assert "rank 1 closed the connection and left no error: its process may have ended" in error, error
