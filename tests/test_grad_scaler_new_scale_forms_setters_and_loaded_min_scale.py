"""fusedist.amp.GradScaler against torch.amp.GradScaler("cpu"): the forms of
``update(new_scale)`` torch documents (a float, a 1-element tensor) and a plain number.

Loss scales are powers of two, so unscaling is exact and both sides see the same unscaled
gradients; fp32 parameters agree to fp32 rounding of the optimizer math.
"""

from __future__ import annotations

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdamW
from test_grad_scaler_probe import _scaled_backward

TOL = 1e-6


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in ((5,), (3, 4))]


def _max_diff(a, b):
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("form", ["1-element tensor", "int", "0-dim tensor"])
@pytest.mark.parametrize("kw", [{}, {"hysteresis": 2}], ids=["torch rule", "hysteresis"])
def test_update_to_a_new_scale_in_each_documented_form_trains_as_torchs_float(form, kw):
    """torch documents ``update(new_scale)`` with "a float or a 1-element tensor"; its scale has
    shape (), so a ``tensor([s])`` failed in copy_, and an int failed on ``.device``. Each form
    now sets the scale, and training goes on as torch's does after ``update(float(s))``."""
    new = {"1-element tensor": torch.tensor([64.0]), "int": 64, "0-dim tensor": torch.tensor(64.0)}[form]
    ours = _params()
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    a, b = FusedAdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    sa = GradScaler("cpu", init_scale=2.0**10, growth_interval=2, **kw)
    sb = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for step in range(6):
        poison = (0, float("inf")) if step == 4 else None
        for scaler, opt, params in ((sa, a, ours), (sb, b, theirs)):
            opt.zero_grad()
            _scaled_backward(scaler, params, step, poison)
            scaler.step(opt)
            if step == 1:
                scaler.update(new if scaler is sa else 64.0)
            else:
                scaler.update()
        assert _max_diff(ours, theirs) <= TOL, step
        if not kw:
            assert (sa.get_scale(), sa._get_growth_tracker()) == (sb.get_scale(), sb._get_growth_tracker()), step
    assert sa._scale.shape == sb._scale.shape == ()


def test_a_new_scale_tensor_torch_refuses_is_refused_alike():
    """Tensors torch's update refuses (several elements, requiring grad) are refused the same way."""
    for bad in (torch.tensor([8.0, 2.0]), torch.tensor([8.0], requires_grad=True)):
        for scaler in (GradScaler("cpu"), torch.amp.GradScaler("cpu")):
            params = _params()
            opt = torch.optim.SGD(params, lr=0.1)
            _scaled_backward(scaler, params, 0)
            scaler.step(opt)
            with pytest.raises(AssertionError, match="1-element"):
                scaler.update(bad)


@pytest.mark.parametrize("device", [torch.device("cpu"), "cpu:0"], ids=["torch.device", "indexed"])
def test_a_scaler_built_with_a_device_object_or_index_takes_a_new_scale_tensor(device):
    """torch keeps the device argument as given and compares it with ``new_scale.device.type``,
    so a scaler built with ``torch.device("cpu")`` trained, then refused every tensor passed to
    ``update``. It now updates as one built with "cpu", and trains alike."""
    ours = _params()
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    a, b = FusedAdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    sa = GradScaler(device, init_scale=2.0**10, growth_interval=2)
    sb = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for step in range(4):
        for scaler, opt, params in ((sa, a, ours), (sb, b, theirs)):
            opt.zero_grad()
            _scaled_backward(scaler, params, step, (0, float("nan")) if step == 2 else None)
            scaler.step(opt)
            scaler.update(torch.tensor(32.0) if step == 0 else None)
        assert _max_diff(ours, theirs) <= TOL, step
        assert (sa.get_scale(), sa._get_growth_tracker()) == (sb.get_scale(), sb._get_growth_tracker()), step


@pytest.mark.parametrize("bad", [float("inf"), 0.0, -1.0, "one"])
def test_a_state_dict_with_a_min_scale_the_constructor_refuses_is_refused_and_changes_nothing(bad):
    """The constructor takes a ``min_scale`` in (0, init_scale]; a loaded one was taken as it was:
    at inf the scale never backed off again (every step skipped), at 0 or less there was no floor,
    and a string failed at the first overflow. Refused now, before anything loads."""
    scaler = GradScaler("cpu", init_scale=64.0, min_scale=1.0)
    saved = dict(scaler.state_dict(), scale=256.0, min_scale=bad)
    with pytest.raises(ValueError, match="min_scale must be None or a finite number > 0"):
        scaler.load_state_dict(saved)
    assert scaler.state_dict() == GradScaler("cpu", init_scale=64.0, min_scale=1.0).state_dict()
    scaler.load_state_dict(dict(saved, min_scale=None))  # a scaler saved without a floor loads
    assert (scaler.get_scale(), scaler._min_scale) == (256.0, None)


@pytest.mark.parametrize("setter, bad", [("set_backoff_factor", 0.0), ("set_backoff_factor", -0.5),
                                         ("set_growth_factor", float("inf")), ("set_growth_interval", 0)])
def test_a_setter_refuses_what_the_constructor_refuses_and_valid_ones_train_as_torchs(setter, bad):
    """torch's setters check nothing: its set_backoff_factor(0) makes the scale 0 at the next
    overflow (and -0.5 makes it negative). fusedist's refuse what its constructor refuses and keep
    the old setting; valid values set mid-run train as torch's do."""
    ours = _params()
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    a, b = FusedAdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    sa = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    sb = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for step in range(7):
        if step == 2:
            with pytest.raises(ValueError, match=rf"GradScaler\.{setter}: "):
                getattr(sa, setter)(bad)
            assert (sa.get_growth_factor(), sa.get_backoff_factor(), sa.get_growth_interval()) == (2.0, 0.5, 3)
            for scaler in (sa, sb):
                scaler.set_growth_factor(4.0)
                scaler.set_backoff_factor(0.25)
                scaler.set_growth_interval(2)
        for scaler, opt, params in ((sa, a, ours), (sb, b, theirs)):
            opt.zero_grad()
            _scaled_backward(scaler, params, step, (0, float("inf")) if step in (3, 6) else None)
            scaler.step(opt)
            scaler.update()
        assert _max_diff(ours, theirs) <= TOL, step
        assert (sa.get_scale(), sa._get_growth_tracker()) == (sb.get_scale(), sb._get_growth_tracker()), step


@pytest.mark.parametrize("bad", ["meta device", "two elements", "requires grad"])
def test_a_refused_new_scale_tensor_changes_nothing_before_the_next_update(bad):
    """torch's update refuses such a tensor before it changes anything, so a loop that catches the
    error and calls ``update()`` goes on as if the bad call never happened. fusedist's reset the
    hysteresis count first: an overflow counted towards the backoff was forgotten, and the scale
    stayed up a step longer than the same loop without the bad call."""
    new = {"meta device": torch.tensor(8.0, device="meta"), "two elements": torch.tensor([8.0, 2.0]),
           "requires grad": torch.tensor([8.0], requires_grad=True)}[bad]
    runs = []
    for refused_first in (False, True):
        params = _params()
        opt, scaler = FusedAdamW(params, lr=1e-2), GradScaler("cpu", init_scale=2.0**10, hysteresis=2)
        for step in range(4):
            opt.zero_grad()
            _scaled_backward(scaler, params, step, (0, float("inf")) if step in (0, 1) else None)
            scaler.step(opt)
            if refused_first and step == 1:
                with pytest.raises(AssertionError, match="1-element"):
                    scaler.update(new)
            scaler.update()
        runs.append((scaler.state_dict(), [p.detach().clone() for p in params]))
    assert runs[1][0] == runs[0][0]
    assert _max_diff(runs[1][1], runs[0][1]) == 0
