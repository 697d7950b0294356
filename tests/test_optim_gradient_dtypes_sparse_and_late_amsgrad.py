"""Two places where the fused optimizers take what torch's refuse, and what they do there.

* A gradient of another dtype than its parameter (possible once the parameter's ``grad_dtype``
  is lifted, e.g. fp32 gradients accumulated for bf16 weights): torch's Adam/AdamW refuse it in
  every implementation ("expected dtype float for `end`"), its SGD takes it except ``fused=True``.
  The fused kernels read any floating gradient and compute in the parameter's compute dtype (fp32,
  fp64 for fp64 parameters), so the step is torch's step on the gradient converted to that dtype:
  for an fp32 parameter, torch's on ``grad.float()``; for a bf16 one, torch's on an fp32 copy of
  the weights rounded to bf16 after each step (the fused optimizers keep fp32 moments for bf16
  parameters).
* A sparse gradient under the scaler: the fused optimizers refuse it in ``step()`` naming the
  parameter and what to use instead (torch's Adam/AdamW refuse it too); the scaler's check pass,
  which runs first, refused it as "check_and_norm: grads[0] is sparse", naming neither.
* ``amsgrad`` switched on after a parameter's state was made: torch's Adam raises
  ``KeyError: 'max_exp_avg_sq'`` at the next step. The fused step starts the maximum at zeros then,
  which is torch's own AMSGrad from that step on: torch's Adam given a zero ``max_exp_avg_sq`` at
  the switch.

Tolerances: fp32 steps 1e-6 absolute (same math, another operation order: tests/test_optim.py);
bf16 weights one bf16 ulp relative (2**-8: an fp32 ulp apart before rounding can round apart).
"""

from __future__ import annotations

import random

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

from test_optim import BACKENDS

SHAPES = [(7,), (5, 3), (1,), (0,)]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Each kernel path: Triton (interpreted here), the PyTorch reference, the C++ CPU Adam."""
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


CASES = [
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
]


def _params(gen, dtype):
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


@pytest.mark.parametrize("fused_cls, torch_cls, kwargs", CASES)
@pytest.mark.parametrize("param_dtype, grad_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float32, torch.float64),
    (torch.bfloat16, torch.float32),
])
def test_gradient_of_another_dtype_steps_as_torch_on_the_converted_gradient(
        backend, fused_cls, torch_cls, kwargs, param_dtype, grad_dtype):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    ours = _params(gen, param_dtype)
    theirs = [torch.nn.Parameter(p.detach().float()) for p in ours]  # (fp32 weights, rounded below)
    for p in ours:
        p.grad_dtype = None  # (torch refuses to assign a gradient of another dtype otherwise)
    opt, ref = fused_cls(ours, **kwargs), torch_cls(theirs, **kwargs)
    for step in range(4):
        for p, q in zip(ours, theirs):
            p.grad = (torch.randn(p.shape, generator=gen) * 3).to(grad_dtype)
            q.grad = p.grad.float()
        opt.step()
        ref.step()
        with torch.no_grad():
            for p, q in zip(ours, theirs):
                q.copy_(q.to(param_dtype))  # the weights the fused step writes
                assert p.dtype == param_dtype and p.grad.dtype == grad_dtype
                tol = dict(rtol=0, atol=1e-6) if param_dtype == torch.float32 else dict(rtol=2**-8, atol=1e-6)
                torch.testing.assert_close(p.float(), q, **tol, msg=lambda m: f"seed {seed} step {step}: {m}")


def test_lamb_takes_a_gradient_of_another_dtype_as_its_converted_gradient(backend):
    """LAMB has no torch counterpart: against itself on the fp32-converted gradient."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    ours = _params(gen, torch.float32)
    same = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p in ours:
        p.grad_dtype = None
    opt, ref = FusedLAMB(ours, lr=1e-2, weight_decay=0.01), FusedLAMB(same, lr=1e-2, weight_decay=0.01)
    for _ in range(3):
        for p, q in zip(ours, same):
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            q.grad = p.grad.float()
        opt.step()
        ref.step()
    for p, q in zip(ours, same):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fused_cls, torch_cls", [(FusedAdam, torch.optim.Adam), (FusedAdamW, torch.optim.AdamW)])
def test_amsgrad_switched_on_later_is_torchs_amsgrad_from_a_zero_maximum(backend, fused_cls, torch_cls):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    ours = _params(gen, torch.float32)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt, ref = fused_cls(ours, lr=1e-2), torch_cls(theirs, lr=1e-2)
    for step in range(5):
        if step == 2:
            ref.param_groups[0]["amsgrad"] = True
            with pytest.raises(KeyError, match="max_exp_avg_sq"):  # torch's own step at the switch
                for q in theirs:
                    q.grad = torch.zeros_like(q)
                ref.step()
            opt.param_groups[0]["amsgrad"] = True
            for q in theirs:  # what the fused step starts from
                ref.state[q]["max_exp_avg_sq"] = torch.zeros_like(q)
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen) * (4.0 if step == 1 else 1.0)  # (a maximum to keep)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=lambda m: f"seed {seed} step {step}: {m}")
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(opt.state[p]["max_exp_avg_sq"], ref.state[q]["max_exp_avg_sq"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("fused_cls, alternative", [
    (FusedAdamW, "torch.optim.SparseAdam"), (FusedSGD, "torch.optim.SGD"),
])
def test_sparse_gradient_under_the_scaler_is_refused_naming_the_parameter(fused_cls, alternative, lazy):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    dense = torch.nn.Linear(3, 2)
    emb = torch.nn.Embedding(6, 3, sparse=True)
    params = [*dense.parameters(), emb.weight]
    opt = fused_cls([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
    before = [p.detach().clone() for p in params]
    for call in ("unscale_", "step"):
        scaler = GradScaler("cpu", init_scale=8.0, lazy_unscale=lazy)
        opt.zero_grad()
        loss = dense(emb(torch.randint(0, 6, (4,), generator=gen))).square().sum()
        scaler.scale(loss).backward()
        grads = [p.grad.to_dense().clone() for p in params]
        with pytest.raises(RuntimeError, match=rf"{fused_cls.__name__} does not support sparse gradients "
                                               rf"\(param 0 of param group 1\); use {alternative}"):
            getattr(scaler, call)(opt)
        assert all(torch.equal(p, b) for p, b in zip(params, before)), call  # nothing written
        assert all(torch.equal(p.grad.to_dense(), g) for p, g in zip(params, grads)), call
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):  # torch's refusal, for AdamW
        torch.optim.AdamW([emb.weight]).step()
