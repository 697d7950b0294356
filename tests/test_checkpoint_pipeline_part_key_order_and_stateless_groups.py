"""Pipeline parts (several on one rank here: one process, the same plan as several ranks'),
checked against torch:

- ``load(..., pipeline=True, strict=False)`` lists ``unexpected_keys`` in the order torch's
  ``load_state_dict(strict=False)`` of the whole model lists them (Note [the order of unexpected
  keys] in fusedist/checkpoint/_names.py): they came stage by stage, in the checkpoint's order
  (a root buffer saved by the last stage after every layer's keys, a module the loaded model
  registers before the layers after them). Reference: the whole loaded model's
  ``load_state_dict(strict=False)`` of the whole saved model's state dict.
- a part without state whose optimizer holds no parameters takes the settings (lr, weight decay,
  betas) of the groups its stage saved, as torch's ``Optimizer.load_state_dict`` restores an
  empty group's (it kept its own), and another number of groups is refused as torch refuses it.
- torch's distributed checkpoint whose entries a part without state cannot tell apart: several
  optimizer states were reported as "holds no optimizer state", several model entries by their
  count alone; they are named, and of several model entries the one called ``model`` is taken,
  as the parts with state take it (a strict load was refused). Reference: torch's
  ``load_state_dict`` of the saved model and optimizer state (fp32 copies: exactly equal).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from fusedist import checkpoint


class _Block(nn.Module):
    def __init__(self, gated: bool):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        if gated:  # (the saved model's layers have a gate the loaded ones lack)
            self.gate = nn.Linear(3, 1)


def _saved_whole() -> nn.Module:
    """The saved model: a root buffer, then the embedding, the layers, a norm, a head with a
    buffer of its own."""
    model = nn.Module()
    model.register_buffer("rope", torch.rand(2))
    model.emb = nn.Linear(2, 3)
    model.layers = nn.ModuleDict({str(i): _Block(True) for i in range(4)})
    model.norm = nn.LayerNorm(3)
    model.head = nn.Linear(3, 2)
    model.head.register_buffer("scale", torch.rand(2))
    return model


def _loaded_whole() -> nn.Module:
    """The loaded model: its head registered before the layers, no norm, no gates."""
    model = nn.Module()
    model.emb = nn.Linear(2, 3)
    model.head = nn.Linear(3, 2)
    model.layers = nn.ModuleDict({str(i): _Block(False) for i in range(4)})
    return model


def _cut(whole: nn.Module, keep: set, layers: set) -> nn.Module:
    """A pipeline part as torchtitan cuts one: the whole model with the other layers removed,
    the names kept."""
    part = copy.deepcopy(whole)
    for name in [n for n in part._modules if n not in keep]:
        delattr(part, name)
    for name in [n for n in part._buffers if n not in keep]:
        delattr(part, name)
    if "layers" in part._modules:
        for i in [i for i in part.layers if int(i) not in layers]:
            del part.layers[i]
    return part


def test_unexpected_keys_of_pipeline_parts_come_in_the_whole_models_torch_order(tmp_path):
    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    saved, reference = _saved_whole(), _loaded_whole()
    path = str(tmp_path / "ckpt")
    stages = [_cut(saved, {"emb", "layers"}, {0, 1}), _cut(saved, {"rope", "layers", "norm", "head"}, {2, 3})]
    checkpoint.save(path, stages, [None, None], pipeline=True)
    loaded = copy.deepcopy(reference)
    parts = [_cut(loaded, {"emb", "layers"}, {0}), _cut(loaded, {"head", "layers"}, {1, 2, 3})]
    result = checkpoint.load(path, parts, [None, None], pipeline=True, strict=False)
    expected = reference.load_state_dict(saved.state_dict(), strict=False)
    assert expected.unexpected_keys[:4] == ["rope", "norm.weight", "norm.bias", "head.scale"]  # (the case is torch's)
    assert result.unexpected_keys == expected.unexpected_keys
    assert result.missing_keys == expected.missing_keys == []
    for part in parts:
        for key, value in part.state_dict().items():
            assert torch.equal(value, reference.state_dict()[key]), key


class _Loss(nn.Module):
    """A part without parameters or buffers (a pipeline's last stage holding only the loss)."""

    def forward(self, x):
        return x.square().mean()


def _over_nothing(*settings: dict):
    """A stateless part's optimizer: groups of no parameters (torch builds it)."""
    return torch.optim.AdamW([dict(s, params=[]) for s in settings], lr=1e-2)


def _settings(opt) -> list:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]


def test_a_stateless_parts_optimizer_over_no_parameters_takes_its_saved_group_settings(tmp_path):
    """Its empty groups kept their own lr and weight decay; torch's Optimizer.load_state_dict
    restores them (and refuses another number of groups)."""
    import pytest

    seed = int.from_bytes(os.urandom(2), "little")
    torch.manual_seed(seed)
    body = nn.Linear(3, 3)
    opt = torch.optim.AdamW(body.parameters(), lr=1e-2)
    body(torch.randn(2, 3)).square().mean().backward()
    opt.step()
    saved_lr = 0.5 + torch.rand(2).tolist()[0]
    stateless = _over_nothing({"lr": saved_lr, "weight_decay": 0.3}, {"lr": 2 * saved_lr, "betas": (0.5, 0.6)})
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, [body, _Loss()], [opt, stateless], pipeline=True)

    reference = _over_nothing({}, {})
    reference.load_state_dict(stateless.state_dict())
    fresh, fresh_opt, fresh_stateless = nn.Linear(3, 3), None, _over_nothing({}, {})
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    checkpoint.load(path, [fresh, _Loss()], [fresh_opt, fresh_stateless], pipeline=True)
    assert _settings(fresh_stateless) == _settings(reference) != _settings(_over_nothing({}, {}))
    assert _settings(fresh_opt) == _settings(opt)

    one_group, other = _over_nothing({}), nn.Linear(3, 3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="different number of parameter groups"):  # (torch's refusal)
        _over_nothing({}).load_state_dict(stateless.state_dict())
    with pytest.raises(checkpoint.CheckpointError, match=r"has 1 param group\(s\) \(of no parameters\); the one its "
                       r"stage without state \(ranks \[0\], part 1\) saved in .* has 2"):
        checkpoint.load(path, [other, _Loss()], [torch.optim.AdamW(other.parameters()), one_group], pipeline=True)
    assert _settings(one_group) == _settings(_over_nothing({}))
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


class _Unsaved(nn.Module):
    """A part whose state dict leaves its parameter out (a state-dict hook drops it): no state
    to tell the model's entries by, an optimizer over a parameter."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self._register_state_dict_hook(_drop_own)


def _drop_own(module, state, prefix, local_metadata):
    for key in [k for k in state if k.startswith(prefix)]:
        del state[key]


def _dcp_of(directory: str, entries: dict) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (one process, torch.distributed not initialized)
        dcp.save(entries, checkpoint_id=directory)


def _trained(seed: int) -> tuple:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    torch.manual_seed(seed)
    body = nn.Sequential(nn.Linear(3, 3))
    opt = torch.optim.AdamW(body.parameters(), lr=1e-2)
    body(torch.randn(2, 3)).square().mean().backward()
    opt.step()
    return (body, opt) + get_state_dict(body, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))


def test_torch_dcp_entries_a_part_without_state_cannot_tell_apart_are_named(tmp_path):
    """Several optimizer states (an EMA model's beside the model's): the part without state said
    the checkpoint held no optimizer state; several model entries: their count, not their keys;
    and where one is called 'model', which the parts with state take, a strict load was refused."""
    import pytest

    seed = int.from_bytes(os.urandom(2), "little")
    body, opt, model_state, optim_state = _trained(seed)
    _, _, ema_state, ema_optim_state = _trained(seed + 1)
    named, unnamed = str(tmp_path / "named"), str(tmp_path / "unnamed")
    _dcp_of(named, {"model": model_state, "ema": ema_state, "optim": optim_state, "optim_ema": ema_optim_state})
    _dcp_of(unnamed, {"student": model_state, "ema": ema_state, "optim": optim_state})
    part = _Unsaved()
    with pytest.raises(checkpoint.CheckpointError, match=r"holds 2 optimizer states \('optim', 'optim_ema'\); "
                       "fusedist.checkpoint.load reads one, and a model part without state cannot tell which"):
        checkpoint.load(named, [part], [torch.optim.AdamW(part.parameters())], pipeline=True, strict=False)
    with pytest.raises(checkpoint.CheckpointError, match=r"holds 2 entries of tensors besides an optimizer's "
                       r"\('student', 'ema'\) and none is called 'model'"):
        checkpoint.load(unnamed, [_Loss()], [None], pipeline=True)

    # 'model' and its one optimizer state, strict: as torch's load_state_dict of them
    _dcp_of(str(tmp_path / "one"), {"model": model_state, "ema": ema_state, "optim": optim_state})
    reference, fresh = nn.Sequential(nn.Linear(3, 3)), nn.Sequential(nn.Linear(3, 3))
    reference.load_state_dict(body.state_dict())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    checkpoint.load(str(tmp_path / "one"), [fresh, _Loss()], [fresh_opt, None], pipeline=True)
    for key, value in reference.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    for i, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(fresh_opt.state_dict()["state"][i][name]), torch.as_tensor(value))
