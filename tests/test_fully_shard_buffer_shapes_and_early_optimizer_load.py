"""State dicts of fully_shard models against torch, world size 2 on gloo.

``fusedist.fsdp.load_full_state_dict`` against torch's ``load_state_dict`` on the same unsharded
model: a tensor outside the units (a buffer) loaded with the wrong shape must be refused as torch
refuses it ("size mismatch"), not broadcast into the buffer by ``copy_``: a (1,) entry would
fill every element of a (10,) buffer silently, and so would a 0-dim one.

``optimizer.load_state_dict`` on a fresh optimizer over the pieces (before its first step, so
before fusedist's optimizer state-dict hooks exist: Note [state loaded before the hooks] in
fusedist/fsdp/optim_state.py) with torch FSDP2's optimizer state dict (DTensor state) or with
whole state tensors: the run must continue as the FSDP2 run it was taken from (2 more AdamW
steps, within 1e-5; a lost or wrong moment is off by ~lr = 1e-2). The dicts are deep copies:
torch's ``load_state_dict`` keeps the loaded ``step`` tensor itself, which both runs would step.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedist
from fusedist.testing import run_distributed


class Net(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.block = nn.Sequential(nn.Linear(d, 2 * d + 1), nn.Tanh(), nn.Linear(2 * d + 1, d))
        self.head = nn.Linear(d, 3)
        self.register_buffer("scale", torch.randn(10))
        self.register_buffer("tmp", torch.randn(3), persistent=False)

    def forward(self, x):
        return self.head(self.block(self.inp(x))) * self.scale[:3]


def _sharded(seed: int, shard=None) -> Net:
    torch.manual_seed(seed)
    model = Net()
    shard = shard or fusedist.fully_shard
    shard(model.block)
    shard(model)
    return model


def _steps(model, opt, first, last, rank, ws):
    for step in range(first, last):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
        per = 8 // ws
        F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


def _whole(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _wrong_buffer_shape(rank, ws, key, shape):
    from fusedist.fsdp import full_state_dict, load_full_state_dict

    model = _sharded(0)
    src = full_state_dict(_sharded(1))
    before = full_state_dict(model)
    bad = dict(src)
    bad[key] = torch.randn(shape)
    torch_error = None
    try:
        Net().load_state_dict(bad)
    except RuntimeError as e:
        torch_error = str(e)
    assert torch_error is not None and "size mismatch" in torch_error
    with pytest.raises(ValueError, match=re.escape(f"'{key}' has shape {tuple(shape)}")):
        load_full_state_dict(model, bad)
    assert torch.equal(full_state_dict(model)[key], before[key])
    load_full_state_dict(model, src)  # the right shapes load, every entry whole
    after = full_state_dict(model)
    assert all(torch.equal(after[k], src[k]) for k in src)


@pytest.mark.parametrize("shape", [(1,), ()], ids=["one-element", "0-dim"])
def test_load_full_state_dict_refuses_a_buffer_of_another_shape(shape):
    run_distributed(_wrong_buffer_shape, 2, "scale", shape)


def _optimizer_load_before_first_step(rank, ws, whole_state):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    ref = _sharded(0, fully_shard)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _steps(ref, ref_opt, 0, 2, rank, ws)
    model_sd, opt_sd = copy.deepcopy(ref.state_dict()), copy.deepcopy(ref_opt.state_dict())
    assert any(isinstance(v, DTensor) for st in opt_sd["state"].values() for v in st.values())
    if whole_state:
        opt_sd["state"] = {k: {n: v.full_tensor() if isinstance(v, DTensor) else v for n, v in st.items()}
                           for k, st in opt_sd["state"].items()}
    model = _sharded(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.load_state_dict(model_sd)
    opt.load_state_dict(opt_sd)
    _steps(ref, ref_opt, 2, 4, rank, ws)
    _steps(model, opt, 2, 4, rank, ws)
    want, got = _whole(ref), _whole(model)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)


@pytest.mark.parametrize("whole_state", [False, True], ids=["dtensor-state", "whole-state"])
def test_optimizer_load_state_dict_before_first_step_continues_as_fsdp2(whole_state):
    run_distributed(_optimizer_load_before_first_step, 2, whole_state)
