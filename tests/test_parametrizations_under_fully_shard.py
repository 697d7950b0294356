"""Modules under ``torch.nn.utils.parametrize`` (weight_norm, spectral_norm) and
``torch.nn.utils.prune`` in a ``fusedist.fully_shard`` model, against torch's FSDP2 on the same
model, world size 2 on gloo: training steps and whole weights (``parametrizations.weight.original0``,
spectral norm's power-iteration buffers, prune's ``weight_orig`` / ``weight_mask``) (a
parametrization's setter on a sharded model is in tests/test_fsdp_one_rank_refusals.py).
"""

from __future__ import annotations

import torch
import torch.nn.utils.prune as prune
from torch import nn
from torch.nn.utils import parametrizations

import fusedist
from fusedist.testing import run_distributed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.fc1 = nn.Linear(12, 8)
        self.fc2 = nn.Linear(8, 3)
        parametrizations.weight_norm(self.conv)
        parametrizations.spectral_norm(self.fc1)
        prune.l1_unstructured(self.fc2, "weight", amount=0.3)

    def forward(self, x):
        x = torch.tanh(self.conv(x)).flatten(1)
        return self.fc2(torch.tanh(self.fc1(x)))


def _train(model, rank, steps=2):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 2, 4, 4, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _whole(state):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _parametrized_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (world,))
    models = {}
    for name, shard in (("torch", torch_fully_shard), ("fusedist", fusedist.fully_shard)):
        torch.manual_seed(0)
        model = Net()
        for unit in (model.conv, model.fc1):
            shard(unit, mesh=mesh)
        shard(model, mesh=mesh)
        _train(model, rank)
        models[name] = model
    want = _whole(models["torch"].state_dict())
    got = _whole(fusedist.fsdp.full_state_dict(models["fusedist"]))
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=lambda m: f"{key}: {m}")

    return len(want)


def test_parametrized_and_pruned_modules_train_as_under_fsdp2():
    # (a parametrization's setter given the whole weight is taken as torch's setter takes it:
    # tests/test_fsdp_one_rank_refusals.py)
    for compared in run_distributed(_parametrized_worker, 2, timeout=90):
        assert compared > 0
