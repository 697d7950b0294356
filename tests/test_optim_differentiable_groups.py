"""A param group saying ``differentiable=True`` -- loaded from a state dict or added with
``add_param_group`` -- in a fused optimizer built without it, as in torch's optimizer built without it
(Note [a differentiable group] in fusedist/optim/adam.py). torch's step enables autograd by the
optimizer's defaults, not by the group: it runs without autograd and computes the ordinary update,
and the group keeps the flag. So do the fused optimizers. What torch refuses of such a group (Adam/AdamW
with ``foreach=True`` or ``fused=True``) is refused, before any group is stepped; the fused Adam stepped
it.

Reference: torch's optimizer of the same class, given the same dict or group. Fresh random parameters
and gradients; the seed is in every failure message. Tolerance (fp32, three steps of lr 1e-2 on O(1)
values): torch runs its single-tensor path for a differentiable group and the fused step another
kernel, a few ulps apart per step: rtol 1e-5, atol 1e-6 (a missed step or a lost moment moves a
parameter by ~1e-2).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from fusedist.optim import FusedAdam, FusedAdamW, FusedSGD

CASES = [(torch.optim.AdamW, FusedAdamW, {}), (torch.optim.Adam, FusedAdam, {"weight_decay": 0.1}),
         (torch.optim.SGD, FusedSGD, {"momentum": 0.9})]
IDS = ["AdamW", "Adam", "SGD momentum"]
SHAPES = [(7,), (3, 5)]


def _pair(gen, torch_cls, fused_cls, settings):
    values = [torch.randn(s, generator=gen) for s in SHAPES]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    ours = [torch.nn.Parameter(v.clone()) for v in values]
    return theirs, torch_cls(theirs[:1], lr=1e-2, **settings), ours, fused_cls(ours[:1], lr=1e-2, **settings)


def _step_both(gen, ref, theirs, opt, ours, steps=3):
    for _ in range(steps):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        ref.step()
        opt.step()


def _same(ours, theirs, seed):
    for a, b in zip(ours, theirs):
        assert a.grad_fn is None and b.grad_fn is None
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("torch_cls,fused_cls,settings", CASES, ids=IDS)
@pytest.mark.parametrize("how", ["loaded", "added"])
def test_a_differentiable_group_steps_as_torch(torch_cls, fused_cls, settings, how):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    theirs, ref, ours, opt = _pair(gen, torch_cls, fused_cls, settings)
    if how == "added":
        ref.add_param_group({"params": theirs[1:], "differentiable": True})
        opt.add_param_group({"params": ours[1:], "differentiable": True})
    else:
        for o in (ref, opt):
            o.add_param_group({"params": (theirs if o is ref else ours)[1:]})
        _step_both(gen, ref, theirs, opt, ours, steps=1)
        state_dict = copy.deepcopy(ref.state_dict())
        for group in state_dict["param_groups"]:
            group["differentiable"] = True
        ref.load_state_dict(copy.deepcopy(state_dict))
        opt.load_state_dict(state_dict)
    flags = [g["differentiable"] for g in opt.param_groups]
    assert flags == [g["differentiable"] for g in ref.param_groups] == [how == "loaded", True]
    _step_both(gen, ref, theirs, opt, ours)
    _same(ours, theirs, seed)
    saved = opt.state_dict()["param_groups"]
    assert [g["differentiable"] for g in saved] == flags, f"seed {seed}"


@pytest.mark.parametrize("torch_cls,fused_cls", [(torch.optim.AdamW, FusedAdamW), (torch.optim.Adam, FusedAdam)],
                         ids=["AdamW", "Adam"])
@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_a_differentiable_group_torch_cannot_step_is_refused_before_any_update(torch_cls, fused_cls,
                                                                               implementation):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    theirs, ref, ours, opt = _pair(gen, torch_cls, fused_cls, {})
    _step_both(gen, ref, theirs, opt, ours, steps=1)  # (state to keep)
    group = {"differentiable": True, implementation: True}
    ref.add_param_group({"params": theirs[1:], **group})
    opt.add_param_group({"params": ours[1:], **group})
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=gen)
        b.grad = a.grad.clone()
    with pytest.raises((AssertionError, RuntimeError)):  # torch's
        ref.step()
    before = [p.detach().clone() for p in ours]
    state_before = copy.deepcopy(opt.state_dict())
    with pytest.raises(RuntimeError, match=rf"{fused_cls.__name__} \(param group 1\): the group has "
                                           rf"differentiable=True and {implementation}=True.*nothing was updated"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, before)), f"seed {seed}"
    after = opt.state_dict()
    assert after["param_groups"] == state_before["param_groups"]
    for index, state in state_before["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][index][key], value), f"seed {seed}: state {index} {key}"

    opt.param_groups[1][implementation] = None  # as told: then it steps as torch's (which steps the same)
    ref.param_groups[1][implementation] = None
    ref.param_groups[0]["params"][0].grad = None  # (torch stepped group 0 before refusing group 1)
    opt.param_groups[0]["params"][0].grad = None
    ref.step()
    opt.step()
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
