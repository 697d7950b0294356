"""FusedSGD on CPU tensors (``fusedist/optim/_cpu_sgd.py``): torch's foreach SGD, op for op, so
the same bits as ``torch.optim.SGD(foreach=True)`` on fresh random inputs -- every option, fp32
and fp64, many parameters, a momentum switched on later, skipped (overflowed) steps -- and the
gradients are never written. Tensors the path does not take (masters, mixed dtypes) keep the
reference path, whose tests are in test_optim.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusedist.optim import FusedSGD
from fusedist.optim import _cpu_sgd

@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    """The path under test is the CPU backend's (the tests' default is Triton's interpreter)."""
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "torch")


SHAPES = [(7,), (3, 5), (1,), (4, 4, 2), (0,), (33,)]
OPTIONS = [dict(momentum=m, dampening=d, nesterov=n, weight_decay=wd, maximize=mx)
           for m, d, n, wd, mx in itertools.product((0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.01), (False, True))
           if not (n and (m == 0 or d != 0))]


def _params(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def _grads(step, dtype):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_fused_sgd_on_cpu_is_torchs_foreach_sgd_bit_for_bit(dtype, options):
    ours, theirs = _params(dtype, 0), _params(dtype, 0)
    opt = FusedSGD(ours, lr=0.1, **options)
    ref = torch.optim.SGD(theirs, lr=0.1, foreach=True, **options)
    for step in range(4):
        grads = _grads(step, dtype)
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        kept = [p.grad.clone() for p in ours]
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q), (step, options)
        assert all(torch.equal(p.grad, k) for p, k in zip(ours, kept))
    if options["momentum"]:
        for p, q in zip(ours, theirs):
            assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])


def test_momentum_switched_on_later_and_a_parameter_without_gradient():
    ours, theirs = _params(torch.float32, 1), _params(torch.float32, 1)
    opt, ref = FusedSGD(ours, lr=0.05), torch.optim.SGD(theirs, lr=0.05, foreach=True)
    for step in range(5):
        if step == 2:
            for o in (opt, ref):
                o.param_groups[0].update(momentum=0.8, dampening=0.1)
        for i, (p, q, g) in enumerate(zip(ours, theirs, _grads(step, torch.float32))):
            missing = step == 3 and i == 1  # no gradient at this step: not stepped, buffer untouched
            p.grad, q.grad = (None, None) if missing else (g.clone(), g.clone())
        opt.step()
        ref.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, theirs)), step


def test_a_skipped_step_writes_nothing_and_the_next_starts_the_buffer():
    """found_inf set (an overflowed step under a GradScaler): nothing changes; the next step
    starts each momentum buffer from its gradient, as torch's SGD, which never saw the skipped
    step."""
    from fusedist.optim import functional as F

    ours, theirs = _params(torch.float32, 2), _params(torch.float32, 2)
    bufs = [torch.zeros_like(p) for p in ours]
    steps = [torch.tensor(1.0) for _ in ours]
    before = [p.detach().clone() for p in ours]
    grads = _grads(0, torch.float32)
    with torch.no_grad():
        F.sgd_update(ours, grads, bufs, None, lr=0.1, momentum=0.9, dampening=0.3, step=steps,
                     found_inf=torch.ones(1))
        assert all(torch.equal(p, b) for p, b in zip(ours, before)) and all(not b.any() for b in bufs)
        F.sgd_update(ours, grads, bufs, None, lr=0.1, momentum=0.9, dampening=0.3, step=steps,
                     inv_scale=torch.full((1,), 0.5), clip_coef=torch.full((1,), 0.25))
    ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, dampening=0.3, foreach=True)
    for q, g in zip(theirs, grads):
        q.grad = g * 0.125  # unscaled and clipped: exact (powers of two)
    ref.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))


def test_the_path_is_taken_only_for_tensors_without_casts():
    cpu, f32, f64, bf16 = torch.device("cpu"), torch.float32, torch.float64, torch.bfloat16
    assert _cpu_sgd.applies(cpu, f32, f32, False, [torch.zeros(3)])
    assert _cpu_sgd.applies(cpu, f64, f64, False, None)
    assert not _cpu_sgd.applies(cpu, bf16, bf16, True, None)  # FP32 masters: casts
    assert not _cpu_sgd.applies(cpu, f32, f64, False, None)
    assert not _cpu_sgd.applies(cpu, f32, f32, False, [torch.zeros(3, dtype=f64)])
    assert not _cpu_sgd.applies(torch.device("meta"), f32, f32, False, None)
