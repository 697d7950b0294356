"""The job's store does not grow with training: every key fusedist writes is removed once no peer reads it.

One launch of 2 gloo ranks trains 30 steps of DDP with the GradScaler and clip_grad_norm_, DDP with ZeRO-2 and
fully_shard, with a divergence probe triggered and resolved (a rank slower than FUSEDIST_DIVERGENCE_PROBE_S),
consistency checks, Join with uneven inputs, and five groups created and destroyed, one of them after a failed
collective (a stall report that does not end the job). ``store.num_keys()``, taken between two barriers, grows
by what torch itself writes for a group (measured on a group only torch used) and by nothing else.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedist.testing import run_distributed

_ENV = {"FUSEDIST_DIVERGENCE_PROBE_S": "0.3", "FUSEDIST_STALL_REPORT_S": "0.3"}
_STEPS = 30
_CYCLES_AT = {4: "ddp", 8: "ddp", 12: "two communicators", 16: "ddp", 24: "failed collective"}
_SLOW_AT, _SLOW_S = 15, 0.6


def _mlp():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _keys(store) -> tuple:
    """(the store's key count, fusedist's keys), read between two barriers: no rank writes meanwhile."""
    dist.barrier()
    base = getattr(store, "_underlying_non_prefix_store", store)
    count, ours = store.num_keys(), sorted(k for k in base.list_keys() if "fusedist/" in k)
    dist.barrier()
    return count, ours


def _group_cycle(rank: int, kind: str):
    """A group made, used by fusedist (or only by torch), destroyed; what a failed collective raised, if one did."""
    import fusedist
    from fusedist.comm import get_communicator
    from fusedist.reliability import attach_monitor

    group = dist.new_group([0, 1])
    raised = None
    if kind == "torch":
        dist.all_reduce(torch.ones(2), group=group)
    elif kind == "ddp":
        model = fusedist.DistributedDataParallel(_mlp(), process_group=group)
        x, y = _batch(rank, 99)
        nn.functional.mse_loss(model(x), y).backward()
        model.check_consistency()
        del model
    elif kind == "two communicators":  # one group, two monitors in each process: each process leaves it once
        from fusedist.comm import TorchCommunicator
        from fusedist.reliability import stall_report

        cached, direct = attach_monitor(get_communicator(group)), attach_monitor(TorchCommunicator(group))
        cached.comm.all_reduce(torch.ones(2))
        direct.comm.all_reduce(torch.ones(2))
        if rank == 0:
            dist.destroy_process_group(group)
        dist.barrier()
        if rank == 1:  # rank 0 left, rank 1 is still in the group: it reads that rank 0 left
            raised = stall_report.read_entries(cached.store, cached.group_name, cached.generation, [0])
            dist.destroy_process_group(group)
        del cached, direct
        return raised
    else:  # rank 0 alone runs a collective: it fails, with a stall report, and the job goes on
        comm = get_communicator(group)
        attach_monitor(comm)
        if rank == 0:
            comm.timeout = datetime.timedelta(seconds=0.5)
            try:
                comm.all_reduce(torch.ones(4), tag="alone")
            except Exception as error:  # noqa: BLE001 - what the test reads
                raised = f"{type(error).__name__}: {error}"
        dist.barrier()  # (rank 1 holds the group until rank 0's collective timed out)
        del comm
    dist.destroy_process_group(group)
    return raised


def _training_job(rank: int, world: int) -> dict:
    import fusedist
    from torch.distributed import distributed_c10d

    from fusedist.reliability import stall_report

    published = []  # the kinds of entries this rank wrote under its groups' keys
    publish = stall_report.publish

    def noting(store, group, generation, at, entry, bounded=True):
        published.append(entry.get("kind"))
        return publish(store, group, generation, at, entry, bounded)

    stall_report.publish = noting  # (the rank's own process)
    store = distributed_c10d._get_default_store()
    out = {"cycles": {}}
    before = _keys(store)
    _group_cycle(rank, "torch")
    after = _keys(store)
    out["torch group"] = after[0] - before[0]

    ddp = fusedist.DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=1024.0)
    zero_model = fusedist.DistributedDataParallel(_mlp())
    zero = fusedist.ZeroRedundancyOptimizer(zero_model.parameters(), torch.optim.SGD, stage=2, lr=0.05)
    sharded = fusedist.fully_shard(_mlp())
    sharded_opt = torch.optim.SGD(sharded.parameters(), lr=0.05)
    for step in range(1, _STEPS + 1):
        if step == _SLOW_AT and rank == 1:
            time.sleep(_SLOW_S)  # rank 0 waits past the probe's delay: its probe publishes, then withdraws
        x, y = _batch(rank, step)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(ddp(x), y)).backward()
        scaler.unscale_(opt)
        fusedist.clip_grad_norm_(ddp.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        zero.zero_grad()
        nn.functional.mse_loss(zero_model(x), y).backward()
        zero.clip_grad_norm_(1.0)
        zero.step()
        sharded_opt.zero_grad()
        nn.functional.mse_loss(sharded(x), y).backward()
        fusedist.clip_grad_norm_(sharded.parameters(), 1.0)
        sharded_opt.step()
        if step in (10, 20):
            ddp.check_consistency()
            sharded.check_consistency()
        if step == 20:
            with fusedist.Join([ddp]):  # uneven inputs: rank 1 runs one batch more
                for extra in range(2 + rank):
                    opt.zero_grad()
                    nn.functional.mse_loss(ddp(x + extra), y).backward()
                    opt.step()
            ddp.check_consistency()
        if step == 1:
            out["step 1"] = _keys(store)
        if step in _CYCLES_AT:
            before = _keys(store)
            out[_CYCLES_AT[step]] = _group_cycle(rank, _CYCLES_AT[step])
            after = _keys(store)
            out["cycles"][step] = (after[0] - before[0], sorted(set(after[1]) - set(before[1])))
    out["step 30"] = _keys(store)
    out["published"] = published
    out["forgotten"] = _destroyed_both_ways(rank, store)
    return out


def _unwrapped_layers(fn) -> int:
    layers = 0
    while hasattr(fn, "__wrapped__"):
        fn, layers = fn.__wrapped__, layers + 1
    return layers


def _destroyed_both_ways(rank: int, store) -> dict:
    """Note [one wrapper of torch's group-unregister functions] (fusedist/_group_table.py): a subgroup destroyed
    (torch's _unregister_process_group), then every group (_unregister_all_process_groups); each runs the release
    of the group's communicators and the drop of a destroyed group from torch.distributed.nn's defaults, through
    one wrapper of each function."""
    import torch.distributed.nn.functional as nn_functional
    from torch.distributed import distributed_c10d

    from fusedist.comm import get_communicator
    from fusedist.distributed import follow_nn_defaults

    # as torch.distributed.nn imported by the program after init_process_group leaves it: the live group captured
    nn_functional.all_reduce.__defaults__ = nn_functional.all_reduce.__defaults__[:-1] + (dist.group.WORLD,)
    follow_nn_defaults(start=True)
    group = dist.new_group([0, 1])
    sub, world = get_communicator(group), get_communicator(None)
    out = {"layers": [_unwrapped_layers(getattr(distributed_c10d, name))
                      for name in ("_unregister_process_group", "_unregister_all_process_groups")]}
    dist.destroy_process_group(group)
    out["subgroup"] = (sub.released, world.released, nn_functional.all_reduce.__defaults__[-1] is not None)
    dist.destroy_process_group()
    out["all"] = (world.released, nn_functional.all_reduce.__defaults__[-1] is None)
    # every rank has left every group: the last to leave deleted their entries
    store.set(f"test/destroyed/{rank}", b"")
    store.wait([f"test/destroyed/{peer}" for peer in (0, 1)], datetime.timedelta(seconds=30))
    base = getattr(store, "_underlying_non_prefix_store", store)
    out["fusedist keys left"] = sorted(k for k in base.list_keys() if "fusedist/" in k)
    return out


@pytest.fixture(scope="module")
def job():
    return run_distributed(_training_job, 2, timeout=120, pg_timeout=60, env=_ENV)


def test_the_store_holds_as_many_keys_after_step_30_as_after_step_1(job):
    for rank, out in enumerate(job):
        (first, ours_first), (last, ours_last) = out["step 1"], out["step 30"]
        assert ours_last == ours_first, (rank, "fusedist's keys left", sorted(set(ours_last) - set(ours_first)))
        # (what the five groups' gloo rendezvous wrote is torch's own: as many as a group only torch used)
        assert last - first == len(_CYCLES_AT) * out["torch group"], (rank, first, last, out["torch group"])


def test_a_created_and_destroyed_group_leaves_only_what_torch_leaves(job):
    for rank, out in enumerate(job):
        assert out["torch group"] > 0, out  # (the reference: torch's own keys of a group, which it never removes)
        for step, (grown, ours) in out["cycles"].items():
            assert ours == [] and grown == out["torch group"], (rank, step, _CYCLES_AT[step], grown, ours)


def test_one_wrapper_of_torchs_unregister_functions_releases_communicators_and_nn_defaults_both_ways(job):
    for rank, out in enumerate(job):
        forgotten = out["forgotten"]
        # before: one wrapper for the communicators' release and one for torch.distributed.nn's defaults
        assert forgotten["layers"] == [1, 1], (rank, forgotten)
        # a subgroup's destroy released its communicator only; the live default group stayed held by the default
        assert forgotten["subgroup"] == (True, False, True), (rank, forgotten)
        assert forgotten["all"] == (True, True), (rank, forgotten)
        assert forgotten["fusedist keys left"] == [], (rank, forgotten)


def test_the_paths_that_write_entries_ran(job):
    """The probe published and withdrew, the checks announced themselves, the failed collective reported:
    each wrote under its group's keys, so the counts above cover them."""
    for rank, out in enumerate(job):
        assert "checking" in out["published"] and "exit" in out["published"], (rank, out["published"])
    assert "waiting" in job[0]["published"], job[0]["published"]  # (rank 0 waited for the slow rank 1)
    assert "failure" in job[0]["published"], job[0]["published"]
    raised = job[0]["failed collective"]
    assert raised.startswith("StallError") and "Stall report" in raised, raised


def test_a_process_with_two_monitors_on_a_group_leaves_it_once(job):
    """Its second monitor counted as a second rank leaving: with two ranks, the group's entries were deleted while
    rank 1 was still in it, and its report no longer read that rank 0 had left."""
    entry = job[1]["two communicators"][0]
    assert entry is not None and entry["kind"] == "exit", job[1]["two communicators"]
