"""Gradients that are lazily negated views (torch's negative bit: ``torch._neg_view(x)``,
``z.conj().imag``) or lazily conjugated ones (``p.grad = z.conj()``): memory holds ``-value`` or
``conj(value)`` while torch reads ``value``. The kernels read raw memory, so such a gradient used
to be stepped the wrong way (Note [lazily negated tensors] in fusedist/optim/_negated.py, Note
[lazily conjugated gradients] in fusedist/optim/_complex.py). Every kernel backend, the scaler's
unscale and the clip are checked against torch's optimizers on the resolved gradients.

torch's own AdamW/SGD raise on a conjugated complex gradient ("view_as_real doesn't work on
unresolved conjugated tensors"), and its GradScaler.unscale_ and foreach clip raise on either
kind; the reference there is torch on ``g.resolve_conj()`` / ``g.resolve_neg()``, the values.

Tolerances: fp32 (complex64) parameters of order 1, a few steps, both sides fp32 arithmetic
differing only in rounding order: 1e-6 absolute (as test_optim.py); LAMB against the fp64
reference: 1e-5 (as test_optim.py's LAMB test).
"""

from __future__ import annotations

import pytest
import torch

import fusedist
from fusedist.amp import GradScaler
from fusedist.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD
from fusedist.optim.functional import adam_update, sgd_update
from fusedist.optim.grad_norms import tensor_norms

from test_optim import BACKENDS, _reference_lamb

ATOL = 1e-6
SHAPES = [(1,), (17,), (3, 5)]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


def _negated(gen, shape):
    """A negated view of fresh values: for one element ``z.conj().imag`` (what complex math
    hands a real parameter), else ``torch._neg_view``."""
    if shape == (1,):
        g = torch.randn(1, generator=gen, dtype=torch.complex64).conj().imag
    else:
        g = torch._neg_view(torch.randn(shape, generator=gen))
    assert g.is_neg()
    return g


def _close(ours, theirs, what, atol=ATOL):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=atol, msg=lambda m: f"{what} param {i}: {m}")


@pytest.mark.parametrize("cls,torch_cls,kwargs", [
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.05)),
    (FusedLAMB, None, dict(lr=1e-2, weight_decay=0.01)),
])
def test_negated_gradients_step_like_torch(backend, cls, torch_cls, kwargs):
    """Memory holds -g: the Triton path used to step every element the wrong way (0.04 off
    AdamW's parameters after two steps)."""
    gen = torch.Generator().manual_seed(7)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    opt = cls(ours, **kwargs)
    ref = torch_cls(theirs, **kwargs) if torch_cls is not None else None
    steps = []
    for _ in range(2):
        grads = [_negated(gen, s) for s in SHAPES]
        steps.append([g.resolve_neg() for g in grads])
        for a, b, g in zip(ours, theirs, grads):
            a.grad, b.grad = g, g.resolve_neg()
        opt.step()
        if ref is not None:
            ref.step()
    if ref is None:  # LAMB: no torch optimizer; the fp64 reference of test_optim.py
        expected = _reference_lamb(start, steps, kwargs["lr"], (0.9, 0.999), 1e-6, kwargs["weight_decay"], 1.0)
        _close([p.double() for p in ours], expected, cls.__name__, atol=1e-5)
    else:
        _close(ours, theirs, cls.__name__)


def test_functional_api_resolves_read_inputs_and_refuses_written_negated_views(backend):
    """A negated inv_scale is read as its value; a negated tensor the update writes (parameter,
    state) is refused before anything is written, naming it."""
    gen = torch.Generator().manual_seed(8)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    for t, g in zip(theirs, grads):
        t.grad = g.clone()
    torch.optim.SGD(theirs, lr=0.1).step()
    # -(-0.5) = 0.5: an exact unscale of gradients scaled by 2
    sgd_update(params, [g * 2 for g in grads], None, None, lr=0.1, inv_scale=torch._neg_view(torch.tensor([-0.5])))
    _close(params, theirs, "sgd_update with a negated inv_scale")
    before = [p.clone() for p in params]
    written = [params[0], torch._neg_view(params[1].clone())]
    states = [[torch.zeros(s) for s in SHAPES[:2]] for _ in range(2)]
    with pytest.raises(ValueError, match=r"adam_update: params\[1\] is a lazily negated view"):
        adam_update(written, grads[:2], *states, None, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0, adamw=True, step=1)
    states[1][0] = torch._neg_view(states[1][0])
    with pytest.raises(ValueError, match=r"adam_update: exp_avg_sqs\[0\] is a lazily negated view"):
        adam_update(params[:2], grads[:2], *states, None, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0, adamw=True, step=1)
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert all(not s.any() for s in states[0])


@pytest.mark.parametrize("cls,torch_cls,kwargs", [
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
])
def test_conjugated_complex_gradients_step_like_torch(backend, cls, torch_cls, kwargs):
    """``p.grad = z.conj()`` used to raise from view_as_real (torch's optimizers raise too);
    stepped now as the gradient's values. A conjugated parameter is refused, naming the fix."""
    gen = torch.Generator().manual_seed(9)
    start = [torch.randn(s, generator=gen, dtype=torch.complex64) for s in SHAPES]
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    opt, ref = cls(ours, **kwargs), torch_cls(theirs, **kwargs)
    for _ in range(2):
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen, dtype=torch.complex64).conj()
            a.grad, b.grad = g, g.resolve_conj()
        opt.step()
        ref.step()
    _close(ours, theirs, cls.__name__)
    conj_param = torch.nn.Parameter(torch.randn(3, generator=gen, dtype=torch.complex64).conj())
    conj_param.grad = torch.randn(3, generator=gen, dtype=torch.complex64)
    with pytest.raises(ValueError, match="lazily conjugated view.*resolve_conj"):
        cls([conj_param], **kwargs).step()


@pytest.mark.parametrize("kind", ["neg", "conj"])
@pytest.mark.parametrize("fused,lazy", [(True, False), (True, True), (False, False)])
def test_scaler_unscale_and_clip_of_negated_and_conjugated_gradients(backend, kind, fused, lazy):
    """GradScaler.unscale_ (in place and lazy), fusedist.clip_grad_norm_ and the step, with a
    fused and with a torch optimizer, against torch's AdamW on the values unscaled by hand and
    clipped by torch's clip. torch's own scaler and foreach clip raise on these gradients."""
    gen = torch.Generator().manual_seed(10)
    dtype = torch.complex64 if kind == "conj" else torch.float32
    start = [torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES]
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    opt = (FusedAdamW if fused else torch.optim.AdamW)(ours, lr=1e-2)
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    scaler = GradScaler("cpu", init_scale=4.0, lazy_unscale=lazy)
    scaler.scale(torch.ones(()))
    for a, b in zip(ours, theirs):
        value = torch.randn(a.shape, generator=gen, dtype=dtype)
        scaled = value * 4.0
        a.grad = torch._neg_view(-scaled) if kind == "neg" else scaled.conj_physical().conj()
        assert a.grad.is_neg() or a.grad.is_conj()
        b.grad = value
    scaler.unscale_(opt)
    if not lazy:  # written in place, keeping the view's bit
        _close([a.grad.resolve_neg().resolve_conj() for a in ours], [b.grad for b in theirs], "unscaled p.grad")
    total = fusedist.clip_grad_norm_(ours, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, foreach=False)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    if kind == "conj" and not fused:
        return  # torch's AdamW cannot step a conjugated gradient (see the module docstring)
    scaler.step(opt)
    scaler.update()
    ref.step()
    _close(ours, theirs, f"{type(opt).__name__} lazy={lazy}")


def test_norms_of_conjugated_gradients():
    """The per-tensor norms (Lightning's grad_norm, the sharded clips) of a conjugated gradient
    used to raise from view_as_real."""
    z = torch.randn(5, dtype=torch.complex64)
    x = torch.randn(4)
    got = tensor_norms([z.conj(), torch._neg_view(x)])
    torch.testing.assert_close(got, torch.stack([torch.linalg.vector_norm(z), torch.linalg.vector_norm(x)]))


@pytest.mark.parametrize("kind", ["neg", "conj"])
def test_lazy_unscale_applied_for_a_clip_of_some_parameters(kind):
    """A clip of other parameters than the optimizer's (or of another norm order) makes the
    lazily pending unscale write the gradients first: an in-place product that torch's list
    kernels refuse on a flagged gradient, so it is done on the gradient's memory."""
    gen = torch.Generator().manual_seed(11)
    dtype = torch.complex64 if kind == "conj" else torch.float32
    start = [torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES]
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    opt, ref = FusedAdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    scaler = GradScaler("cpu", init_scale=4.0, lazy_unscale=True)
    scaler.scale(torch.ones(()))
    for a, b in zip(ours, theirs):
        value = torch.randn(a.shape, generator=gen, dtype=dtype)
        a.grad = torch._neg_view(-value * 4.0) if kind == "neg" else (value * 4.0).conj_physical().conj()
        b.grad = value
    scaler.unscale_(opt)
    total = fusedist.clip_grad_norm_(ours[1:], 0.5)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(theirs[1:], 0.5, foreach=False), rtol=1e-6, atol=0)
    scaler.step(opt)
    scaler.update()
    ref.step()
    _close(ours, theirs, "FusedAdamW after a clip of some parameters")


@pytest.mark.parametrize("kind", ["neg", "conj"])
def test_recorded_clip_applied_to_unchanged_gradients_when_one_is_replaced(kind):
    """fusedist's clip defers its coefficient to the step; a gradient replaced after it makes
    the coefficient apply to the others in place first (as torch's clip scaled them): a list
    product torch refuses on a flagged gradient, done on its memory."""
    gen = torch.Generator().manual_seed(12)
    dtype = torch.complex64 if kind == "conj" else torch.float32
    start = [torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES]
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    opt, ref = FusedAdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    for a, b in zip(ours, theirs):
        value = torch.randn(a.shape, generator=gen, dtype=dtype)
        a.grad = torch._neg_view(-value * 4.0) if kind == "neg" else (value * 4.0).conj_physical().conj()
        b.grad = value
    scaler.unscale_(opt)
    fusedist.clip_grad_norm_(ours, 0.5)
    torch.nn.utils.clip_grad_norm_(theirs, 0.5, foreach=False)
    new = torch.randn(SHAPES[0], generator=gen, dtype=dtype)
    ours[0].grad, theirs[0].grad = new.clone(), new.clone()
    scaler.step(opt)
    scaler.update()
    ref.step()
    _close(ours, theirs, "FusedAdamW after a replaced gradient")
