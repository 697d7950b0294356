"""Multi-tensor optimizer kernels (Triton; interpreter on CPU) against the pure-PyTorch reference.

Both paths compute in fp32 with the same operation order, so fp32 results agree to a few ulp;
the tolerance below (2e-6 relative + 1e-7 absolute) allows for the fp64-vs-fp32 rounding of
the bias corrections and for ``exp2(s * log2(beta))`` against ``beta ** s``.
"""

from __future__ import annotations

import pytest
import torch

from fusedist.optim import _reference
from fusedist.optim import functional as F

from fusedist._memory_layout import is_dense
from fusedist.backend import triton_available, triton_interpreting

pytestmark = pytest.mark.skipif(
    not triton_available() or (not torch.cuda.is_available() and not triton_interpreting()),
    reason="needs Triton with CUDA or TRITON_INTERPRET=1",
)

SIZES = (1, 7, 1023, 65537)
RTOL, ATOL = 2e-6, 1e-7


@pytest.fixture
def device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _kernels():
    return F._kernels()


def _make(sizes, param_dtype, grad_dtype, device, seed=0, with_master=False):
    gen = torch.Generator().manual_seed(seed)
    p32 = [torch.randn(n, generator=gen) for n in sizes]
    params = [p.to(device=device, dtype=param_dtype) for p in p32]
    grads = [torch.randn(n, generator=gen).to(device=device, dtype=grad_dtype) for n in sizes]
    m = [torch.randn(n, generator=gen).to(device) * 0.1 for n in sizes]
    v = [torch.rand(n, generator=gen).to(device) * 0.01 for n in sizes]
    masters = [p.to(device) for p in p32] if with_master else None
    return params, grads, m, v, masters


def _clone(xs):
    return None if xs is None else [x.clone() for x in xs]


def _assert_close(actual, expected):
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)


def _scalars(device, inv=0.25, clip=0.5):
    return (torch.tensor([inv], device=device), torch.tensor([clip], device=device))


# The decay form (adamw) and the dtypes are separate constexprs of the kernel: every dtype pair
# once, and each decay form both with and without a master.
@pytest.mark.parametrize("param_dtype,grad_dtype,with_master,adamw", [
    (torch.float32, torch.float32, False, True),
    (torch.bfloat16, torch.bfloat16, True, True),
    (torch.float16, torch.float32, True, False),
    (torch.bfloat16, torch.float16, False, False),
])
def test_adam_kernel_matches_reference(device, param_dtype, grad_dtype, with_master, adamw):
    params, grads, m, v, masters = _make(SIZES, param_dtype, grad_dtype, device, with_master=with_master)
    ref = [_clone(params), _clone(m), _clone(v), _clone(masters)]
    inv, clip = _scalars(device)
    steps = [torch.tensor(float(k + 1), device=device) for k in range(len(SIZES))]  # per-tensor steps
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, adamw=adamw,
                 bias_correction=True, maximize=False, inv_scale=inv, clip_coef=clip, found_inf=None)
    _kernels().adam(params, grads, masters, m, v, steps, **hyper)
    _reference.adam(ref[0], grads, ref[3], ref[1], ref[2], steps, **hyper)
    _assert_close(m, ref[1])
    _assert_close(v, ref[2])
    if with_master:
        _assert_close(masters, ref[3])
        for p, w in zip(params, masters):  # the parameter is exactly the cast of its master
            assert torch.equal(p, w.to(param_dtype))
    else:
        # Low-precision results may differ by one rounding step of the parameter dtype.
        for p, r in zip(params, ref[0]):
            tol = dict(rtol=RTOL, atol=ATOL) if param_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(p.float(), r.float(), **tol)


@pytest.mark.parametrize("with_master", [False, True])
def test_adam_amsgrad_kernel_matches_reference(device, with_master):
    """AMSGrad in the fused pass: the running maximum, including a nan in v (torch.maximum
    propagates it) and a stored maximum above the new v."""
    params, grads, m, v, masters = _make(SIZES, torch.bfloat16 if with_master else torch.float32,
                                         torch.float32, device, with_master=with_master)
    vmax = [x * torch.where(torch.rand_like(x) < 0.5, 2.0, 0.5) for x in v]
    v[2][5] = float("nan")
    ref = [_clone(params), _clone(m), _clone(v), _clone(masters), _clone(vmax)]
    steps = [torch.tensor(float(k + 3), device=device) for k in range(len(SIZES))]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, adamw=True,
                 bias_correction=True, maximize=False, inv_scale=None, clip_coef=None, found_inf=None)
    _kernels().adam(params, grads, masters, m, v, steps, max_exp_avg_sqs=vmax, **hyper)
    _reference.adam(ref[0], grads, ref[3], ref[1], ref[2], steps, max_exp_avg_sqs=ref[4], **hyper)
    assert vmax[2][5].isnan() and ref[4][2][5].isnan()
    for ours, theirs in ((vmax, ref[4]), (masters, ref[3]) if with_master else (params, ref[0])):
        for a, e in zip(ours, theirs):
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, equal_nan=True)


def test_dense_layouts_take_the_kernels(device, monkeypatch):
    """channels_last and transposed tensors whose gradient and states share their layout are
    walked as flat memory by the kernels (no reference fallback), with the reference's result."""
    gen = torch.Generator().manual_seed(5)
    p = [torch.randn(4, 3, 5, 5, generator=gen).to(device).to(memory_format=torch.channels_last),
         torch.randn(9, 6, generator=gen).to(device).t()]
    g = [torch.randn_like(x, memory_format=torch.preserve_format) for x in p]
    m = [torch.randn_like(x, memory_format=torch.preserve_format) * 0.1 for x in p]
    v = [torch.rand_like(x, memory_format=torch.preserve_format) * 0.01 for x in p]
    expected = [_clone(p), _clone(m), _clone(v)]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, adamw=True, step=2)
    for lst in expected:
        for i, x in enumerate(lst):
            lst[i] = x.contiguous()
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "torch")
    F.adam_update(expected[0], [x.contiguous() for x in g], expected[1], expected[2], None, **hyper)
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "triton")

    def no_fallback(*args, **kwargs):
        raise AssertionError("a dense layout fell back to the reference path")

    monkeypatch.setattr(_reference, "adam", no_fallback)
    F.adam_update(p, g, m, v, None, **hyper)
    _assert_close(p, expected[0])
    _assert_close(m, expected[1])
    assert p[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("momentum,dampening,nesterov,first", [
    (0.0, 0.0, False, False), (0.9, 0.0, False, True), (0.9, 0.1, False, False), (0.9, 0.0, True, False),
])
def test_sgd_kernel_matches_reference(device, momentum, dampening, nesterov, first):
    params, grads, bufs, _, masters = _make(SIZES, torch.bfloat16, torch.float32, device, with_master=True)
    bufs = bufs if momentum else None
    ref = [_clone(params), _clone(bufs), _clone(masters)]
    inv, clip = _scalars(device)
    step = 1 if first else 5
    hyper = dict(lr=0.05, momentum=momentum, dampening=dampening, weight_decay=0.01, nesterov=nesterov,
                 maximize=True, inv_scale=inv, clip_coef=clip, found_inf=None)
    _kernels().sgd(params, grads, masters, bufs, step, **hyper)
    _reference.sgd(ref[0], grads, ref[2], ref[1], step, **hyper)
    _assert_close(masters, ref[2])
    if bufs is not None:
        _assert_close(bufs, ref[1])


def test_lamb_kernels_match_reference(device):
    params, grads, m, v, _ = _make(SIZES, torch.float32, torch.bfloat16, device)
    ref = [_clone(params), _clone(m), _clone(v)]
    upd = [torch.empty_like(x) for x in m]
    ref_upd = [torch.empty_like(x) for x in m]
    div = torch.tensor([3.0], device=device)
    hyper = dict(beta1=0.9, beta2=0.999, beta3=0.1, eps=1e-6, weight_decay=0.01, adamw=True,
                 bias_correction=True, inv_scale=None, clip_coef=None, found_inf=None)
    p2, u2 = _kernels().lamb_stage1(params, grads, None, m, v, upd, 3, div, **hyper)
    rp2, ru2 = _reference.lamb_stage1(ref[0], grads, None, ref[1], ref[2], ref_upd, 3, div, **hyper)
    _assert_close(upd, ref_upd)
    torch.testing.assert_close(p2, rp2, rtol=1e-5, atol=0)  # fp32 sums in different orders
    torch.testing.assert_close(u2, ru2, rtol=1e-5, atol=0)
    ratios = (rp2.sqrt() / ru2.sqrt())
    _kernels().lamb_stage2(params, None, upd, ratios, lr=1e-2, found_inf=None)
    _reference.lamb_stage2(ref[0], None, ref_upd, ratios, lr=1e-2, found_inf=None)
    _assert_close(params, ref[0])


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_check_and_norm_matches_reference(device, grad_dtype):
    _, grads, _, _, _ = _make(SIZES, torch.float32, grad_dtype, device)
    inv = torch.tensor([0.125], device=device)
    bad, sumsq = _kernels().check_and_norm(grads, inv)
    expected = sum(((g.double() * 0.125) ** 2).sum() for g in grads)
    assert bad.item() == 0.0
    # fp32 accumulation of ~67k squares: relative error well under 1e-5.
    torch.testing.assert_close(sumsq.double(), expected.reshape(1), rtol=1e-5, atol=0)
    grads[2][17] = float("nan")
    assert _kernels().check_and_norm(grads, inv)[0].item() == 1.0
    grads[2][17] = 0
    grads[3][65536] = float("inf")  # last element of the last chunk
    assert _kernels().check_and_norm(grads, None)[0].item() == 1.0


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_check_and_norm_unscales_in_place_when_asked(device, grad_dtype):
    """GradScaler.unscale_'s default (Note [lazy unscale]): the same flag and norm as the
    read-only pass, and every gradient multiplied by inv_scale in the same kernel -- as torch's
    unscale_ writes it, inf/nan included."""
    _, grads, _, _, _ = _make(SIZES, torch.float32, grad_dtype, device)
    grads[1][5] = float("inf")
    inv = torch.tensor([0.37], device=device)  # not a power of two: the rounding is checked too
    expected = [(g.float() * 0.37).to(grad_dtype) for g in grads]
    bad_ro, sumsq_ro = _kernels().check_and_norm(_clone(grads), inv)
    bad, sumsq = _kernels().check_and_norm(grads, inv, unscale_in_place=True)
    assert bad.item() == bad_ro.item() == 1.0
    torch.testing.assert_close(sumsq, sumsq_ro, rtol=0, atol=0, equal_nan=True)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    # The reference path (CPU, or tensors the kernel does not take) writes the same values.
    _, ref_grads, _, _, _ = _make(SIZES, torch.float32, grad_dtype, device)
    ref_grads[1][5] = float("inf")
    _reference.check_and_norm(ref_grads, inv, unscale_in_place=True)
    for g, e in zip(ref_grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_check_and_norm_takes_gradients_of_every_layout(device):
    """Gradients that are not contiguous -- dense in another order (channels_last, a
    transpose) or not dense at all (a strided slice of a larger tensor) -- among contiguous
    ones: the same flag, norm and in-place unscale as contiguous copies, and the slice's base
    untouched outside the slice."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(6, 10, generator=gen).to(device)
    grads = [torch.randn(64, generator=gen).to(device),
             torch.randn(4, 3, 5, 5, generator=gen).to(device).to(memory_format=torch.channels_last),
             torch.randn(7, 5, generator=gen).to(device).t(),
             base[:, ::2]]
    assert not grads[3].is_contiguous() and not is_dense(grads[3])
    inv = torch.tensor([0.37], device=device)
    copies = [g.clone(memory_format=torch.contiguous_format) for g in grads]
    base_before = base.clone()
    bad, sumsq = F.check_and_norm(grads, inv, unscale_in_place=True)
    ref_bad, ref_sumsq = _reference.check_and_norm(copies, inv, unscale_in_place=True)
    assert bad.item() == ref_bad.item() == 0.0
    torch.testing.assert_close(sumsq, ref_sumsq, rtol=1e-6, atol=0)
    for g, c in zip(grads, copies):
        torch.testing.assert_close(g, c, rtol=0, atol=0)
    assert torch.equal(base[:, 1::2], base_before[:, 1::2])
    grads[3][2, 1] = float("inf")  # an overflow only in the slice
    assert F.check_and_norm(grads, inv)[0].item() == 1.0


def test_check_and_norm_reads_only(device):
    _, grads, _, _, _ = _make(SIZES, torch.float32, torch.float16, device)
    before = _clone(grads)
    F.check_and_norm(grads, torch.tensor([0.5], device=device))
    for g, b in zip(grads, before):
        assert torch.equal(g, b)


# inf and nan differ only in the check that sets found_inf (test_check_and_norm_matches_reference
# takes both); the update kernels see the flag: each op once, each non-finite value at least once.
@pytest.mark.parametrize("op,bad_value", [("adam", float("nan")), ("sgd", float("inf")), ("lamb", float("inf"))])
def test_found_inf_writes_nothing(device, op, bad_value):
    params, grads, m, v, masters = _make(SIZES, torch.bfloat16, torch.float16, device, with_master=True)
    grads[1][3] = bad_value
    found_inf, _ = F.check_and_norm(grads)
    assert found_inf.item() == 1.0
    snapshot = [_clone(x) for x in (params, m, v, masters)]
    steps = [torch.tensor(1.0, device=device) for _ in SIZES]
    if op == "adam":
        F.adam_update(params, grads, m, v, masters, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.1, adamw=True, step=steps, found_inf=found_inf)
    elif op == "sgd":
        F.sgd_update(params, grads, m, masters, lr=0.1, momentum=0.9, step=steps, found_inf=found_inf)
    else:
        F.lamb_update(params, grads, m, v, masters, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6,
                      weight_decay=0.01, step=steps, found_inf=found_inf)
    for now, before in zip((params, m, v, masters), snapshot):
        for a, b in zip(now, before):
            assert torch.equal(a, b)


def test_mixed_dtypes_in_one_call_bucket_correctly(device):
    """One functional call with fp32, bf16 (+master) and fp16 params and mixed grad dtypes."""
    gen = torch.Generator().manual_seed(3)
    dtypes = [(torch.float32, torch.float32, False), (torch.bfloat16, torch.float32, True),
              (torch.float16, torch.float16, False), (torch.bfloat16, torch.bfloat16, True)]
    params, grads, m, v, masters = [], [], [], [], []
    for k, (pd, gd, master) in enumerate(dtypes):
        p = torch.randn(300 + k, generator=gen)
        params.append(p.to(device=device, dtype=pd))
        grads.append(torch.randn(300 + k, generator=gen).to(device=device, dtype=gd))
        m.append(torch.zeros(300 + k, device=device))
        v.append(torch.zeros(300 + k, device=device))
        masters.append(p.to(device) if master else None)
    ref = [_clone(params), _clone(m), _clone(v), [None if w is None else w.clone() for w in masters]]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=False, step=1)
    F.adam_update(params, grads, m, v, masters, **hyper)
    for i in range(len(dtypes)):
        _reference.adam([ref[0][i]], [grads[i]], None if ref[3][i] is None else [ref[3][i]],
                        [ref[1][i]], [ref[2][i]], 1, bias_correction=True, maximize=False,
                        inv_scale=None, clip_coef=None, found_inf=None,
                        **{k: val for k, val in hyper.items() if k != "step"})
    _assert_close(m, ref[1])
    _assert_close(v, ref[2])


def test_reference_backend_and_triton_backend_agree(device, monkeypatch):
    """FUSEDIST_KERNEL_BACKEND=torch vs the Triton path through the public functional API."""
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", backend)
        params, grads, m, v, masters = _make((5, 1023), torch.bfloat16, torch.bfloat16, device, with_master=True)
        inv, clip = _scalars(device)
        zero = torch.zeros(1, device=device)
        F.adam_update(params, grads, m, v, masters, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.1, adamw=True, step=2, inv_scale=inv, clip_coef=clip, found_inf=zero)
        bad, sumsq = F.check_and_norm(grads, inv)
        results[backend] = (masters, m, v, sumsq)
    for a, b in zip(results["torch"][:3], results["triton"][:3]):
        _assert_close(a, b)
    torch.testing.assert_close(results["torch"][3], results["triton"][3], rtol=1e-5, atol=0)


def test_non_contiguous_and_fp64_use_reference(device):
    base = torch.randn(8, 6, device=device)
    p = base.t()  # non-contiguous
    g = torch.randn(6, 8, device=device)
    m, v = torch.zeros(6, 8, device=device), torch.zeros(6, 8, device=device)
    expected = p.clone()
    _reference.adam([expected], [g], None, [m.clone()], [v.clone()], 1, lr=0.1, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.0, adamw=False, bias_correction=True, maximize=False,
                    inv_scale=None, clip_coef=None, found_inf=None)
    F.adam_update([p], [g], [m], [v], None, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                  adamw=False, step=1)
    assert torch.equal(base.t(), expected)
    p64 = torch.randn(10, dtype=torch.float64, device=device)
    F.sgd_update([p64], [torch.ones_like(p64)], None, None, lr=0.5)


def test_bf16_write_back_rounds_like_torch(device):
    """The kernel's fp32 -> bf16 rounding (done with integer ops) equals torch's ``.to``,
    bit for bit, including ties, values rounding to inf, subnormals, -0.0 and NaN payloads."""
    specials = torch.tensor([1.5441, -2.0000001, 3.3895e38, 3.4e38, 1e-40, -0.0, 0.0, 1.00390625, 1.01171875])
    nans = torch.tensor([0x7FFFFFFF, 0x7FC00000, -1, 0x7F800001], dtype=torch.int32).view(torch.float32)
    master = torch.cat([specials, nans, torch.randn(5000) * 100]).to(device)
    param = torch.zeros_like(master, dtype=torch.bfloat16)
    # lr = 0 and no decay: the master keeps its value and the parameter receives its rounding.
    _kernels().sgd([param], [torch.zeros_like(master)], [master], None, 1, lr=0.0, momentum=0.0,
                   dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                   inv_scale=None, clip_coef=None, found_inf=None)
    expected = master.to(torch.bfloat16)
    same_bits = param.view(torch.int16) == expected.view(torch.int16)
    assert bool((same_bits | (param.isnan() & expected.isnan())).all())
    assert param[3].isinf() and param.isnan().sum() == 4


def test_empty_tensors_are_fine(device):
    empty = [torch.zeros(0, device=device), torch.zeros(0, 3, device=device)]
    bad, sumsq = F.check_and_norm(empty)
    assert bad.item() == 0 and sumsq.item() == 0
    F.adam_update(empty, empty, [e.clone() for e in empty], [e.clone() for e in empty], None, lr=0.1,
                  beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, step=1)
    params, grads, m, v, _ = _make((0, 5), torch.float32, torch.float32, device)
    F.lamb_update(params, grads, m, v, None, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, step=1)
    F.sgd_update(params, grads, m, None, lr=0.1, momentum=0.9, step=1)


def test_functional_errors(device):
    p = torch.zeros(4, device=device)
    with pytest.raises(ValueError, match="grads has 2 entries"):
        F.adam_update([p], [p, p], [p], [p], None, lr=1, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0,
                      adamw=True, step=1)
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] has shape"):
        F.adam_update([p], [p], [torch.zeros(5, device=device)], [p], None, lr=1, beta1=0.9, beta2=0.9,
                      eps=1e-8, weight_decay=0, adamw=True, step=1)
    with pytest.raises(ValueError, match="lr=nan is not finite"):
        F.sgd_update([p], [p], None, None, lr=float("nan"))
    with pytest.raises(TypeError, match="found_inf must be None or a 1-element float32"):
        F.sgd_update([p], [p], None, None, lr=1.0, found_inf=torch.zeros(2, device=device))
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.int64"):
        F.sgd_update([torch.zeros(3, dtype=torch.long)], [torch.zeros(3)], None, None, lr=1.0)


@pytest.mark.gpu
def test_gpu_kernels_match_reference_large():
    """Compiled kernels on a large, multi-chunk list (runs only with CUDA)."""
    device = torch.device("cuda")
    params, grads, m, v, masters = _make((1, 4097, 3_000_001), torch.bfloat16, torch.bfloat16, device,
                                         with_master=True)
    ref = [_clone(params), _clone(m), _clone(v), _clone(masters)]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True,
                 bias_correction=True, maximize=False, inv_scale=None, clip_coef=None, found_inf=None)
    _kernels().adam(params, grads, masters, m, v, 7, **hyper)
    _reference.adam(ref[0], grads, ref[3], ref[1], ref[2], 7, **hyper)
    _assert_close(masters, ref[3])
    _assert_close(m, ref[1])


def test_cpu_ext_dispatch_point(monkeypatch):
    """The C++ CPU Adam plugs in as ``fusedist.optim._cpu_adam.adam_update`` with the contract's
    signature; a stand-in module checks that the backend selector routes CPU buckets to it."""
    import sys
    import types

    calls = []

    def adam_update(params, grads, exp_avgs, exp_avg_sqs, masters, *, lr, beta1, beta2, eps, weight_decay,
                    adamw, step, bias_correction, maximize, inv_scale, clip_coef, found_inf):
        calls.append(len(params))
        _reference.adam(params, grads, masters, exp_avgs, exp_avg_sqs, step, lr=lr, beta1=beta1, beta2=beta2,
                        eps=eps, weight_decay=weight_decay, adamw=adamw, bias_correction=bias_correction,
                        maximize=maximize, inv_scale=inv_scale, clip_coef=clip_coef, found_inf=found_inf)

    stand_in = types.ModuleType("fusedist.optim._cpu_adam")
    stand_in.adam_update = adam_update
    monkeypatch.setitem(sys.modules, "fusedist.optim._cpu_adam", stand_in)
    # If the real adapter was imported earlier, `from . import _cpu_adam` finds the package attribute.
    import fusedist.optim

    monkeypatch.setattr(fusedist.optim, "_cpu_adam", stand_in, raising=False)
    monkeypatch.setattr(F, "_has_cpu_adam", lambda: True)
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "cpu_ext")
    params, grads, m, v, _ = _make((3, 9), torch.float32, torch.float32, torch.device("cpu"))
    F.adam_update(params, grads, m, v, None, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                  adamw=True, step=1)
    assert calls == [2]


class _Unreadable:
    """Makes reading one tensor's value on the host raise (``item()``, ``float()``, ``tolist``)."""

    def __init__(self, monkeypatch, tensor):
        for name in ("item", "__float__", "tolist"):
            original = getattr(torch.Tensor, name)

            def guarded(self, *args, _original=original, _name=name, **kwargs):
                if self is tensor:
                    raise AssertionError(f"the lr tensor was read on the host ({_name})")
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, guarded)


def test_a_tensor_lr_is_read_by_the_kernels_not_the_host(monkeypatch, device):
    """Note [a learning rate on the device]: Adam(W), SGD and LAMB's second pass take a tensor
    lr as a pointer (no host read, which on CUDA would wait for the device) and give the update
    of its value: bitwise the float lr's for SGD and LAMB; for AdamW a rounding of
    ``1 - lr * weight_decay`` apart (fp32 in the kernel, as torch forms it from a tensor lr,
    against the float's double on the host)."""
    lr = 3e-2
    lr_t = torch.tensor(lr, device=device)
    params, grads, m, v, masters = _make((7, 1030), torch.float32, torch.float32, device)
    hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, bias_correction=True,
                 maximize=False, inv_scale=None, clip_coef=None, found_inf=None)
    ref = [_clone(params), _clone(m), _clone(v)]
    _kernels().adam(ref[0], grads, None, ref[1], ref[2], 3, lr=lr, **hyper)
    with monkeypatch.context() as patch:
        _Unreadable(patch, lr_t)
        _kernels().adam(params, grads, None, m, v, 3, lr=lr_t, **hyper)
    for a, e in zip(params, ref[0]):
        torch.testing.assert_close(a, e, rtol=2 ** -23, atol=0.0)  # one fp32 rounding of the decay
    assert any(not torch.equal(a, b) for a, b in zip(params, _make((7, 1030), torch.float32, torch.float32,
                                                                   device)[0]))  # it stepped

    params, grads, bufs, _, _ = _make((5, 300), torch.float32, torch.float32, device, seed=1)
    ref_p, ref_b = _clone(params), _clone(bufs)
    sgd_hyper = dict(momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False,
                     inv_scale=None, clip_coef=None, found_inf=None)
    _kernels().sgd(ref_p, grads, None, ref_b, 2, lr=lr, **sgd_hyper)
    with monkeypatch.context() as patch:
        _Unreadable(patch, lr_t)
        _kernels().sgd(params, grads, None, bufs, 2, lr=lr_t, **sgd_hyper)
    assert all(torch.equal(a, e) for a, e in zip(params, ref_p))

    params, _, updates, _, _ = _make((9, 64), torch.float32, torch.float32, device, seed=2)
    ratios = torch.rand(len(params), device=device)
    ref_p = _clone(params)
    _kernels().lamb_stage2(ref_p, None, updates, ratios, lr=lr, found_inf=None)
    with monkeypatch.context() as patch:
        _Unreadable(patch, lr_t)
        _kernels().lamb_stage2(params, None, updates, ratios, lr=lr_t, found_inf=None)
    assert all(torch.equal(a, e) for a, e in zip(params, ref_p))


def test_tensor_betas_are_read_by_the_kernel_not_the_host(monkeypatch, device):
    """Note [betas on the device]: Adam takes tensor betas as a pointer (no host read) and
    gives bitwise the update of float betas holding the tensors' values (log2 of the fp32 value
    in fp64 on the device, as on the host), with AMSGrad and a tensor lr too."""
    beta1_t, beta2_t = torch.tensor(0.8, device=device), torch.tensor([0.95], device=device)
    beta1, beta2 = float(beta1_t), float(beta2_t)  # the fp32 values, as numbers
    for amsgrad, lr in ((False, 2e-2), (True, torch.tensor(2e-2, device=device))):
        params, grads, m, v, _ = _make((6, 1030), torch.float32, torch.float32, device, seed=3)
        vmax = [torch.rand_like(t) for t in v] if amsgrad else None
        hyper = dict(lr=lr, eps=1e-8, weight_decay=0.1, adamw=True, bias_correction=True, maximize=False,
                     inv_scale=None, clip_coef=None, found_inf=None)
        ref = [_clone(params), _clone(m), _clone(v), _clone(vmax) if amsgrad else None]
        _kernels().adam(ref[0], grads, None, ref[1], ref[2], 4, beta1=beta1, beta2=beta2, max_exp_avg_sqs=ref[3],
                        **hyper)
        with monkeypatch.context() as patch:
            _Unreadable(patch, beta1_t)
            _Unreadable(patch, beta2_t)
            _kernels().adam(params, grads, None, m, v, 4, beta1=beta1_t, beta2=beta2_t, max_exp_avg_sqs=vmax,
                            **hyper)
        for ours, expected in zip((params, m, v, vmax), ref):
            assert all(torch.equal(a, e) for a, e in zip(ours or [], expected or []))
    # the betas do matter: other values give another update
    other = _clone(params)
    _kernels().adam(other, grads, None, _clone(m), _clone(v), 5, beta1=torch.tensor(0.7, device=device),
                    beta2=beta2_t, **hyper)
    assert any(not torch.equal(a, b) for a, b in zip(other, params))


@pytest.mark.gpu
def test_a_cuda_tensor_lr_steps_without_a_host_sync():
    """The fused optimizers step with a CUDA tensor lr without synchronizing the host (torch's
    sync debug mode raises on any synchronizing call inside the step), and match torch's AdamW
    given the same tensor lr."""
    from fusedist.optim import FusedAdamW, FusedSGD

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 33), (129,), (3, 3, 7)]
    tensor_betas = dict(weight_decay=0.1, betas=(torch.tensor(0.8, device=device), torch.tensor(0.95, device=device)))
    for fused, ref_cls, kw in ((FusedAdamW, torch.optim.AdamW, dict(weight_decay=0.1)),
                               (FusedAdamW, torch.optim.AdamW, tensor_betas),  # Note [betas on the device]
                               (FusedSGD, torch.optim.SGD, dict(momentum=0.9))):
        ours = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]
        theirs = [p.detach().clone().requires_grad_() for p in ours]
        opt = fused(ours, lr=torch.tensor(1e-2, device=device), **kw)
        ref = ref_cls(theirs, lr=torch.tensor(1e-2, device=device), **kw)
        for step in range(3):
            for a, b in zip(ours, theirs):
                a.grad = torch.randn(a.shape, generator=gen).to(device)
                b.grad = a.grad.clone()
            if step:  # the first step makes the state (allocations may synchronize)
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
