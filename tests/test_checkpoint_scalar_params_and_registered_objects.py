"""Checkpoint probes, round 2: each test compares against torch (or the documented behaviour) on
fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phased_launches import launch_phase
from shared_rank_launch import results_of
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


def _scalar_resume(launched, test: str) -> None:
    results_of(launched, f"{test}: save")
    got = results_of(launched, f"{test}: load")[0]
    for key, value in _scalar_reference(launched["seeds"][test]).items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6)


def test_a_zero_dim_parameter_loads_into_fully_shard_at_another_world_size(launched):
    """A DDP checkpoint (torch's AdamW: the moments of a 0-dim parameter are 0-dim, like its
    step count) into fully_shard at 3 ranks: a load cloned them whole to the ranks whose piece
    of it is empty, and their next step failed ("output with shape [] doesn't match the
    broadcast shape [0]"; FusedAdamW: "state 'exp_avg' ... has shape (), the parameter (0,)")."""
    _scalar_resume(launched, "test_a_zero_dim_parameter_loads_into_fully_shard_at_another_world_size")


def test_a_fully_shard_checkpoint_with_a_zero_dim_parameter_continues_on_zero(launched):
    """Saved as scalars, its moments reached ZeRO's flat shard as 0-dim tensors: "output with
    shape [] doesn't match the broadcast shape [12]" at the first step."""
    _scalar_resume(launched, "test_a_fully_shard_checkpoint_with_a_zero_dim_parameter_continues_on_zero")


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


def test_objects_registered_on_some_ranks_only_are_refused_at_save(launched):
    """As fusedist.checkpoint.save refuses a scaler on some ranks only: the Checkpointer wrote
    rank 0's objects alone, and the restart passing the same objects on every rank could load
    none of its checkpoints ("holds no LR scheduler state" / "holds no GradScaler state")."""
    for which in ("lr_scheduler", "scaler"):
        saved = results_of(launched, f"{which} on rank 1 only: save")
        for message in saved:  # refused on every rank, naming what differs
            assert isinstance(message, str), saved
            assert f"registered different objects at restore(): {which} is None on ranks [0]" in message, message
        assert results_of(launched, f"{which} on rank 1 only: load") == [0, 0]  # nothing written


_ZERO_DIM_TESTS = {  # test: (how it saves at world size 2, how it loads, at which world size)
    "test_a_zero_dim_parameter_loads_into_fully_shard_at_another_world_size": ("save_ddp", "load", 3),
    "test_a_fully_shard_checkpoint_with_a_zero_dim_parameter_continues_on_zero": ("save", "zero", 1),
}
_REGISTERING_TEST = "test_objects_registered_on_some_ranks_only_are_refused_at_save"


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The saves (and the registering scenarios) at world size 2 in one launch, then each load at
    its own world size."""
    seeds = {test: int(torch.randint(0, 10_000, ()).item()) for test in _ZERO_DIM_TESTS}
    roots = {name: str(tmp_path_factory.mktemp("ckpt")) for name in [*_ZERO_DIM_TESTS, "lr_scheduler", "scaler"]}
    saves = {test: {f"{test}: save": (_scalar_rank, (roots[test], seeds[test], saving))}
             for test, (saving, _, _) in _ZERO_DIM_TESTS.items()}
    saves[_REGISTERING_TEST] = {f"{which} on rank 1 only: {phase}": (_registering_rank, (roots[which], which, phase))
                                for which in ("lr_scheduler", "scaler") for phase in ("save", "load")}
    out = launch_phase(request, saves, 2, timeout=120)
    for test, (_, loading, world) in _ZERO_DIM_TESTS.items():
        out.update(launch_phase(request, {test: {
            f"{test}: load": (_scalar_rank, (roots[test], seeds[test], loading))}}, world, timeout=60))
    out["seeds"] = seeds
    return out
