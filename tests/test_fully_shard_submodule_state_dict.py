"""State dicts of a module *inside* a fully_shard unit (``model.blocks[0].mlp`` where
``model.blocks[0]`` was passed to ``fully_shard``, or ``model.head`` in the root's unit): its
``state_dict()`` / ``load_state_dict``, torch's ``get_model_state_dict`` /
``set_model_state_dict`` on it, and ``torch.distributed.checkpoint`` of its dict, against torch's
FSDP2 on the same model and wrapping (Note [state-dict hooks on every module of a unit] in
fusedist/fsdp/state_dict_hooks.py), world size 2 on gloo.

FSDP2's entries are DTensors; fusedist's are ``ShardedPiece`` entries, as at the unit level: this
rank's piece, whose ``size()`` is the whole parameter's. Loads are compared by the whole weights
right after the load (bitwise) and by the loss of a training step after it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusedist
from phased_launches import launch_phase
from shared_rank_launch import results_of

# a Sequential of two Linears inside a block unit, one Linear of it, and a Linear of the root's unit
TARGETS = ("blocks.0.mlp", "blocks.0.mlp.0", "head")


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.mlp(torch.tanh(self.attn(x)))


class Net(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _make(kind: str, seed: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = Net()
    if kind == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fusedist.fully_shard
    mesh = init_device_mesh("cpu", (2,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _plain(seed: int, path: str) -> dict:
    """The whole parameters of ``path`` in an unsharded model of ``seed``."""
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Net().get_submodule(path).state_dict().items()}


def _whole(model) -> dict:
    """Every weight of ``model`` whole (FSDP2: the DTensors' full tensors)."""
    sd = model.state_dict()
    if any(type(v).__name__ == "DTensor" for v in sd.values()):
        return {k: v.full_tensor().detach().clone() for k, v in sd.items()}
    return {k: v.clone() for k, v in fusedist.fsdp.full_state_dict(model).items()}


def _step_loss(model, rank: int) -> float:
    """The global loss of one SGD step (each rank its half of the batch); the weights after it
    are compared by the caller."""
    import torch.distributed as dist

    torch.manual_seed(5)
    x = torch.randn(4, 4)[2 * rank:2 * rank + 2]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item()


def _same(a: dict, b: dict, what) -> None:
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for k in a:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), (what, k)


# ------------------------------------------------------------------ taking the state dict
def _taken(rank, ws):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fusedist.fsdp.dcp import ShardedPiece

    ours, ref = _make("ours", 0), _make("torch", 0)
    whole = _whole(ref)
    for path in TARGETS:
        pre = path + "."
        expect = {k[len(pre):]: v for k, v in whole.items() if k.startswith(pre)}
        torch_sd = ref.get_submodule(path).state_dict()
        assert {k: v.full_tensor() for k, v in torch_sd.items()}.keys() == expect.keys()
        sub = ours.get_submodule(path)
        # sharded: the module's own state_dict(), torch's helper, and while the unit is gathered
        if path != "head":
            ours.blocks[0].unshard()
        for how, sd in (("state_dict", sub.state_dict()), ("get_model_state_dict", get_model_state_dict(sub))):
            assert sd.keys() == expect.keys(), (path, how, sorted(sd))
            for k, v in sd.items():
                assert isinstance(v, ShardedPiece), (path, how, k, type(v))
                assert v.size() == torch_sd[k].size(), (path, how, k)  # the whole parameter's, as FSDP2's
                lo, hi = v.element_range
                assert torch.equal(v.local().reshape(-1), expect[k].reshape(-1)[lo:hi]), (path, how, k)
        # full: whole parameters on every rank, or on rank 0 only with cpu_offload, as FSDP2's
        for cpu in (False, True):
            opts = StateDictOptions(full_state_dict=True, cpu_offload=cpu)
            got, theirs = get_model_state_dict(sub, options=opts), get_model_state_dict(ref.get_submodule(path),
                                                                                          options=opts)
            assert got.keys() == theirs.keys(), (path, cpu)
            if theirs:
                _same({k: v.detach() for k, v in got.items()}, expect, (path, cpu))
                assert all(v.device.type == "cpu" for v in got.values())
    # a round trip through a fresh model of another seed is bitwise
    for path in TARGETS:
        fresh = _make("ours", 1)
        fresh.get_submodule(path).load_state_dict(ours.get_submodule(path).state_dict())
        pre = path + "."
        after = _whole(fresh)
        _same({k: v for k, v in after.items() if k.startswith(pre)},
              {k: v for k, v in _whole(ours).items() if k.startswith(pre)}, ("round trip", path))
    return True


def test_submodule_state_dict_entries_match_fsdp2(launched):
    assert results_of(launched, "taken") == [True, True]


# ------------------------------------------------------------------ what a full state dict holds
def _tensors_in(obj, out: dict) -> dict:
    """Every tensor reachable from ``obj`` through dicts, sequences and attributes, by id."""
    if isinstance(obj, torch.Tensor):
        out[id(obj)] = obj
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors_in(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors_in(v, out)
    elif hasattr(obj, "__dict__"):
        _tensors_in(vars(obj), out)
    return out


def _held(rank, ws):
    import torch.distributed.checkpoint.state_dict as helpers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fusedist.fsdp import state_dict_hooks

    ours, ref = _make("ours", 0), _make("torch", 0)
    inner = helpers._maybe_full_or_cpu_state_dict
    seen = []

    def produced(state_dict, info):
        # the dict the modules' hooks filled, before torch copies it: what is kept whole for it
        held = _tensors_in(state_dict_hooks._GATHERED, {})
        seen.append((sum(t.nbytes for t in held.values()), sum(v.nbytes for v in state_dict.values()),
                     set(held) <= {id(v) for v in state_dict.values()}))
        return inner(state_dict, info)

    out = {}
    helpers._maybe_full_or_cpu_state_dict = produced
    try:
        for path in ("blocks.0.attn", "blocks.0.mlp.0", "head", ""):
            for cpu in (False, True):
                opts = StateDictOptions(full_state_dict=True, cpu_offload=cpu)
                got = get_model_state_dict(ours.get_submodule(path), options=opts)
                theirs = get_model_state_dict(ref.get_submodule(path), options=opts)
                assert got.keys() == theirs.keys(), (path, cpu)
                _same(got, theirs, (path, cpu))
                held, wanted, only_entries = seen[-2]  # (the last is FSDP2's call)
                out[path, cpu] = (held, wanted, only_entries, len(state_dict_hooks._GATHERED))
    finally:
        helpers._maybe_full_or_cpu_state_dict = inner
    return out


def test_full_state_dict_of_a_submodule_keeps_only_its_own_parameters_whole(launched):
    """``get_model_state_dict(block.attn, full_state_dict=True)``: the block is gathered, and
    only ``attn``'s parameters are kept whole -- the dict's own entries, no more -- once the
    dict is produced (Note [state-dict hooks on every module of a unit]); values as FSDP2's."""
    d = 8
    attn = (d * d + d) * 4
    block = attn + (2 * d * d + 2 * d + 2 * d * d + d) * 4
    for res in results_of(launched, "held"):
        for (path, cpu), (held, wanted, only_entries, left) in res.items():
            assert held == wanted and only_entries, (path, cpu, held, wanted)
            assert left == 0, (path, cpu)  # nothing kept once the helper returns
        assert res["blocks.0.attn", False][0] == attn < block


# ------------------------------------------------------------------ loading
def _loads(rank, ws):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    out = {}
    for path in TARGETS:
        full = _plain(1, path)
        weights_only = {k: v for k, v in full.items() if k.endswith("weight")}
        for how in ("set full", "set full partial", "set broadcast", "load_state_dict full"):
            sd = {k: v.clone() for k, v in (weights_only if "partial" in how else full).items()}
            if how == "set broadcast" and rank != 0:
                sd = {}
            results = {}
            for kind in ("ours", "torch"):
                model = _make(kind, 0)
                sub = model.get_submodule(path)
                given = {k: v.clone() for k, v in sd.items()}
                if how == "load_state_dict full" and kind == "torch":
                    # FSDP2 takes whole tensors through its helper only (DTensor parameters)
                    set_model_state_dict(sub, given, options=StateDictOptions(full_state_dict=True))
                elif how == "load_state_dict full":
                    assert sub.load_state_dict(given) is not None
                else:
                    opts = StateDictOptions(full_state_dict=True, strict="partial" not in how,
                                            broadcast_from_rank0=how == "set broadcast")
                    set_model_state_dict(sub, given, options=opts)
                weights = _whole(model)
                results[kind] = weights, _step_loss(model, rank), _whole(model)
            loaded, loss, stepped = results["ours"]
            _same(loaded, results["torch"][0], (path, how, "loaded"))
            pre = path + "."
            for k, v in (weights_only if "partial" in how else full).items():
                assert torch.equal(loaded[pre + k], v), (path, how, k)
            assert loss == results["torch"][1], (path, how, loss, results["torch"][1])
            _same(stepped, results["torch"][2], (path, how, "after a step"))
            out[path, how] = loss
    return out


def test_submodule_loads_match_fsdp2(launched):
    res = results_of(launched, "loads")
    assert res[0] == res[1]
    assert len(res[0]) == len(TARGETS) * 4


# ------------------------------------------------------------------ Distributed Checkpoint of one submodule
def _dcp(rank, ws, where):
    import torch.distributed.checkpoint as dcp

    for kind in ("ours", "torch"):
        src = _make(kind, 1)
        dcp.save({"mlp": src.blocks[0].mlp.state_dict()}, checkpoint_id=f"{where}/{kind}")
    saved = _plain(1, "blocks.0.mlp")
    for kind in ("ours", "torch"):
        for src in ("ours", "torch"):
            model = _make(kind, 0)
            sd = model.blocks[0].mlp.state_dict()
            dcp.load({"mlp": sd}, checkpoint_id=f"{where}/{src}")
            model.blocks[0].mlp.load_state_dict(sd)
            got = {k[len("blocks.0.mlp."):]: v for k, v in _whole(model).items() if k.startswith("blocks.0.mlp.")}
            _same(got, saved, (kind, src))
    return True


def test_submodule_dcp_save_load_interchanges_with_fsdp2(launched):
    assert results_of(launched, "dcp") == [True, True]


# ------------------------------------------------------------------ bad input
def _errors(rank, ws):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    out = []
    model = _make("ours", 0)
    sub = model.get_submodule("blocks.0.mlp")
    full = _plain(1, "blocks.0.mlp")
    before = _whole(model)
    bad = dict(full, **{"0.weight": torch.zeros(5, 8)})
    for call in (lambda: sub.load_state_dict(bad),
                 lambda: set_model_state_dict(sub, dict(bad), options=StateDictOptions(full_state_dict=True))):
        with pytest.raises(RuntimeError) as err:
            call()
        out.append(str(err.value))
    missing = {k: v for k, v in full.items() if k != "2.bias"}
    with pytest.raises(RuntimeError) as err:
        sub.load_state_dict(missing)
    out.append(str(err.value))
    # the missing key aside, the load took place, as torch's does
    assert torch.equal(_whole(model)["blocks.0.mlp.0.weight"], full["0.weight"])
    assert not torch.equal(before["blocks.0.mlp.0.weight"], full["0.weight"])
    return out


def test_submodule_bad_input_named_with_whole_shapes(launched):
    for wrong_shape, via_helper, missing in results_of(launched, "errors"):
        for msg in (wrong_shape, via_helper):
            # FSDP2's wording: the whole parameter's shape, not this rank's piece's
            assert ("size mismatch for 0.weight: copying a param with shape torch.Size([5, 8]) from checkpoint, "
                    "the shape in current model is torch.Size([16, 8])") in msg, msg
            assert msg.count("size mismatch") == 1, msg
        assert 'Missing key(s) in state_dict: "2.bias"' in missing, missing
        assert "size mismatch" not in missing, missing


# ------------------------------------------------------------------ one launch of the ranks
@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return launch_phase(request, {
        "test_submodule_state_dict_entries_match_fsdp2": {"taken": (_taken, ())},
        "test_full_state_dict_of_a_submodule_keeps_only_its_own_parameters_whole": {"held": (_held, ())},
        "test_submodule_loads_match_fsdp2": {"loads": (_loads, ())},
        "test_submodule_dcp_save_load_interchanges_with_fsdp2": {
            "dcp": (_dcp, (str(tmp_path_factory.mktemp("submodule-dcp")),))},
        "test_submodule_bad_input_named_with_whole_shapes": {"errors": (_errors, ())},
    }, 2, timeout=300)
