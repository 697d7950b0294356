"""FP32 masters that come with a loaded optimizer state: a group without ``master_weights``
steps its 16-bit parameters (Note [a loaded master in a group without masters] in
fusedist/optim/_base.py), and a master saved with its parameters resumes bit for bit, the
check at the first step being exactly the rounding the kernels write parameters with (Note
[loaded masters checked against the parameters]).

Tolerances: bf16 parameters within one bf16 ulp (2**-7 relative) of torch's AdamW, which keeps
its moments in bf16 where fusedist keeps them in fp32, so an update near a rounding boundary
may round the other way; the moments within 2**-5 relative: torch rounds its bf16 moments to
2**-9 relative each step, an error that decays by beta1 = 0.9 (exp_avg: at most 10 x 2**-9) or,
over 9 steps, hardly by beta2 = 0.999 (exp_avg_sq: at most 9 x 2**-9). Comparisons within
fusedist are exact: same kernels, same inputs."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from test_optim import BACKENDS

SHAPES = [(7,), (5, 6), (130,)]
ULP = 2.0 ** -7  # a bf16 ulp for magnitudes in [1, 2)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


def _bf16_params(gen):
    """Magnitudes in [1, 2): one bf16 ulp everywhere, so an update's size in ulps is known."""
    out = []
    for s in SHAPES:
        sign = torch.randint(0, 2, s, generator=gen) * 2 - 1
        out.append((sign * (1 + torch.rand(s, generator=gen))).to(torch.bfloat16).requires_grad_())
    return out


def _copies(params):
    return [p.detach().clone().requires_grad_() for p in params]


def _set_grads(params, directions, gen):
    """Gradients of a steady direction (5% noise): Adam's update is then about ``lr`` a step,
    in one direction, so FP32 masters drift where the bf16 parameters stand still."""
    for p, d in zip(params, directions):
        p.grad = (d * (1 + 0.05 * torch.randn(d.shape, generator=gen))).to(p.dtype)


@pytest.mark.parametrize("kernels", BACKENDS[1:])  # (the master is dropped before any kernel runs)
def test_a_group_without_masters_steps_its_bf16_params_like_torch_adamw(kernels, monkeypatch):
    """A FusedAdamW(master_weights=False) loading a state that carries masters (a run with
    masters, saved with groups that do not ask for them) stepped through those FP32 masters:
    updates of 0.4 ulp added up on them and moved the bf16 weights, where torch's
    AdamW on the bf16 parameters -- and fusedist on the state without its masters -- leave
    them where they are. The group's setting wins: the masters are dropped."""
    from fusedist.optim import FusedAdamW

    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", kernels)
    seed = int.from_bytes(os.urandom(2), "little")
    gen = torch.Generator().manual_seed(seed)
    source = _bf16_params(gen)
    directions = [torch.randn(s, generator=gen) for s in SHAPES]
    lr = 0.4 * ULP  # (under half an ulp a step: torch leaves the bf16 weights where they are)
    source_opt = FusedAdamW(source, lr=lr, master_weights=True)
    for _ in range(3):
        _set_grads(source, directions, gen)
        source_opt.step()
    saved = copy.deepcopy(source_opt.state_dict())
    assert all("master_param" in s for s in saved["state"].values())
    saved["param_groups"][0].pop("master_weights")  # (groups saved without asking for masters)
    stripped = copy.deepcopy(saved)
    for s in stripped["state"].values():
        s.pop("master_param")

    ours, plain, theirs = _copies(source), _copies(source), _copies(source)
    opt, plain_opt = FusedAdamW(ours, lr=lr), FusedAdamW(plain, lr=lr)
    ref = torch.optim.AdamW(theirs, lr=lr)
    opt.load_state_dict(saved)
    plain_opt.load_state_dict(stripped)
    ref.load_state_dict(saved)  # (torch keeps the master entry, unread)
    for _ in range(6):  # (updates adding up to 2.4 ulps on a master)
        grads_seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        for params in (ours, plain, theirs):
            _set_grads(params, directions, torch.Generator().manual_seed(grads_seed))
        for o in (opt, plain_opt, ref):
            o.step()

    for i, (p, q, r) in enumerate(zip(ours, plain, theirs)):
        assert torch.equal(p, q), f"param {i} (seed {seed}): stepped otherwise than from the state without masters"
        torch.testing.assert_close(p.float(), r.float(), rtol=ULP, atol=0, msg=lambda m: f"param {i}, seed {seed}: {m}")
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref.state[r][key].float(), rtol=2**-5, atol=1e-7)
        assert opt.state[p]["step"].item() == ref.state[r]["step"].item() == 9
    assert not any("master_param" in opt.state[p] for p in ours), "the group without masters kept them"
    assert "master_param" not in str(opt.state_dict()["state"])


def test_masters_saved_with_their_parameters_resume_bit_exact(backend):
    """The normal resume: a state saved with its parameters -- masters holding more bits than
    the bf16 weights -- continues bit for bit as the run that was not interrupted, and its
    masters stay within float tolerance of torch's AdamW on fp32 copies."""
    from fusedist.optim import FusedAdamW

    seed = int.from_bytes(os.urandom(2), "little")
    gen = torch.Generator().manual_seed(seed)
    run = _bf16_params(gen)
    fp32 = [p.detach().float().requires_grad_() for p in run]
    directions = [torch.randn(s, generator=gen) for s in SHAPES]
    kw = dict(lr=1e-2, weight_decay=0.1)
    opt, ref = FusedAdamW(run, master_weights=True, **kw), torch.optim.AdamW(fp32, **kw)
    grads = []
    for step in range(4):
        _set_grads(run, directions, gen)
        grads.append([p.grad.clone() for p in run])
        for p, g in zip(fp32, grads[-1]):
            p.grad = g.float()
        opt.step()
        ref.step()
        if step == 1:
            saved_opt = copy.deepcopy(opt.state_dict())
            resumed = _copies(run)
    assert any(not torch.equal(saved_opt["state"][i]["master_param"], p.float()) for i, p in enumerate(resumed))
    resumed_opt = FusedAdamW(resumed, master_weights=True, **kw)
    resumed_opt.load_state_dict(saved_opt)
    for step in range(2, 4):
        for p, g in zip(resumed, grads[step]):
            p.grad = g.clone()
        resumed_opt.step()
    for i, (p, q, r) in enumerate(zip(run, resumed, fp32)):
        assert torch.equal(p, q), f"param {i} (seed {seed})"
        assert torch.equal(opt.state[p]["master_param"], resumed_opt.state[q]["master_param"]), f"master {i}"
        # fp32 masters of order 1 after four steps: 1e-6 as against torch's AdamW elsewhere
        torch.testing.assert_close(resumed_opt.state[q]["master_param"], r.detach(), rtol=0, atol=1e-6)


def test_a_loaded_master_is_kept_exactly_when_it_rounds_to_its_parameter():
    """The check is the kernels' own rounding (to nearest, ties to even), not a distance: a
    master half an ulp above a bf16 value with an even last bit rounds to it and is kept; half
    an ulp above one with an odd last bit rounds away and is replaced by the parameter. (A stale
    master that rounds to the parameter is kept too: Note [loaded masters checked against the
    parameters] says why no check on the values can tell it.)"""
    from fusedist.optim import FusedAdamW

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    base = (1 + torch.rand(64, generator=gen)).to(torch.bfloat16)
    odd = (base.view(torch.int16) & 1).bool()
    even_params = torch.where(odd, torch.nextafter(base, base.new_tensor(0.0)), base)
    one_odd = even_params.clone()
    one_odd[5] = torch.nextafter(one_odd[5], one_odd.new_tensor(4.0))
    assert not (even_params.view(torch.int16) & 1).any() and (one_odd.view(torch.int16) & 1).sum() == 1
    params = [even_params.clone().requires_grad_(), one_odd.clone().requires_grad_()]
    masters = [p.detach().float() + ULP / 2 for p in params]  # (exact in fp32)
    opt = FusedAdamW(params, lr=0.0, weight_decay=0.0, master_weights=True)
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(64), "exp_avg_sq": torch.zeros(64),
                 "master_param": m.clone()} for i, m in enumerate(masters)}
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(opt.state[params[0]]["master_param"], masters[0]), "a master that rounds to it was replaced"
    assert torch.equal(opt.state[params[1]]["master_param"], params[1].detach().float()), "a stale master was kept"
