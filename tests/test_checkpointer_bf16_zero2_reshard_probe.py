"""A Checkpointer job of bf16 parameters on ZeRO-2 + FusedAdamW with FP32 master weights, a
GradScaler with hysteresis (one overflow on one rank), clipping and a StepLR, saved at world 3
under a root whose name holds a space and a non-ASCII letter, restored at world 2: the
optimizer's consolidated state (masters, moments, step counts, hyperparameters), the
parameters, the scaler's and the scheduler's state come back bit for bit.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fusedist.testing import run_distributed

ROWS = 6  # the global batch, split evenly over 3 or 2 ranks


def _job(seed: int):
    import fusedist

    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.bfloat16))
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), fusedist.optim.FusedAdamW, stage=2, lr=1e-2,
                                           weight_decay=0.1, master_weights=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2, hysteresis=2)
    return model, opt, sched, scaler


def _everything(model, opt, sched, scaler) -> dict:
    opt.consolidate_state_dict(0)
    return {"optimizer": opt.state_dict() if opt.rank == 0 else None, "scaler": scaler.state_dict(),
            "sched": sched.state_dict(), "params": [p.detach().clone() for p in model.parameters()]}


def _rank(rank, world_size, root, phase):
    import fusedist
    from fusedist.checkpoint import Checkpointer

    model, opt, sched, scaler = _job(0 if phase == "save" else 7)
    ckpt = Checkpointer(root, keep=2, run_id="bf16-zero2")
    start = ckpt.restore(model, opt, scaler, lr_scheduler=sched)
    if phase == "restore":
        state = _everything(model, opt, sched, scaler)
        ckpt.close()
        return start, state
    rows = ROWS // world_size
    for step in range(start, 4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(ROWS, 8, generator=g).to(torch.bfloat16), torch.randn(ROWS, 3, generator=g)
        opt.zero_grad()
        mine = slice(rank * rows, (rank + 1) * rows)
        loss = (model(x[mine]).float() - y[mine]).pow(2).mean()
        if step == 2 and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        fusedist.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
        ckpt.save(step + 1)
    ckpt.close()
    return 4, _everything(model, opt, sched, scaler)


def _assert_same(saved, restored, where=""):
    if isinstance(saved, torch.Tensor):
        assert torch.equal(saved, restored) and saved.dtype == restored.dtype, where
    elif isinstance(saved, dict):
        assert saved.keys() == restored.keys(), where
        for k in saved:
            _assert_same(saved[k], restored[k], f"{where}[{k!r}]")
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(restored), where
        for i, (a, b) in enumerate(zip(saved, restored)):
            _assert_same(a, b, f"{where}[{i}]")
    else:
        assert saved == restored, f"{where}: {saved!r} != {restored!r}"


def test_bf16_zero2_masters_scaler_and_scheduler_restore_at_another_world_size(tmp_path):
    root = os.path.join(str(tmp_path), "run ü 1")
    saved = run_distributed(_rank, 3, root, "save", timeout=120)[0][1]
    restored = run_distributed(_rank, 2, root, "restore", timeout=120)
    for start, state in restored:
        assert start == 4
        _assert_same(saved["params"], state["params"], "params")
        _assert_same(saved["scaler"], state["scaler"], "scaler")
        _assert_same(saved["sched"], state["sched"], "sched")
    _assert_same(saved["optimizer"], restored[0][1]["optimizer"], "optimizer")
    assert saved["scaler"]["_hysteresis_tracker"] == 2  # the overflow at step 2 was absorbed, then reset
