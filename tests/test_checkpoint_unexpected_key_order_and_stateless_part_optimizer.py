"""Two load results matched to torch, single process:

- ``load(..., strict=False)`` lists ``unexpected_keys`` in the order torch's
  ``Module.load_state_dict(strict=False)`` lists them (Note [the order of unexpected keys] in
  fusedist/checkpoint/_names.py): it listed them in the checkpoint's order (and, for torch's
  distributed checkpoint, in the order DCP reads them back; for a pipelined one, by stage),
  where torch lists a module's keys before its submodules'. Reference: torch's
  ``load_state_dict(strict=False)`` of the saved state.
- a pipelined load that is not strict, of torch's distributed checkpoint or fusedist's own, into
  parts one of which holds no state but has an optimizer (one over no parameters, as a stage
  without parameters builds to step with the others) refused with "holds no optimizer state"
  although the checkpoint holds the other parts'. Reference: torch's ``load_state_dict`` of the
  saved model and optimizer state, stepped on: fp32, the same operations, so exactly equal.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fusedist import checkpoint


class _Tagged(nn.Linear):
    """A Linear with extra state (``get_extra_state``) and a buffer of its own."""

    def __init__(self, *shape):
        super().__init__(*shape)
        self.register_buffer("scale", torch.rand(shape[1]))

    def get_extra_state(self):
        return {"tag": 3}

    def set_extra_state(self, state):
        self.tag = state["tag"]


class _Saved(nn.Module):
    """The saved model: modules the loaded one lacks at every depth, registered in an order
    other than the one torch lists them in."""

    def __init__(self):
        super().__init__()
        self.register_buffer("m_buf", torch.rand(3))
        self.z_extra = nn.Linear(2, 2)
        self.body = nn.Sequential(_Tagged(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5)), nn.Linear(5, 5))
        self.a_head = nn.Linear(5, 2)


class _Loaded(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4)))
        self.tail = nn.Linear(4, 1)  # (missing from the checkpoint)


def _saved_dcp(directory: str, state: dict) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (one process, torch.distributed not initialized)
        dcp.save(state, checkpoint_id=directory)


@pytest.mark.parametrize("kind", ["fusedist", "fusedist pipelined", "torch dcp"])
def test_unexpected_keys_come_in_torch_load_state_dict_order(tmp_path, kind):
    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    saved = _Saved()
    path = str(tmp_path / "ckpt")
    if kind == "fusedist":
        checkpoint.save(path, saved)
    elif kind == "fusedist pipelined":  # (one part: loaded by a job that is not pipelined)
        checkpoint.save(path, [saved], [None], pipeline=True)
    else:
        _saved_dcp(path, {"model": saved.state_dict()})
    reference, loaded = _Loaded(), _Loaded()
    loaded.load_state_dict(reference.state_dict())
    expected = reference.load_state_dict(saved.state_dict(), strict=False)
    assert expected.unexpected_keys[:3] == ["m_buf", "z_extra.weight", "z_extra.bias"]  # (the case is torch's)
    result = checkpoint.load(path, loaded, strict=False)
    assert result.unexpected_keys == expected.unexpected_keys
    assert result.missing_keys == expected.missing_keys
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


class _Plain(nn.Module):
    """A saved model of parameters and buffers only (a checkpoint of several optimizers holds no
    other state), with modules the loaded one lacks at every depth."""

    def __init__(self):
        super().__init__()
        self.register_buffer("m_buf", torch.rand(3))
        self.z_extra = nn.Linear(2, 2)
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5)), nn.Linear(5, 5))
        self.a_head = nn.Linear(5, 2)


class _PlainLoaded(nn.Module):
    """Holds what the checkpoint lacks too: buffers in both parts' layers, a new module."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4)))
        self.body[0].register_buffer("new_b", torch.zeros(2))
        self.body[1][0].register_buffer("new_c", torch.zeros(2))
        self.tail = nn.Linear(4, 1)


def _reversed_optimizers(model: nn.Module) -> list:
    """One optimizer per layer of the body, in the opposite order to the layers."""
    return [torch.optim.AdamW(model.body[1][0].parameters()), torch.optim.AdamW(model.body[0].parameters())]


@pytest.mark.parametrize("how", ["load", "Checkpointer.restore"])
def test_keys_of_a_load_with_a_list_of_optimizers_come_in_torch_order(tmp_path, how):
    """Several optimizers over one model load part by part (one view per optimizer): the keys
    came part by part."""
    from fusedist.checkpoint import Checkpointer

    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    saved = _Plain()
    path = str(tmp_path / "ckpt")
    if how == "load":
        checkpoint.save(path, saved, _reversed_optimizers(saved))
    else:
        with Checkpointer(path, every_steps=1, async_save=False) as ckpt:
            ckpt.restore(saved, _reversed_optimizers(saved))
            ckpt.save(1)
    reference, loaded = _PlainLoaded(), _PlainLoaded()
    loaded.load_state_dict(reference.state_dict())
    expected = reference.load_state_dict(saved.state_dict(), strict=False)
    if how == "load":
        result = checkpoint.load(path, loaded, _reversed_optimizers(loaded), strict=False)
    else:
        with Checkpointer(path, every_steps=1, async_save=False) as again:
            assert again.restore(loaded, _reversed_optimizers(loaded), strict=False) == 1
            result = again.incompatible_keys
    assert (result.missing_keys, result.unexpected_keys) == (expected.missing_keys, expected.unexpected_keys)
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


class _Loss(nn.Module):
    """A part without parameters or buffers (a pipeline's last stage holding only the loss)."""

    def forward(self, x):
        return x.square().mean()


def _body(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))


def _step(model, opt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 6, generator=gen)).square().mean().backward()
    opt.step()


def _over_nothing():
    """The stateless part's optimizer: one group of no parameters (torch builds it)."""
    return torch.optim.AdamW([{"params": []}], lr=1e-2)


@pytest.mark.parametrize("kind", ["torch dcp", "fusedist, stateless part saved with one",
                                  "fusedist, stateless part saved without"])
@pytest.mark.parametrize("strict", [False, True], ids=["not strict", "strict"])
def test_a_stateless_part_with_an_optimizer_loads_the_other_parts(tmp_path, kind, strict):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    seed = int.from_bytes(os.urandom(2), "little")
    body = _body(seed)
    opt = torch.optim.AdamW(body.parameters(), lr=1e-2)
    _step(body, opt, seed)
    path = str(tmp_path / "ckpt")
    if kind == "torch dcp":  # (torchtitan's: the optimizer flattened by name)
        _saved_dcp(path, dict(zip(("model", "optim"), get_state_dict(
            body, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)))))
    else:
        stateless_opt = _over_nothing() if kind.endswith("with one") else None
        checkpoint.save(path, [body, _Loss()], [opt, stateless_opt], pipeline=True)
    reference = _body(seed + 1)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reference.load_state_dict(body.state_dict())
    reference_opt.load_state_dict(opt.state_dict())
    fresh = _body(seed + 1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    result = checkpoint.load(path, [fresh, _Loss()], [fresh_opt, _over_nothing()], pipeline=True, strict=strict)
    if not strict:
        assert (result.missing_keys, result.unexpected_keys) == ([], [])
    for step in (seed + 2, seed + 3):
        _step(fresh, fresh_opt, step)
        _step(reference, reference_opt, step)
    for key, value in reference.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    for i, state in reference_opt.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(fresh_opt.state_dict()["state"][i][name], value), (i, name)
