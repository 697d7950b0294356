"""``scaler.step(optimizer, closure)`` against torch.amp.GradScaler: a step skipped for inf/nan
gradients runs no closure and returns None (with ``fused=True``, as torch's fused AdamW, it runs
and its loss is returned); a closure passed by keyword is refused, as torch's scaler refuses it
(Note [a skipped step runs no closure] in fusedist/amp/grad_scaler.py).

Scales are powers of two and the closure only counts and returns a value, so both sides step
the same unscaled gradients: parameters agree to fp32 rounding of the optimizer math (1e-6).
"""

from __future__ import annotations

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdamW, FusedSGD

OVERFLOWS = {1: float("inf"), 2: float("nan"), 5: float("inf")}


def _loop(scaler, opt, params, unscale_first, steps=7):
    """Returns (closure calls, step return values, scales) of a loop whose closure returns its step."""
    calls, returned, scales = [], [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(50 + step)
        opt.zero_grad()
        loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params)
        scaler.scale(loss).backward()
        if step in OVERFLOWS:
            with torch.no_grad():
                params[0].grad.view(-1)[2] = OVERFLOWS[step]
        if unscale_first:
            scaler.unscale_(opt)

        def closure(step=step):
            calls.append(step)
            return torch.tensor(float(step))

        out = scaler.step(opt, closure)
        returned.append(None if out is None else float(out))
        scaler.update()
        scales.append(scaler.get_scale())
    return calls, returned, scales


@pytest.mark.parametrize("ours_cls, theirs_cls, lazy, unscale_first", [
    (FusedAdamW, torch.optim.AdamW, False, False),
    (FusedAdamW, torch.optim.AdamW, True, True),
    (FusedSGD, torch.optim.SGD, False, True),
])
def test_positional_closure_is_not_run_on_a_skipped_step(ours_cls, theirs_cls, lazy, unscale_first):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    ours_p = [torch.randn(s, generator=gen).requires_grad_() for s in [(7,), (3, 5)]]
    theirs_p = [p.detach().clone().requires_grad_() for p in ours_p]
    kw = dict(lr=1e-2, momentum=0.9) if ours_cls is FusedSGD else dict(lr=1e-2)
    settings = dict(init_scale=2.0**8, growth_interval=2)
    ours = _loop(GradScaler("cpu", lazy_unscale=lazy, **settings), ours_cls(ours_p, **kw), ours_p, unscale_first)
    theirs = _loop(torch.amp.GradScaler("cpu", **settings), theirs_cls(theirs_p, **kw), theirs_p, unscale_first)
    assert theirs[0] == [s for s in range(7) if s not in OVERFLOWS]  # (the reference skips them)
    assert ours == theirs
    for a, b in zip(ours_p, theirs_p):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step only", "unscale_ first"])
def test_closure_of_a_fused_true_optimizer_runs_on_a_skipped_step_as_torch(unscale_first):
    """torch's scaler calls a ``fused=True`` optimizer's step on a skipped step too (it skips on
    the device), so the closure runs and its loss is returned; ours skipped it for every group.
    A group built with ``fused=True`` now does as torch's fused AdamW does (as for its step hooks
    and the LR scheduler's flag)."""
    seed = int(torch.randint(0, 2**31, ()))
    gen = torch.Generator().manual_seed(seed)
    ours_p = [torch.randn(s, generator=gen).requires_grad_() for s in [(7,), (3, 5)]]
    theirs_p = [p.detach().clone().requires_grad_() for p in ours_p]
    settings = dict(init_scale=2.0**8, growth_interval=2)
    ours = _loop(GradScaler("cpu", **settings), FusedAdamW(ours_p, lr=1e-2, fused=True), ours_p, unscale_first)
    theirs = _loop(torch.amp.GradScaler("cpu", **settings), torch.optim.AdamW(theirs_p, lr=1e-2, fused=True),
                   theirs_p, unscale_first)
    assert theirs[0] == list(range(7)), seed  # (torch's fused AdamW runs it on the skipped steps too)
    assert ours == theirs, seed
    for a, b in zip(ours_p, theirs_p):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")


def test_keyword_closure_is_refused_as_torch_refuses_it():
    p = torch.randn(3, requires_grad=True)
    for scaler, opt in ((GradScaler("cpu"), FusedAdamW([p])), (torch.amp.GradScaler("cpu"), torch.optim.AdamW([p]))):
        scaler.scale(p.sum()).backward()
        with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
            scaler.step(opt, closure=lambda: None)
        p.grad = None


def test_a_skipped_first_step_with_a_closure_leaves_the_scheduler_warning_as_torch():
    """torch's scaler does not call the optimizer's step it skips, so an LR scheduler stepped
    after an overflowing first step warns that the optimizer never stepped; the fused step,
    run without the closure, reports the skip the same way."""
    caught = {}
    for name, scaler, make in (("ours", GradScaler("cpu"), FusedAdamW), ("torch", torch.amp.GradScaler("cpu"),
                                                                        torch.optim.AdamW)):
        p = torch.randn(3, requires_grad=True)
        opt = make([p], lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        scaler.scale(p.sum() * float("inf")).backward()
        with pytest.warns(UserWarning) as record:
            assert scaler.step(opt, lambda: 1.0) is None
            scaler.update()
            sched.step()
        caught[name] = [str(w.message)[:60] for w in record if "lr_scheduler" in str(w.message)]
    assert caught["torch"] and caught["ours"] == caught["torch"]


def _zero2_closure_vs_torch(rank, world):
    """ZeRO stage 2 with ``scaler.step(opt, closure)`` against torch DDP + AdamW + torch's
    scaler. The loop zeroes the gradients through the module (which does not reach stage 2's
    shards: a step consumes them), so a skipped step that left the overflowed shard in place
    would poison every later step."""
    import copy

    import fusedist

    torch.manual_seed(0)
    net = torch.nn.Linear(6, 4)
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(net))
    model = fusedist.DistributedDataParallel(net)
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), FusedAdamW, stage=2, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    calls = {"ours": [], "torch": []}
    sides = (("ours", model, opt, GradScaler("cpu", init_scale=2.0**8)),
             ("torch", ref, ref_opt, torch.amp.GradScaler("cpu", init_scale=2.0**8)))
    for step in range(5):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        for name, module, optimizer, scaler in sides:
            module.zero_grad()
            loss = module(x).pow(2).sum()
            if step == 1 and rank == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(optimizer, lambda name=name, step=step: calls[name].append(step))
            scaler.update()
    assert calls["torch"] == [0, 2, 3, 4] and calls["ours"] == calls["torch"], calls
    for a, b in zip(net.parameters(), ref.module.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


def test_zero_stage2_skipped_step_with_a_closure_matches_torch():
    from fusedist.testing import run_distributed

    run_distributed(_zero2_closure_vs_torch, 2)
