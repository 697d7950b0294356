"""copy.deepcopy of a fusedist.DistributedDataParallel model (Note [copies of the wrapper] in
fusedist/ddp/wrapper.py): torch.optim.swa_utils.AveragedModel(model) averages as with torch DDP,
a copy trains as a wrapper of its own with the original's options, a copy made on one rank only
issues no collective, and pickling is refused with what to pickle instead. Compared with torch
DDP on 2 gloo ranks.
"""

from __future__ import annotations

import copy
import os
import pickle

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from fusedist.testing import run_distributed


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def _batches(rank, n):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def _train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _worker(rank, world):
    import fusedist

    out = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_net(), bucket_cap_mb=0.001, find_unused_parameters=True)
        averaged = AveragedModel(model)  # a deep copy of the wrapper
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(rank, 4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            averaged.update_parameters(model)
        twin = copy.deepcopy(model)
        _train(twin, _batches(10 + rank, 3))  # the copy trains as a wrapper of its own
        out[who] = dict(
            averaged=[p.detach().clone() for p in averaged.module.parameters()],
            twin=[p.detach().clone() for p in twin.parameters()],
            shares=any(a.data_ptr() == b.data_ptr() for a, b in zip(twin.parameters(), model.parameters())),
            kind=type(averaged.module).__name__,
        )
    copied = copy.deepcopy(fusedist.DistributedDataParallel(_net(), bucket_cap_mb=0.001))
    out["options"] = (copied.config.bucket_cap_mb, copied.process_group is torch.distributed.group.WORLD)
    try:
        pickle.dumps(copied)
    except TypeError as exc:
        out["pickle"] = str(exc)
    return out


def test_copies_average_and_train_as_torch_ddp_copies():
    """SGD, averages and BatchNorm in fp32 with the same reduction order: equal to 1e-6."""
    for out in run_distributed(_worker, 2, timeout=120):
        ref, ours = out["torch"], out["fusedist"]
        for what in ("averaged", "twin"):
            diff = max((a - b).abs().max().item() for a, b in zip(ref[what], ours[what]))
            assert diff <= 1e-6, (what, diff)
        assert not ours["shares"] and ours["kind"] == "DistributedDataParallel"
        assert out["options"] == (0.001, True)
        assert "cannot be pickled" in out["pickle"] and "model.module" in out["pickle"]


def _one_rank_copy_worker(rank, world):
    import fusedist

    model = fusedist.DistributedDataParallel(_net())
    batches = _batches(rank, 3)
    _train(model, batches[:1])
    if rank == 0:
        # e.g. to save a snapshot: no collective may happen here. (A forward of the copy is a
        # DDP forward, which broadcasts buffers, as torch's copy's does.)
        snapshot = copy.deepcopy(model)
        torch.save(snapshot.module.state_dict(), os.devnull)
    _train(model, batches[1:])  # the ranks' collectives still pair
    return [p.detach().clone() for p in model.parameters()]


def test_a_copy_on_one_rank_issues_no_collective():
    r0, r1 = run_distributed(_one_rank_copy_worker, 2, timeout=60, env={"FUSEDIST_TIMEOUT_S": "10"})
    assert all(torch.equal(a, b) for a, b in zip(r0, r1))
