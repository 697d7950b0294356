"""``fusedist.amp.GradScaler`` given two names of one stepped optimizer in one iteration: the optimizer a
program kept after a strategy handed it over to a fused one (``hand_over`` in
fusedist/integrations/_optimizer_swap.py), the strategy's optimizer, and Fabric's or Lightning's wrapper
of either. ``unscale_`` through one and ``step`` through another unscale the gradients once, and a second
``unscale_`` or ``step`` through the other name is refused with torch's message (Note [one scaler state
per stepped optimizer] in fusedist/optim/_scaler_protocol.py).

Reference: torch.amp.GradScaler with ``unscale_`` and ``step`` on one torch.optim.SGD (momentum, so an
update divided twice by the scale is visible: it is ``scale`` times too small), over fresh random
gradients with an overflow in one iteration; the seed is in every failure message. Tolerance: the scales
are powers of two, so the unscaled gradients are exact; fp32 SGD with momentum in another kernel,
1e-6. Scales exactly.
"""

from __future__ import annotations

import random

import pytest
import torch
from lightning.fabric.wrappers import _FabricOptimizer
from lightning.pytorch.core.optimizer import LightningOptimizer

from fusedist.amp import GradScaler
from fusedist.integrations._optimizer_swap import convert_optimizer, hand_over

SHAPES = [(5,), (3, 4)]
OVERFLOW_AT = 1
STEPS = 4


class _Strategy:
    """What Fabric's strategy does with the wrapper's step at 32-bit precision: step the optimizer."""

    def optimizer_step(self, optimizer, **kwargs):
        return optimizer.step(**kwargs)


def _params(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(scaler, unscale_through, step_through, params, seed):
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(seed * 100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 8.0  # (as if scaled by init_scale 8)
        if step == OVERFLOW_AT:
            params[1].grad.view(-1)[3] = float("inf")
        scaler.scale(torch.zeros(()))
        scaler.unscale_(unscale_through)
        scaler.step(step_through)
        scaler.update()
    return scaler.get_scale()


def _torch_run(seed):
    params = _params(seed)
    opt = _sgd(params)
    scale = _train(torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2), opt, opt, params, seed)
    return scale, params


def _names(kind, params):
    """{name: object} of one stepped optimizer, as a Fabric program holds them."""
    kept = _sgd(params)
    if kind == "handed over":  # the strategy's fused optimizer, in the kept one's place
        strategy_opt = convert_optimizer(kept, fused_optimizer=True, zero_stage=0, master_weights=False,
                                         strategy="test", fresh_from="a fresh optimizer")
        hand_over(kept, strategy_opt, [])
    else:  # the strategy keeps torch's optimizer (fused_optimizer=False): torch's path of the scaler
        strategy_opt = kept
    return {"kept": kept, "strategy": strategy_opt, "fabric": _FabricOptimizer(strategy_opt, _Strategy()),
            "lightning": LightningOptimizer(strategy_opt)}


PAIRS = [("fabric", "kept"), ("kept", "fabric"), ("strategy", "kept"), ("kept", "strategy"),
         ("fabric", "strategy"), ("lightning", "strategy")]
# (under torch's path the kept optimizer is the strategy's: that pair is one object)
CASES = [(kind, a, b) for kind in ("handed over", "torch path") for a, b in PAIRS
         if kind == "handed over" or {a, b} != {"kept", "strategy"}]


@pytest.mark.parametrize("kind,unscale_name,step_name", CASES, ids=[f"{k}:{a}-{b}" for k, a, b in CASES])
def test_unscale_through_one_name_step_through_another_unscales_once(kind, unscale_name, step_name):
    """The record was kept per name: step() found its name "not unscaled" and unscaled again
    (SGD's updates 8 times too small from the first step)."""
    seed = random.randrange(2**31)
    want_scale, want = _torch_run(seed)
    params = _params(seed)
    names = _names(kind, params)
    got_scale = _train(GradScaler("cpu", init_scale=8.0, growth_interval=2), names[unscale_name],
                       names[step_name], params, seed)
    assert got_scale == want_scale, f"seed {seed}"
    for a, b in zip(params, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("kind", ["handed over", "torch path"])
def test_second_unscale_or_step_through_another_name_refused_as_torch(kind):
    """torch refuses unscale_ twice and step twice in one iteration; through two names of one
    optimizer both went through (the second unscale_ divided the gradients again)."""
    params = _params(0)
    names = _names(kind, params)
    scaler = GradScaler("cpu", init_scale=8.0)
    for p in params:
        p.grad = torch.ones_like(p) * 8.0
    scaler.scale(torch.zeros(()))
    scaler.unscale_(names["fabric"])
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) has already been called on this optimizer since the "
                                           r"last update\(\)\.$"):
        scaler.unscale_(names["kept"])
    scaler.step(names["kept"])
    with pytest.raises(RuntimeError, match=r"^step\(\) has already been called since the last update\(\)\.$"):
        scaler.step(names["fabric"])
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) is being called after step\(\)\.$"):
        scaler.unscale_(names["strategy"])
    scaler.update()
    assert len(scaler._per_optimizer_states) == 0  # (a new iteration starts clean)
    momentum = [names["strategy"].state[p]["momentum_buffer"] for p in params]
    for buf in momentum:  # the unscaled gradient, once: 8 / 8
        torch.testing.assert_close(buf, torch.ones_like(buf), rtol=0, atol=0)
