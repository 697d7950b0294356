"""Step hooks of an optimizer whose step the scaler skips for inf/nan gradients, against torch.

torch's scaler does not call ``step`` of an unfused optimizer on an overflow, so its
``register_step_pre_hook`` / ``register_step_post_hook`` hooks do not run; it calls a
``fused=True`` one anyway (it skips on the device), whose hooks then run. fusedist's fused
optimizers are always called; their hooks ran on every skipped step (Note [a skipped step runs
no step hooks] in fusedist/amp/skipped_step.py). Oracle: torch's AdamW (foreach, and fused=True)
under torch's scaler, with an EMA of the weights kept by a post-hook.
Tolerance: fp32 AdamW steps and EMA updates in another operation order, 1e-6.
"""

from __future__ import annotations

import random

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdamW

OVERFLOWS = {1: float("inf"), 3: float("nan")}


def _loop(params, opt, scaler, seed, unscale_first):
    """Five iterations with an EMA post-hook: (hook calls, EMA)."""
    ema = [p.detach().clone() for p in params]
    calls = []

    def pre(optimizer, args, kwargs):
        calls.append("pre")

    def post(optimizer, args, kwargs):
        calls.append("post")
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p, 0.5)

    handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
    gen = torch.Generator().manual_seed(seed)
    for step in range(5):
        opt.zero_grad()
        loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params)
        scaler.scale(loss * OVERFLOWS.get(step, 1.0)).backward()
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    for handle in handles:
        handle.remove()
    return calls, ema


def _twins(fused_group: bool) -> tuple:
    """(seed, our parameters, torch's equal copies, the optimizers' settings, the scalers' settings)."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(4,), (2, 3)]]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=0.1, fused=True) if fused_group else dict(lr=0.1)
    return seed, ours, theirs, kw, dict(init_scale=2.0 ** 6, growth_interval=2)


@pytest.mark.parametrize("fused_group", [False, True])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_a_skipped_step_runs_the_optimizers_hooks_as_torch(fused_group, unscale_first):
    """Before: the pre- and post-hooks ran on both skipped steps (EMA 1e-1 away, 10 calls
    where torch's made 6)."""
    seed, ours, theirs, kw, settings = _twins(fused_group)
    got = _loop(ours, FusedAdamW(ours, **kw), GradScaler("cpu", **settings), seed, unscale_first)
    want = _loop(theirs, torch.optim.AdamW(theirs, **kw), torch.amp.GradScaler("cpu", **settings), seed, unscale_first)
    assert got[0] == want[0], (seed, got[0], want[0])
    assert len(want[0]) == (10 if fused_group else 6)  # (torch's fused optimizers run theirs)
    for a, b in zip(got[1] + ours, want[1] + theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")


def _loop_with_step_wrapper(params, opt, scaler, seed):
    """accelerate's ``AcceleratedOptimizer.step`` in five iterations: the optimizer's ``step`` set
    on the object to a wrapper noting it ran, put back after the scaler's step; the LR scheduler
    stepped only when it ran (accelerate's ``step_was_skipped``). (per-step flags, LRs)"""
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    original = opt.step
    called, flags, lrs = [], [], []

    def patched(*args, **kwargs):
        called.append(True)
        return original(*args, **kwargs)

    gen = torch.Generator().manual_seed(seed)
    for step in range(5):
        opt.zero_grad()
        loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params)
        scaler.scale(loss * OVERFLOWS.get(step, 1.0)).backward()
        called.clear()
        opt.step = patched
        scaler.step(opt)
        scaler.update()
        opt.step = original
        flags.append(bool(called))
        if called:
            scheduler.step()
        lrs.append(scheduler.get_last_lr())
    return flags, lrs


@pytest.mark.parametrize("fused_group", [False, True])
def test_a_skipped_step_calls_no_step_wrapper_set_on_the_optimizer_as_torch(fused_group):
    """Before: the wrapper ran on both skipped steps, so the accelerate-style loop saw no
    overflow and halved the LR five times, where torch's skipped steps left it at three."""
    seed, ours, theirs, kw, settings = _twins(fused_group)
    got = _loop_with_step_wrapper(ours, FusedAdamW(ours, **kw), GradScaler("cpu", **settings), seed)
    want = _loop_with_step_wrapper(theirs, torch.optim.AdamW(theirs, **kw), torch.amp.GradScaler("cpu", **settings),
                                   seed)
    assert got == want, (seed, got, want)
    assert want[0] == ([True] * 5 if fused_group else [True, False, True, False, True])  # (torch's fused: called)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
