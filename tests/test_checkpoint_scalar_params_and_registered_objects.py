"""Checkpoint probes, round 2: each test compares against torch (or the documented behaviour) on
fresh random inputs."""

from __future__ import annotations

import torch
from torch import nn

from fusedist.testing import run_distributed
from models import LogitScaled  # a 0-dim learnable scale beside ordinary layers


# ------------------------------------------------- a 0-dim parameter of a fully_shard model


def _batch(step: int, seed: int):
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(seed * 100 + step))


def _scalar_rank(rank, world_size, root, seed, phase):
    import fusedist
    from fusedist.fsdp import full_state_dict

    torch.manual_seed(seed)
    model = LogitScaled()
    if phase == "zero":  # DDP + ZeRO-2 loading the fully_shard checkpoint
        model = fusedist.DistributedDataParallel(model)
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    elif phase == "save_ddp":  # the full state of torch's AdamW: 0-dim moments
        model = fusedist.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        fusedist.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = 6 // world_size
    saving = phase.startswith("save")
    if not saving:
        fusedist.checkpoint.load(root, model, opt)
    for step in range(2) if saving else range(2, 4):
        model(_batch(step, seed)[rank * per:(rank + 1) * per]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    if saving:
        fusedist.checkpoint.save(root, model, opt)
        return None
    if phase == "zero":
        opt.wait_for_params()
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return full_state_dict(model)


def _scalar_reference(seed: int) -> dict:
    torch.manual_seed(seed)
    ref = LogitScaled()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(4):
        ref(_batch(step, seed)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return ref.state_dict()


def _scalar_resume(tmp_path, saving: str, world_size: int, phase: str) -> None:
    seed = int(torch.randint(0, 10_000, ()).item())
    run_distributed(_scalar_rank, 2, str(tmp_path), seed, saving, timeout=60)
    got = run_distributed(_scalar_rank, world_size, str(tmp_path), seed, phase, timeout=60)[0]
    for key, value in _scalar_reference(seed).items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6)


def test_a_zero_dim_parameter_loads_into_fully_shard_at_another_world_size(tmp_path):
    """A DDP checkpoint (torch's AdamW: the moments of a 0-dim parameter are 0-dim, like its
    step count) into fully_shard at 3 ranks: a load cloned them whole to the ranks whose piece
    of it is empty, and their next step failed ("output with shape [] doesn't match the
    broadcast shape [0]"; FusedAdamW: "state 'exp_avg' ... has shape (), the parameter (0,)")."""
    _scalar_resume(tmp_path, "save_ddp", 3, "load")


def test_a_fully_shard_checkpoint_with_a_zero_dim_parameter_continues_on_zero(tmp_path):
    """Saved as scalars, its moments reached ZeRO's flat shard as 0-dim tensors: "output with
    shape [] doesn't match the broadcast shape [12]" at the first step."""
    _scalar_resume(tmp_path, "save", 1, "zero")


# ------------------------------------------------- objects registered on some ranks only
def _registering_rank(rank, world_size, root, which, phase):
    import fusedist
    from fusedist.checkpoint import CheckpointError, Checkpointer

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    scaler = fusedist.amp.GradScaler("cpu")
    partial = phase == "save" and rank == 0  # rank 0 leaves `which` out
    ckpt = Checkpointer(root, run_id="registering")
    try:
        start = ckpt.restore(model, opt, None if partial and which == "scaler" else scaler,
                             lr_scheduler=None if partial and which == "lr_scheduler" else sched)
        if phase == "save":
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            sched.step()
            ckpt.save(1)
        ckpt.close()
        return start
    except CheckpointError as exc:
        ckpt.close()
        return str(exc)


def test_objects_registered_on_some_ranks_only_are_refused_at_save(tmp_path):
    """As fusedist.checkpoint.save refuses a scaler on some ranks only: the Checkpointer wrote
    rank 0's objects alone, and the restart passing the same objects on every rank could load
    none of its checkpoints ("holds no LR scheduler state" / "holds no GradScaler state")."""
    for which in ("lr_scheduler", "scaler"):
        root = str(tmp_path / which)
        saved = run_distributed(_registering_rank, 2, root, which, "save", timeout=60)
        for message in saved:  # refused on every rank, naming what differs
            assert isinstance(message, str), saved
            assert f"registered different objects at restore(): {which} is None on ranks [0]" in message, message
        assert run_distributed(_registering_rank, 2, root, which, "load", timeout=60) == [0, 0]  # nothing written
