"""Fused optimizers, GradScaler and clip_grad_norm_ against torch where a program drives them
off the common path: a second clip after the recorded one, an iteration whose step the program
skipped, momentum switched on after the first steps, fp64 parameters and fp16 gradients under
the scaler, a state dict whose steps are numbers.

Scales are powers of two, so both sides see the same unscaled gradients and differ only by
rounding of the optimizer math: in fp32, parameters within 1e-6 (as in test_optim.py) and
norms within 1e-6 relative; fp64 tests give their own bound.
"""

from __future__ import annotations

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdamW, FusedSGD, clip_grad_norm_

from test_optim import BACKENDS, DEVICE  # noqa: F401 - the backend fixture's parameters

SHAPES = [(5,), (3, 4), (1,), (6, 2)]
ATOL = 1e-6


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


def _twins(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.randn(s, generator=gen).to(DEVICE, dtype).requires_grad_() for s in SHAPES]
    return ours, [p.detach().clone().requires_grad_() for p in ours]


def _set_grads(params, step, scale=1.0):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(DEVICE, p.dtype)


def _assert_close(ours, theirs, atol=ATOL):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=atol)


def _adamw_pair(seed=0, dtype=torch.float32):
    ours, theirs = _twins(seed, dtype)
    return ours, theirs, FusedAdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)


def _scalers(lazy_unscale=False, init_scale=4.0):
    """(fusedist's, torch's) GradScaler, both past their first scale() call."""
    pair = (GradScaler(DEVICE.type, init_scale=init_scale, lazy_unscale=lazy_unscale),
            torch.amp.GradScaler(DEVICE.type, init_scale=init_scale))
    for sc in pair:
        sc.scale(torch.zeros((), device=DEVICE))
    return pair


@pytest.mark.parametrize("lazy_unscale", [False, True], ids=["unscale in place", "lazy unscale"])
@pytest.mark.parametrize("second", ["subset", "inf norm"])
def test_a_clip_after_the_recorded_clip_sees_clipped_gradients(second, lazy_unscale):
    """fusedist's clip on the optimizer's parameters records its coefficient for the step
    (p.grad is left as it is); a second clip that runs torch's (a subset, another norm type)
    must see the gradients clipped by the first, as with torch, and the step apply both."""
    ours, theirs = _twins()
    opt, ref = FusedSGD(ours, lr=0.1, momentum=0.9), torch.optim.SGD(theirs, lr=0.1, momentum=0.9)
    sc, ref_sc = _scalers(lazy_unscale)
    _set_grads(ours, 0, 4.0)
    _set_grads(theirs, 0, 4.0)
    sc.unscale_(opt)
    ref_sc.unscale_(ref)
    first = clip_grad_norm_(ours, 0.5)
    torch.testing.assert_close(first, torch.nn.utils.clip_grad_norm_(theirs, 0.5), rtol=1e-6, atol=0)
    if second == "subset":
        n, t = clip_grad_norm_(ours[:2], 0.1), torch.nn.utils.clip_grad_norm_(theirs[:2], 0.1)
    else:
        n, t = (clip_grad_norm_(ours, 0.2, norm_type=float("inf")),
                torch.nn.utils.clip_grad_norm_(theirs, 0.2, norm_type=float("inf")))
    torch.testing.assert_close(n, t, rtol=1e-6, atol=0)
    sc.step(opt)
    ref_sc.step(ref)
    _assert_close(ours, theirs)


@pytest.mark.parametrize("lazy_unscale", [False, True], ids=["unscale in place", "lazy unscale"])
def test_an_iteration_whose_step_was_skipped_leaves_nothing_for_the_next(lazy_unscale):
    """unscale_ + clip, then no step (the program skipped it, e.g. for a non-finite norm) and
    update(): the next iteration's step without unscale_ must not apply the old clip
    coefficient or inverse scale, as torch's scaler forgets them at update()."""
    ours, theirs, opt, ref = _adamw_pair()
    sc, ref_sc = _scalers(lazy_unscale)
    for step in range(3):
        _set_grads(ours, step, sc.get_scale())
        _set_grads(theirs, step, ref_sc.get_scale())
        if step == 0:
            sc.unscale_(opt)
            ref_sc.unscale_(ref)
            clip_grad_norm_(ours, 0.1)
            torch.nn.utils.clip_grad_norm_(theirs, 0.1)
        else:
            sc.step(opt)
            ref_sc.step(ref)
        sc.update()
        ref_sc.update()
    assert sc.get_scale() == ref_sc.get_scale()
    _assert_close(ours, theirs)


def test_sgd_momentum_switched_on_after_the_first_steps_matches_torch(backend):
    """A group stepped with momentum 0 has no momentum buffers; when a schedule switches
    momentum on, torch's SGD starts each buffer from that step's gradient. The first group
    keeps momentum 0 throughout, the second switches (with dampening) at step 2."""
    ours, theirs = _twins()
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:]}]  # noqa: E731
    opt, ref = FusedSGD(groups(ours), lr=0.1), torch.optim.SGD(groups(theirs), lr=0.1)
    for step in range(5):
        if step == 2:
            for o in (opt, ref):
                o.param_groups[1].update(momentum=0.9, dampening=0.25)
        _set_grads(ours, step)
        _set_grads(theirs, step)
        opt.step()
        ref.step()
    _assert_close(ours, theirs)


@pytest.mark.parametrize("unscale", [False, True], ids=["step only", "unscale_ and clip"])
def test_fp64_parameters_step_under_the_scaler_like_torch(unscale):
    """fp64 parameters (a fused optimizer runs them on the reference path) under the scaler
    (the check pass failed on them): their norm is measured in fp64, as torch's clip does
    (within 1e-12 relative). Unclipped, parameters agree within 1e-12; the clip coefficient
    reaches the update as an fp32 scalar (the protocol's contract), so clipped updates carry
    fp32's relative precision (6e-8 of an update of ~lr = 1e-2: 1e-9 after three steps)."""
    ours, theirs, opt, ref = _adamw_pair(dtype=torch.float64)
    sc, ref_sc = _scalers()
    for step in range(3):
        _set_grads(ours, step, sc.get_scale())
        _set_grads(theirs, step, ref_sc.get_scale())
        if unscale:
            sc.unscale_(opt)
            ref_sc.unscale_(ref)
            n, t = clip_grad_norm_(ours, 0.5), torch.nn.utils.clip_grad_norm_(theirs, 0.5)
            assert n.dtype == t.dtype == torch.float64
            torch.testing.assert_close(n, t, rtol=1e-12, atol=0)
        sc.step(opt)
        ref_sc.step(ref)
        sc.update()
        ref_sc.update()
    _assert_close(ours, theirs, atol=1e-9 if unscale else 1e-12)


def test_fp16_gradients_are_not_unscaled_in_place():
    """Unscaled in fp16, gradients of a few 1e-7 keep a few bits (9% error measured); torch's
    unscale_ refuses fp16 gradients. fusedist's refuses them too, changing nothing, and the
    lazy form unscales in fp32 inside the update: FP32 masters then follow torch's AdamW on
    fp32 copies given grad.float() / scale, within fp32 rounding (1e-6)."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(s, generator=gen).to(DEVICE, torch.float16).requires_grad_() for s in SHAPES]
    masters = [p.detach().float().requires_grad_() for p in ours]
    opt = FusedAdamW(ours, lr=1e-3, master_weights=True)
    ref = torch.optim.AdamW(masters, lr=1e-3)
    scale = 2.0**16
    for p in ours:
        p.grad = (torch.randn(p.shape, generator=gen) * 3e-7 * scale).to(DEVICE, torch.float16)
    scaled = [p.grad.clone() for p in ours]
    with pytest.raises(ValueError, match="float16 gradients.*lazy_unscale=True"):
        _scalers(init_scale=scale)[0].unscale_(opt)
    for p, g in zip(ours, scaled):
        assert torch.equal(p.grad, g)
    sc = _scalers(lazy_unscale=True, init_scale=scale)[0]
    sc.unscale_(opt)
    sc.step(opt)
    for m, g in zip(masters, scaled):
        m.grad = g.float() / scale
    ref.step()
    _assert_close([opt.state[p]["master_param"] for p in ours], masters)


def _with_number_steps(state_dict):
    """The state dict as torch before 1.12 saved it: each step a Python number."""
    state = {k: {**v, "step": int(v["step"])} for k, v in state_dict["state"].items()}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def test_a_state_dict_with_number_steps_loads_and_continues_like_torch(backend):
    """Old checkpoints keep each step as a number; torch's AdamW converts them when loading.
    A fused optimizer takes them too (it failed at its next step), and refuses a step that is
    not one number before anything is loaded."""
    ours, theirs = _twins()
    src = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        _set_grads(theirs, step)
        src.step()
    saved = _with_number_steps(src.state_dict())
    with torch.no_grad():
        for a, b in zip(ours, theirs):
            a.copy_(b)
    opt, ref = FusedAdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    bad = {"state": {**saved["state"], 0: {**saved["state"][0], "step": torch.ones(2)}},
           "param_groups": saved["param_groups"]}
    with pytest.raises(ValueError, match="state 'step' of param 0 of param group 0"):
        opt.load_state_dict(bad)
    assert not opt.state and opt.param_groups[0]["weight_decay"] == 1e-2
    opt.load_state_dict(saved)
    ref.load_state_dict(saved)
    for step in range(3, 6):
        _set_grads(ours, step)
        _set_grads(theirs, step)
        opt.step()
        ref.step()
    _assert_close(ours, theirs)
