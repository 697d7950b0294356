"""Fused optimizers, GradScaler and clip_grad_norm_ against torch: a scaler step
on an optimizer without gradients, gradients written between fusedist's clip and the step,
FusedSGD's state after an overflowed first step (in memory and read by torch's SGD), and
momentum buffers created only when missing.

Scales are powers of two, so both sides see the same unscaled gradients and differ only by
rounding of the optimizer math in fp32: parameters within 1e-6 (as in test_optim.py), norms
within 1e-6 relative. Where both sides run the same torch ops on the same values (a state dict
loaded into torch's SGD and stepped by it), the bound is exact equality.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdamW, FusedLAMB, FusedSGD, clip_grad_norm_

from test_optim import BACKENDS, DEVICE  # noqa: F401 - the backend fixture's parameters
from test_optim_off_common_path import _scalers

SHAPES = [(5,), (3, 4), (1,), (6, 2)]
ATOL = 1e-6
SGD_KW = dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


def _twins(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.randn(s, generator=gen).to(DEVICE).requires_grad_() for s in SHAPES]
    return ours, [p.detach().clone().requires_grad_() for p in ours]


def _grads(step, scale=1.0, inf=False):
    """Fresh random gradients for SHAPES (the same for both sides), scaled; one inf if asked."""
    gen = torch.Generator().manual_seed(100 + step)
    grads = [(torch.randn(s, generator=gen) * scale).to(DEVICE) for s in SHAPES]
    if inf:
        grads[1].view(-1)[2] = float("inf")
    return grads


def _set(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.to(p.dtype)


def _assert_close(ours, theirs, atol=ATOL):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=atol)


# -- 1. a scaler step on an optimizer without gradients ----------------------------------------


@pytest.mark.parametrize("unscale", [False, True], ids=["step only", "unscale_ first"])
@pytest.mark.parametrize("fused", [FusedAdamW, FusedSGD])
def test_a_scaler_step_without_gradients_raises_like_torch(fused, unscale):
    """torch's scaler refuses to step an optimizer whose parameters have no gradient
    (AssertionError: No inf checks were recorded for this optimizer.), and update() then finds
    no check either. fusedist's scaler stepped silently; it raises the same, changing nothing."""
    ours, theirs = _twins()
    opt, ref = fused(ours, lr=0.1), getattr(torch.optim, fused.__name__[len("Fused"):])(theirs, lr=0.1)
    for sc, o in zip(_scalers(), (opt, ref)):
        if unscale:
            sc.unscale_(o)
        with pytest.raises(AssertionError, match=r"^No inf checks were recorded for this optimizer\.$"):
            sc.step(o)
        with pytest.raises(AssertionError, match=r"^No inf checks were recorded prior to update\.$"):
            sc.update()
    _assert_close(ours, theirs, atol=0)
    assert not opt.state


def test_an_optimizer_without_gradients_next_to_one_with_them():
    """Two optimizers under one scaler, only the second has gradients: as torch's, the step of
    the first raises, the second steps, and update() counts the second's check."""
    ours, theirs = _twins()
    grads = _grads(0, 4.0)
    for params, cls, sc in zip((ours, theirs), (FusedSGD, torch.optim.SGD), _scalers()):
        idle, busy = cls(params[:2], **SGD_KW), cls(params[2:], **SGD_KW)
        _set(params[2:], grads[2:])
        with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
            sc.step(idle)
        sc.step(busy)
        sc.update()
        assert sc.get_scale() == 4.0
    _assert_close(ours, theirs)


class _ShardOfAdamW(FusedAdamW):
    """Steps the parameters it is given, while the gradients it checks are others (as a rank
    of a sharded optimizer whose parameters have no p.grad, its gradients being shards)."""

    def __init__(self, own, checked, **kwargs):
        self._checked = checked
        super().__init__(own, **kwargs)

    def _fusedist_grad_params(self):
        return [p for p in self._checked if p.grad is not None]

    def _fusedist_local_grads(self):
        return [p.grad for p in self._fusedist_grad_params()]


def test_no_inf_check_is_about_the_protocol_not_p_grad():
    """A sharded optimizer may step parameters whose p.grad is None (ZeRO stage 2 keeps its
    gradients as shards; here a rank owns only parameters without gradients) while the
    gradients it checks exist: its step must not raise, and an overflow must still skip it."""
    ours, _ = _twins()
    opt = _ShardOfAdamW(ours[:1], ours[1:], lr=0.1)
    sc, _ = _scalers()
    before = ours[0].detach().clone()
    _set(ours[1:], _grads(0, 4.0, inf=True)[1:])
    sc.step(opt)
    sc.update()
    assert sc.get_scale() == 2.0 and torch.equal(ours[0].detach(), before)
    _set(ours[1:], _grads(1, 2.0)[1:])
    sc.unscale_(opt)
    sc.step(opt)
    sc.update()
    assert sc.get_scale() == 2.0


# -- 2. gradients written between fusedist's clip and the step ---------------------------------


def _clip_then(change, lazy_unscale=False, optimizers=None, in_step_pre_hook=False):
    """unscale_, clip (fusedist's fast path / torch's), ``change(params, step)`` on both sides
    (or, ``in_step_pre_hook``, from a step pre-hook: program code inside ``scaler.step``),
    scaler step; three iterations of ``optimizers(ours, theirs)``, by default FusedSGD
    against torch's SGD."""
    ours, theirs = _twins()
    make = optimizers or (lambda a, b: (FusedSGD(a, **SGD_KW), torch.optim.SGD(b, **SGD_KW)))
    opt, ref = make(ours, theirs)
    sc, ref_sc = _scalers(lazy_unscale)
    for step in range(3):
        grads = _grads(step)
        _set(ours, [g * sc.get_scale() for g in grads])
        _set(theirs, [g * ref_sc.get_scale() for g in grads])
        sc.unscale_(opt)
        ref_sc.unscale_(ref)
        n, t = clip_grad_norm_(ours, 0.5), torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        torch.testing.assert_close(n, t, rtol=1e-6, atol=0)
        assert opt.step_context.clip_coef is not None  # the fast path was taken
        hooks = []
        for o, params in ((opt, ours), (ref, theirs)):
            if in_step_pre_hook:
                hooks.append(o.register_step_pre_hook(lambda o, a, k, params=params, step=step: change(params, step)))
            else:
                change(params, step)
        sc.step(opt)
        ref_sc.step(ref)
        sc.update()
        ref_sc.update()
        for hook in hooks:
            hook.remove()
    return ours, theirs


def _replace_two(params, step):
    gen = torch.Generator().manual_seed(200 + step)
    for i in (0, 3):
        params[i].grad = torch.randn(SHAPES[i], generator=gen).to(DEVICE)


def _drop_one(params, step):
    params[1].grad = None


def test_gradients_replaced_after_the_clip_are_not_clipped():
    """``p.grad = new`` after the clip: torch's clip scaled the old tensors only, so the new
    ones step unclipped and the others clipped. fusedist gave the new ones the coefficient."""
    ours, theirs = _clip_then(_replace_two)
    _assert_close(ours, theirs)


def test_gradients_replaced_by_a_step_pre_hook_are_seen_by_the_step():
    """A step pre-hook is program code that runs inside ``scaler.step``, after the scaler's own
    checks looked at the gradients: the step must look again (Note [gradients looked up once a
    call]), stepping the new tensors unclipped as torch's does, and the dropped one not at all."""
    def replace_and_drop(params, step):
        _replace_two(params, step)
        _drop_one(params, step)

    ours, theirs = _clip_then(replace_and_drop, in_step_pre_hook=True)
    _assert_close(ours, theirs)


def test_lamb_norm_after_a_replacement_is_of_what_the_step_uses():
    """FusedLAMB clips again with the global norm of the gradients it steps. A gradient replaced
    after fusedist's clip is stepped unclipped (as torch's clip would leave it): the norm must
    be of those gradients too, as with torch's clip scaling p.grad in place (the other side,
    FusedLAMB as well). (LAMB measured its norm before settling the clip, with the coefficient
    on the new gradient too.) A large eps and a small max_grad_norm make the update depend on
    that norm."""
    lamb = dict(lr=0.05, eps=0.1, weight_decay=0.01, max_grad_norm=0.1)
    ours, theirs = _clip_then(_replace_two, optimizers=lambda a, b: (FusedLAMB(a, **lamb), FusedLAMB(b, **lamb)))
    _assert_close(ours, theirs)


def test_a_gradient_dropped_after_the_clip():
    """``p.grad = None`` after the clip: that parameter is not stepped, the others are clipped."""
    ours, theirs = _clip_then(_drop_one)
    _assert_close(ours, theirs)


def test_a_new_backward_after_zero_grad_is_not_clipped():
    """zero_grad() and another backward after the clip (the clipped gradients are thrown away):
    the step uses the new, unclipped gradients, as torch's does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).to(DEVICE)
    twin = copy.deepcopy(model)
    opt, ref = FusedSGD(model.parameters(), **SGD_KW), torch.optim.SGD(twin.parameters(), **SGD_KW)
    sc, ref_sc = _scalers()
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x1, x2 = (torch.randn(5, 4, generator=gen).to(DEVICE) for _ in range(2))
        for m, o, s in ((model, opt, sc), (twin, ref, ref_sc)):
            s.scale(m(x1).square().sum()).backward()
            s.unscale_(o)
            (clip_grad_norm_ if o is opt else torch.nn.utils.clip_grad_norm_)(m.parameters(), 0.05)
            o.zero_grad()
            m(x2).square().sum().backward()
            s.step(o)
            s.update()
    _assert_close(model.parameters(), twin.parameters())


def test_a_gradient_that_appears_after_the_clip_is_not_clipped():
    """A parameter without a gradient at the clip receives one before the step: torch steps it
    with that gradient as it is (and the others clipped)."""
    def appear(params, step):
        params[2].grad = torch.full(SHAPES[2], 0.5, device=DEVICE)

    ours, theirs = _twins()
    opt, ref = FusedSGD(ours, **SGD_KW), torch.optim.SGD(theirs, **SGD_KW)
    sc, ref_sc = _scalers()
    for step in range(2):
        grads = _grads(step)
        for params, s in ((ours, sc), (theirs, ref_sc)):
            _set(params, [g * s.get_scale() for g in grads])
            params[2].grad = None
        sc.unscale_(opt)
        ref_sc.unscale_(ref)
        clip_grad_norm_(ours, 0.5)
        torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        appear(ours, step)
        appear(theirs, step)
        sc.step(opt)
        ref_sc.step(ref)
        sc.update()
        ref_sc.update()
    _assert_close(ours, theirs)


def test_a_second_clip_after_a_replacement_sees_what_torch_sees():
    """Fast clip, one gradient replaced, then a clip that runs torch's (a subset): it must see
    the others clipped by the first and the new one as it is, as torch's second clip does."""
    ours, theirs = _twins()
    opt, ref = FusedSGD(ours, **SGD_KW), torch.optim.SGD(theirs, **SGD_KW)
    sc, ref_sc = _scalers()
    grads = _grads(0)
    norms = []
    for params, o, s, clip in ((ours, opt, sc, clip_grad_norm_), (theirs, ref, ref_sc, torch.nn.utils.clip_grad_norm_)):
        _set(params, [g * s.get_scale() for g in grads])
        s.unscale_(o)
        clip(params, 0.5)
        _replace_two(params, 0)
        norms.append(clip(params[:2], 0.1))
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)
    sc.step(opt)
    ref_sc.step(ref)
    _assert_close(ours, theirs)


def _add_noise(params, step):
    with torch.no_grad():
        params[1].grad.add_(0.25)


def _accumulate(params, step):
    with torch.enable_grad():
        sum((p * (k + 1)).sum() for k, p in enumerate(params)).backward()  # in place into p.grad


@pytest.mark.parametrize("write, first", [(_add_noise, 1), (_accumulate, 0)], ids=["grad.add_", "second backward"])
def test_a_gradient_written_in_place_after_the_clip_raises(write, first):
    """An in-place write after the clip (noise added, a second backward accumulating): torch
    steps ``coef * old + written``; the old values are gone, so no deferred coefficient gives
    that. fusedist stepped ``coef * (old + written)`` silently; it raises before any change."""
    ours, _ = _twins()
    opt = FusedSGD(ours, **SGD_KW)
    sc, _ = _scalers()
    _set(ours, [g * sc.get_scale() for g in _grads(0)])
    sc.unscale_(opt)
    clip_grad_norm_(ours, 0.5)
    write(ours, 0)
    before = [p.detach().clone() for p in ours]
    with pytest.raises(RuntimeError, match=rf"gradient of param {first} of param group 0 was written in place after "
                                           r"fusedist.clip_grad_norm_"):
        sc.step(opt)
    _assert_close(ours, before, atol=0)
    assert not opt.state


def test_a_write_after_the_clip_under_lazy_unscale_raises():
    """With lazy_unscale the gradients still hold the scaled values after the clip: replacing
    one then raises as any write after a lazy unscale_ does."""
    ours, _ = _twins()
    opt = FusedSGD(ours, **SGD_KW)
    sc, _ = _scalers(lazy_unscale=True)
    _set(ours, [g * sc.get_scale() for g in _grads(0)])
    sc.unscale_(opt)
    clip_grad_norm_(ours, 0.5)
    _replace_two(ours, 0)
    with pytest.raises(RuntimeError, match=r"written after GradScaler\(lazy_unscale=True\)"):
        sc.step(opt)


def _scaled_twins(fused=FusedSGD, reference=torch.optim.SGD, kw=SGD_KW, unscale=True):
    """A fused optimizer and its torch counterpart with the same scaled gradients, each
    unscaled by its scaler if ``unscale``: (ours, theirs, opt, ref, scaler, torch's scaler)."""
    ours, theirs = _twins()
    opt, ref = fused(ours, **kw), reference(theirs, **kw)
    sc, ref_sc = _scalers()
    grads = _grads(0)
    _set(ours, [g * 4.0 for g in grads])
    _set(theirs, [g * 4.0 for g in grads])
    if unscale:
        sc.unscale_(opt)
        ref_sc.unscale_(ref)
    return ours, theirs, opt, ref, sc, ref_sc


def _steps_leave_grads_as_they_were(ours, theirs, opt, ref, sc, ref_sc):
    """Both scalers step: fusedist's leaves p.grad bit for bit as it was, the parameters match."""
    before = [p.grad.clone() for p in ours]
    sc.step(opt)
    ref_sc.step(ref)
    for p, g in zip(ours, before):
        assert torch.equal(p.grad, g)
    _assert_close(ours, theirs)


def test_an_unchanged_clip_stays_in_the_step():
    """Nothing written between clip and step: the coefficient is still applied by the step
    (p.grad keeps its unclipped values), and parameters match torch's."""
    ours, theirs, opt, ref, sc, ref_sc = _scaled_twins()
    clip_grad_norm_(ours, 0.5)
    torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    _steps_leave_grads_as_they_were(ours, theirs, opt, ref, sc, ref_sc)


def test_a_parameter_listed_twice_counts_twice_as_in_torchs_clip():
    """Two modules sharing a tied tensor, chained: torch's norm counts it twice (and scales it
    twice). The recorded norm of unscale_ counts each of the optimizer's parameters once, so
    the clip takes torch's path; the step then matches torch's."""
    ours, theirs, opt, ref, sc, ref_sc = _scaled_twins()
    norm = clip_grad_norm_([ours[0], *ours], 0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_([theirs[0], *theirs], 0.5)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    sc.step(opt)
    ref_sc.step(ref)
    _assert_close(ours, theirs)


def test_a_fused_step_writes_no_gradient_back():
    """The documented difference from torch's scaler: a fused update applies the scale inline
    and leaves p.grad as it was (scaled, when unscale_ was not called); parameters match."""
    ours, theirs, opt, ref, sc, ref_sc = _scaled_twins(FusedAdamW, torch.optim.AdamW, dict(lr=0.01), unscale=False)
    _steps_leave_grads_as_they_were(ours, theirs, opt, ref, sc, ref_sc)


# -- 3. FusedSGD after an overflowed first step -------------------------------------------------


def _sgd_steps(opt, params, sc, steps, overflow=()):
    for step in steps:
        _set(params, _grads(step, sc.get_scale(), inf=step in overflow))
        sc.step(opt)
        sc.update()


def test_sgd_with_dampening_after_an_overflowed_first_step_matches_torch(backend):
    """The first step overflows (skipped: torch's SGD never runs, so it makes no momentum
    buffer), then steps proceed: the first real step starts the buffer from its gradient,
    without dampening, as torch's does."""
    ours, theirs = _twins()
    opt, ref = FusedSGD(ours, **SGD_KW), torch.optim.SGD(theirs, **SGD_KW)
    sc, ref_sc = _scalers()
    _sgd_steps(opt, ours, sc, range(5), overflow={0, 3})
    _sgd_steps(ref, theirs, ref_sc, range(5), overflow={0, 3})
    assert sc.get_scale() == ref_sc.get_scale()
    _assert_close(ours, theirs)


def test_sgd_state_dict_after_an_overflowed_first_step_continues_in_torch(backend):
    """fusedist's state dict after a skipped first step, loaded into torch's SGD (and scaler),
    continues exactly as torch's own. It held a zero momentum buffer, which torch's SGD takes as
    a buffer to decay: with dampening the next step gave (1 - dampening) * grad, not grad. The
    state now says what torch's does: nothing was stepped."""
    ours, theirs = _twins()
    opt, ref = FusedSGD(ours, **SGD_KW), torch.optim.SGD(theirs, **SGD_KW)
    sc, ref_sc = _scalers()
    _sgd_steps(opt, ours, sc, [0], overflow={0})
    _sgd_steps(ref, theirs, ref_sc, [0], overflow={0})
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"] == ref.state_dict()["state"] == {}
    loaded_params = [p.detach().clone().requires_grad_() for p in ours]
    loaded = torch.optim.SGD(loaded_params, **SGD_KW)
    loaded.load_state_dict(saved)
    loaded_sc = torch.amp.GradScaler(DEVICE.type)
    loaded_sc.load_state_dict(sc.state_dict())
    loaded_sc.scale(torch.zeros((), device=DEVICE))
    _sgd_steps(loaded, loaded_params, loaded_sc, range(1, 4))
    _sgd_steps(ref, theirs, ref_sc, range(1, 4))
    _assert_close(loaded_params, theirs, atol=0)


def test_sgd_state_dict_round_trip_through_torch_after_a_skipped_first_step(backend):
    """fusedist (first step skipped) -> torch's SGD, two steps -> fusedist again: every step
    of the way as torch's SGD alone, and the buffer torch filled is not restarted."""
    ours, theirs = _twins()
    opt, ref = FusedSGD(ours, **SGD_KW), torch.optim.SGD(theirs, **SGD_KW)
    sc, ref_sc = _scalers()
    _sgd_steps(opt, ours, sc, [0], overflow={0})
    _sgd_steps(ref, theirs, ref_sc, [0], overflow={0})
    middle = torch.optim.SGD(ours, **SGD_KW)
    middle.load_state_dict(copy.deepcopy(opt.state_dict()))
    mid_sc = torch.amp.GradScaler(DEVICE.type)
    mid_sc.load_state_dict(sc.state_dict())
    mid_sc.scale(torch.zeros((), device=DEVICE))
    _sgd_steps(middle, ours, mid_sc, range(1, 3))
    again = FusedSGD(ours, **SGD_KW)
    again.load_state_dict(copy.deepcopy(middle.state_dict()))
    sc.load_state_dict(mid_sc.state_dict())
    _sgd_steps(again, ours, sc, range(3, 5))
    _sgd_steps(ref, theirs, ref_sc, range(1, 5))
    _assert_close(ours, theirs)


def test_sgd_state_dict_of_a_skipped_first_step_keeps_the_master(backend):
    """With FP32 masters the state of a never-stepped bf16 parameter keeps its master (only the
    unfilled buffer and its step count are left out), and a FusedSGD loading it continues as
    the original does."""
    gen = torch.Generator().manual_seed(3)
    ours = [torch.randn(s, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_() for s in SHAPES]
    twins = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedSGD(ours, master_weights=True, **SGD_KW)
    sc, _ = _scalers()
    _sgd_steps(opt, ours, sc, [0], overflow={0})
    saved = copy.deepcopy(opt.state_dict())
    assert all(set(st) == {"master_param"} for st in saved["state"].values()) and len(saved["state"]) == 4
    other = FusedSGD(twins, master_weights=True, **SGD_KW)
    other.load_state_dict(saved)
    other_sc = GradScaler(DEVICE.type)
    other_sc.load_state_dict(sc.state_dict())
    other_sc.scale(torch.zeros((), device=DEVICE))
    _sgd_steps(opt, ours, sc, range(1, 4))
    _sgd_steps(other, twins, other_sc, range(1, 4))
    _assert_close([opt.state[p]["master_param"] for p in ours], [other.state[p]["master_param"] for p in twins],
                  atol=0)


# -- 4. momentum buffers looked for only where one may be missing -------------------------------


def _count_searches(monkeypatch):
    calls = []
    original = FusedSGD._add_missing_buffers

    def counting(self, group, params, states):
        calls.append(len(params))
        return original(self, group, params, states)

    monkeypatch.setattr(FusedSGD, "_add_missing_buffers", counting)
    return calls


def test_sgd_steps_do_not_look_for_missing_buffers_when_none_can_be(monkeypatch):
    """With momentum from the start every state is made with its buffer: no step walks the
    states looking for missing ones (it cost ~0.1 us per parameter per step)."""
    calls = _count_searches(monkeypatch)
    ours, theirs = _twins()
    opt, ref = FusedSGD(ours, **SGD_KW), torch.optim.SGD(theirs, **SGD_KW)
    for step in range(3):
        _set(ours, _grads(step))
        _set(theirs, _grads(step))
        opt.step()
        ref.step()
    assert calls == []
    _assert_close(ours, theirs)


def test_momentum_switched_on_while_a_parameter_has_no_gradient(monkeypatch, backend):
    """Momentum switched on at a step where one parameter of the group has no gradient: that
    parameter's buffer starts from its next gradient, as torch's does; once every state has a
    buffer the search stops."""
    calls = _count_searches(monkeypatch)
    ours, theirs = _twins()
    opt, ref = FusedSGD(ours, lr=0.1), torch.optim.SGD(theirs, lr=0.1)
    for step in range(6):
        if step == 2:
            for o in (opt, ref):
                o.param_groups[0].update(momentum=0.9, dampening=0.25)
        grads = _grads(step)
        for params in (ours, theirs):
            _set(params, grads)
            if step == 2:
                params[3].grad = None
        opt.step()
        ref.step()
    assert calls == [3, 4]  # step 2 (param 3 still without a buffer), step 3; none after
    _assert_close(ours, theirs)


def test_buffers_missing_in_a_loaded_torch_state_are_made(backend):
    """A state dict of torch's SGD run without momentum (``momentum_buffer: None``) loaded into
    a FusedSGD with momentum: the buffers start from the next gradient, as in torch's SGD."""
    ours, theirs = _twins()
    src = torch.optim.SGD(theirs, lr=0.1)
    for step in range(2):
        _set(theirs, _grads(step))
        src.step()
    with torch.no_grad():
        for a, b in zip(ours, theirs):
            a.copy_(b)
    saved = src.state_dict()
    saved["param_groups"][0].update(momentum=0.9, dampening=0.25)
    opt, ref = FusedSGD(ours, lr=0.1), torch.optim.SGD(theirs, lr=0.1)
    opt.load_state_dict(copy.deepcopy(saved))
    ref.load_state_dict(copy.deepcopy(saved))
    for step in range(2, 5):
        _set(ours, _grads(step))
        _set(theirs, _grads(step))
        opt.step()
        ref.step()
    _assert_close(ours, theirs)


def test_gradients_written_after_a_lazy_unscale_are_refused_with_advice_that_exists():
    """The refusal names the clip the optimizer has: FusedAdamW has no clip_grad_norm_ of its
    own (ZeroRedundancyOptimizer has one), so the advice is fusedist.clip_grad_norm_ alone."""
    p = torch.nn.Parameter(torch.randn(4))
    opt, scaler = FusedAdamW([p]), GradScaler("cpu", lazy_unscale=True)
    scaler.scale(torch.ones(()))
    p.grad = torch.randn(4) * 65536.0
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_([p], 1.0)  # writes the still scaled gradient
    with pytest.raises(RuntimeError, match="Clip with fusedist.clip_grad_norm_, or build") as caught:
        scaler.step(opt)
    assert not hasattr(opt, "clip_grad_norm_") and "optimizer.clip_grad_norm_" not in str(caught.value)
