"""An LR scheduler built on an optimizer that a strategy handed over to another (Lightning's and
Fabric's fusedist strategies: ``hand_over`` in fusedist/integrations/_optimizer_swap.py) warns
"lr_scheduler.step() before optimizer.step()" exactly where torch's warns for a scheduler built
on the optimizer that steps: only after a first step the scaler skipped for an inf gradient.

In one process: the optimizer that steps is a FusedAdamW here (the strategies' ZeRO wrapper needs
a process group; tests/test_fabric_strategy.py runs that one against Fabric's DDP). Fresh random
gradients per run, the seed in every failure message; learning rates are compared exactly (both
sides multiply the same base lr by the same schedule factor).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.integrations._optimizer_swap import hand_over
from fusedist.optim import FusedAdamW

SHAPES = [(5,), (3, 4)]


def _params(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def _run(stepping, scheduler, scaler, params, seed, overflows):
    """The scheduler's step-order messages and the learning rates of ``stepping`` after one scaler
    iteration, then scheduler step, per entry of ``overflows`` (True: an inf gradient)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, inf in enumerate(overflows):
            gen = torch.Generator().manual_seed(seed * 100 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if inf:
                params[0].grad.view(-1)[0] = float("inf")
            scaler.scale(torch.zeros(()))
            scaler.step(stepping)
            scaler.update()
            scheduler.step()
    messages = [str(w.message).split(".")[0] for w in caught if "lr_scheduler" in str(w.message)]
    return messages, [group["lr"] for group in stepping.param_groups]


@pytest.mark.parametrize("overflows", [(True, False), (False, False), (True, True)],
                         ids=["skipped then ran", "ran", "skipped twice"])
@pytest.mark.parametrize("built_before", [True, False], ids=["built before", "built after"])
@pytest.mark.parametrize("original_cls", [FusedAdamW, torch.optim.AdamW], ids=["FusedAdamW", "AdamW"])
def test_scheduler_on_a_handed_over_optimizer_warns_as_torch(original_cls, built_before, overflows):
    """A user's FusedAdamW handed over (a strategy with zero_stage > 0 shards it) kept its own
    step flag: the hand-over's link to the new optimizer's flag was recorded as False, so a
    scheduler built on it (before or after the hand-over) warned at its first step although the
    new optimizer had stepped."""
    seed = random.randrange(2**31)
    theirs = _params(seed)
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    want = _run(ref, _schedule(ref), torch.amp.GradScaler("cpu", init_scale=4.0), theirs, seed, overflows)
    assert bool(want[0]) == overflows[0], f"seed {seed}"  # torch warns after a skipped first step only
    ours = _params(seed)
    original, new = original_cls(ours, lr=1e-2), FusedAdamW(ours, lr=1e-2)
    scheduler = _schedule(original) if built_before else None
    hand_over(original, new, [])  # (the strategy is not given the scheduler: fabric.setup_optimizers)
    scheduler = scheduler or _schedule(original)
    got = _run(new, scheduler, GradScaler("cpu", init_scale=4.0), ours, seed, overflows)
    assert got == want, f"seed {seed}"
