"""A torch distributed checkpoint's optimizer state loads only into an optimizer of its algorithm.

A fusedist checkpoint records its optimizer's algorithm and ``load`` refuses another's; a torch
DCP checkpoint records none, and AdamW's state went into SGD silently (SGD's groups then held
``betas`` and ``amsgrad``, its state ``exp_avg``). Its param groups' settings tell the
algorithm (Note [the algorithm of a torch distributed checkpoint's optimizer] in
fusedist/checkpoint/_dcp_algorithm.py). Single process: ``dcp.save`` without a process group.
The reference for what does load is torch's own optimizer state: copied, so compared exactly.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from fusedist import checkpoint
from fusedist.checkpoint import CheckpointError
from fusedist.optim import FusedAdam, FusedAdamW


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _groups(model, **kw) -> list:
    return [{"params": model[0].parameters(), "lr": 3e-3, **kw}, {"params": model[2].parameters(), "lr": 1e-3, **kw}]


def _saved(tmp_path, make_optimizer, drop=()):
    """A torch DCP checkpoint of a model and ``make_optimizer(model)`` after two steps on random
    inputs, under an LR scheduler (whose ``initial_lr`` joins the saved groups); the group keys
    ``drop`` are left out, as a torch that did not have them saved it."""
    model = _net()
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(6, 5, generator=gen)).pow(2).mean().backward()
        opt.step()
        sched.step()
    msd, osd = get_state_dict(model, opt)
    for group in osd["param_groups"]:
        for key in drop:
            del group[key]
    path = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: DCP warns that it saves alone)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return path, model, opt


@pytest.mark.parametrize("saved_with,loaded_into,named", [
    ("AdamW", "SGD", r"settings \['amsgrad', 'betas', 'decoupled_weight_decay', 'eps'\], which SGD does not have"),
    ("SGD", "AdamW", r"settings \['dampening', 'momentum', 'nesterov'\], which AdamW does not have"),
    ("AdamW", "Adam", r"param group 0 was saved with decoupled_weight_decay=True \(AdamW's weight decay\)"),
], ids=["AdamW-into-SGD", "SGD-into-AdamW", "AdamW-into-Adam"])
@pytest.mark.parametrize("pipeline", [False, True], ids=["model", "pipeline-parts"])
def test_another_algorithms_state_is_refused_and_nothing_changes(tmp_path, saved_with, loaded_into, named, pipeline):
    kinds = {"AdamW": lambda m: torch.optim.AdamW(_groups(m), weight_decay=0.1),
             "Adam": lambda m: torch.optim.Adam(_groups(m)),
             "SGD": lambda m: torch.optim.SGD(_groups(m), momentum=0.9)}
    path, _, _ = _saved(tmp_path, kinds[saved_with])
    fresh = _net(1)
    opt = kinds[loaded_into](fresh)
    before = [p.detach().clone() for p in fresh.parameters()]
    groups_before = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    with pytest.raises(CheckpointError, match=rf"torch's distributed checkpoint\) is another algorithm's than "
                                              rf"{loaded_into}'s: .*{named}.*optimizer=None"):
        if pipeline:  # the model's one part, as a pipelined job's rank passes its parts
            checkpoint.load(path, [fresh], [opt], pipeline=True)
        else:
            checkpoint.load(path, fresh, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups] == groups_before
    assert not opt.state


@pytest.mark.parametrize("loaded_into", ["AdamW", "FusedAdamW"])
def test_the_same_algorithms_state_loads_with_a_schedulers_keys(tmp_path, loaded_into):
    """AdamW's state (its groups carrying the scheduler's ``initial_lr``) loads into a fresh
    AdamW or FusedAdamW that has no scheduler: the state and settings are torch's exactly."""
    path, model, saved_opt = _saved(tmp_path, lambda m: torch.optim.AdamW(_groups(m), weight_decay=0.1))
    fresh = _net(1)
    opt = (torch.optim.AdamW if loaded_into == "AdamW" else FusedAdamW)(_groups(fresh), weight_decay=0.5)
    checkpoint.load(path, fresh, opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    reference, loaded = saved_opt.state_dict(), opt.state_dict()
    for index, state in reference["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(loaded["state"][index][key]), torch.as_tensor(value)), (index, key)
    for saved, group in zip(reference["param_groups"], loaded["param_groups"]):
        assert (group["lr"], group["weight_decay"], group["initial_lr"]) == \
            (saved["lr"], saved["weight_decay"], saved["initial_lr"])


_DECOUPLED = {"weight_decay": 0.1, "decoupled_weight_decay": True}
_WITHOUT_KEY = {"Adam(decoupled)": lambda m: torch.optim.Adam(_groups(m), **_DECOUPLED),
                "FusedAdam(decoupled)": lambda m: FusedAdam(_groups(m), **_DECOUPLED),
                "AdamW": lambda m: torch.optim.AdamW(_groups(m), weight_decay=0.1),
                "FusedAdamW": lambda m: FusedAdamW(_groups(m), weight_decay=0.1),
                "Adam": lambda m: torch.optim.Adam(_groups(m), weight_decay=0.1)}


@pytest.mark.parametrize("loaded_into", list(_WITHOUT_KEY))
def test_groups_saved_without_decoupled_weight_decay(tmp_path, loaded_into):
    """Groups saved without ``decoupled_weight_decay`` (a torch older than the setting): torch's
    ``load_state_dict`` fills it from the class -- False for Adam and FusedAdam, True for AdamW and
    FusedAdamW -- so ``Adam(decoupled_weight_decay=True)`` silently switched to L2 decay. That is
    refused naming the group, before anything changes; where the setting stays, the state loads
    exactly and the groups are what torch's own ``load_state_dict`` of the same state makes."""
    path, model, saved_opt = _saved(tmp_path, lambda m: torch.optim.AdamW(_groups(m), weight_decay=0.1),
                                    drop=("decoupled_weight_decay",))
    fresh = _net(1)
    opt = _WITHOUT_KEY[loaded_into](fresh)
    built = [g["decoupled_weight_decay"] for g in opt.param_groups]
    if loaded_into.endswith("(decoupled)"):
        before = [p.detach().clone() for p in fresh.parameters()]
        name = type(opt).__name__
        with pytest.raises(CheckpointError, match=rf"param group 0 was saved without decoupled_weight_decay .*"
                                                  rf"{name}.load_state_dict fills it with False.*"
                                                  rf"decoupled_weight_decay=True: from then on it would run Adam's"):
            checkpoint.load(path, fresh, opt)
        assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
        assert [g["decoupled_weight_decay"] for g in opt.param_groups] == built and not opt.state
        return
    checkpoint.load(path, fresh, opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    reference = saved_opt.state_dict()
    loaded = opt.state_dict()
    for index, state in reference["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(loaded["state"][index][key]), torch.as_tensor(value)), (index, key)
    # torch's own loader on the same groups without the key: the setting each class fills
    torch_made = _WITHOUT_KEY[loaded_into](_net(1))
    keyless = {**reference, "param_groups": [{k: v for k, v in g.items() if k != "decoupled_weight_decay"}
                                             for g in reference["param_groups"]]}
    torch_made.load_state_dict(keyless)
    assert [g["decoupled_weight_decay"] for g in opt.param_groups] == \
        [g["decoupled_weight_decay"] for g in torch_made.param_groups] == built
