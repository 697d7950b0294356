"""``fusedist.integrations.lightning.grad_norm`` on ``fully_shard`` pieces outside a Trainer, at
4 gloo ranks, against Lightning's ``grad_norm`` on an unsharded copy of the model whose loss
is the mean of the 4 ranks' losses (the gradient the sharded model's reduce-scatter averages):

* HSDP over a (2 replicas x 2 shards) mesh: the per-parameter all-reduce runs over the shard
  group only (Note [gradient norms of fully_shard pieces]); over all 4 ranks every sum of
  ``|g|^p`` would be counted twice;
* ``fusedist.amp.GradScaler(lazy_unscale=True)`` with ``FusedAdamW``: after ``unscale_`` the
  pieces' ``.grad`` still hold the scaled values; the norms are of the unscaled gradients.

Inputs are fresh random draws (the seed is in every failure message). Tolerance: fp32, the
same gradients summed in another order and norms taken piecewise: 1e-5 relative (norms of
order 1).
"""

from __future__ import annotations

import random

import torch
from torch import nn

from fusedist.testing import run_distributed

WORLD, REPLICAS, SHARDS = 4, 2, 2
TOL = 1e-5
NORM_TYPES = (2, "inf", 1.5)


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3), nn.Tanh(), nn.Linear(3, 1))


def _batch(seed: int, rank: int):
    g = torch.Generator().manual_seed(seed * 31 + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 1, generator=g)


def _reference_norms(seed: int, world: int) -> dict:
    """Lightning's grad_norm on the unsharded model, gradient of the ranks' mean loss."""
    from lightning.pytorch.utilities import grad_norm

    net = _net(seed)
    loss = sum(nn.functional.mse_loss(net(x), y) for x, y in (_batch(seed, r) for r in range(world))) / world
    loss.backward()
    return {t: {k: float(v) for k, v in grad_norm(net, t).items()} for t in NORM_TYPES}


def _compare(ours: dict, ref: dict, what: str) -> None:
    assert ours.keys() == ref.keys(), f"{what}: keys {sorted(ours)} vs {sorted(ref)}"
    for key, value in ref.items():
        assert abs(ours[key] - value) <= TOL * max(1.0, abs(value)), f"{what}: {key}: {ours[key]} vs {value}"


def _worker(rank: int, world: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.integrations.lightning import grad_norm
    from fusedist.optim import FusedAdamW

    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    out = {}
    for case in ("hsdp", "hsdp, lazy unscale"):
        model = _net(seed)
        fusedist.fully_shard(model[0], mesh=mesh)
        fusedist.fully_shard(model, mesh=mesh)
        lazy = case.endswith("lazy unscale")
        opt = FusedAdamW(model.parameters(), lr=1e-2) if lazy else torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = fusedist.amp.GradScaler("cpu", init_scale=1024.0, lazy_unscale=True) if lazy else None
        x, y = _batch(seed, rank)
        loss = nn.functional.mse_loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        got = {t: {k: float(v) for k, v in grad_norm(model, t).items()} for t in NORM_TYPES}
        ref = _reference_norms(seed, world)
        for t in NORM_TYPES:
            _compare(got[t], ref[t], f"seed {seed}, {case}, rank {rank}, norm {t}")
        out[case] = got
        if scaler is not None:  # the step still applies the unscale once
            scaler.step(opt)
    return out


def test_grad_norm_of_hsdp_pieces_and_a_lazy_unscale_match_the_unsharded_model():
    seed = random.randrange(2**20)
    results = run_distributed(_worker, WORLD, seed, timeout=300)
    for rank in range(1, WORLD):
        assert results[rank] == results[0], f"seed {seed}: rank {rank} logged other norms than rank 0"
