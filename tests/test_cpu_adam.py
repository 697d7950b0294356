"""The C++ CPU Adam/AdamW kernel (fusedist._cpu_ops via fusedist.optim._cpu_adam) against torch.

Every ISA path this CPU supports is tested (FUSEDIST_CPU_ISA forces a narrower one).

Tolerances. fp32 results are compared with rtol=1e-6 (about 8 float32 ulp) plus a small
absolute term. Why not bitwise: torch's vectorized lerp uses an FMA and ours does not (it keeps
our three ISA paths bitwise identical, which is tested exactly), so exp_avg can differ from torch
in its last bit; that ulp propagates into the update ``lr * m / d``, i.e. ~1e-10 absolute for
lr=1e-3, which flips the rounding of ``param + update`` by at most an ulp of the param. Near zero
that ulp of the update dominates any relative measure, hence the absolute term of
``1e-6 * lr`` per step for params. (torch's own fused CPU kernel and its foreach path also
differ in the last bits -- see test_torch_fused_and_foreach_differ_too.)
"""

from __future__ import annotations


import pytest
import torch

from fusedist import _extension
from fusedist.optim import _cpu_adam
from fusedist.optim._cpu_adam import adam_update

pytestmark = pytest.mark.skipif(
    not _extension.is_available("_cpu_ops"),
    reason=f"fusedist._cpu_ops not built ({_extension.load_error('_cpu_ops')}); "
    "tests/test_cpu_adam_build.py fails when a compiler is present",
)

ALL_ISAS = ["scalar", "avx2", "avx512"]
ODD_SHAPES = [(1,), (7,), (1023,), (65537,), (33, 17), (3, 5, 7)]
LR = 1e-3


@pytest.fixture(params=ALL_ISAS)
def isa(request, monkeypatch):
    if request.param not in _cpu_adam.available_isas():
        pytest.skip(f"this CPU/build has no {request.param} path ({_cpu_adam.available_isas()})")
    monkeypatch.setenv(_cpu_adam.ISA_ENV, request.param)
    assert _cpu_adam.selected_isa() == request.param
    return request.param


def _rand(shapes, dtype=torch.float32, scale=1.0):
    return [(torch.randn(s) * scale).to(dtype) for s in shapes]


def _assert_fp32_close(ours, ref, steps=1, lr=LR, what="", atol=None):
    atol = 1e-6 * lr * steps if atol is None else atol
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(
            a, b.detach(), rtol=1e-6, atol=atol, msg=lambda m: f"{what}[{i}]: {m}"
        )


# exp_avg near zero: torch's FMA lerp rounds (1 - beta1) * (g - m) once less than we do, an
# absolute difference of up to half an ulp of that O(0.1 * |g|) product (~2e-8 for |g| < 4).
STATE_ATOL = 1e-7


def _torch_states(opt, params):
    return (
        [opt.state[p]["exp_avg"] for p in params],
        [opt.state[p]["exp_avg_sq"] for p in params],
    )


def _run_against_torch(shapes, *, adamw, weight_decay, maximize=False, betas=(0.9, 0.999),
                       steps=4, grad_scale=1.0):
    torch.manual_seed(1234)
    params = _rand(shapes)
    ref = [p.clone().requires_grad_() for p in params]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(ref, lr=LR, betas=betas, eps=1e-8, weight_decay=weight_decay, maximize=maximize,
              foreach=True)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    for step in range(1, steps + 1):
        grads = _rand(shapes, scale=grad_scale)
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        adam_update(params, grads, exp_avgs, exp_avg_sqs, None, lr=LR, beta1=betas[0],
                    beta2=betas[1], eps=1e-8, weight_decay=weight_decay, adamw=adamw, step=step,
                    maximize=maximize)
    ref_m, ref_v = _torch_states(opt, ref)
    _assert_fp32_close(params, ref, steps, what="params")
    _assert_fp32_close(exp_avgs, ref_m, what="exp_avg", atol=STATE_ATOL)
    _assert_fp32_close(exp_avg_sqs, ref_v, what="exp_avg_sq", atol=STATE_ATOL)


@pytest.mark.parametrize("adamw,weight_decay", [(True, 0.01), (False, 0.01), (True, 0.0)])
@pytest.mark.parametrize("maximize", [False, True])
def test_fp32_matches_torch_odd_sizes(isa, adamw, weight_decay, maximize):
    _run_against_torch(ODD_SHAPES, adamw=adamw, weight_decay=weight_decay, maximize=maximize)


def test_large_beta1_uses_torch_lerp_branch(isa):
    # 1 - beta1 >= 0.5 takes the other side of torch's two-sided lerp formula.
    _run_against_torch([(257,), (4099,)], adamw=True, weight_decay=0.1, betas=(0.3, 0.99))


def test_many_tensors(isa):
    torch.manual_seed(0)
    shapes = [(int(n),) for n in torch.randint(1, 3000, (150,))]
    _run_against_torch(shapes, adamw=True, weight_decay=0.05, steps=2)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_master_weights_and_low_precision_copy(isa, param_dtype, grad_dtype):
    """torch's best equivalent: upcast grads, AdamW on the FP32 master, copy back."""
    torch.manual_seed(7)
    masters = _rand(ODD_SHAPES)
    params = [m.to(param_dtype) for m in masters]
    ref = [m.clone().requires_grad_() for m in masters]
    opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.02, foreach=True)
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    for step in range(1, 4):
        grads = _rand(ODD_SHAPES, grad_dtype)
        for r, g in zip(ref, grads):
            r.grad = g.float()
        opt.step()
        adam_update(params, grads, exp_avgs, exp_avg_sqs, masters, lr=LR, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.02, adamw=True, step=step)
        for i, (p, m) in enumerate(zip(params, masters)):
            # Bitwise: the copy-out is exactly torch's round-to-nearest-even of the new master.
            assert torch.equal(p, m.to(param_dtype)), f"params[{i}] != masters[{i}].to({param_dtype})"
    _assert_fp32_close(masters, ref, 3, what="masters")


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_without_master(isa, param_dtype):
    """Half-precision params are widened, updated in fp32 and rounded back."""
    torch.manual_seed(3)
    params = _rand(ODD_SHAPES, param_dtype)
    wide = [p.float().requires_grad_() for p in params]
    grads = _rand(ODD_SHAPES, param_dtype)
    for w, g in zip(wide, grads):
        w.grad = g.float()
    torch.optim.AdamW(wide, lr=LR, weight_decay=0.01, foreach=True).step()
    exp_avgs = [torch.zeros(s) for s in ODD_SHAPES]
    exp_avg_sqs = [torch.zeros(s) for s in ODD_SHAPES]
    adam_update(params, grads, exp_avgs, exp_avg_sqs, None, lr=LR, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.01, adamw=True, step=1)
    for i, (p, w) in enumerate(zip(params, wide)):
        # The fp32 results agree to an ulp, so the rounded values agree except where the fp32
        # value sits on a rounding boundary: allow one ulp of the half type.
        ulp = torch.finfo(param_dtype).eps
        torch.testing.assert_close(p.float(), w.detach().to(param_dtype).float(), rtol=ulp, atol=0,
                                   msg=lambda m: f"params[{i}]: {m}")


def test_inv_scale_and_clip_applied_inline(isa):
    torch.manual_seed(5)
    scale, clip = 1024.0, 0.37
    inv_scale = torch.tensor([1.0 / scale])
    clip_coef = torch.tensor([clip])
    params = _rand(ODD_SHAPES)
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.01, foreach=True)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    for step in range(1, 3):
        scaled = [g.to(torch.bfloat16) for g in _rand(ODD_SHAPES, scale=scale)]
        for r, g in zip(ref, scaled):
            r.grad = g.float().mul(inv_scale).mul(clip_coef)  # the kernel's operation order
        opt.step()
        adam_update(params, scaled, exp_avgs, exp_avg_sqs, None, lr=LR, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.01, adamw=True, step=step, inv_scale=inv_scale,
                    clip_coef=clip_coef, found_inf=torch.zeros(1))
    _assert_fp32_close(params, ref, 2, what="params")
    ref_m, ref_v = _torch_states(opt, ref)
    _assert_fp32_close(exp_avgs, ref_m, what="exp_avg", atol=STATE_ATOL)
    _assert_fp32_close(exp_avg_sqs, ref_v, what="exp_avg_sq", atol=STATE_ATOL)


@pytest.mark.parametrize("flag", [1.0, float("nan")])
def test_found_inf_leaves_everything_bitwise_unchanged(isa, flag):
    torch.manual_seed(9)
    masters = _rand(ODD_SHAPES)
    params = [m.to(torch.bfloat16) for m in masters]
    grads = _rand(ODD_SHAPES, torch.bfloat16)
    grads[2][5] = float("inf")
    exp_avgs, exp_avg_sqs = _rand(ODD_SHAPES), [t.abs() for t in _rand(ODD_SHAPES)]
    before = [t.clone() for t in masters + params + grads + exp_avgs + exp_avg_sqs]
    adam_update(params, grads, exp_avgs, exp_avg_sqs, masters, lr=LR, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.01, adamw=True, step=3, inv_scale=torch.tensor([0.5]),
                clip_coef=torch.tensor([0.1]), found_inf=torch.tensor([flag]))
    after = masters + params + grads + exp_avgs + exp_avg_sqs
    for i, (a, b) in enumerate(zip(after, before)):
        assert torch.equal(a, b), f"tensor {i} was written although found_inf={flag}"
    # The same call with found_inf=0 does update (the skip above is not vacuous).
    adam_update(params, grads, exp_avgs, exp_avg_sqs, masters, lr=LR, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.01, adamw=True, step=3, found_inf=torch.zeros(1))
    assert not torch.equal(masters[0], before[0])


def test_no_bias_correction_matches_formula(isa):
    """bias_correction=False (no torch optimizer has it): against the formula in float64."""
    torch.manual_seed(11)
    params, grads = _rand(ODD_SHAPES), _rand(ODD_SHAPES)
    exp_avgs = [torch.randn(s) * 0.1 for s in ODD_SHAPES]
    exp_avg_sqs = [torch.rand(s) * 0.1 for s in ODD_SHAPES]
    beta1, beta2, eps, wd = 0.9, 0.99, 1e-6, 0.1
    expected = []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p, g, m, v = p.double(), g.double(), m.double(), v.double()
        p = p * (1 - LR * wd)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        expected.append((p - LR * m / (v.sqrt() + eps), m, v))
    adam_update(params, grads, exp_avgs, exp_avg_sqs, None, lr=LR, beta1=beta1, beta2=beta2,
                eps=eps, weight_decay=wd, adamw=True, step=5, bias_correction=False)
    for i, (p, m, v) in enumerate(expected):
        torch.testing.assert_close(params[i].double(), p, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(exp_avgs[i].double(), m, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(exp_avg_sqs[i].double(), v, rtol=1e-6, atol=0)


def test_isa_paths_are_bitwise_identical():
    isas = _cpu_adam.available_isas()
    if len(isas) < 2:
        pytest.skip(f"only {isas} available")
    torch.manual_seed(13)
    shapes = ODD_SHAPES + [(40000,)]
    init = (_rand(shapes), _rand(shapes), [t.abs() for t in _rand(shapes)])
    grads = [_rand(shapes, torch.bfloat16), _rand(shapes, torch.float16), _rand(shapes)]
    results = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in isas:
            mp.setenv(_cpu_adam.ISA_ENV, name)
            masters, exp_avgs, exp_avg_sqs = ([t.clone() for t in ts] for ts in init)
            params = [m.to(torch.float16) for m in masters]
            for step, g in enumerate(grads, 1):
                adam_update(params, g, exp_avgs, exp_avg_sqs, masters, lr=LR, beta1=0.9,
                            beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=step != 2, step=step,
                            inv_scale=torch.tensor([0.25]), clip_coef=torch.tensor([0.8]))
            results[name] = masters + params + exp_avgs + exp_avg_sqs
    for name in isas[1:]:
        for i, (a, b) in enumerate(zip(results[name], results[isas[0]])):
            assert torch.equal(a, b), f"{name} and {isas[0]} differ in tensor {i}"


def _special_floats():
    torch.manual_seed(17)
    bits = torch.randint(-(2**31), 2**31 - 1, (200000,), dtype=torch.int64).to(torch.int32)
    edge = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 65536.0, -65520.0, 2.0**-14,
         2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-26, 3.0 * 2.0**-25, 1e-40, -1e-45,
         3.4028235e38, float("inf"), float("-inf"), 1.00390625, 1.01171875, 1.0 + 2.0**-11,
         1.0 + 3 * 2.0**-11, 2.0**-133],
        dtype=torch.float32,
    )
    # bf16 ties: exactly halfway between neighbours, odd and even.
    ties = (torch.arange(0x3F800000, 0x3F800000 + 64 * 0x10000, 0x8000, dtype=torch.int64)
            .to(torch.int32).view(torch.float32))
    return torch.cat([bits.view(torch.float32), edge, ties])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conversion_rounding_matches_torch(isa, dtype):
    ops = _extension.require("_cpu_ops")
    code = {torch.bfloat16: 1, torch.float16: 2}[dtype]
    isa_code = {"scalar": 0, "avx2": 1, "avx512": 2}[isa]
    src = _special_floats()
    out = torch.empty(src.numel(), dtype=dtype)
    ops.convert(src.data_ptr(), 0, out.data_ptr(), code, src.numel(), isa_code)
    expected = src.to(dtype)
    nan = torch.isnan(src)
    assert torch.equal(torch.isnan(out), nan)
    same = out[~nan].view(torch.int16) == expected[~nan].view(torch.int16)
    assert bool(same.all()), f"first mismatch at {src[~nan][~same][:5].tolist()}"
    # Widening back: every 16-bit pattern converts exactly as torch does.
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    wide = torch.empty(every.numel(), dtype=torch.float32)
    ops.convert(every.data_ptr(), code, wide.data_ptr(), 0, every.numel(), isa_code)
    ref = every.float()
    assert torch.equal(torch.isnan(wide), torch.isnan(ref))
    assert torch.equal(wide[~torch.isnan(ref)], ref[~torch.isnan(ref)])


def test_torch_fused_and_foreach_agree_only_to_the_same_tolerance():
    """Context for the tolerance: torch's two CPU paths do not agree bitwise either (with torch
    2.13, 2 of these 32768 elements differ after 5 steps, by 2.3e-10)."""
    torch.manual_seed(19)
    base = _rand([(1 << 15,)])
    runs = []
    for kwargs in ({"foreach": True}, {"fused": True}):
        p = [t.clone().requires_grad_() for t in base]
        opt = torch.optim.AdamW(p, lr=LR, **kwargs)
        torch.manual_seed(20)
        for _ in range(5):
            p[0].grad = torch.randn_like(p[0])
            opt.step()
        runs.append(p[0].detach())
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-6, atol=5 * 1e-6 * LR)


def test_empty_and_zero_size_tensors(isa):
    params = [torch.zeros(0), torch.ones(3)]
    grads = [torch.zeros(0), torch.ones(3)]
    adam_update(params, grads, [torch.zeros(0), torch.zeros(3)], [torch.zeros(0), torch.zeros(3)],
                None, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, step=1)
    # First Adam step moves each weight by lr against the gradient's sign.
    torch.testing.assert_close(params[1], torch.full((3,), 0.9), rtol=1e-6, atol=1e-6)
    adam_update([], [], [], [], None, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                adamw=True, step=1)


# ----------------------------------------------------------------------------- bad input


def _call(params, grads=None, exp_avgs=None, exp_avg_sqs=None, masters=None, **kw):
    shapes = [tuple(p.shape) for p in params]
    args = dict(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, step=1)
    args.update(kw)
    adam_update(
        params,
        grads if grads is not None else [torch.zeros(s) for s in shapes],
        exp_avgs if exp_avgs is not None else [torch.zeros(s) for s in shapes],
        exp_avg_sqs if exp_avg_sqs is not None else [torch.zeros(s) for s in shapes],
        masters,
        **args,
    )


def test_bad_inputs_name_the_offending_tensor():
    good = [torch.zeros(4), torch.zeros(2, 3)]
    with pytest.raises(ValueError, match=r"grads has 1 tensors but params has 2"):
        _call(good, grads=[torch.zeros(4)])
    with pytest.raises(ValueError, match=r"grads\[1\] has shape \(3, 2\) but params\[1\] has \(2, 3\)"):
        _call(good, grads=[torch.zeros(4), torch.zeros(3, 2)])
    with pytest.raises(TypeError, match=r"exp_avgs\[0\] has dtype torch.bfloat16"):
        _call(good, exp_avgs=[torch.zeros(4, dtype=torch.bfloat16), torch.zeros(2, 3)])
    with pytest.raises(TypeError, match=r"params\[1\] has dtype torch.float64"):
        _call([torch.zeros(4), torch.zeros(2, 3, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[1\] has strides \(1, 2\), unlike params\[1\]"):
        _call(good, exp_avg_sqs=[torch.zeros(4), torch.zeros(3, 2).t()])
    with pytest.raises(ValueError, match=r"masters\[0\] is on meta"):
        _call(good, masters=[torch.zeros(4, device="meta"), torch.zeros(2, 3)])
    with pytest.raises(TypeError, match=r"grads\[0\] must be a tensor, got NoneType"):
        _call(good, grads=[None, torch.zeros(2, 3)])
    with pytest.raises(ValueError, match=r"inv_scale must be a 1-element float32 CPU tensor"):
        _call(good, inv_scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"step must be >= 1"):
        _call(good, step=0)
    with pytest.raises(ValueError, match=r"betas must lie in \[0, 1\)"):
        _call(good, beta2=1.0)
    # Nothing was written by any rejected call.
    assert all(not t.any() for t in good)


def test_bad_isa_request(monkeypatch):
    monkeypatch.setenv(_cpu_adam.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="FUSEDIST_CPU_ISA='sse9' is not one of"):
        _call([torch.zeros(3)])
    ops = _extension.require("_cpu_ops")
    with pytest.raises(ValueError, match="unknown ISA code 7"):
        ops.convert(0, 0, 0, 0, 0, 7)


def test_result_does_not_depend_on_thread_count(isa):
    """Pieces are independent, so 1 or N OpenMP threads give bitwise the same step."""
    torch.manual_seed(23)
    shapes = [(70001,), (5,), (40000,)]  # several 32K-element pieces, uneven tails
    init = (_rand(shapes), _rand(shapes, torch.bfloat16))
    results = []
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            masters, grads = ([t.clone() for t in ts] for ts in init)
            params = [m.to(torch.bfloat16) for m in masters]
            exp_avgs, exp_avg_sqs = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
            adam_update(params, grads, exp_avgs, exp_avg_sqs, masters, lr=LR, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.01, adamw=True, step=1)
            results.append(masters + params + exp_avgs + exp_avg_sqs)
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_lazily_negated_gradient_steps_like_torch(monkeypatch):
    """A real view with torch's negative bit holds ``-value`` in memory; the kernel reads raw
    memory, so it must be resolved first (Note [lazily negated gradients]). ``z.conj().imag`` of
    a one-element complex ``z`` is such a view and dense (a learned scalar given a gradient from
    complex math); ``torch._neg_view`` makes larger ones. Through FusedAdamW's trusted path and
    the checked direct call, against torch's AdamW."""
    from fusedist.optim import FusedAdamW

    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "cpu_ext")
    torch.manual_seed(29)
    shapes = [(1,), (17,), (3, 5)]
    ours = [torch.nn.Parameter(p) for p in _rand(shapes)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedAdamW(ours, lr=LR, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.01, foreach=True)
    direct = [p.detach().clone() for p in ours]
    states = ([torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes])
    for step in (1, 2):
        grads = [torch.randn(1, dtype=torch.complex64).conj().imag] + [torch._neg_view(torch.randn(s))
                                                                       for s in shapes[1:]]
        assert all(g.is_neg() and g.is_contiguous() for g in grads)
        for o, r, g in zip(ours, ref, grads):
            o.grad, r.grad = g, g.clone()
        opt.step()
        ref_opt.step()
        adam_update(direct, grads, *states, None, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.01, adamw=True, step=step)
    _assert_fp32_close(ours, ref, steps=2, what="FusedAdamW")
    _assert_fp32_close(direct, ref, steps=2, what="adam_update")
    # The unscale factor is read from memory too: a negated view of -0.5 is 0.5 (exact scaling).
    grads = [torch.randn(s) for s in shapes]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    ref_opt.step()
    adam_update(direct, [g * 2 for g in grads], *states, None, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.01, adamw=True, step=3, inv_scale=torch._neg_view(torch.tensor([-0.5])))
    _assert_fp32_close(direct, ref, steps=3, what="adam_update with a negated inv_scale view")
    # A negated view the kernel would write is refused, naming it, before anything is written.
    with pytest.raises(ValueError, match=r"params\[0\] is a lazily negated view"):
        _call([torch._neg_view(torch.zeros(4))])


@pytest.mark.parametrize("step", [10**6, 2**40])
def test_very_large_step_counts_match_torch(isa, step):
    """Bias corrections at step counts where beta**step underflows (torch's AdamW resumed from
    a state at that step, as after a long run's checkpoint), with an lr given as a tensor."""
    torch.manual_seed(31)
    shapes = [(1,), (17,), (65,)]
    params = _rand(shapes)
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.01, foreach=True)
    exp_avgs = [torch.randn(s) * 0.1 for s in shapes]
    exp_avg_sqs = [torch.rand(s) * 0.01 for s in shapes]
    grads = _rand(shapes)
    for r, g, m, v in zip(ref, grads, exp_avgs, exp_avg_sqs):
        opt.state[r] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        r.grad = g.clone()
    opt.step()
    adam_update(params, grads, exp_avgs, exp_avg_sqs, None, lr=torch.tensor(LR), beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.01, adamw=True, step=step)
    _assert_fp32_close(params, ref, what="params")
    ref_m, ref_v = _torch_states(opt, ref)
    _assert_fp32_close(exp_avgs, ref_m, what="exp_avg", atol=STATE_ATOL)
    _assert_fp32_close(exp_avg_sqs, ref_v, what="exp_avg_sq", atol=STATE_ATOL)
