"""Fused optimizers given parameters as torch's optimizers take them, against torch's:

* named parameters (``model.named_parameters()``): the groups keep ``param_names`` as torch's do,
  the state dicts are interchangeable with torch's both ways and a resumed run steps as torch's;
  a state dict whose parameters are in another order is refused naming the saved and the met
  parameter (Note [parameter names in a load] in fusedist/optim/_loaded_state.py), where torch's
  loader takes states of the wrong shapes;
* a group listing one parameter twice is refused naming both positions (Note [a parameter listed
  twice] in fusedist/optim/_base.py): torch's warn and step it twice, the fused pass computed a
  third result; a parameter already in another group is refused as torch's refuses it, naming it;
* torch's global and per-optimizer step hooks and the state-dict hooks run in torch's order."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fusedist.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

PAIRS = [(FusedAdamW, torch.optim.AdamW, {}), (FusedAdam, torch.optim.Adam, {"amsgrad": True}),
         (FusedSGD, torch.optim.SGD, {"momentum": 0.9, "nesterov": True})]


def _model(seed=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _train(model, opt, seed, steps=3):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=gen)).pow(2).sum().backward()
        opt.step()


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("ours, theirs, kw", PAIRS, ids=lambda v: getattr(v, "__name__", ""))
def test_named_parameters_state_dicts_interchange_with_torch(ours, theirs, kw):
    """fp32 on both sides, the same op order up to fused multiply-adds: a few ulps (1e-6)."""
    m_ours, m_theirs = _model(), _model()
    o_ours = ours(m_ours.named_parameters(), lr=0.01, **kw)
    o_theirs = theirs(m_theirs.named_parameters(), lr=0.01, **kw)
    _train(m_ours, o_ours, seed=5)
    _train(m_theirs, o_theirs, seed=5)
    assert _max_diff(m_ours, m_theirs) < 1e-6
    saved_ours, saved_theirs = o_ours.state_dict(), o_theirs.state_dict()
    names = [n for n, _ in _model().named_parameters()]
    assert saved_ours["param_groups"][0]["param_names"] == saved_theirs["param_groups"][0]["param_names"] == names
    assert set(saved_ours["param_groups"][0]) == set(saved_theirs["param_groups"][0])

    # each loads the other's, and both resume as torch's resumed from its own
    resumed = {}
    for cls, saved in ((ours, saved_theirs), (theirs, saved_ours), (theirs, saved_theirs)):
        model = _model()
        model.load_state_dict(m_theirs.state_dict())
        opt = cls(model.named_parameters(), lr=0.01, **kw)
        opt.load_state_dict(saved)
        assert opt.state_dict()["param_groups"][0]["param_names"] == names
        _train(model, opt, seed=9)
        resumed[(cls, id(saved))] = model
    reference = resumed[(theirs, id(saved_theirs))]
    assert _max_diff(resumed[(ours, id(saved_theirs))], reference) < 1e-6
    assert _max_diff(resumed[(theirs, id(saved_ours))], reference) < 1e-6


@pytest.mark.parametrize("ours, theirs, kw", PAIRS[::2], ids=lambda v: getattr(v, "__name__", ""))
def test_state_dict_of_reordered_parameters_refused_naming_both(ours, theirs, kw):
    model = _model()
    source = theirs(model.named_parameters(), lr=0.01, **kw)
    _train(model, source, seed=1, steps=1)
    saved = source.state_dict()
    target = ours(list(_model().named_parameters())[::-1], lr=0.01, **kw)
    with pytest.raises(ValueError, match=r"saved for '0\.weight' and met '1\.bias'.*another order.*pre-hook"):
        target.load_state_dict(saved)
    assert not target.state  # nothing was loaded
    # torch's loader takes it (states of other shapes), as its documentation says names do not steer a load
    theirs(list(_model().named_parameters())[::-1], lr=0.01, **kw).load_state_dict(saved)


@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD, FusedLAMB])
def test_a_parameter_listed_twice_is_refused(cls):
    p, q = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's own deprecation warning, before the refusal)
        torch.optim.SGD([q, p, q], lr=0.1)  # torch's takes it
        with pytest.raises(ValueError, match=r"param group 0 lists the same parameter twice, as param 0 and param 2 "
                                             r"\(shape \(2, 3\)\).*List each parameter once"):
            cls([q, p, q], lr=0.1)
        opt = cls([("u", p)], lr=0.1)
        with pytest.raises(ValueError, match=r"param group 1 lists the same parameter \('v'\) twice, as param 0 and "
                                             r"param 1"):
            opt.add_param_group({"params": [("w", q), ("v", q)]})
    assert len(opt.param_groups) == 1  # the refused group is not added
    p.grad = torch.ones_like(p)
    opt.step()  # and the optimizer steps on


@pytest.mark.parametrize("cls", [FusedAdamW, FusedLAMB])
def test_a_parameter_in_two_groups_is_refused_naming_it(cls):
    """torch's refusal, its message kept as the start, saying which parameter and where."""
    model = _model()
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group") as theirs:
        torch.optim.AdamW([{"params": model[0].parameters()}, {"params": [model[1].weight, model[0].bias]}])
    assert "param 1 of the added group" not in str(theirs.value)
    with pytest.raises(ValueError, match=r"^some parameters appear in more than one parameter group: param 1 of the "
                                         r"added group is param 1 of param group 0 \(shape \(3,\)\)"):
        cls([{"params": model[0].parameters()}, {"params": [model[1].weight, model[0].bias]}])
    opt = cls(model.named_parameters())
    with pytest.raises(ValueError, match=r"param 0 of the added group \('1\.weight'\) is param 2 of param group 0"):
        opt.add_param_group({"params": (item for item in [("again", model[1].weight)]), "lr": 0.5})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": (item for item in [("new", torch.nn.Parameter(torch.ones(2)))])})  # read once
    assert opt.param_groups[1]["param_names"] == ["new"] and len(opt.param_groups[1]["params"]) == 1


@pytest.mark.parametrize("ours, theirs", [(FusedAdamW, torch.optim.AdamW), (FusedSGD, torch.optim.SGD)])
def test_step_and_state_dict_hooks_run_in_torchs_order(ours, theirs):
    def events(cls):
        log = []
        p = torch.nn.Parameter(torch.randn(3))
        p.grad = torch.randn(3)
        opt = cls([p], lr=0.1)
        handles = [register_optimizer_step_pre_hook(lambda o, a, k: log.append(("global pre", o is opt, sorted(k)))),
                   register_optimizer_step_post_hook(lambda o, a, k: log.append(("global post", o is opt, sorted(k))))]
        try:
            opt.register_step_pre_hook(lambda o, a, k: log.append(("pre", o is opt, sorted(k))))
            opt.register_step_post_hook(lambda o, a, k: log.append(("post", o is opt, sorted(k))))
            opt.register_state_dict_pre_hook(lambda o: log.append(("state_dict pre", o is opt)))
            opt.register_state_dict_post_hook(lambda o, sd: log.append(("state_dict post", sorted(sd))))
            opt.step()
            log.append(("loss", opt.step(closure=lambda: 2.5)))
            opt.state_dict()
        finally:
            for handle in handles:
                handle.remove()
        return log

    assert events(ours) == events(theirs)
