"""A state dict of torch's Adam/AdamW made with ``capturable=True`` loads into FusedAdam/FusedAdamW as
into torch's own non-capturable optimizer: the groups keep the flag, the step counts are fp32 tensors
on the parameters' device, and training goes on as torch's would (Note [a capturable state dict] in
fusedist/optim/adam.py). It was refused ("capturable=True is not supported").

The state dict is written as torch writes it with ``capturable=True``: torch's optimizer trains a few
steps, then its groups say ``capturable: True`` and each step count is an fp32 tensor (on the
parameters' device: the CPU here). Reference: torch's optimizer of the same class loading the same
dict. On the CPU torch cannot step a capturable group ("params and state_steps must be on supported
devices"), so the reference then runs its groups with ``capturable=False``: the same update, computed
with the step count read on the host. Fresh random parameters and gradients; the seed is in every
failure message. Tolerance: fp32 Adam in another kernel over four steps, 1e-6 (the fused and torch
updates agree to a few ulps per step).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from fusedist.optim import FusedAdam, FusedAdamW

SHAPES = [(7,), (3, 5)]
CASES = [(torch.optim.AdamW, FusedAdamW, {}), (torch.optim.Adam, FusedAdam, {"weight_decay": 0.1}),
         (torch.optim.AdamW, FusedAdamW, {"amsgrad": True})]


def _params(gen):
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _steps(opt, params, gen, n):
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(n)]
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return grads


def _capturable_state_dict(torch_cls, settings, seed):
    """(parameter values, the state dict torch's ``capturable=True`` optimizer writes after two steps)."""
    gen = torch.Generator().manual_seed(seed)
    params = _params(gen)
    opt = torch_cls(params, lr=1e-2, **settings)
    _steps(opt, params, gen, 2)
    state_dict = copy.deepcopy(opt.state_dict())
    for group in state_dict["param_groups"]:
        group["capturable"] = True
    for state in state_dict["state"].values():  # (torch's capturable step counts: fp32 on the device)
        state["step"] = state["step"].to(torch.float32)
    return [p.detach().clone() for p in params], state_dict


@pytest.mark.parametrize("torch_cls,fused_cls,settings", CASES,
                         ids=["AdamW", "Adam weight decay", "AdamW amsgrad"])
def test_capturable_state_dict_loads_and_trains_as_torch(torch_cls, fused_cls, settings):
    seed = random.randrange(2**31)
    values, state_dict = _capturable_state_dict(torch_cls, settings, seed)

    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    ref = torch_cls(theirs, lr=1e-2, **settings)
    ref.load_state_dict(copy.deepcopy(state_dict))
    ours = [torch.nn.Parameter(v.clone()) for v in values]
    opt = fused_cls(ours, lr=1e-2, **settings)
    opt.load_state_dict(copy.deepcopy(state_dict))

    # loaded as torch's: the groups keep the flag (a state dict saved again gives it back)
    assert [g["capturable"] for g in opt.param_groups] == [g["capturable"] for g in ref.param_groups] == [True]
    saved = opt.state_dict()["param_groups"]
    assert saved == ref.state_dict()["param_groups"], f"seed {seed}"
    for p in ours:
        step = opt.state[p]["step"]
        assert step.dtype == torch.float32 and step.device == p.device and float(step) == 2.0

    for group in ref.param_groups:  # (torch cannot step a capturable group on the CPU; same update)
        group["capturable"] = False
    gen = torch.Generator().manual_seed(seed + 1)
    for step in _steps(ref, theirs, gen, 4):
        for p, g in zip(ours, step):
            p.grad = g.clone()
        opt.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in ref.state[b]:
                torch.testing.assert_close(opt.state[a][key], ref.state[b][key], rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"seed {seed}, {key}: {m}")
        assert float(opt.state[a]["step"]) == float(ref.state[b]["step"]) == 6.0


def test_capturable_still_refused_by_the_constructor():
    """Asking for a step that can be captured in a CUDA graph, which the fused step does not promise."""
    with pytest.raises(ValueError, match=r"FusedAdamW: capturable=True is not supported"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(2))], capturable=True)
