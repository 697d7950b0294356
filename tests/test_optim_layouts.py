"""Fused optimizers accept every layout torch's optimizers accept, support AMSGrad, and a
failed step or state-dict load changes nothing (Note [validate, then mutate])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fusedist.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD
from fusedist._memory_layout import is_dense

from test_optim import BACKENDS, DEVICE  # noqa: F401 - the backend fixture's parameters

# fp32 on every path: the kernels and torch's foreach path agree to a few ulp after 5 steps.
ATOL = 2e-6


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


def _odd_layout_params(seed: int) -> list[nn.Parameter]:
    """One parameter per layout torch accepts: channels_last, transposed, a strided slice
    (not dense), a plain one (whose gradient will be non-contiguous) and a vector."""
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(8, 3, 3, 3, generator=gen).to(DEVICE).to(memory_format=torch.channels_last)
    transposed = torch.randn(5, 7, generator=gen).to(DEVICE).t()
    strided = torch.randn(6, 10, generator=gen).to(DEVICE)[:, ::2]
    plain = torch.randn(4, 9, generator=gen).to(DEVICE)
    vector = torch.randn(11, generator=gen).to(DEVICE)
    params = [nn.Parameter(t) for t in (conv, transposed, strided, plain, vector)]
    assert params[0].is_contiguous(memory_format=torch.channels_last) and not params[0].is_contiguous()
    assert not params[1].is_contiguous() and is_dense(params[1])
    assert not is_dense(params[2])
    return params


def _twins(params):
    """Copies with the same values and strides (clone keeps a dense tensor's layout)."""
    return [nn.Parameter(p.detach().clone()) for p in params]


def _grads_for(params, step: int):
    gen = torch.Generator().manual_seed(100 + step)
    grads = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(DEVICE)
        if p.dim() == 4:
            g = g.to(memory_format=torch.channels_last)  # what autograd gives a channels_last weight
        if i == 3:
            g = torch.randn(tuple(reversed(p.shape)), generator=gen).to(DEVICE).t()  # non-contiguous alone
        grads.append(g)
    return grads


@pytest.mark.parametrize("fused_cls,torch_cls,kwargs", [
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
    (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
])
def test_every_layout_steps_like_torch(backend, fused_cls, torch_cls, kwargs):
    ours = _odd_layout_params(0)
    theirs = _twins(ours)
    strides = [p.stride() for p in ours]
    opt, ref = fused_cls(ours, **kwargs), torch_cls(theirs, **kwargs)
    for step in range(5):
        for ps in (ours, theirs):
            for p, g in zip(ps, _grads_for(ps, step)):
                p.grad = g.clone(memory_format=torch.preserve_format) if is_dense(g) else g
        opt.step()
        ref.step()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=ATOL, msg=f"param {i}")
        assert a.stride() == strides[i], f"param {i} changed layout"
    for p in ours[:2]:  # dense: states laid out like the parameter (the kernels' flat path)
        for key, value in opt.state[p].items():
            if key != "step":
                assert value.stride() == p.stride(), key


@pytest.mark.parametrize("master_weights", [False, True])
def test_states_laid_out_unlike_a_changed_parameter(backend, master_weights):
    """A parameter made contiguous after its states were made channels_last (``p.data =
    p.data.contiguous()``, as a model moved back from channels_last): its states and master
    no longer walk like it, so that parameter must leave the kernels' flat path -- the steps
    still follow torch's."""
    dtype = torch.bfloat16 if master_weights else torch.float32
    gen = torch.Generator().manual_seed(5)
    conv = torch.randn(4, 3, 3, 3, generator=gen).to(DEVICE).to(memory_format=torch.channels_last)
    ours = [nn.Parameter(conv.clone(memory_format=torch.preserve_format).to(dtype)),
            nn.Parameter(torch.randn(16, generator=gen).to(DEVICE).to(dtype))]
    theirs = [nn.Parameter(p.detach().float().clone(memory_format=torch.preserve_format)) for p in ours]
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.05, master_weights=master_weights)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.05)
    for step in range(4):
        if step == 2:
            for p in (ours[0], theirs[0]):
                p.data = p.data.contiguous()
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen).to(DEVICE).to(dtype)
            a.grad, b.grad = g, g.float()  # (the same values on both sides)
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            if master_weights:
                a = opt.state[a]["master_param"]
            torch.testing.assert_close(a.detach().float(), b.detach(), rtol=0, atol=ATOL)
    assert ours[0].is_contiguous() and not opt.state[ours[0]]["exp_avg"].is_contiguous()


def test_lamb_steps_odd_layouts_like_contiguous_copies(backend):
    """FusedLAMB has no torch counterpart: the same parameters made contiguous are the oracle."""
    ours = _odd_layout_params(1)
    plain = [nn.Parameter(p.detach().contiguous()) for p in ours]
    opt, ref = FusedLAMB(ours, lr=1e-2), FusedLAMB(plain, lr=1e-2)
    for step in range(3):
        for p, g in zip(ours, _grads_for(ours, step)):
            p.grad = g
        for p, g in zip(plain, _grads_for(ours, step)):
            p.grad = g.contiguous()
        opt.step()
        ref.step()
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=ATOL)


def test_channels_last_conv_and_transposed_weight_repro(backend):
    """The reported repros: a channels_last Conv2d, and FusedAdamW([a, nc])."""
    torch.manual_seed(0)
    m = nn.Conv2d(3, 8, 3).to(DEVICE).to(memory_format=torch.channels_last)
    r = copy.deepcopy(m)
    opt, ref = FusedAdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(r.parameters(), lr=1e-2)
    x = torch.randn(2, 3, 10, 10, device=DEVICE)
    for net, o in ((m, opt), (r, ref)):
        net(x).square().sum().backward()
        o.step()
    torch.testing.assert_close(m.weight.detach(), r.weight.detach(), rtol=0, atol=ATOL)
    assert m.weight.is_contiguous(memory_format=torch.channels_last)

    a = nn.Parameter(torch.randn(4, 5, device=DEVICE))
    nc = nn.Parameter(torch.randn(5, 4, device=DEVICE).t())
    a2, nc2 = _twins([a, nc])
    opt, ref = FusedAdamW([a, nc]), torch.optim.AdamW([a2, nc2])
    for p in (a, nc, a2, nc2):
        p.grad = torch.ones_like(p)
    opt.step()
    ref.step()
    torch.testing.assert_close(nc.detach(), nc2.detach(), rtol=0, atol=ATOL)
    assert int(opt.state[a]["step"]) == int(opt.state[nc]["step"]) == 1


def test_failed_step_changes_nothing_and_names_the_real_index():
    good = nn.Parameter(torch.randn(4, device=DEVICE))
    other = nn.Parameter(torch.randn(3, device=DEVICE))
    bad = nn.Parameter(torch.randn(5, 2, device=DEVICE))
    opt = FusedAdamW([{"params": [good]}, {"params": [other, bad]}], lr=0.1)
    for p in (good, other):
        p.grad = torch.ones_like(p)
    bad.grad = torch.eye(5, 2, device=DEVICE).to_sparse()
    before = [p.detach().clone() for p in (good, other, bad)]
    with pytest.raises(RuntimeError, match="param 1 of param group 1"):
        opt.step()
    for p, b in zip((good, other, bad), before):
        assert torch.equal(p.detach(), b)
    assert not opt.state, "a failed step must create no state and count no step"
    bad.grad = None
    opt.step()  # recovers: the first real step is step 1
    assert int(opt.state[good]["step"]) == 1


@pytest.mark.parametrize("cls,torch_cls", [(FusedAdamW, torch.optim.AdamW), (FusedAdam, torch.optim.Adam)])
def test_amsgrad_matches_torch(backend, cls, torch_cls):
    gen = torch.Generator().manual_seed(3)
    ours = [nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in ((7,), (33, 5), (1,))]
    theirs = _twins(ours)
    kwargs = dict(lr=1e-2, weight_decay=0.1, amsgrad=True, betas=(0.8, 0.9))
    opt, ref = cls(ours, **kwargs), torch_cls(theirs, **kwargs)
    for step in range(12):
        # Gradient magnitudes that shrink and grow, so the running maximum matters.
        scale = 3.0 if step % 4 == 0 else 0.1
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if step % 5 == 2 and i == 1:
                a.grad = b.grad = None  # no gradient this step
                continue
            g = torch.randn(a.shape, generator=gen).to(DEVICE) * scale
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=ATOL)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(opt.state[a]["max_exp_avg_sq"], ref.state[b]["max_exp_avg_sq"], rtol=1e-6, atol=0)


def test_torch_amsgrad_state_dict_loads_and_continues_like_torch(backend):
    """The reported case: a torch AdamW(amsgrad=True) state dict loaded into FusedAdamW."""
    gen = torch.Generator().manual_seed(4)
    theirs = [nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in ((6,), (4, 3))]
    ref = torch.optim.AdamW(theirs, lr=1e-2, amsgrad=True)
    grads = [[torch.randn(p.shape, generator=gen).to(DEVICE) for p in theirs] for _ in range(6)]
    for gs in grads[:3]:
        for p, g in zip(theirs, gs):
            p.grad = g.clone()
        ref.step()
    ours = _twins(theirs)
    opt = FusedAdamW(ours, lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert opt.param_groups[0]["amsgrad"] is True
    for gs in grads[3:]:
        for a, b, g in zip(ours, theirs, gs):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=ATOL)


def _state_snapshot(opt):
    sd = opt.state_dict()
    return copy.deepcopy(sd["param_groups"]), {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                                               for k, s in sd["state"].items()}


def _assert_same_snapshot(a, b):
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert a[1][k].keys() == b[1][k].keys()
        for n in a[1][k]:
            va, vb = a[1][k][n], b[1][k][n]
            assert torch.equal(va, vb) if torch.is_tensor(va) else va == vb


@pytest.mark.parametrize("damage,message", [
    (lambda sd: sd["param_groups"][0].update(eps=-1.0), "invalid epsilon"),
    (lambda sd: sd["param_groups"][0].update(betas=(0.9, 1.5)), "invalid betas"),
    (lambda sd: sd["state"][1].update(exp_avg=torch.zeros(9)),
     r"state 'exp_avg' of param 1 of param group 0 has shape \(9,\)"),
])
def test_refused_state_dict_changes_nothing(damage, message):
    params = [nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2, 2))]
    opt = FusedAdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = _state_snapshot(opt)
    incoming = copy.deepcopy(opt.state_dict())
    damage(incoming)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(incoming)
    _assert_same_snapshot(before, _state_snapshot(opt))
    opt.step()  # still steps


def _ddp_channels_last_worker(rank, world_size):
    import fusedist

    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    base = base.to(memory_format=torch.channels_last)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = FusedAdamW(ours.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + rank)
    for _ in range(4):
        x = torch.randn(4, 3, 10, 10, generator=gen).to(memory_format=torch.channels_last)
        for model, o in ((ours, opt), (ref, opt_ref)):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()
    conv = ours.module[0].weight
    return {
        "diff": max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters())),
        "channels_last": conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous(),
        "grad_like_param": conv.grad.stride() == conv.stride(),
    }


def test_ddp_with_channels_last_and_fused_adamw_matches_torch_ddp():
    from fusedist.testing import run_distributed

    for result in run_distributed(_ddp_channels_last_worker, world_size=2):
        assert result["diff"] < 1e-5, result
        assert result["channels_last"] and result["grad_like_param"], result
