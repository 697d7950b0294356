"""Fused optimizers against torch.optim at the edges of its API: states and step counts the
program replaced between steps (Note [states the program replaced] in
fusedist/optim/functional.py), torch's refusal of ``fused`` and ``foreach`` together, what a
state-dict post-hook of SGD sees, and the refusals of a sparse gradient (FusedLAMB) and of a
complex parameter in a group added later."""

import pytest
import torch

from fusedist.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD, functional


def _params(seed: int, dtype=torch.float32) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype)) for shape in ((5, 3), (7,), (2, 3, 2))]


def _steps(params, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()


def _train_replacing_states(ref, ref_opt, got, opt, seed: int, convert, replace_in) -> None:
    """2 steps of each, ``convert(key, value)`` applied to the states of the optimizers in
    ``replace_in``, 3 more steps; then the parameters must agree."""
    _steps(ref, ref_opt, 2, seed + 1)
    _steps(got, opt, 2, seed + 1)
    for o in replace_in:
        _replace_states(o, convert)
    _steps(ref, ref_opt, 3, seed + 2)
    _steps(got, opt, 3, seed + 2)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _replace_states(opt, convert) -> None:
    for state in opt.state.values():
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor):
                state[key] = convert(key, value)


def test_sgd_momentum_buffer_replaced_by_fp64_steps_as_torch():
    # A momentum buffer the program replaced with an fp64 tensor was read and written by the
    # kernels as fp32 memory: values off by ~1e18. torch's SGD computes with it.
    seed = int(torch.randint(0, 10_000, ()).item())
    ref, got = _params(seed), _params(seed)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    opt = FusedSGD(got, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    _train_replacing_states(ref, ref_opt, got, opt, seed, lambda k, v: v.double() if k == "momentum_buffer" else v,
                            (ref_opt, opt))


@pytest.mark.parametrize("amsgrad", [False, True])
def test_functional_adam_reads_fp64_step_counts_by_value(amsgrad):
    # functional.adam_update takes the step counts as tensors; the kernels read an fp64 count's
    # memory as fp32 (a count of 0: a bias correction of 0, and nan parameters).
    seed = int(torch.randint(0, 10_000, ()).item())
    gen = torch.Generator().manual_seed(seed)
    ref = [torch.randn(shape, generator=gen) for shape in ((5, 3), (7,))]
    grads = [torch.randn(p.shape, generator=gen) for p in ref]
    got = [p.clone() for p in ref]
    counts = [3.0, 7.0]
    for params, dtype in ((ref, torch.float32), (got, torch.float64)):
        moments = [[torch.rand(p.shape, generator=torch.Generator().manual_seed(seed + k)) for p in params]
                   for k in range(3)]
        functional.adam_update(params, grads, moments[0], moments[1], None, lr=0.05, beta1=0.9, beta2=0.999,
                               eps=1e-8, weight_decay=0.1, adamw=True,
                               step=[torch.tensor(c, dtype=dtype) for c in counts],
                               max_exp_avg_sqs=moments[2] if amsgrad else None)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_adam_moments_replaced_by_fp64_keep_the_update():
    # torch's Adam refuses moments of another dtype than the parameter; the fused one steps
    # them (on the reference path) with the values they hold -- never reads fp64 memory as fp32.
    seed = int(torch.randint(0, 10_000, ()).item())
    ref, got = _params(seed), _params(seed)
    ref_opt, opt = FusedAdam(ref, lr=0.05, weight_decay=0.1), FusedAdam(got, lr=0.05, weight_decay=0.1)
    _train_replacing_states(ref, ref_opt, got, opt, seed,
                            lambda k, v: v.double() if k in ("exp_avg", "exp_avg_sq") else v, (opt,))


def test_lamb_refuses_a_sparse_gradient_naming_it():
    dense = torch.nn.Linear(3, 2)
    emb = torch.nn.Embedding(6, 2, sparse=True)
    opt = FusedLAMB([{"params": dense.parameters()}, {"params": emb.parameters()}])
    (dense(torch.randn(4, 3)).sum() + emb(torch.tensor([1, 4])).sum()).backward()
    before = [p.detach().clone() for p in (*dense.parameters(), *emb.parameters())]
    with pytest.raises(RuntimeError, match=r"FusedLAMB does not support sparse gradients \(param 0 of param group 1\)"):
        opt.step()
    for a, b in zip(before, (*dense.parameters(), *emb.parameters())):
        assert torch.equal(a, b)


@pytest.mark.parametrize("torch_cls, cls, kwargs", [
    (torch.optim.Adam, FusedAdam, dict(lr=0.05, weight_decay=0.1)),
    (torch.optim.SGD, FusedSGD, dict(lr=0.1, momentum=0.9)),
])
def test_step_counts_replaced_by_int64_step_as_torch(torch_cls, cls, kwargs):
    # torch's Adam counts an int64 step up; the fused step's ``_foreach_add_(steps, 1.0)``
    # raised "result type Float can't be cast to the desired output type Long".
    seed = int(torch.randint(0, 10_000, ()).item())
    ref, got = _params(seed), _params(seed)
    ref_opt, opt = torch_cls(ref, **kwargs), cls(got, **kwargs)
    _train_replacing_states(ref, ref_opt, got, opt, seed, lambda k, v: v.long() if k == "step" else v, (ref_opt, opt))
    assert all(float(st["step"]) == 5 for st in opt.state.values())


@pytest.mark.parametrize("torch_cls, cls", [(torch.optim.Adam, FusedAdam), (torch.optim.AdamW, FusedAdamW),
                                            (torch.optim.SGD, FusedSGD)])
def test_fused_and_foreach_both_true_refused_as_torch(torch_cls, cls):
    # torch refuses the two implementations at once; the fused optimizers took both silently.
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together") as torch_error:
        torch_cls(_params(0), fused=True, foreach=True)
    with pytest.raises(type(torch_error.value), match="`fused` and `foreach` cannot be `True` together"):
        cls(_params(0), fused=True, foreach=True)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_state_dict_post_hook_sees_torchs_state_dict(momentum):
    # FusedSGD left out its step counts after torch's post-hooks had run: a hook saw keys (and,
    # without momentum, whole states) that torch's SGD state dict has not.
    seen = []

    def hook(opt, state_dict):
        seen.append({key: sorted(values) for key, values in state_dict["state"].items()})
        return {**state_dict, "hooked": True}

    results = []
    for cls in (torch.optim.SGD, FusedSGD):
        params = _params(3)
        opt = cls(params, lr=0.1, momentum=momentum)
        _steps(params, opt, 2, 4)
        opt.register_state_dict_post_hook(hook)
        results.append(opt.state_dict())
    assert seen[0] == seen[1]
    assert results[1]["hooked"] and sorted(results[0]) == sorted(results[1])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD, FusedLAMB])
def test_complex_parameter_of_a_later_group_refused_as_at_construction(cls):
    # The constructor refuses a complex parameter it cannot step (FusedLAMB's; complex32 for
    # the others, which step complex64/complex128 as torch does); a group added later took it,
    # and its first step raised only about the gradient's dtype.
    dtype = torch.complex64 if cls is FusedLAMB else torch.complex32
    complex_param = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    with pytest.raises(TypeError, match=rf"param 0 of param group 0 has dtype {dtype}; only"):
        cls([complex_param])
    params = _params(1)
    opt = cls(params)
    with pytest.raises(TypeError, match=rf"param 0 of param group 1 has dtype {dtype}; only"):
        opt.add_param_group({"params": [complex_param]})
    assert len(opt.param_groups) == 1
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # the optimizer is left as it was
