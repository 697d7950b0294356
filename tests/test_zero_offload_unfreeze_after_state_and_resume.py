"""ZeroRedundancyOptimizer(offload="cpu"): parameters that join once the optimizer state exists
-- a frozen layer unfrozen after the first step, or added with ``add_param_group`` after a
checkpoint load (progressive unfreezing resumed) -- grow the host masters, gradients and
staging as the non-offloaded optimizer grows its own (Note [growing the partition] in
fusedist/zero/grow.py), and train as torch's AdamW on the whole model.

The oracle is unsharded torch.optim.AdamW in one process on the global batch with the same
unfreezing schedule (DDP averages per-rank mean losses over equal chunks: the global mean
loss). Tolerance 1e-5 (fp32; the C++ CPU Adam agrees with torch's to a few ulp per step): lr
1e-2 moves every parameter by ~1e-2 per step, so a joined layer that is not stepped, stepped
with the wrong group's hyperparameters or another slice's gradient, or an old slice whose
master or state moved, is caught. bf16 parameters are compared with the same run without
offload (same masters, same rounding).
"""

import os

import pytest
import torch
from torch import nn

import models

from fusedist.testing import run_distributed

STEPS, UNFREEZE, TOL = 6, 3, 1e-5


def _batch(step, rank=None, world_size=1):
    return models.rank_slice_of_global_batch(step, rank, world_size, seed=517, n=8)


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 2)).to(dtype)
    model[0].requires_grad_(False)  # the backbone layer unfrozen at step UNFREEZE
    return model


def _groups(model, how):
    """Every parameter (a fine-tuning script passing model.parameters()) or the trainable ones
    (the backbone comes later with add_param_group)."""
    return [dict(params=[p for p in model.parameters() if how == "frozen" or p.requires_grad], weight_decay=0.1)]


def _added_group(model):
    return dict(params=list(model[0].parameters()), lr=2e-2, weight_decay=0.05)


def _reference(how):
    model = _mlp()
    opt = torch.optim.AdamW(_groups(model, how), lr=1e-2)
    for step in range(STEPS):
        if step == UNFREEZE:
            model[0].requires_grad_(True)
            if how == "add":
                opt.add_param_group(_added_group(model))
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def _zero_run(rank, world_size, how, stage, offload, resume, dtype=torch.float32):
    """fusedist DDP + ZeRO; with ``resume`` the run restarts from a checkpoint (model state dict
    and every rank's optimizer shard) right before the step that unfreezes the backbone."""
    import torch.distributed as dist

    import fusedist

    def build():
        module = _mlp(dtype)
        ddp = fusedist.DistributedDataParallel(module, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
        return module, ddp, fusedist.ZeroRedundancyOptimizer(
            _groups(module, how), torch.optim.AdamW, stage=stage, offload=offload, lr=1e-2)

    module, ddp, opt = build()
    for step in range(STEPS):
        if step == UNFREEZE:
            if resume:
                shards = [None] * world_size
                dist.all_gather_object(shards, opt.shard_state_dict())
                weights = {k: v.clone() for k, v in module.state_dict().items()}
                module, ddp, opt = build()
                module.load_state_dict(weights)
                opt.load_state_dict(shards)
            module[0].requires_grad_(True)
            if how == "add":
                opt.add_param_group(_added_group(module))
        x, y = _batch(step, rank, world_size)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
    return module, opt


def _state_diff(full, ref_opt):
    theirs = ref_opt.state_dict()["state"]
    if sorted(full["state"]) != sorted(theirs):
        return float("inf")
    return max((full["state"][i][k].float() - v.float()).abs().max().item() if k != "step"
               else abs(float(full["state"][i][k]) - float(v))
               for i, st in theirs.items() for k, v in st.items())


def _join_worker(rank, world_size):
    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}
    refs = {how: _reference(how) for how in ("frozen", "add")}
    for how, stage, resume in (("frozen", 1, False), ("add", 2, True)):
        module, opt = _zero_run(rank, world_size, how, stage, "cpu", resume)
        ref_model, ref_opt = refs[how]
        item = dict(diff=(models.flat_params(module) - models.flat_params(ref_model)).abs().max().item())
        full = opt.consolidate_state_dict()
        if rank == 0:
            item["state_diff"] = _state_diff(full, ref_opt)
        out[(how, stage, resume)] = item
    # bf16 parameters (staging of the rounded masters grown too): the same run without offload.
    runs = [_zero_run(rank, world_size, "frozen", 2, offload, True, torch.bfloat16) for offload in (None, "cpu")]
    out["bf16"] = dict(diff=(models.flat_params(runs[0][0]) - models.flat_params(runs[1][0])).abs().max().item())
    return out


def test_offload_parameters_join_after_the_first_step_and_after_a_load():
    """Before the fix each of these raised NotImplementedError ("parameters cannot join once
    the optimizer state exists") at the step or backward that took the backbone on."""
    for per_rank in run_distributed(_join_worker, 2, timeout=120):
        for key, item in per_rank.items():
            assert item["diff"] < TOL, (key, item)
            assert item.get("state_diff", 0.0) < TOL, (key, item)


def _single_process_pair(device, dtype):
    """One process, no DDP (parameters join at the step that sees them trainable), a GradScaler
    and a clip: offload against the same run without it."""
    import fusedist

    finals = []
    for offload in (None, "cpu"):
        model = _mlp().to(device=device, dtype=dtype)
        opt = fusedist.ZeroRedundancyOptimizer(list(model.parameters()), torch.optim.AdamW, lr=1e-2,
                                               weight_decay=0.1, offload=offload, bucket_cap_mb=0.0002)
        scaler = fusedist.amp.GradScaler(device, init_scale=2.0**10)
        for step in range(STEPS):
            if step == UNFREEZE:
                model[0].requires_grad_(True)
            x, y = (t.to(device) for t in _batch(step))
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
            scaler.scale(loss * (float("inf") if step == UNFREEZE + 1 else 1.0)).backward()
            scaler.unscale_(opt)
            opt.clip_grad_norm_(0.5)
            scaler.step(opt)
            scaler.update()
        finals.append((models.flat_params(model).float().cpu(), opt))
    return finals


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_offload_join_without_ddp_with_scaler_and_clip(device, monkeypatch):
    """The joined parameters' host buffers (pinned on CUDA) hold their masters and gradients;
    an overflowing step right after the join skips them too."""
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    (a, _), (b, opt) = _single_process_pair(device, dtype)
    if device == "cuda":
        assert all(t.is_pinned() for t in [*opt._offload.masters.values(), *opt._offload.host_grads.values()])
    assert (a - b).abs().max().item() < (1e-2 if dtype == torch.bfloat16 else TOL)
