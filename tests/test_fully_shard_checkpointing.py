"""Activation checkpointing with ``fully_shard`` in the forms training code writes, against
torch's FSDP2 with the same wrapping on 2 gloo ranks: ``checkpoint`` inside a unit's forward,
and around the call of a sharded block from its parent (Hugging Face models'
``gradient_checkpointing_enable()``, whose default is the reentrant checkpoint), each reentrant
and non-reentrant, with ``reshard_after_forward`` True and False.

The reentrant forms run the unit's forward under ``no_grad`` and run it again inside
backward, where the recompute's own backward reaches the unit's gradient hooks: the unit must
be gathered for the recompute and reduce once all of its gradients are in.

Tolerance: the same values gathered, the same ops and an exact two-rank average: the runs
are equal in practice; FP32_TOL = 2e-6 leaves an ulp or two through the steps, where a missed
or doubled reduction, or a recompute on resharded (stale) pieces, is off by far more.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusedist.testing import run_distributed

FP32_TOL = 2e-6
STEPS = 3


class Block(nn.Module):
    def __init__(self, inner: bool, reentrant: bool):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.inner, self.reentrant = inner, reentrant

    def _mlp(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x):
        return checkpoint(self._mlp, x, use_reentrant=self.reentrant) if self.inner else self._mlp(x)


class Net(nn.Module):
    def __init__(self, inner: bool, reentrant: bool):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block(inner, reentrant) for _ in range(3))
        self.out = nn.Linear(16, 4)
        self.outer = not inner
        self.reentrant = reentrant

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant) if self.outer else block(h)
        return self.out(h)


def _full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return {k: v.detach().clone() for k, v in
            get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}


def _worker(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for inner in (True, False):
        for reentrant in (True, False):
            for reshard in (True, False):
                torch.manual_seed(seed)
                base = Net(inner, reentrant)
                runs = {}
                for name, shard in (("torch", torch_fully_shard), ("ours", fusedist.fully_shard)):
                    model = copy.deepcopy(base)
                    for block in model.blocks:
                        shard(block, mesh=mesh, reshard_after_forward=reshard)
                    shard(model, mesh=mesh)
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                    gen = torch.Generator().manual_seed(seed + rank)
                    losses = []
                    for _ in range(STEPS):
                        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
                        loss = F.mse_loss(model(x), y)
                        loss.backward()
                        opt.step()
                        opt.zero_grad()
                        losses.append(loss.item())
                    runs[name] = (losses, _full(model))
                where = "inside the unit" if inner else "around the unit's call"
                out[f"{'reentrant' if reentrant else 'non-reentrant'} {where}, reshard_after_forward={reshard}"] = runs
    return out


def test_activation_checkpointing_forms_match_torch_fsdp2():
    seed = random.randrange(2**31)
    for rank, out in enumerate(run_distributed(_worker, 2, seed, timeout=240)):
        for case, runs in out.items():
            what = f"{case}, rank {rank}, seed {seed}"
            (ours, ours_w), (ref, ref_w) = runs["ours"], runs["torch"]
            for i, (a, b) in enumerate(zip(ours, ref)):
                assert abs(a - b) <= FP32_TOL * max(1.0, abs(b)), f"{what}: loss {i}: {a} vs torch {b}"
            for k in ref_w:
                diff = (ours_w[k] - ref_w[k]).abs().max().item()
                assert diff <= FP32_TOL, f"{what}: {k} differs from torch's by {diff}"
