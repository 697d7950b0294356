"""fusedist.amp.GradScaler: a loss scale below ``min_scale`` (from ``update(new_scale)`` or a
loaded torch state dict) and overflowing steps. A backoff must never raise the scale; the
steps are skipped as torch's scaler skips them."""

from __future__ import annotations

import warnings

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdamW


def _overflowing_run(how: str, hysteresis: int, steps: int = 4):
    """Scale 2**6 under min_scale=2**8, then overflows from step 1 on: ours and torch's
    (torch's has no floor) side by side; (our scales, parameters, torch's parameters)."""
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(5, generator=gen)
    ours, theirs = init.clone().requires_grad_(), init.clone().requires_grad_()
    opt, ref = FusedAdamW([ours], lr=1e-2), torch.optim.AdamW([theirs], lr=1e-2)
    sc = GradScaler("cpu", init_scale=2.0 ** 10, min_scale=2.0 ** 8, hysteresis=hysteresis)
    rsc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
    if how == "torch state":
        sc.load_state_dict(rsc.state_dict())
    scales = []
    for step in range(steps):
        x = torch.randn(5, generator=gen) * (float("inf") if step >= 1 else 1.0)
        for s, p, o in ((sc, ours, opt), (rsc, theirs, ref)):
            o.zero_grad()
            s.scale((p * x).sum()).backward()
            s.step(o)
        sc.update(2.0 ** 6 if how == "new_scale" and step == 0 else None)
        rsc.update()
        scales.append(sc.get_scale())
    return scales, ours, theirs


@pytest.mark.parametrize("hysteresis", [1, 2])
@pytest.mark.parametrize("how", ["torch state", "new_scale"])
def test_an_overflow_below_min_scale_never_raises_the_scale(how, hysteresis):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the overflow-at-the-floor warning)
        scales, ours, theirs = _overflowing_run(how, hysteresis)
    assert scales == [2.0 ** 6] * 4, scales  # was: 64 -> 256 at the first backoff
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-6)  # steps 1-3 skipped by both


def test_an_overflow_below_min_scale_warns_as_at_the_floor():
    with pytest.warns(RuntimeWarning, match="min_scale"):
        _overflowing_run("torch state", 1)


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan"), -2.0])
def test_update_to_a_scale_it_cannot_train_with_is_refused_and_changes_nothing(bad):
    """torch's update(new_scale) takes 0 (every gradient zero, steps go on, the scale never
    grows) or inf/nan (every step skipped for good) silently; after the refusal the iteration
    ends as torch's does with update()."""
    gen = torch.Generator().manual_seed(1)
    init = torch.randn(4, generator=gen)
    ours, theirs = init.clone().requires_grad_(), init.clone().requires_grad_()
    opt, ref = FusedAdamW([ours], lr=1e-2), torch.optim.AdamW([theirs], lr=1e-2)
    sc, rsc = GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1), torch.amp.GradScaler(
        "cpu", init_scale=2.0 ** 4, growth_interval=1)
    for step in range(3):
        x = torch.randn(4, generator=gen)
        for s, p, o in ((sc, ours, opt), (rsc, theirs, ref)):
            o.zero_grad()
            s.scale((p * x).sum()).backward()
            s.step(o)
        if step == 1:
            with pytest.raises(ValueError, match="new_scale must be a finite number > 0"):
                sc.update(bad)
            assert sc.get_scale() == 2.0 ** 5
        sc.update()
        rsc.update()
        assert (sc.get_scale(), sc._get_growth_tracker()) == (rsc.get_scale(), rsc._get_growth_tracker())
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-6)
