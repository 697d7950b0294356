"""ZeroRedundancyOptimizer against torch (2 gloo ranks):

* torch's state-dict helpers (``get_state_dict``, ``get_optimizer_state_dict`` with a full state
  dict, ``set_state_dict``) on a ZeRO optimizer raise an error naming ``fusedist.checkpoint``
  on every rank -- not a bare ``KeyError: 'state'`` -- and leave the optimizer's state as it
  was: the zero-gradient step torch's helpers take to create a missing state used to advance
  Adam's moments and step counts first;
* trainable parameters with no elements (one of them unused in a step): the consolidated state
  dict holds their entries as torch's optimizer's does (step counts, empty moments), also after
  loading torch's state dict and stepping on, and after growing the optimizer with a group of
  them (they used to be missing);
* a float64 model clipped with ``clip_grad_norm_`` under a fused inner optimizer (FusedAdamW,
  FusedSGD), stages 1 and 2: the norms and the trained parameters are torch DDP + torch's clip
  to float64 precision (the coefficient used to be rounded to float32: 1e-9 off).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


def _batch(rank, step, dtype=torch.float32):
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank)).to(dtype)


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _moments(opt) -> list:
    shard = opt.shard_state_dict()
    return [(k, f["state"][key].clone(), f["state"]["step"].clone()) for k, frags in sorted(shard["fragments"].items())
            for f in frags for key in ("exp_avg", "exp_avg_sq")]


def _torch_helpers_worker(rank, world, stage, keep_grads):
    import fusedist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         get_state_dict, set_state_dict)

    model = fusedist.DistributedDataParallel(_net())
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.1)
    opt.zero_grad()
    model(_batch(rank, 0)).square().mean().backward()
    opt.step()
    if not keep_grads:
        opt.zero_grad()
    before = _moments(opt)
    calls = [lambda: get_state_dict(model, opt),
             lambda: get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)),
             lambda: set_state_dict(model, opt, model_state_dict=model.module.state_dict(),
                                    optim_state_dict={"state": {}, "param_groups": []})]
    for call in calls:
        with pytest.raises(RuntimeError, match="fusedist.checkpoint.save"):
            call()
        for p in model.parameters():  # (torch's helper gives parameters zero gradients before its step)
            p.grad = None
    after = _moments(opt)
    assert len(after) == len(before) > 0
    for (k, m, s), (k2, m2, s2) in zip(before, after):
        assert k == k2 and torch.equal(m, m2) and torch.equal(s, s2), k


HELPERS = [(1, False), (2, True)]


@pytest.mark.parametrize("stage,keep_grads", HELPERS)
def test_torch_state_dict_helpers_refused_without_changing_the_state(stage, keep_grads, launched):
    results_of(launched, f"helpers {stage} {keep_grads}")


def _fp64_clip_worker(rank, world, stage, name):
    import fusedist

    fused = getattr(fusedist.optim, name)
    reference = {"FusedAdamW": torch.optim.AdamW, "FusedSGD": torch.optim.SGD}[name]
    kw = dict(lr=0.1, momentum=0.9) if name == "FusedSGD" else dict(lr=0.1)
    base = _net(torch.float64)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), fused, stage=stage, **kw)
    ref = reference(theirs.parameters(), **kw)
    for step in range(3):
        x = _batch(rank, step, torch.float64)
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            model(x).square().sum().backward()
        got = opt.clip_grad_norm_(0.05)
        want = nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
        assert got.dtype == torch.float64
        assert abs(got.item() - want.item()) <= 1e-13 * want.item(), (step, got.item(), want.item())
        opt.step()
        ref.step()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-14)


FP64_CLIP = [(1, "FusedAdamW"), (2, "FusedSGD")]


@pytest.mark.parametrize("stage,name", FP64_CLIP)
def test_fp64_clip_under_a_fused_inner_optimizer_is_torchs(stage, name, launched):
    results_of(launched, f"fp64 clip {stage} {name}")


class _WithEmpty(nn.Module):
    """Two parameters with no elements between ordinary ones (``f`` left out of some forwards),
    and two frozen ones, ``g`` empty, for a group added later."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)
        self.e = nn.Parameter(torch.zeros(0, 3))
        self.b = nn.Linear(3, 2)
        self.f = nn.Parameter(torch.zeros(2, 0))
        self.g = nn.Parameter(torch.zeros(0), requires_grad=False)
        self.h = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x, use_f=True):
        y = self.b(self.a(x)) * self.h + self.e.sum() + self.g.sum()
        return y + self.f.sum() if use_f else y


def _groups(m):
    return [{"params": [m.a.weight, m.e, m.a.bias]}, {"params": [m.b.weight, m.b.bias, m.f], "lr": 0.03}]


def _assert_same_state_dict(got, want):
    assert sorted(got["state"]) == sorted(want["state"])
    for index, state in want["state"].items():
        assert sorted(got["state"][index]) == sorted(state), (index, got["state"][index], state)
        for key, value in state.items():
            mine = torch.as_tensor(got["state"][index][key])
            value = torch.as_tensor(value)
            assert mine.shape == value.shape, (index, key)
            torch.testing.assert_close(mine.double(), value.double(), rtol=0, atol=1e-6)
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]


def _empty_params_worker(rank, world, stage, name):
    import fusedist

    ours_cls = getattr(torch.optim, name, None) or getattr(fusedist.optim, name)
    torch_cls = getattr(torch.optim, name.replace("Fused", ""))
    kw = dict(lr=0.1, momentum=0.9) if "SGD" in name else dict(lr=0.1)
    base = _WithEmpty()
    x = torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(1))
    mine = slice(4 * rank, 4 * rank + 4)

    def train(model, opt, xs, steps, use_f=lambda s: True):
        for s in range(steps):
            opt.zero_grad()
            model(xs, use_f(s)).square().mean().backward()
            opt.step()

    ref = copy.deepcopy(base)
    ref_opt = torch_cls(_groups(ref), **kw)
    model = fusedist.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
    opt = fusedist.ZeroRedundancyOptimizer(_groups(model.module), ours_cls, stage=stage, **kw)
    train(ref, ref_opt, x, 3, lambda s: s != 1)
    train(model, opt, x[mine], 3, lambda s: s != 1)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        _assert_same_state_dict(opt.state_dict(), ref_opt.state_dict())

    # torch's state dict into ZeRO, two more steps on both sides
    model = fusedist.DistributedDataParallel(copy.deepcopy(ref), find_unused_parameters=True)
    opt = fusedist.ZeroRedundancyOptimizer(_groups(model.module), ours_cls, stage=stage, **kw)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    train(ref, ref_opt, x, 2)
    train(model, opt, x[mine], 2)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        _assert_same_state_dict(opt.state_dict(), ref_opt.state_dict())

    # a group of parameters unfrozen after steps, one of them empty (progressive unfreezing)
    for m, o in ((ref, ref_opt), (model.module, opt)):
        m.g.requires_grad_(True)
        m.h.requires_grad_(True)
        o.add_param_group({"params": [m.g, m.h], "lr": 0.02})
    train(ref, ref_opt, x, 2)
    train(model, opt, x[mine], 2)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        _assert_same_state_dict(opt.state_dict(), ref_opt.state_dict())


EMPTY = [(1, "AdamW"), (2, "FusedSGD")]


@pytest.mark.parametrize("stage,name", EMPTY)
def test_parameters_with_no_elements_in_state_dicts_as_torchs(stage, name, launched):
    results_of(launched, f"empty {stage} {name}")


@pytest.fixture(scope="module")
def launched(request):
    """The selected tests' scenarios in one launch of 2 ranks (each builds its own models and
    optimizers); a scenario's assertion fails its own test."""
    return launch_for_selected(request, {
        "test_torch_state_dict_helpers_refused_without_changing_the_state": {
            f"helpers {stage} {keep}": (_torch_helpers_worker, (stage, keep)) for stage, keep in HELPERS},
        "test_fp64_clip_under_a_fused_inner_optimizer_is_torchs": {
            f"fp64 clip {stage} {name}": (_fp64_clip_worker, (stage, name)) for stage, name in FP64_CLIP},
        "test_parameters_with_no_elements_in_state_dicts_as_torchs": {
            f"empty {stage} {name}": (_empty_params_worker, (stage, name)) for stage, name in EMPTY},
    }, 2, timeout=300)
