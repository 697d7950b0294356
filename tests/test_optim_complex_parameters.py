"""Complex parameters in FusedAdam, FusedAdamW and FusedSGD, stepped as torch's optimizers step
them (Note [complex parameters] in fusedist/optim/_complex.py): the same updates, complex states
in the state dicts, state dicts loaded both ways, the scaler's unscale and the clip on complex
gradients, and the refusals that remain (FusedLAMB, complex32), naming the parameter.

Tolerances: complex64 parameters of order 1 stepped a few times are fp32 arithmetic on both
sides, differing only by the rounding of the optimizer math: 1e-6 absolute (as test_optim.py).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

import fusedist
from fusedist.amp import GradScaler
from fusedist.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

from test_optim import BACKENDS

ATOL = 1e-6
CASES = [  # (ours, torch's, keywords, group changes before a step)
    (FusedAdam, torch.optim.Adam, dict(amsgrad=True, maximize=True, weight_decay=0.1), {}),
    (FusedAdamW, torch.optim.AdamW, dict(betas=(torch.tensor(0.8), torch.tensor(0.95))), {2: dict(lr=0.03)}),
    (FusedSGD, torch.optim.SGD, dict(momentum=0.9, nesterov=True, weight_decay=0.1), {}),
    # momentum switched on later: the step makes the buffer on the real view, kept complex
    (FusedSGD, torch.optim.SGD, dict(dampening=0.2), {2: dict(momentum=0.5)}),
]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


def _pair(gen):
    """Two copies of complex64, fp32 and complex128 parameters in one group."""
    start = [torch.randn(4, 3, generator=gen, dtype=torch.complex64), torch.randn(5, generator=gen),
             torch.randn(2, generator=gen, dtype=torch.complex128)]
    return [torch.nn.Parameter(t.clone()) for t in start], [torch.nn.Parameter(t.clone()) for t in start]


def _grads(ours, theirs, gen, skip=()):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        g = None if i in skip else torch.randn(a.shape, generator=gen, dtype=a.dtype)
        a.grad, b.grad = g, None if g is None else g.clone()


def _close(ours, theirs, msg):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=ATOL, msg=lambda m: f"{msg} param {i}: {m}")


def _same_states(ours: dict, theirs: dict, msg):
    assert set(ours) == set(theirs), msg
    for key, state in theirs.items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and name != "step":
                got = ours[key][name]
                assert got.dtype == value.dtype and got.shape == value.shape, (msg, key, name, got.dtype)
                torch.testing.assert_close(got, value, rtol=0, atol=ATOL, msg=lambda m: f"{msg} {key} {name}: {m}")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_complex_parameters_step_like_torch(backend, case):
    fused_cls, torch_cls, kw, changes = CASES[case]
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    ours, theirs = _pair(gen)
    opt, ref = fused_cls(ours, lr=0.01, **kw), torch_cls(theirs, lr=0.01, **copy.deepcopy(kw))
    for step in range(4):
        for key, value in changes.get(step, {}).items():
            opt.param_groups[0][key] = ref.param_groups[0][key] = value
        _grads(ours, theirs, gen, skip=(2,) if step == 1 else ())  # a parameter without a gradient once
        opt.step()
        ref.step()
        _close(ours, theirs, f"seed {seed} step {step}")
    _same_states(opt.state_dict()["state"], ref.state_dict()["state"], f"seed {seed}")


@pytest.mark.parametrize("fused_cls, torch_cls, kw", [(c[0], c[1], c[2]) for c in CASES[::2]], ids=["Adam", "SGD"])
def test_complex_state_dicts_load_both_ways_and_copies_step_on(fused_cls, torch_cls, kw):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    ours, theirs = _pair(gen)
    opt, ref = fused_cls(ours, lr=0.01, **kw), torch_cls(theirs, lr=0.01, **kw)
    for _ in range(2):
        _grads(ours, theirs, gen)
        opt.step()
        ref.step()
    # torch's state into ours and ours into torch's, on each other's parameters; and a deep copy
    ours2 = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    theirs2 = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt2, ref2 = fused_cls(ours2, lr=0.01, **kw), torch_cls(theirs2, lr=0.01, **kw)
    opt2.load_state_dict(ref.state_dict())
    ref2.load_state_dict(opt.state_dict())
    copied = copy.deepcopy({"params": ours, "opt": opt})
    for step in range(2):
        _grads(ours2, theirs2, gen)
        for a, c in zip(ours2, copied["params"]):
            c.grad = a.grad.clone()
        opt2.step()
        ref2.step()
        copied["opt"].step()
        _close(ours2, theirs2, f"seed {seed} loaded, step {step}")
        _close(copied["params"], theirs2, f"seed {seed} deep copy, step {step}")


def test_complex_gradients_unscale_and_clip_like_torch():
    # GradScaler.unscale_ checks and unscales the complex gradients as real pairs; the recorded
    # clip's norm is torch's (a real fp32 tensor) and the update applies it; AMSGrad switched on
    # later keeps a complex maximum. (torch's GradScaler has no complex unscale on the CPU: the
    # reference divides by the scale itself, exact for a power of two.)
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    ours, theirs = _pair(gen)
    ours, theirs = ours[:2], theirs[:2]  # (complex128 takes torch's clip: the fp64 rule)
    opt, ref = FusedAdam(ours, lr=0.01), torch.optim.Adam(theirs, lr=0.01)
    scaler = GradScaler(init_scale=1024.0, device="cpu")
    scaler.scale(torch.ones(()))
    for step in range(3):
        if step == 2:
            opt.param_groups[0]["amsgrad"] = True
        _grads(ours, theirs, gen)
        for a, b in zip(ours, theirs):
            a.grad.mul_(1024.0)
        scaler.unscale_(opt)
        norm = fusedist.clip_grad_norm_(ours, 1.0)
        their_norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        assert norm.dtype == their_norm.dtype == torch.float32
        torch.testing.assert_close(norm, their_norm, rtol=1e-6, atol=0)
        scaler.step(opt)
        scaler.update()
        if step < 2:
            ref.step()
            _close(ours, theirs, f"seed {seed} step {step}")
    assert opt.state[ours[0]]["max_exp_avg_sq"].dtype == torch.complex64


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex_refusals_name_the_parameter():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, dtype=torch.complex64))]
    with pytest.raises(TypeError, match=r"FusedLAMB: param 1 of param group 0 has dtype torch.complex64; "
                                        r".*\(FusedAdam, FusedAdamW and FusedSGD take complex ones\)"):
        FusedLAMB(params)
    opt = FusedAdam(params[:1])
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex32))
    with pytest.raises(TypeError, match=r"param 0 of param group 1 has dtype torch.complex32; only .*complex128"):
        opt.add_param_group({"params": [half]})
    assert len(opt.param_groups) == 1
    # a complex gradient of a real parameter (its grad_dtype lifted) is refused naming it, before any write
    before = params[0].detach().clone()
    params[0].grad_dtype = None
    params[0].grad = torch.ones(3, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"gradient of param 0 of group 0 has dtype torch.complex64, the parameter "
                                        r"torch.float32"):
        opt.step()
    assert torch.equal(params[0].detach(), before) and not opt.state
    # and a real gradient of a complex parameter, whose real view is twice its size: refused
    # before the group stepped ahead of it is written
    first, cplx = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, dtype=torch.complex64))
    sgd = FusedSGD([{"params": [first]}, {"params": [torch.nn.Parameter(torch.randn(1)), cplx]}], lr=0.1)
    first.grad = torch.ones(3)
    cplx.grad_dtype = None
    cplx.grad = torch.ones(2)
    before = first.detach().clone()
    with pytest.raises(TypeError, match=r"FusedSGD \(group 1\): gradient of param 1 has dtype torch.float32, the "
                                        r"parameter torch.complex64"):
        sgd.step()
    assert torch.equal(first.detach(), before)
