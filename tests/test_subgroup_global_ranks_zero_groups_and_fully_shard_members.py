"""Process subgroups at world 3 (gloo), against torch: a ZeroRedundancyOptimizer given a group of
the same ranks as its DDP model's (another ``new_group`` object) trains as torch's, a group of
other ranks is refused naming both sets of global ranks; ``fully_shard(process_group=...)`` (or
``mesh=``) on a rank outside the group is refused naming the rank; ``consolidate_state_dict(to=)``
takes a group rank, as torch's (a global rank outside the group is refused saying so); a
collective on a subgroup that one member never joins times out naming the group ranks with their
global ranks.

Tolerance: fp32 Adam, 3 steps; both sides average the same three gradients with one all-reduce
and run the same update on the same elements, so they agree to a few ulps (1e-6 on weights of
magnitude ~0.5 moved ~1e-2 a step).
"""

from __future__ import annotations

import datetime

import torch
from torch import nn

from fusedist.testing import run_distributed
from models import raised

WORLD = 3
TOL = 1e-6


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _train(model, opt, rank, seed):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    for _ in range(3):
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _zero_groups(rank, seed, out):
    """ZeRO over a group of the DDP model's ranks (trains as torch's) and over a subgroup of them."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fusedist

    same = dist.new_group(list(range(WORLD)))  # the default group's ranks, another object
    pair, single = dist.new_group([0, 1]), dist.new_group([2])
    adam = dict(optimizer_class=torch.optim.Adam, lr=0.01)
    theirs = TorchDDP(_net())
    ref = _train(theirs, TorchZero(theirs.parameters(), process_group=same, **adam), rank, seed)
    ours = fusedist.DistributedDataParallel(_net())
    try:
        got = _train(ours, fusedist.ZeroRedundancyOptimizer(ours.parameters(), process_group=same, **adam),
                     rank, seed)
        out["same ranks"] = max((a - b).abs().max().item() for a, b in zip(ref, got))
    except ValueError as exc:
        out["same ranks"] = str(exc)
    other = fusedist.DistributedDataParallel(_net())
    out["subgroup"] = raised(lambda: fusedist.ZeroRedundancyOptimizer(
        other.parameters(), process_group=pair if rank < 2 else single, **adam))
    tail = dist.new_group([1, 2])
    if rank > 0:  # `to` is a group rank, as torch's: global rank 2 is group rank 1 here
        alone = fusedist.ZeroRedundancyOptimizer(_net().parameters(), process_group=tail, **adam)
        out["to"] = raised(lambda: alone.consolidate_state_dict(to=2))
        alone.consolidate_state_dict(to=1)
        out["full on group rank 1"] = sorted(alone.state_dict()) == ["param_groups", "state"]


def _timeout_worker(rank, world, seed):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import fusedist
    from fusedist.comm.torch_comm import TorchCommunicator

    out = {}
    late = dist.new_group([1, 2])
    mesh = DeviceMesh("cpu", torch.tensor([1, 2]))
    if rank == 0:  # outside the group and the mesh: refused by name, before any collective
        out["fully_shard outside"] = raised(lambda: fusedist.fully_shard(_net(), process_group=late))
        out["fully_shard outside mesh"] = raised(lambda: fusedist.fully_shard(_net(), mesh=mesh))
    elif rank == 1:  # group rank 0 of [1, 2]; global rank 2 is alive, in the next collective instead
        comm = TorchCommunicator(late, timeout=datetime.timedelta(seconds=1.0))
        out["timeout"] = raised(lambda: comm.all_reduce(torch.ones(3)))
    _zero_groups(rank, seed, out)
    return out


def test_subgroups_zero_groups_fully_shard_outside_and_timeouts_name_global_ranks():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    outs = run_distributed(_timeout_worker, WORLD, seed, timeout=120)
    for rank, out in enumerate(outs):
        what = f"seed {seed}, rank {rank}"
        assert isinstance(out["same ranks"], float) and out["same ranks"] <= TOL, (what, out["same ranks"])
        mine = "[0, 1]" if rank < 2 else "[2]"
        assert out["subgroup"].startswith("ValueError"), (what, out["subgroup"])
        assert f"spans global ranks {mine}" in out["subgroup"], (what, out["subgroup"])
        assert "global ranks [0, 1, 2]" in out["subgroup"], (what, out["subgroup"])
    for out in outs[1:]:
        assert out["to"].startswith("ValueError") and "to=2 is not a rank" in out["to"], out["to"]
        assert "rank of this process group, 0..1 (global ranks [1, 2]), not a global rank" in out["to"], out["to"]
    assert not outs[1]["full on group rank 1"] and outs[2]["full on group rank 1"]
    outside = outs[0]["fully_shard outside"]
    assert outside.startswith("ValueError") and "rank 0 is not a member of process_group" in outside, outside
    outside = outs[0]["fully_shard outside mesh"]
    assert outside.startswith("ValueError") and "rank 0 is not in the mesh" in outside, outside
    timeout = outs[1]["timeout"]
    assert "failed on rank 0 of 2 (global rank 1)" in timeout, timeout
    assert "some rank of [1] (global rank 2) did not join it" in timeout, timeout
