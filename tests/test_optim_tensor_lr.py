"""Fused optimizers and GradScaler against torch: a tensor learning rate (given,
scheduled, refused, and through state dicts both ways) and the LR scheduler's warning after a
first step the scaler skipped.

Inputs are fresh random values per run; the seed (from random.randrange) is in every failure
message. Parameters are fp32: both sides differ only by rounding of the optimizer math (torch's
single-tensor Adam forms ``lr / bias_correction`` in the lr tensor's fp32, fusedist in fp64), a
few fp32 ulps per step on values of order 1, so 1e-6 absolute (as in test_optim.py).
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdam, FusedAdamW, FusedSGD

from test_optim import BACKENDS, DEVICE  # noqa: F401 - the backend fixture's parameters

SHAPES = [(5,), (3, 4), (1,)]
ATOL = 1e-6  # fp32 parameters of order 1, a few steps: see the module docstring
PAIRS = [(FusedAdam, torch.optim.Adam, {}), (FusedAdamW, torch.optim.AdamW, {}),
         (FusedSGD, torch.optim.SGD, dict(momentum=0.9, weight_decay=0.01))]
PAIR_IDS = ["Adam", "AdamW", "SGD"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


def _seed() -> int:
    return random.randrange(2**31)


def _twins(seed):
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.randn(s, generator=gen).to(DEVICE).requires_grad_() for s in SHAPES]
    return ours, [p.detach().clone().requires_grad_() for p in ours]


def _set_grads(seed, step, *param_lists, inf=False):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    grads = [torch.randn(s, generator=gen).to(DEVICE) for s in SHAPES]
    if inf:
        grads[1].view(-1)[0] = float("inf")
    for params in param_lists:
        for p, g in zip(params, grads):
            p.grad = g.clone()


def _assert_close(ours, theirs, seed, atol=ATOL):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=atol,
                                   msg=lambda m, i=i: f"param {i}, seed {seed}: {m}")


# -- 1. a tensor learning rate -----------------------------------------------------------------


@pytest.mark.parametrize("fused,ref_cls,kw", PAIRS, ids=PAIR_IDS)
def test_a_tensor_lr_steps_like_torch(backend, fused, ref_cls, kw):
    """torch's Adam/AdamW/SGD take a 1-element tensor lr, and a scheduler changes it in place;
    fusedist refused it (TypeError). Both now step with the tensor's current value."""
    seed = _seed()
    ours, theirs = _twins(seed)
    lr = 0.05 + random.Random(seed).random() * 0.05
    opt = fused(ours, lr=torch.tensor(lr), **kw)
    ref = ref_cls(theirs, lr=torch.tensor(lr), **kw)
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5) for o in (opt, ref)]
    for step in range(3):
        _set_grads(seed, step, ours, theirs)
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    torch.testing.assert_close(opt.param_groups[0]["lr"], ref.param_groups[0]["lr"], rtol=0, atol=0)
    _assert_close(ours, theirs, seed)


@pytest.mark.parametrize("fused,ref_cls,kw", PAIRS, ids=PAIR_IDS)
def test_a_tensor_lr_put_into_a_group_steps_like_torch(fused, ref_cls, kw):
    """A program replacing a group's float lr by a tensor between steps."""
    seed = _seed()
    ours, theirs = _twins(seed)
    opt, ref = fused(ours, lr=0.1, **kw), ref_cls(theirs, lr=0.1, **kw)
    for step in range(2):
        if step == 1:
            for o in (opt, ref):
                o.param_groups[0]["lr"] = torch.tensor([0.03])  # 1-element, not 0-d: torch squeezes it
        _set_grads(seed, step, ours, theirs)
        opt.step()
        ref.step()
    _assert_close(ours, theirs, seed)


@pytest.mark.parametrize("fused,ref_cls,kw", PAIRS, ids=PAIR_IDS)
def test_a_tensor_lr_of_several_elements_is_refused_like_torch(fused, ref_cls, kw):
    """torch: ValueError "Tensor lr must be 1-element", from the constructor."""
    ours, theirs = _twins(0)
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        ref_cls(theirs, lr=torch.tensor([0.1, 0.2]), **kw)
    with pytest.raises(ValueError, match=r"param group 0.*Tensor lr must be 1-element"):
        fused(ours, lr=torch.tensor([0.1, 0.2]), **kw)


@pytest.mark.parametrize("fused,ref_cls", [(FusedAdam, torch.optim.Adam), (FusedAdamW, torch.optim.AdamW)],
                         ids=["Adam", "AdamW"])
def test_a_tensor_lr_with_foreach_is_refused_like_torch(fused, ref_cls):
    """torch's Adam/AdamW refuse a tensor lr with foreach=True (not capturable): ValueError from
    the constructor, RuntimeError from a step after a tensor was put into such a group, which
    then changes nothing."""
    seed = _seed()
    ours, theirs = _twins(seed)
    message = "lr as a Tensor is not supported for capturable=False and foreach=True"
    for cls, params in ((ref_cls, theirs), (fused, ours)):
        with pytest.raises(ValueError, match=message):
            cls(params, lr=torch.tensor(0.1), foreach=True)
    opt, ref = fused(ours, lr=0.1, foreach=True), ref_cls(theirs, lr=0.1, foreach=True)
    _set_grads(seed, 0, ours, theirs)
    for o in (opt, ref):
        o.param_groups[0]["lr"] = torch.tensor(0.1)
        with pytest.raises(RuntimeError, match=message):
            o.step()
    _assert_close(ours, theirs, seed, atol=0)
    assert not any(opt.state[p] for p in ours)


@pytest.mark.parametrize("direction", ["fusedist to torch", "torch to fusedist"])
@pytest.mark.parametrize("fused,ref_cls,kw", PAIRS, ids=PAIR_IDS)
def test_a_tensor_lr_survives_state_dicts_both_ways(fused, ref_cls, kw, direction):
    """A state dict with a tensor lr, saved by one library and loaded by the other: the loader
    keeps the tensor and both then step alike."""
    seed = _seed()
    ours, theirs = _twins(seed)
    opt, ref = fused(ours, lr=torch.tensor(0.07), **kw), ref_cls(theirs, lr=torch.tensor(0.07), **kw)
    _set_grads(seed, 0, ours, theirs)
    opt.step()
    ref.step()
    src, dst = (opt, ref) if direction == "fusedist to torch" else (ref, opt)
    saved = copy.deepcopy(src.state_dict())  # torch's loader would share same-device state tensors
    saved["param_groups"][0]["lr"] = torch.tensor(0.02)
    src.param_groups[0]["lr"] = torch.tensor(0.02)
    dst.load_state_dict(saved)
    assert isinstance(dst.param_groups[0]["lr"], torch.Tensor)
    for step in (1, 2):
        _set_grads(seed, step, ours, theirs)
        opt.step()
        ref.step()
    _assert_close(ours, theirs, seed)


# -- 2. the LR scheduler's warning after a step the scaler skipped -----------------------------


def _scheduler_warnings(opt, scaler, params, seed, overflows, unscale):
    """Messages the scheduler's first step warns with, after one scaler iteration per entry of
    ``overflows`` (True: an inf gradient, so the scaler skips that step)."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    scaler.scale(torch.zeros((), device=DEVICE))
    for step, inf in enumerate(overflows):
        _set_grads(seed, step, params, inf=inf)
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step()
    return [str(w.message).split(".")[0] for w in caught]


@pytest.mark.parametrize("fused_flag", [None, True], ids=["default", "fused=True"])
@pytest.mark.parametrize("overflows", [(True,), (False,), (True, False), (True, True)],
                         ids=["skipped", "ran", "skipped then ran", "skipped twice"])
@pytest.mark.parametrize("unscale", [False, True], ids=["step only", "unscale_ first"])
@pytest.mark.parametrize("fused,ref_cls", [(FusedAdamW, torch.optim.AdamW), (FusedSGD, torch.optim.SGD)],
                         ids=["AdamW", "SGD"])
def test_the_scheduler_warns_after_a_skipped_first_step_like_torch(fused, ref_cls, unscale, overflows, fused_flag):
    """torch's scaler skips an overflowed step by not calling its optimizer's step, so an LR
    scheduler stepped after only skipped steps warns "Detected call of `lr_scheduler.step()`
    before `optimizer.step()`"; with fused=True torch calls step (it skips on the device) and no
    warning comes. fusedist's scaler always called step, so it never warned."""
    seed = _seed()
    ours, theirs = _twins(seed)
    opt, ref = fused(ours, lr=0.1, fused=fused_flag), ref_cls(theirs, lr=0.1, fused=fused_flag)
    got = _scheduler_warnings(opt, GradScaler(DEVICE.type, init_scale=4.0), ours, seed, overflows, unscale)
    want = _scheduler_warnings(ref, torch.amp.GradScaler(DEVICE.type, init_scale=4.0), theirs, seed, overflows,
                               unscale)
    assert got == want, f"seed {seed}"
    assert bool(want) == (all(overflows) and fused_flag is None)  # what torch 2.13 does
    _assert_close(ours, theirs, seed)
