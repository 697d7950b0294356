"""Less-travelled ``fully_shard`` paths against torch's FSDP2 in the same processes (2 gloo ranks):
a container without forward (``nn.ModuleList``) and ``load_state_dict(assign=True)`` into a
materialized or a meta-device model (Note [load_state_dict(assign=True)] in
fusedist/fsdp/state_dict_hooks.py).

Tolerance: the loads are copies (exact); the training steps after them run the same ops on the
same values with a two-rank average (exact in practice), so FP32_TOL = 2e-6; a load dropped
(the model's own initial weights) is off by more than 1e-2.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed

FP32_TOL = 2e-6


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin, self.norm = nn.Linear(d, d), nn.LayerNorm(d)
        self.register_buffer("scale", torch.rand(d) + 0.5)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x)) * self.scale) + x


class _Net(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.emb = nn.Linear(4, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(2))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _fully_shard(impl):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fusedist import fully_shard
    return fully_shard


def _module_list(rank, world):
    out = {}
    for impl in ("torch", "fusedist"):
        model = _Net()
        before = [id(p) for p in model.parameters()]
        try:
            _fully_shard(impl)(model.blocks)
            out[impl] = None
        except ValueError as e:
            out[impl] = str(e)
        out[impl + " unchanged"] = [id(p) for p in model.parameters()] == before
    return out


def test_module_list_is_refused_as_torch_refuses_it():
    for out in run_distributed(_module_list, 2, timeout=120):
        assert out["torch"] is not None and "do not implement forward" in out["torch"]
        assert out["fusedist"] is not None, "fusedist.fully_shard took an nn.ModuleList (its forward crashes later)"
        assert "do not implement forward" in out["fusedist"] and "ModuleList" in out["fusedist"]
        assert out["fusedist unchanged"], "the refusal came after the module changed"


def _module_list_in_a_list(rank, world):
    import fusedist

    out = []
    for members in (lambda m: [m.blocks], lambda m: [m.blocks, m.blocks[0]], lambda m: [m.emb, m.blocks]):
        model = _Net()
        before = [id(p) for p in model.parameters()]
        try:
            fusedist.fully_shard(members(model))
            out.append(None)
        except ValueError as e:
            out.append((str(e), [id(p) for p in model.parameters()] == before))
    return out


def test_module_list_as_the_outermost_member_of_a_list_is_refused_too():
    """A list unit whose outermost member is a container without forward was taken, and the
    modules inside then ran on this rank's pieces (a shape error, or a wrong result where the
    shapes fit)."""
    for out in run_distributed(_module_list_in_a_list, 2, timeout=120):
        for refused, item in zip(out, (0, 0, 1)):
            assert refused is not None, out
            message, unchanged = refused
            assert "do not implement forward" in message and f"item {item} of the list" in message, message
            assert unchanged


def _build(impl, seed, meta):
    torch.manual_seed(seed)
    with torch.device("meta") if meta else torch.device("cpu"):
        model = _Net()
    fully_shard = _fully_shard(impl)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def _assign(rank, world, seed, meta):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    full = StateDictOptions(full_state_dict=True)
    torch.manual_seed(seed + 100)
    loaded = _Net().state_dict()
    results = {}
    for impl in ("torch", "fusedist"):
        src = _build(impl, seed, meta=False)
        set_model_state_dict(src, copy.deepcopy(loaded), options=full)
        model = _build(impl, seed, meta=meta)
        model.load_state_dict(src.state_dict(), assign=True)  # DTensors / ShardedPieces
        after_load = get_model_state_dict(model, options=full)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            torch.manual_seed(seed + 10 * step + rank)
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        results[impl] = (after_load, get_model_state_dict(model, options=full))
    return loaded, results


@pytest.mark.parametrize("meta", [False, True], ids=["materialized", "meta"])
def test_load_state_dict_assign_loads_as_fsdp2(meta):
    seed = random.randrange(1 << 20)
    for loaded, res in run_distributed(_assign, 2, seed, meta, timeout=240):
        for key, value in loaded.items():
            for impl in ("torch", "fusedist"):
                torch.testing.assert_close(res[impl][0][key], value, rtol=0, atol=0,
                                           msg=lambda m: f"seed {seed}, {impl} after the load, {key}: {m}")
            torch.testing.assert_close(res["fusedist"][1][key], res["torch"][1][key], rtol=FP32_TOL, atol=FP32_TOL,
                                       msg=lambda m: f"seed {seed}, after 2 steps, {key}: {m}")
