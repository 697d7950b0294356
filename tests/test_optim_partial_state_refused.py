"""A state dict whose state for a parameter holds some of what the update reads but not all of
it (a step count without the moments, moments without a step count) is refused by the fused
optimizers' ``load_state_dict``, naming the parameter and the missing keys, with nothing
loaded. torch's Adam raises KeyError loading such a state dict (no step count) or at its next
step (a moment missing); the fused
step made the missing parts afresh and trained on silently (Note [a partial state refused] in
fusedist/optim/_loaded_state.py). A parameter with no state at all still starts afresh, as in
torch."""

from __future__ import annotations

import copy

import pytest
import torch

from fusedist.optim import FusedAdam, FusedAdamW, FusedLAMB


def _params(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((5, 3), (7,))]


def _step(params, opt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def _trained_state_dict(opt_cls, seed: int) -> dict:
    params = _params(seed)
    opt = opt_cls(params, lr=1e-2)
    for s in range(2):
        _step(params, opt, seed + 1 + s)
    return copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("missing", ["step", "exp_avg", "exp_avg_sq"])
def test_a_partial_adam_state_is_refused_where_torch_fails_at_its_step(missing):
    seed = int(torch.randint(0, 2**31 - 8, ()))
    saved = _trained_state_dict(torch.optim.AdamW, seed)
    del saved["state"][1][missing]
    theirs = torch.optim.AdamW(_params(seed), lr=1e-2)
    with pytest.raises(KeyError, match=missing):  # (torch's reference: its load or its step fails)
        theirs.load_state_dict(copy.deepcopy(saved))
        _step(theirs.param_groups[0]["params"], theirs, seed + 5)

    params = _params(seed)
    ours = FusedAdamW(params, lr=1e-2)
    _step(params, ours, seed + 3)
    before = copy.deepcopy(ours.state_dict())
    with pytest.raises(ValueError, match=rf"param 1 of param group 0 has .* but not '{missing}'.*nothing was loaded"):
        ours.load_state_dict(saved)
    after = ours.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for index, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][index][key], value), f"state {key!r} of param {index} changed"


def test_lamb_refuses_moments_without_a_step_count_and_parameters_without_state_start_afresh():
    seed = int(torch.randint(0, 2**31 - 8, ()))
    saved = _trained_state_dict(FusedLAMB, seed)
    partial = copy.deepcopy(saved)
    del partial["state"][0]["step"]
    with pytest.raises(ValueError, match=r"FusedLAMB.*param 0 of param group 0 has 'exp_avg', 'exp_avg_sq' but not "
                                         r"'step'"):
        FusedLAMB(_params(seed), lr=1e-2).load_state_dict(partial)

    # No state at all for parameter 1: it starts afresh, as a torch optimizer's parameter does.
    del saved["state"][1]
    for ours_cls, theirs_cls in ((FusedLAMB, None), (FusedAdam, torch.optim.Adam)):
        saved_here = saved if theirs_cls is None else _without_state_of(_trained_state_dict(theirs_cls, seed), 1)
        ours_params = _params(seed)
        ours = ours_cls(ours_params, lr=1e-2)
        ours.load_state_dict(saved_here)
        _step(ours_params, ours, seed + 7)
        assert float(ours.state[ours_params[1]]["step"]) == 1.0
        if theirs_cls is not None:
            theirs_params = _params(seed)
            theirs = theirs_cls(theirs_params, lr=1e-2)
            theirs.load_state_dict(saved_here)
            _step(theirs_params, theirs, seed + 7)
            for a, b in zip(ours_params, theirs_params):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _without_state_of(state_dict: dict, index: int) -> dict:
    state_dict["state"].pop(index)
    return state_dict
