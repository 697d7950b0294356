"""ZeRO state saved from a model in one memory format loads into the same model in another.

ZeRO's shards hold each parameter's elements in memory order (a channels_last weight as it
lies in memory), so a contiguous model loading a channels_last run's shards, or the reverse,
must re-order them (Note [fragments] in fusedist/zero/state.py). Compared exactly: loading
moves values, it computes nothing.
"""

import copy
import os

import torch
from torch import nn

from fusedist.testing import run_distributed


def _model(channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    return m.to(memory_format=torch.channels_last) if channels_last else m


def _trained(channels_last: bool, stage: int):
    import fusedist

    ddp = fusedist.DistributedDataParallel(_model(channels_last))
    opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), fusedist.optim.FusedAdamW, stage=stage, lr=1e-2)
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.randn(4, 3, 8, 8, generator=gen)).square().sum().backward()
        opt.step()
    return ddp, opt


def _full_state(opt):
    opt.consolidate_state_dict(to=0)
    sd = opt.state_dict() if torch.distributed.get_rank() == 0 else None
    return None if sd is None else {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                                    for i, s in sd["state"].items()}


def _worker(rank, world_size, directory):
    import fusedist

    out = {}
    for saved_cl, stage in ((True, 2), (False, 1)):
        ddp, opt = _trained(saved_cl, stage)
        expected = _full_state(opt)
        path = os.path.join(directory, f"ck_{saved_cl}_{stage}")
        fusedist.checkpoint.save(path, ddp, opt)
        shards = [None] * world_size
        torch.distributed.all_gather_object(shards, opt.shard_state_dict())
        loaders = {
            "checkpoint into ZeRO": lambda d, o: fusedist.checkpoint.load(path, d, o),
            "shards into ZeRO": lambda d, o: o.load_state_dict(copy.deepcopy(shards)),
        }
        for how, load in loaders.items():
            ddp2 = fusedist.DistributedDataParallel(_model(not saved_cl))
            opt2 = fusedist.ZeroRedundancyOptimizer(ddp2.parameters(), fusedist.optim.FusedAdamW, stage=stage, lr=1e-2)
            load(ddp2, opt2)
            got = _full_state(opt2)
            if rank == 0:
                out[(how, saved_cl)] = max((got[i][k] - expected[i][k]).abs().max().item()
                                           for i in expected for k in expected[i])
        # ... and into an unsharded optimizer (the checkpoint converts the shards to torch's format)
        plain = _model(not saved_cl)
        ddp3 = fusedist.DistributedDataParallel(plain)
        opt3 = fusedist.optim.FusedAdamW(ddp3.parameters(), lr=1e-2)
        fusedist.checkpoint.load(path, ddp3, opt3)
        if rank == 0:
            out[("checkpoint into FusedAdamW", saved_cl)] = max(
                (opt3.state[p][k] - expected[i][k]).abs().max().item()
                for i, p in enumerate(ddp3.parameters()) for k in ("exp_avg", "exp_avg_sq"))
    return out


def test_zero_state_loads_across_memory_formats(tmp_path):
    result = run_distributed(_worker, 2, str(tmp_path))[0]
    assert len(result) == 6
    for case, diff in result.items():
        assert diff == 0.0, case
