"""Fused optimizers as objects, against torch's:

* pickled, deep-copied or saved whole with ``torch.save`` (Note [an optimizer pickled or
  copied] in fusedist/optim/_base.py), one steps on as the original does: the copy and the
  original, given the same gradients, stay equal bit for bit (the same ops on the same
  values), FusedLAMB's modes included, and bf16 parameters keep their FP32 masters;
* ``load_state_dict``'s hooks run as torch's loader runs them: the pre-hooks once, first, and
  the post-hooks last, so what a post-hook changes in the state stays."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from fusedist.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD


def _round_trip(opt, how):
    if how == "deepcopy":
        return copy.deepcopy(opt)
    if how == "pickle":
        return pickle.loads(pickle.dumps(opt))
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


CASES = {
    "adam": (FusedAdam, dict(lr=0.1, weight_decay=0.01), torch.float32),
    "adamw-bf16-masters": (FusedAdamW, dict(lr=0.1, master_weights=True), torch.bfloat16),
    "sgd-momentum": (FusedSGD, dict(lr=0.1, momentum=0.9, nesterov=True), torch.float32),
    "lamb-modes": (FusedLAMB, dict(lr=0.1, adam_w_mode=False, use_nvlamb=True, set_grad_none=False),
                   torch.float32),
}


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_copy_steps_on_as_the_original(case, how):
    cls, kw, dtype = CASES[case]
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in ((4, 3), (5,))]
    opt = cls(params, **kw)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
    opt.step()
    twin = _round_trip(opt, how)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    for name in getattr(cls, "_pickled_attrs", ()):
        assert getattr(twin, name) == getattr(opt, name), name
    for _ in range(3):
        for p, q in zip(params, twin_params):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
        if dtype != torch.float32:
            assert torch.equal(opt.state[p]["master_param"], twin.state[q]["master_param"])
    twin.zero_grad()  # FusedLAMB's set_grad_none=False: zeros kept
    assert all((q.grad is None) == (getattr(twin, "set_grad_none", True)) for q in twin_params)


def _zero_the_states(opt):
    for st in opt.state.values():
        for key in list(st):
            if key != "step" and isinstance(st[key], torch.Tensor):
                st[key] = torch.zeros_like(st[key])


@pytest.mark.parametrize("ours, theirs, kw, key", [
    (FusedAdam, torch.optim.Adam, {}, "exp_avg"),
    (FusedSGD, torch.optim.SGD, dict(momentum=0.9), "momentum_buffer"),
])
def test_load_hooks_run_as_in_torchs_loader(ours, theirs, kw, key):
    states = {}
    for cls in (theirs, ours):
        p = torch.nn.Parameter(torch.ones(3))
        source = cls([p], lr=0.1, **kw)
        p.grad = torch.full((3,), 2.0)
        source.step()
        target = cls([p], lr=0.1, **kw)
        calls = []
        target.register_load_state_dict_pre_hook(lambda opt, sd: calls.append("pre"))
        target.register_load_state_dict_post_hook(lambda opt: (calls.append("post"), _zero_the_states(opt)))
        target.load_state_dict(source.state_dict())
        assert calls == ["pre", "post"], cls
        states[cls] = target.state[p][key]
    assert torch.equal(states[theirs], torch.zeros(3))
    assert torch.equal(states[ours], states[theirs])
