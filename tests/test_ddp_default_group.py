"""The default group as torch names it: ``model.process_group`` of a DistributedDataParallel
model built without a group is torch's default group (``dist.group.WORLD``), not None, as with
torch's DDP; so the torch idiom ``ZeroRedundancyOptimizer(..., process_group=model.process_group)``
(and ``process_group=dist.group.WORLD``) builds and trains as torch's ZeroRedundancyOptimizer over
torch's DDP. A ZeroRedundancyOptimizer without a DDP model likewise reports the default group.

Tolerance: fp32 SGD with momentum, 4 steps, 2 gloo ranks; both sides average the same two
gradients (one all-reduce of two summands), so they agree to a few ulps: 1e-6 on parameters of
magnitude ~0.5, where each step moves them by ~1e-2.
"""

from __future__ import annotations

import torch
from torch import nn

from fusedist.testing import run_distributed


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 2))


def _train(model, opt, rank, seed):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    for _ in range(4):
        x, y = torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _default_group_worker(rank, world, seed):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fusedist

    world_group = dist.group.WORLD
    theirs = TorchDDP(_net())
    ours = fusedist.DistributedDataParallel(_net())
    out = dict(torch_is_world=theirs.process_group is world_group, ours_is_world=ours.process_group is world_group)
    sgd = dict(optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)
    ref = _train(theirs, TorchZero(theirs.parameters(), process_group=theirs.process_group, **sgd), rank, seed)
    got = _train(ours, fusedist.ZeroRedundancyOptimizer(ours.parameters(), process_group=ours.process_group, **sgd),
                 rank, seed)
    out["diff"] = max((a - b).abs().max().item() for a, b in zip(ref, got))
    again = fusedist.DistributedDataParallel(_net())
    fusedist.ZeroRedundancyOptimizer(again.parameters(), process_group=world_group, **sgd)  # accepted
    alone = fusedist.ZeroRedundancyOptimizer(_net().parameters(), **sgd)
    out["alone_is_world"] = alone.process_group is world_group
    out["torch_alone_is_world"] = TorchZero(_net().parameters(), **sgd).process_group is world_group
    return out


def test_model_process_group_is_the_default_group_and_passes_to_zero():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    for out in run_distributed(_default_group_worker, 2, seed, timeout=120):
        assert out["torch_is_world"] and out["ours_is_world"], (seed, out)
        assert out["torch_alone_is_world"] and out["alone_is_world"], (seed, out)
        assert out["diff"] <= 1e-6, (seed, out)
