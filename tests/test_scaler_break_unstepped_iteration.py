"""An iteration that unscale_s (and clips) but does not step, then gradients accumulated on.

A program may skip ``scaler.step`` for an iteration (say, for a norm it does not trust), call
``update()``, and let the next backward add to the same gradients. torch's ``unscale_`` and
``clip_grad_norm_`` wrote their results into ``p.grad``, so the next iteration adds to unscaled,
clipped gradients. fusedist's lazy unscale_ (and its clip, in either mode) only records a factor
for the step; without a step that factor must still reach ``p.grad`` by ``update()``. Oracle:
torch's GradScaler, torch's AdamW/SGD and torch's clip_grad_norm_, same gradients; tolerance 1e-6
(the same fp32 operations in another order).
"""

from __future__ import annotations

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdamW, FusedSGD, clip_grad_norm_

SKIPPED = 1  # the iteration that does not step; the next one accumulates onto its gradients


def _train(scaler, opt, params, clip):
    """Four iterations; gradients of the skipped one stay for the next. Returns the gradients
    left after the skipped iteration's update() and the final parameters."""
    left = None
    for it in range(4):
        if it != SKIPPED + 1:
            opt.zero_grad()
        scale = scaler.scale(torch.ones(())).item()
        gen = torch.Generator().manual_seed(it)
        for p in params:
            g = torch.randn(p.shape, generator=gen) * scale
            p.grad = g if p.grad is None else p.grad + g
        scaler.unscale_(opt)
        clip(params, 0.5)
        if it != SKIPPED:
            scaler.step(opt)
        scaler.update()
        if it == SKIPPED:
            left = [p.grad.clone() for p in params]
    return left, [p.detach().clone() for p in params]


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "in_place"])
@pytest.mark.parametrize("fused_cls,torch_cls,kwargs", [
    (FusedAdamW, torch.optim.AdamW, {"lr": 0.05}),
    (FusedSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
], ids=["adamw", "sgd"])
def test_unstepped_iteration_leaves_torchs_gradients(lazy, fused_cls, torch_cls, kwargs):
    settings = {"init_scale": 8.0, "growth_interval": 2}
    ref_params = _params()
    ref = _train(torch.amp.GradScaler("cpu", **settings), torch_cls(ref_params, **kwargs), ref_params,
                 torch.nn.utils.clip_grad_norm_)
    params = _params()
    got = _train(GradScaler("cpu", lazy_unscale=lazy, **settings), fused_cls(params, **kwargs), params,
                 clip_grad_norm_)
    for what, ours, theirs in zip(("gradients after the unstepped update()", "final parameters"), got, ref):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"param {i}, {what}: {m}")
