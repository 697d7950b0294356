"""A state dict of torch's Adam/AdamW made with ``capturable=True`` loads into
``ZeroRedundancyOptimizer(..., offload="cpu")`` as into torch's non-capturable optimizer, and training
goes on as torch's (Note [a capturable group offloaded] in fusedist/zero/offload.py). It was refused
("capturable=True is not supported by the host Adam").

The state dict is written as torch writes it with ``capturable=True``: torch's optimizer trains two
steps, then its groups say ``capturable: True`` and each step count is an fp32 tensor. Reference:
torch's optimizer of the same class loading the same dict; torch cannot step a capturable group on the
CPU, so it then runs its groups with ``capturable=False`` (the same update, the step count read on the
host). World size 1 (no process group: the offloaded step is the same code at any world size). Fresh
random weights and batches; the seed is in every failure message. Tolerance 1e-6 (fp32): the host C++
Adam agrees with torch's foreach Adam to a few ulps per step (torch's lerp uses an FMA); over four
steps of lr 1e-2 on O(0.1) weights that stays far below 1e-6, while a missed or doubled step count
(bias correction) or a lost moment moves parameters by ~1e-3.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import fusedist
from fusedist.optim import FusedAdam, FusedAdamW

CASES = [(torch.optim.AdamW, FusedAdamW, {}), (torch.optim.AdamW, torch.optim.AdamW, {}),
         (torch.optim.Adam, FusedAdam, {"weight_decay": 0.1})]


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _train(model, opt, gen, steps):
    for _ in range(steps):
        x, y = torch.randn(6, 5, generator=gen), torch.randn(6, 3, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _capturable_state_dict(torch_cls, settings, seed):
    """(the model after two steps of torch's optimizer, the state dict a capturable one writes then)."""
    model = _model(seed)
    opt = torch_cls(model.parameters(), lr=1e-2, **settings)
    _train(model, opt, torch.Generator().manual_seed(seed), 2)
    state_dict = copy.deepcopy(opt.state_dict())
    for group in state_dict["param_groups"]:
        group["capturable"] = True
    for state in state_dict["state"].values():  # (torch's capturable step counts: fp32)
        state["step"] = state["step"].to(torch.float32)
    return model, state_dict


@pytest.mark.parametrize("torch_cls,inner_cls,settings", CASES,
                         ids=["FusedAdamW", "torch AdamW", "FusedAdam weight decay"])
def test_offload_loads_a_capturable_state_dict_and_trains_as_torch(torch_cls, inner_cls, settings):
    seed = random.randrange(2**31)
    trained, state_dict = _capturable_state_dict(torch_cls, settings, seed)

    theirs = copy.deepcopy(trained)
    ref = torch_cls(theirs.parameters(), lr=1e-2, **settings)
    ref.load_state_dict(copy.deepcopy(state_dict))
    ours = copy.deepcopy(trained)
    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), inner_cls, lr=1e-2, offload="cpu",
                                           bucket_cap_mb=0.0005, **settings)
    opt.load_state_dict(copy.deepcopy(state_dict))
    assert [g["capturable"] for g in opt.param_groups] == [True], f"seed {seed}"

    for group in ref.param_groups:  # (torch cannot step a capturable group on the CPU; same update)
        group["capturable"] = False
    _train(theirs, ref, torch.Generator().manual_seed(seed + 1), 4)
    _train(ours, opt, torch.Generator().manual_seed(seed + 1), 4)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"seed {seed}, {name}: {m}")

    opt.consolidate_state_dict(to=0)
    saved = opt.state_dict()
    assert [g["capturable"] for g in saved["param_groups"]] == [True], f"seed {seed}"
    expected = ref.state_dict()["state"]
    assert sorted(saved["state"]) == sorted(expected)
    for index, state in expected.items():
        assert float(saved["state"][index]["step"]) == float(state["step"]) == 6.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(saved["state"][index][key], state[key], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"seed {seed}, state {index} {key}: {m}")


@pytest.mark.parametrize("how", ["defaults", "group", "partial"])
@pytest.mark.parametrize("torch_cls", [torch.optim.AdamW, torch.optim.Adam])
def test_offload_refuses_capturable_at_construction_and_loads_it(torch_cls, how):
    """``capturable=True`` given to the constructor asks for a step a CUDA graph can capture, which
    the host step is not (Note [a capturable group offloaded]): it was taken silently and failed
    later, inside the user's capture. torch's own optimizer over parameters it cannot capture
    refuses the flag as well (at its first step). The same flag in a loaded state dict still loads
    and trains as torch's (the test above); here a fresh optimizer built right after the refusal
    loads one and steps as torch's non-capturable optimizer does."""
    import functools

    seed = random.randrange(2**31)
    trained, state_dict = _capturable_state_dict(torch_cls, {}, seed)
    probe = copy.deepcopy(trained)
    ref = torch_cls(probe.parameters(), lr=1e-2, capturable=True)  # torch's reference: refused at its step
    probe(torch.randn(2, 5)).sum().backward()
    with pytest.raises(AssertionError, match="capturable=True"):
        ref.step()

    ours = copy.deepcopy(trained)
    params = list(ours.parameters())
    kwargs = dict(lr=1e-2, offload="cpu", bucket_cap_mb=0.0005)
    if how == "defaults":
        args, kwargs["capturable"] = (params, torch_cls), True
    elif how == "group":
        args = ([{"params": params[:2]}, {"params": params[2:], "capturable": True}], torch_cls)
    else:
        args = (params, functools.partial(torch_cls, capturable=True))
    with pytest.raises(ValueError) as refused:
        fusedist.ZeroRedundancyOptimizer(*args, **kwargs)
    message = str(refused.value)
    assert "offload='cpu'" in message and "capturable=True" in message and "CUDA graph" in message, message
    assert f"param group {1 if how == 'group' else 0}" in message, message

    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), torch_cls, lr=1e-2, offload="cpu",
                                           bucket_cap_mb=0.0005)
    opt.load_state_dict(copy.deepcopy(state_dict))
    assert [g["capturable"] for g in opt.param_groups] == [True], f"seed {seed}"
    theirs = copy.deepcopy(trained)
    ref = torch_cls(theirs.parameters(), lr=1e-2)
    ref.load_state_dict(copy.deepcopy(state_dict))
    for group in ref.param_groups:
        group["capturable"] = False
    _train(theirs, ref, torch.Generator().manual_seed(seed + 1), 2)
    _train(ours, opt, torch.Generator().manual_seed(seed + 1), 2)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"seed {seed}, {name}: {m}")
