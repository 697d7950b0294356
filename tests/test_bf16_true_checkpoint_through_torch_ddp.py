"""A "bf16-true" checkpoint of fusedist's Fabric strategy holds each parameter's FP32 master
(``master_param``) beside torch's AdamW state. Fabric's "ddp" loads it into torch's AdamW, which
keeps the entry (cast to bf16) without reading it, and saves it again, stale, after training on.
Both ways the numerics are those of the state without the entry: "ddp" trains exactly as from
the stripped checkpoint, and fusedist's strategy resuming "ddp"'s checkpoint replaces the stale
master by the parameter it no longer rounds to (Note [loaded masters checked against the
parameters] in fusedist/optim/_base.py), exactly as from the stripped one."""

from __future__ import annotations

import os

import pytest

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_lightning_launch import register, shared_launch


def _round_trip(rank, world, seed, directory):
    import torch
    import torch.distributed as dist
    from torch import nn

    import lightning as L
    from fusedist.integrations.fabric import FusedistFabricStrategy

    _launched_env(rank, world)
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    batches = [(torch.randn(6, 5, generator=generator), torch.randn(6, 3, generator=generator)) for _ in range(6)]

    def run(strategy, steps, load=None, save=None):
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="bf16-true")
        fabric.launch()
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
        if load is not None:
            fabric.load(load, {"model": model, "optimizer": optimizer})
        for x, y in (batches[i] for i in steps):
            fabric.backward(nn.functional.mse_loss(model(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()
        if save is not None:
            fabric.save(save, {"model": model, "optimizer": optimizer})
        return [p.detach().clone() for p in model.parameters()]

    def stripped(path):
        if rank == 0:
            saved = torch.load(path, weights_only=False)
            for state in saved["optimizer"]["state"].values():
                state.pop("master_param")
            torch.save(saved, path + "-stripped")
        dist.barrier()
        return path + "-stripped"

    ours, theirs = os.path.join(directory, "fusedist.ckpt"), os.path.join(directory, "ddp.ckpt")
    run(FusedistFabricStrategy(), range(2), save=ours)
    ddp = run("ddp", range(2, 4), load=ours, save=theirs)
    ddp_stripped = run("ddp", range(2, 4), load=stripped(ours))
    kept = sorted(torch.load(theirs, weights_only=False)["optimizer"]["state"][0])
    back = run(FusedistFabricStrategy(), range(4, 6), load=theirs)
    back_stripped = run(FusedistFabricStrategy(), range(4, 6), load=stripped(theirs))
    return {"kept": kept,
            "ddp": all(torch.equal(a, b) for a, b in zip(ddp, ddp_stripped)),
            "back": all(torch.equal(a, b) for a, b in zip(back, back_stripped))}


def _jobs(tmp_path_factory):
    seed = int.from_bytes(os.urandom(2), "little")
    directory = str(tmp_path_factory.mktemp("bf16-true"))
    return {"test_a_bf16_true_checkpoint_through_ddp_trains_as_without_its_masters":
            {"bf16-true through ddp": (_round_trip, (seed, directory))}}


register(_jobs, seconds=240)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def test_a_bf16_true_checkpoint_through_ddp_trains_as_without_its_masters(launched):
    for out in results_of(launched, "bf16-true through ddp"):
        assert "master_param" in out["kept"], out["kept"]  # (what makes the check meaningful: a stale master)
        # exact: the same parameters, moments and gradients either way, on one machine
        assert out["ddp"], '"ddp" trained otherwise from the checkpoint with masters than without them'
        assert out["back"], "fusedist's strategy resumed a stale master from the checkpoint of \"ddp\""
