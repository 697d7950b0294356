"""Fused optimizers against torch, fourth round: FusedLAMB with a tensor learning rate, and
realistic recipes (param groups added mid-training, torch state dicts both ways, maximize /
amsgrad, chained LR schedulers).

Parameters are fp32. Where both sides run the same arithmetic on the same numbers the
comparison is exact; against torch's own optimizers, 1e-6 absolute (a few fp32 ulps per step
on values of order 1, as in test_optim.py); against the fp64 LAMB reference, 1e-5 (as there).
"""

from __future__ import annotations

import copy

import pytest
import torch

from fusedist.optim import FusedLAMB

from test_optim import BACKENDS, SHAPES, _assert_params_close, _clone_params, _grads, _params, _reference_lamb, _set_grads  # noqa: F401


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


# -- FusedLAMB with a tensor lr ------------------------------------------------------------------


def test_lamb_takes_a_tensor_lr_like_a_float_and_like_the_reference(backend):
    """torch's optimizers take ``lr=torch.tensor(...)``; FusedLAMB refused it (TypeError). Its
    steps now equal those with the same value as a float, and the fp64 reference's."""
    lr = torch.tensor(1e-2)
    ours, floats = _params(seed=3), _params(seed=3)
    start = _clone_params(ours)
    opt = FusedLAMB(ours, lr=lr, weight_decay=0.01)
    ref = FusedLAMB(floats, lr=float(lr), weight_decay=0.01)  # the tensor's value exactly
    all_grads = []
    for step in range(6):
        grads = _grads(step)
        all_grads.append(grads)
        _set_grads(ours, grads)
        _set_grads(floats, grads)
        opt.step()
        ref.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    _assert_params_close(ours, floats, atol=0)
    expected = _reference_lamb(start, all_grads, float(lr), (0.9, 0.999), 1e-6, 0.01, 1.0)
    _assert_params_close([p.double() for p in ours], expected, atol=1e-5)


def test_lamb_tensor_lr_follows_a_scheduler_and_state_dicts(backend):
    """A scheduler changes a tensor lr in place: each step uses the current value, as the float
    path under the same scheduler does; the state dict keeps the tensor; a 1-element (not 0-d)
    tensor works; a tensor of several elements is refused as torch refuses it."""
    ours, floats = _params(seed=4), _params(seed=4)
    opt = FusedLAMB(ours, lr=torch.tensor([0.02]), weight_decay=0.1)
    ref = FusedLAMB(floats, lr=float(torch.tensor(0.02)), weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5) for o in (opt, ref)]
    for step in range(4):
        grads = _grads(step)
        _set_grads(ours, grads)
        _set_grads(floats, grads)
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
        # torch's scheduler writes the tensor in place (fp32) and the float as a double:
        # continue the float path from the tensor's value, so the two stay the same numbers.
        ref.param_groups[0]["lr"] = float(opt.param_groups[0]["lr"])
    _assert_params_close(ours, floats, atol=0)
    state = copy.deepcopy(opt.state_dict())
    assert isinstance(state["param_groups"][0]["lr"], torch.Tensor)
    again = FusedLAMB(_clone_params(ours), lr=1.0, weight_decay=0.1)
    again.load_state_dict(state)
    assert isinstance(again.param_groups[0]["lr"], torch.Tensor)
    with pytest.raises(ValueError, match=r"param group 0.*Tensor lr must be 1-element"):
        FusedLAMB(_params(), lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="invalid learning rate"):
        FusedLAMB(_params(), lr=torch.tensor(-1.0))
