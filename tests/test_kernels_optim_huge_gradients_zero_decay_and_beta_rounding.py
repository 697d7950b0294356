"""Optimizer numerics at the edges against torch: a huge gradient's second moment, and a
zero weight decay next to non-finite parameters, on every Adam/SGD implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fusedist.optim as fo
from fusedist.optim import _reference
from fusedist.optim import functional as F
from fusedist.backend import triton_available, triton_interpreting

needs_triton = pytest.mark.skipif(
    not triton_available() or (not torch.cuda.is_available() and not triton_interpreting()),
    reason="needs Triton with CUDA or TRITON_INTERPRET=1",
)
NAN, INF = float("nan"), float("inf")


def _grad(head, n=9, seed=0):
    """A random gradient whose first entries are ``head``."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    g[:len(head)] = torch.tensor(head)
    return g


def _steps(make, p0, grads):
    """The parameter and the tensor states after one ``step()`` per gradient."""
    p = torch.nn.Parameter(p0.clone())
    opt = make([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return [p.detach()] + [v for _, v in sorted(opt.state[p].items()) if v.dim() > 0]


def _assert_same(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=2e-6, atol=1e-7, equal_nan=True)


def _backends():
    out = [pytest.param("torch"), pytest.param("triton", marks=needs_triton)]
    if F._has_cpu_adam():
        out.append(pytest.param("cpu_ext"))
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("pair", [(torch.optim.Adam, fo.FusedAdam), (torch.optim.AdamW, fo.FusedAdamW)],
                         ids=["Adam", "AdamW"])
def test_huge_gradient_keeps_a_finite_second_moment_as_torch(monkeypatch, backend, amsgrad, pair):
    # (1 - beta2) * g * g, evaluated left to right as torch's addcmul does, is finite for |g| up
    # to ~5.8e20; g * g alone overflows past ~1.8e19 and the parameter then never moves again.
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", backend)
    if backend == "cpu_ext" and amsgrad:
        pytest.skip("the C++ kernel has no AMSGrad")
    p0 = torch.randn(9, generator=torch.Generator().manual_seed(1))
    grads = [_grad([3e19, -3e19, 4e20], seed=s) for s in range(2)]
    torch_cls, fused_cls = pair
    expected = _steps(lambda ps: torch_cls(ps, lr=0.1, amsgrad=amsgrad), p0, grads)
    actual = _steps(lambda ps: fused_cls(ps, lr=0.1, amsgrad=amsgrad), p0, grads)
    assert torch.isfinite(actual[0]).all() and (actual[0][:3] != p0[:3]).all()
    _assert_same(actual, expected)


@needs_triton
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_zero_weight_decay_leaves_a_nonfinite_parameter_out_as_torch(monkeypatch, amsgrad):
    # torch adds weight_decay * p only for a nonzero weight_decay; 0 * inf is nan, which would
    # turn the moments of an inf parameter (or one made nan by an inf gradient) into nan.
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "triton")
    p0 = torch.randn(9, generator=torch.Generator().manual_seed(2))
    p0[3] = INF
    grads = [_grad([INF, NAN, -INF]), _grad([1.0, 2.0, 3.0], seed=1), _grad([], seed=2)]
    expected = _steps(lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=amsgrad), p0, grads)
    actual = _steps(lambda ps: fo.FusedAdam(ps, lr=0.1, amsgrad=amsgrad), p0, grads)
    _assert_same(actual, expected)


@needs_triton
def test_sgd_zero_weight_decay_leaves_a_nonfinite_parameter_out_as_torch(monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "triton")
    p0 = torch.randn(9, generator=torch.Generator().manual_seed(3))
    p0[3] = -INF
    grads = [_grad([INF, NAN, 1e38]), _grad([1.0, 2.0], seed=1), _grad([], seed=2)]
    make_t = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    make_f = lambda ps: fo.FusedSGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    _assert_same(_steps(make_f, p0, grads), _steps(make_t, p0, grads))


def _torch_adam_step(p, g, adamw, weight_decay, steps):
    p = torch.nn.Parameter(p.clone())
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([p], lr=0.1, weight_decay=weight_decay)
    for _ in range(steps):
        p.grad = g.clone()
        opt.step()
    return [p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]]


@pytest.mark.parametrize("adamw,weight_decay", [(False, 0.0), (True, 0.01)])
def test_reference_per_tensor_path_matches_torch_at_the_edges(monkeypatch, adamw, weight_decay):
    # The per-tensor loop of the reference (taken for step counts or a found-inf flag on an
    # accelerator) forced here with a mask that skips nothing.
    monkeypatch.setattr(_reference, "skip_now", lambda found_inf: (False, torch.tensor(False)))
    p0 = torch.randn(9, generator=torch.Generator().manual_seed(4))
    p0[4] = INF
    g = _grad([3e19, -3e19, NAN])
    expected = _torch_adam_step(p0, g, adamw, weight_decay, 2)
    p, m, v = p0.clone(), torch.zeros(9), torch.zeros(9)
    for s in (1, 2):
        _reference.adam([p], [g], None, [m], [v], [torch.tensor(float(s))], lr=0.1, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=weight_decay, adamw=adamw, bias_correction=True, maximize=False,
                        inv_scale=None, clip_coef=None, found_inf=None)
    _assert_same([p, m, v], expected)


def test_reference_sgd_zero_weight_decay_matches_torch():
    p0 = torch.randn(9, generator=torch.Generator().manual_seed(5))
    p0[2] = INF
    g = _grad([INF, 1.0])
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    p, buf = p0.clone(), torch.zeros(9)
    for s in (1, 2):
        ref.grad = g.clone()
        opt.step()
        _reference.sgd([p], [g], None, [buf], [torch.tensor(float(s))], lr=0.1, momentum=0.9, dampening=0.0,
                       weight_decay=0.0, nesterov=False, maximize=False, inv_scale=None, clip_coef=None,
                       found_inf=None)
    _assert_same([p, buf], [ref.detach(), opt.state[ref]["momentum_buffer"]])


@needs_triton
def test_lamb_huge_gradient_second_moment_is_finite_in_kernel_and_reference():
    g = [_grad([3e19, -3e19, 4e20])]
    results = []
    for impl in (F._kernels(), _reference):
        p = [torch.randn(9, generator=torch.Generator().manual_seed(6))]
        m, v, u = torch.zeros(9), torch.zeros(9), torch.zeros(9)
        impl.lamb_stage1(p, g, None, [m], [v], [u], 1, torch.tensor([1.0]), beta1=0.9, beta2=0.999, beta3=0.1,
                         eps=1e-6, weight_decay=0.0, adamw=True, bias_correction=True, inv_scale=None,
                         clip_coef=None, found_inf=None)
        results.append([m, v, u])
    expected_v = (0.001 * g[0]) * g[0]
    for m, v, u in results:
        assert torch.isfinite(v).all() and torch.isfinite(u).all()
        torch.testing.assert_close(v, expected_v, rtol=2e-6, atol=0)
    _assert_same(results[0], results[1])


class _Fp32Arguments:
    """A kernel launcher that rounds float arguments to fp32 before launching, as the GPU
    launcher does (the interpreter keeps them in double, which hides fp32 arithmetic on them)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*(float(np.float32(a)) if type(a) is float else a for a in args),
                                              **kwargs)


@needs_triton
@pytest.mark.parametrize("beta2", [0.999, 0.9999])
def test_adam_kernel_one_minus_beta_is_rounded_once_as_torch(monkeypatch, beta2):
    # torch rounds the double 1 - beta to fp32; 1 - fp32(beta) is off by up to 2^-24 / (1 - beta)
    # relative (1.7e-4 for beta2 = 0.9999), which moves exp_avg_sq by as much.
    from fusedist.triton_kernels import multi_tensor as mt

    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "triton")
    monkeypatch.setattr(mt, "cached", _Fp32Arguments)
    p0 = torch.randn(64, generator=torch.Generator().manual_seed(7))
    grads = [_grad([], n=64, seed=s) for s in range(3)]
    expected = _steps(lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.8, beta2)), p0, grads)
    actual = _steps(lambda ps: fo.FusedAdamW(ps, lr=1e-3, betas=(0.8, beta2)), p0, grads)
    _assert_same(actual, expected)


@needs_triton
def test_lamb_kernel_one_minus_beta2_is_rounded_once_as_the_reference(monkeypatch):
    from fusedist.triton_kernels import multi_tensor as mt

    monkeypatch.setattr(mt, "cached", _Fp32Arguments)
    g = [_grad([], n=64, seed=8)]
    results = []
    for impl in (F._kernels(), _reference):
        p = [torch.randn(64, generator=torch.Generator().manual_seed(9))]
        m, v, u = torch.zeros(64), torch.zeros(64), torch.zeros(64)
        impl.lamb_stage1(p, g, None, [m], [v], [u], 1, torch.tensor([1.0]), beta1=0.9, beta2=0.9999, beta3=0.1,
                         eps=1e-6, weight_decay=0.01, adamw=True, bias_correction=True, inv_scale=None,
                         clip_coef=None, found_inf=None)
        results.append(v)
    torch.testing.assert_close(results[0], results[1], rtol=2e-6, atol=0)  # v ~ 1e-4: no absolute slack
