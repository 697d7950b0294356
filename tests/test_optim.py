"""Fused optimizers against torch.optim (and LAMB against a reference written here).

Every parity test runs twice: on the Triton path (interpreter on CPU, compiled on CUDA) and on
the pure-PyTorch reference path (``FUSEDIST_KERNEL_BACKEND=torch``).

Tolerances: fp32 runs use 1e-6 absolute (the issue's bound; both sides compute in fp32 with the
same operation order, differing only in fp32-vs-fp64 rounding of the bias corrections).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from fusedist._extension import is_available
from fusedist.backend import triton_available, triton_interpreting
from fusedist.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
_TRITON_OK = triton_available() and (torch.cuda.is_available() or triton_interpreting())
_CPU_EXT_OK = DEVICE.type == "cpu" and is_available("_cpu_ops")
BACKENDS = [
    pytest.param("triton", marks=pytest.mark.skipif(not _TRITON_OK, reason="no Triton path here")),
    "torch",
    # The C++ CPU Adam (SGD and LAMB have no C++ kernel and run the reference under this setting).
    pytest.param("cpu_ext", marks=pytest.mark.skipif(not _CPU_EXT_OK, reason="fusedist._cpu_ops not built")),
]
SHAPES = [(7,), (33, 5), (1,), (1023,)]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


def _params(dtype=torch.float32, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device=DEVICE, dtype=dtype).requires_grad_() for s in shapes]


def _clone_params(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def _grads(step, shapes=SHAPES, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen).to(device=DEVICE, dtype=dtype) for s in shapes]


def _set_grads(params, grads, skip=()):
    for i, (p, g) in enumerate(zip(params, grads)):
        p.grad = None if i in skip else g.clone().to(p.dtype)


def _groups(params, **second):
    return [{"params": params[:2]}, {"params": params[2:], **second}]


def _assert_params_close(ours, theirs, atol=1e-6):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=atol)


@pytest.mark.parametrize("fused_cls,torch_cls,kwargs,second_group", [
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, betas=(0.8, 0.99))),
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05), dict(weight_decay=0.0, eps=1e-6)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, maximize=True), dict(lr=2e-2)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True), dict(lr=2e-2)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3), dict(lr=0.02, dampening=0.1)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True), dict(momentum=0.5)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1), dict(weight_decay=0.01, maximize=True)),
])
def test_parity_with_torch_20_steps(backend, fused_cls, torch_cls, kwargs, second_group):
    """Two param groups, StepLR, a parameter that gets no grad on some steps, fp32 within 1e-6."""
    ours = _params()
    theirs = _clone_params(ours)
    opt = fused_cls(_groups(ours, **second_group), **kwargs)
    ref = torch_cls(_groups(theirs, **second_group), **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=5, gamma=0.5)
    for step in range(20):
        skip = (1,) if step % 3 == 0 else ()  # a parameter without a grad this step
        grads = _grads(step)
        _set_grads(ours, grads, skip)
        _set_grads(theirs, grads, skip)
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        ref.zero_grad(set_to_none=step % 2 == 0)
    _assert_params_close(ours, theirs)
    assert opt.param_groups[1]["lr"] == ref.param_groups[1]["lr"]


def test_bf16_master_weights_track_fp32_adamw(backend):
    """bf16 params + FP32 masters follow torch AdamW on fp32 params: masters within fp32
    tolerance, bf16 params exactly the rounded masters (so within half a bf16 ulp of torch).
    Gradients are made bf16-representable so both sides see identical gradients."""
    ref_params = _params(seed=5)
    ours = _clone_params(ref_params, torch.bfloat16)
    # Start from bf16-representable weights so the fp32 run starts from the same point.
    with torch.no_grad():
        for r, o in zip(ref_params, ours):
            r.copy_(o.float())
    opt = FusedAdamW(ours, lr=1e-3, weight_decay=0.01, master_weights=True)
    ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0.01)
    naive = _clone_params(ours)  # plain bf16 AdamW, for contrast: rounds tiny updates away
    naive_opt = torch.optim.AdamW(naive, lr=1e-3, weight_decay=0.01)
    for step in range(20):
        grads = [g.to(torch.bfloat16) for g in _grads(step)]
        _set_grads(ours, grads)
        _set_grads(naive, grads)
        _set_grads(ref_params, [g.float() for g in grads])
        opt.step()
        ref.step()
        naive_opt.step()
    masters = [opt.state[p]["master_param"] for p in ours]
    _assert_params_close(masters, ref_params, atol=1e-6)
    for p, w, r in zip(ours, masters, ref_params):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), w.to(torch.bfloat16))
        torch.testing.assert_close(p.detach().float(), r.detach(), rtol=2**-8, atol=1e-6)
    drift_ours = max((p.detach().float() - r.detach()).abs().max().item() for p, r in zip(ours, ref_params))
    drift_naive = max((p.detach().float() - r.detach()).abs().max().item() for p, r in zip(naive, ref_params))
    assert drift_ours < drift_naive


def _reference_lamb(params, grads_per_step, lr, betas, eps, wd, max_grad_norm, adam_w_mode=True):
    """Straightforward LAMB (apex FusedLAMB semantics) in fp64, written from the paper/apex docs."""
    params = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    b1, b2 = betas
    for step, grads in enumerate(grads_per_step, start=1):
        grads = [g.double() for g in grads]
        gnorm = torch.sqrt(sum((g * g).sum() for g in grads))
        if max_grad_norm > 0 and gnorm > max_grad_norm:
            grads = [g / (gnorm / max_grad_norm) for g in grads]
        for i, (p, g) in enumerate(zip(params, grads)):
            if not adam_w_mode:
                g = g + wd * p
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1**step)) / ((v[i] / (1 - b2**step)).sqrt() + eps)
            if adam_w_mode:
                u = u + wd * p
            pn, un = p.norm(), u.norm()
            ratio = pn / un if (wd != 0 and pn > 0 and un > 0) else 1.0
            params[i] = p - lr * ratio * u
    return params


@pytest.mark.parametrize("adam_w_mode,max_grad_norm,wd", [(True, 1.0, 0.01), (False, 0.0, 0.1), (True, 1e3, 0.0)])
def test_lamb_matches_reference(backend, adam_w_mode, max_grad_norm, wd):
    ours = _params(seed=2)
    start = _clone_params(ours)
    opt = FusedLAMB(ours, lr=1e-2, weight_decay=wd, adam_w_mode=adam_w_mode, max_grad_norm=max_grad_norm)
    all_grads = []
    for step in range(10):
        grads = _grads(step)
        all_grads.append(grads)
        _set_grads(ours, grads)
        opt.step()
    expected = _reference_lamb(start, all_grads, 1e-2, (0.9, 0.999), 1e-6, wd, max_grad_norm, adam_w_mode)
    # fp32 vs an fp64 reference over 10 steps of lr 1e-2: 1e-5 absolute.
    _assert_params_close([p.double() for p in ours], expected, atol=1e-5)


@pytest.mark.parametrize("cls,kwargs", [
    (FusedAdamW, dict(lr=1e-2, master_weights=True)),
    (FusedSGD, dict(lr=0.1, momentum=0.9, master_weights=True)),
    (FusedLAMB, dict(lr=1e-2, master_weights=True)),
])
def test_state_dict_round_trip_and_bit_identical_resume(cls, kwargs):
    def make():
        params = _params(torch.bfloat16, seed=9)
        params.append(torch.randn(4, 3, device=DEVICE).requires_grad_())  # mixed dtypes
        return params, cls([{"params": params[:3]}, {"params": params[3:], "lr": 5e-3}], **kwargs)

    shapes = SHAPES + [(4, 3)]
    params, opt = make()
    for step in range(3):
        _set_grads(params, _grads(step, shapes))
        opt.step()
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in params]}, buffer)
    for step in range(3, 6):
        _set_grads(params, _grads(step, shapes))
        opt.step()

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    params2, opt2 = make()
    with torch.no_grad():
        for p, s in zip(params2, saved["params"]):
            p.copy_(s)
    opt2.load_state_dict(saved["opt"])
    for p, q in zip(params, params2):  # state survives with its dtypes (fp32 masters stay fp32)
        for key, value in opt2.state[q].items():
            if isinstance(value, torch.Tensor) and key != "step":
                assert value.dtype == torch.float32, key
    first = opt2.state_dict()
    assert first["param_groups"] == saved["opt"]["param_groups"]
    for step in range(3, 6):
        _set_grads(params2, _grads(step, shapes))
        opt2.step()
    for p, q in zip(params, params2):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            if key == "step" and cls is FusedSGD:
                # torch's SGD keeps no step count, and FusedSGD's state dict is torch's: a loaded
                # buffer counts as past its first step, the only thing the count decides.
                assert opt2.state[q][key] >= 2, opt2.state[q][key]
                continue
            assert torch.equal(value, opt2.state[q][key]), key


def test_load_torch_adamw_state_dict_continues_like_torch():
    params = _params()
    theirs = _clone_params(params)
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    for step in range(3):
        _set_grads(theirs, _grads(step))
        ref.step()
    ours = _clone_params(theirs)
    opt = FusedAdamW(ours, lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    _continue_side_by_side(ref, theirs, opt, ours)


def _continue_side_by_side(ref, theirs, opt, ours):
    """Steps 3-5 of both optimizers on the same gradients; the parameters must stay close."""
    for step in range(3, 6):
        _set_grads(theirs, _grads(step))
        _set_grads(ours, _grads(step))
        ref.step()
        opt.step()
    _assert_params_close(ours, theirs)


def test_load_torch_sgd_state_dict_continues_like_torch():
    """torch's SGD state has no step count: the loaded momentum buffers must not be reset."""
    theirs = _params()
    ref = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, nesterov=True)
    for step in range(3):
        _set_grads(theirs, _grads(step))
        ref.step()
    ours = _clone_params(theirs)
    opt = FusedSGD(ours, lr=0.05, momentum=0.9, nesterov=True)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    _continue_side_by_side(ref, theirs, opt, ours)


def test_master_weights_created_for_a_loaded_state():
    params = _params(torch.bfloat16)
    ref = torch.optim.AdamW(params, lr=1e-3)
    _set_grads(params, _grads(0))
    ref.step()
    opt = FusedAdamW(params, lr=1e-3, master_weights=True)
    opt.load_state_dict(ref.state_dict())
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float32  # widened from bf16
    opt.step()
    assert opt.state[params[0]]["master_param"].dtype == torch.float32
    assert torch.equal(params[0].detach(), opt.state[params[0]]["master_param"].to(torch.bfloat16))


def test_mixed_dtype_groups_and_zero_grad(backend):
    p32 = _params(seed=3)[:2]
    p16 = _params(torch.float16, seed=4)[2:]
    opt = FusedAdam([{"params": p32}, {"params": p16, "master_weights": True}], lr=1e-2)
    _set_grads(p32 + p16, _grads(0))
    opt.step()
    assert "master_param" not in opt.state[p32[0]]
    assert opt.state[p16[0]]["master_param"].dtype == torch.float32
    assert opt.state[p16[0]]["exp_avg"].dtype == torch.float32
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in p32 + p16)
    opt.zero_grad()
    assert all(p.grad is None for p in p32 + p16)
    opt.step()  # no grads: a no-op


def test_gradient_unlike_its_parameter_is_refused_before_any_write():
    """A gradient whose shape no longer matches its parameter (resized through ``.data``, which
    torch's own assignment check does not see) fails the step naming the parameter, with every
    parameter unchanged -- also the ones the checks pass over first."""
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(4)
    params[2].grad.data = torch.randn(5)
    before = [p.detach().clone() for p in params]
    opt = FusedAdamW(params, lr=0.1)
    with pytest.raises(ValueError, match=r"gradient of param 2 of group 0 has shape \(5,\)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_clear_errors():
    with pytest.raises(TypeError, match=r"param 1 of param group 0 has dtype torch.int64"):
        FusedAdam([torch.zeros(2), torch.zeros(2, dtype=torch.long)])
    with pytest.raises(TypeError, match="complex"):
        FusedLAMB([torch.zeros(2, dtype=torch.complex64)])
    with pytest.raises(ValueError, match="lr=nan is not finite"):
        FusedAdamW([torch.zeros(2)], lr=float("nan"))
    with pytest.raises(ValueError, match="betas"):
        FusedAdam([torch.zeros(2)], betas=(0.9, float("inf")))
    with pytest.raises(ValueError, match="capturable"):
        FusedAdam([torch.zeros(2)], capturable=True)
    with pytest.raises(ValueError, match="fused=False"):
        FusedAdamW([torch.zeros(2)], fused=False)
    p = torch.zeros(3, requires_grad=True)
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match=r"sparse gradients \(param 0 of param group 0\)"):
        opt.step()
    p.grad = torch.zeros(3)
    opt.param_groups[0]["lr"] = float("inf")  # e.g. a broken scheduler
    with pytest.raises(ValueError, match="lr=inf is not finite"):
        opt.step()


@pytest.mark.gpu
def test_gpu_adamw_parity_with_torch_fused():
    """Compiled kernels against torch's own fused AdamW on CUDA."""
    ours = [torch.randn(s, device="cuda").requires_grad_() for s in [(1,), (4097,), (1000, 1000)]]
    theirs = _clone_params(ours)
    opt = FusedAdamW(ours, lr=1e-3, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.1, fused=True)
    steps = 20
    for _ in range(steps):
        for a, b in zip(ours, theirs):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    # Both compute each step in fp32 but in different orders (the compiled Triton kernel may
    # fuse a multiply-add that torch rounds twice), so a step may round a parameter
    # differently by about an ulp of its value: after 20 steps up to 20 ulps, a relative
    # 20 * 2**-23 = 2.4e-6 (rtol). The parameters are O(1) (randn), and differences of about
    # an ulp of 1.0 also show on parameters near zero (atol, 8 ulps of 1.0). Measured on an
    # H200: 2.6e-6 at |p| = 2.5, and 1.1e-7 at |p| = 4e-4. A wrong update term (bias
    # correction, decoupled decay) differs by ~lr = 1e-3 and fails.
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=steps * torch.finfo(torch.float32).eps, atol=1e-6)


@pytest.mark.parametrize("cls, kwargs", [(FusedAdamW, dict(lr=1e-2, weight_decay=0.1)),
                                         (FusedSGD, dict(lr=0.1, momentum=0.9)), (FusedLAMB, dict(lr=1e-2))])
def test_master_weights_take_writes_made_between_steps(cls, kwargs):
    """Note [masters and writes from outside]: a bf16 parameter written between steps (a model
    load, an in-place op) is stepped from the written value, not reverted to the stale master.
    At lr=0 the step changes nothing, so the parameter must still hold what was written."""
    params = _params(torch.bfloat16)
    opt = cls(params, master_weights=True, **kwargs)
    _set_grads(params, _grads(0))
    opt.step()
    written = [torch.randn_like(p) for p in params]
    with torch.no_grad():
        for p, w in zip(params, written):
            p.copy_(w)
    _set_grads(params, _grads(1))
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    for p, w in zip(params, written):
        assert torch.equal(p.detach(), w), (p - w).abs().max()
        assert torch.equal(opt.state[p]["master_param"], w.float())
