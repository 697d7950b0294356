"""fully_shard models with torch's Distributed Checkpoint (DCP) and its state-dict helpers
(Note [pieces in torch's distributed checkpoint] in fusedist/fsdp/dcp.py), against torch's
FSDP2 on the same model, on a CPU mesh with gloo.

Training: every step uses one global batch of 12 samples split evenly over the ranks (2 or 3)
and gradients are averaged, so a run is world-size independent up to summation order. A run
saved at 2 ranks after 2 steps, loaded into a freshly initialized model at 3 (or 2) and trained
2 more steps is compared with the uninterrupted 4-step run at 2 ranks: right after the load the
weights are equal bit for bit (a load copies values); after the steps exact at 2 ranks, and
within 1e-6 at 3 (the averaged gradient is a sum of 3 partial sums instead of 2, in fp32: last-bit
differences, ~1e-7 after 2 steps at these magnitudes; a wrong piece is off by ~0.1).
The model has a parameter a rank holds none of at 3 ranks (an empty piece) and a 0-dim one.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fusedist
from phased_launches import launch_phase
from shared_rank_launch import results_of
from test_fully_shard_checkpoint import _steps

TOL3 = 1e-6


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int = 16, scalar: bool = False):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 4)
        self.register_buffer("shift", torch.randn(4))
        self.gain = nn.Parameter(torch.tensor(1.25)) if scalar else None  # a 0-dim parameter

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        x = self.head(x) + self.shift
        return x * self.gain if self.gain is not None else x


def _mesh(ws):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ws,))


def _make(kind: str, ws: int, seed: int, scalar: bool = False):
    torch.manual_seed(seed)
    model = Net(scalar=scalar)
    if kind == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fusedist.fully_shard
    mesh = _mesh(ws)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model, opt, rank, ws, first, last):
    """Steps ``[first, last)`` on the global batches of the checkpoint tests (each rank its slice)."""
    _steps(model, opt, first, last, rank, ws)


def _full(model) -> dict:
    """Whole weights: fusedist's gather, or the DTensors' full tensors."""
    if any(type(v).__name__ == "DTensor" for v in model.state_dict().values()):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in model.state_dict().items()}
    return {k: v.clone() for k, v in fusedist.fsdp.full_state_dict(model).items()}


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    assert all(a[k].shape == b[k].shape for k in a), {k: (a[k].shape, b[k].shape) for k in a}
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)  # stateless: the weights are the whole state


# ------------------------------------------------------------------ dcp.save(model.state_dict())
def _save_models(rank, ws, ours_dir, torch_dir):
    """2 steps at ``ws`` ranks, fusedist's and torch's model saved with dcp; then 2 more steps."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for kind, where in (("ours", ours_dir), ("torch", torch_dir)):
        model = _make(kind, ws, 0)
        opt = _sgd(model)
        _train(model, opt, rank, ws, 0, 2)
        dcp.save({"model": model.state_dict()}, checkpoint_id=where)
        out[kind, 2] = _full(model)
        _train(model, opt, rank, ws, 2, 4)
        out[kind, 4] = _full(model)
    return out


def _load_models(rank, ws, ours_dir, torch_dir):
    """Fresh models at ``ws`` ranks (another seed) loaded from each checkpoint: their weights
    right after the load, and fusedist's after 2 more steps."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for kind in ("ours", "torch"):
        for src, where in (("ours", ours_dir), ("torch", torch_dir)):
            model = _make(kind, ws, 1)
            sd = model.state_dict()
            dcp.load({"model": sd}, checkpoint_id=where)
            model.load_state_dict(sd)
            out[kind, src] = _full(model)
            if kind == "ours" and src == "ours":
                _train(model, _sgd(model), rank, ws, 2, 4)
                out["continued"] = _full(model)
    out["empty pieces"] = sum(p.numel() == 0 for p in _make("ours", ws, 1).parameters())
    return out


@pytest.mark.parametrize("load_ws", [3, 2])
def test_dcp_save_at_2_load_resharded_matches_uninterrupted(request, load_ws):
    saved = results_of(_at(request, 2), "save models")[0]
    assert _diff(saved["ours", 2], saved["torch", 2]) == 0.0  # the same training at 2 ranks
    for res in results_of(_at(request, load_ws), "load models"):
        # every combination: fusedist's checkpoint into fusedist and into torch's FSDP2, and back
        for kind in ("ours", "torch"):
            for src in ("ours", "torch"):
                assert _diff(res[kind, src], saved[src, 2]) == 0.0, (kind, src)
        tol = 0.0 if load_ws == 2 else TOL3
        assert _diff(res["continued"], saved["ours", 4]) <= tol
    if load_ws == 3:
        assert res["empty pieces"] > 0  # the case where a rank holds none of a parameter


# ------------------------------------------------------------------ torch's state-dict helpers
def _helpers_save(rank, ws, where):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _make("ours", ws, 0, scalar=True)
    opt = _sgd(model)
    _train(model, opt, rank, ws, 0, 2)
    dcp.save(get_model_state_dict(model), checkpoint_id=where)
    at2 = _full(model)
    _train(model, opt, rank, ws, 2, 4)
    return at2, _full(model)


def _helpers_load(rank, ws, where, offload):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)

    model = _make("ours", ws, 1, scalar=True)
    sd = get_model_state_dict(model, options=StateDictOptions(cpu_offload=offload))
    dcp.load(sd, checkpoint_id=where)
    set_model_state_dict(model, sd)
    loaded = _full(model)
    _train(model, _sgd(model), rank, ws, 2, 4)
    return loaded, _full(model)


@pytest.mark.parametrize("load_ws", [3, 2])
def test_torch_helpers_sharded_round_trip(request, load_ws):
    at2, at4 = results_of(_at(request, 2), "helpers save")[0]
    for loaded, continued in results_of(_at(request, load_ws), "helpers load"):
        assert _diff(loaded, at2) == 0.0
        assert _diff(continued, at4) <= (0.0 if load_ws == 2 else TOL3)


def _full_helpers(rank, ws):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)

    out = {}
    ref, ours = _make("torch", ws, 0), _make("ours", ws, 0)
    for model in (ref, ours):
        _train(model, _sgd(model), rank, ws, 0, 1)
    whole = _full(ours)
    full = get_model_state_dict(ours, options=StateDictOptions(full_state_dict=True))
    out["full"] = _diff(full, whole)
    out["full vs torch"] = _diff(full, get_model_state_dict(ref, options=StateDictOptions(full_state_dict=True)))
    offloaded = get_model_state_dict(ours, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch_offloaded = get_model_state_dict(ref, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["offload keys"] = (sorted(offloaded), sorted(torch_offloaded))
    out["offload"] = _diff(offloaded, whole) if rank == 0 else None
    # ... and back: every rank passes the whole tensors, or rank 0 broadcasts them
    fresh = _make("ours", ws, 1)
    set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True))
    out["set full"] = _diff(_full(fresh), whole)
    fresh = _make("ours", ws, 1)
    set_model_state_dict(fresh, offloaded, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    out["set broadcast"] = _diff(_full(fresh), whole)
    # model.state_dict() is still the pieces: torch.save (weights_only load), deepcopy, load_state_dict
    sd = ours.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    plain = torch.load(buf, weights_only=True)
    out["pickled plain pieces"] = all(type(v) is torch.Tensor and v.shape == sd[k].shape and torch.equal(v, sd[k])
                                      for k, v in plain.items())
    copied = copy.deepcopy(sd)
    out["deepcopy"] = all(torch.equal(copied[k], sd[k]) and type(copied[k]) is type(sd[k])
                          and (copied[k].numel() == 0 or copied[k].data_ptr() != sd[k].data_ptr()) for k in sd)
    fresh = _make("ours", ws, 1)
    fresh.load_state_dict(plain)
    out["piece round trip"] = _diff(_full(fresh), whole)
    fresh = _make("ours", ws, 1)
    fresh.load_state_dict(whole)  # whole tensors are cut to this rank's rows
    out["load whole"] = _diff(_full(fresh), whole)
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_torch_helpers_full_state_dict(request, ws):
    for rank, res in enumerate(results_of(_at(request, ws), "full helpers")):
        ours_keys, torch_keys = res.pop("offload keys")
        assert ours_keys == torch_keys and (ours_keys != []) == (rank == 0)  # torch: rank 0 only with cpu_offload
        assert res.pop("pickled plain pieces") and res.pop("deepcopy")
        # torch's model took its step with its own 3-way gradient average: last-bit differences
        assert res.pop("full vs torch") <= (0.0 if ws == 2 else TOL3)
        for name, diff in res.items():
            assert diff in (None, 0.0), (rank, name, diff)


# ------------------------------------------------------------------ activation-checkpoint wrappers
def _wrapped(ws, seed, shard_blocks):
    """Net with every block in torch's ``checkpoint_wrapper``, whose state-dict hooks drop the
    ``_checkpoint_wrapped_module.`` segment from the keys (Note [state-dict hooks on every module
    of a unit] in fusedist/fsdp/state_dict_hooks.py): the wrappers sharded on their own, or inside the root's
    unit."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(seed)
    model = Net()
    mesh = _mesh(ws)
    for i, b in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(b)
        if shard_blocks:
            fusedist.fully_shard(model.blocks[i], mesh=mesh)
    fusedist.fully_shard(model, mesh=mesh)
    return model


def _wrapped_round_trip(rank, ws, where, shard_blocks):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)

    from fusedist.fsdp.dcp import ShardedPiece

    torch.manual_seed(0)
    reference = Net().state_dict()  # the same seed, unwrapped and whole
    model = _wrapped(ws, 0, shard_blocks)
    sd = model.state_dict()
    out = {"keys": sorted(sd) == sorted(reference),
           "pieces": sorted(k for k, v in sd.items() if not isinstance(v, ShardedPiece) and k != "shift")}
    dcp.save({"model": sd}, checkpoint_id=where)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["full"] = _diff(full, reference)
    fresh = _wrapped(ws, 1, shard_blocks)
    loaded = {"model": fresh.state_dict()}
    dcp.load(loaded, checkpoint_id=where)
    fresh.load_state_dict(loaded["model"])
    out["dcp round trip"] = _diff(get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True)),
                                  reference)
    fresh = _wrapped(ws, 1, shard_blocks)
    set_model_state_dict(fresh, dict(reference), options=StateDictOptions(full_state_dict=True))
    out["set full"] = _diff(get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True)), reference)
    return out


@pytest.mark.parametrize("shard_blocks", [True, False])
def test_checkpoint_wrapped_blocks_save_their_pieces(at_3, shard_blocks):
    """Every sharded parameter's entry is a piece under the key without the wrapper's segment,
    so DCP writes this rank's rows (a plain tensor would be written as replicated: one rank's
    rows as the whole parameter), and whole tensors under those keys load."""
    for rank, res in enumerate(results_of(at_3, f"wrapped round trip {shard_blocks}")):
        assert res.pop("keys") and res.pop("pieces") == [], (rank, res)
        for name, diff in res.items():
            assert diff == 0.0, (rank, name, diff)


# ------------------------------------------------------------------ the launches
def _at(request, ws: int) -> dict:
    """The scenarios' results at world ``ws`` (only the launches a selected test reads start)."""
    return request.getfixturevalue(f"at_{ws}")


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("dcp")
    return {name: str(base / name) for name in ("ours", "torch", "helpers", "wrapped-True", "wrapped-False")}


@pytest.fixture(scope="module")
def at_2(request, directories):
    """World 2: the saves, then the loads at the same world size (one launch)."""
    d = directories
    return launch_phase(request, {
        "test_dcp_save_at_2_load_resharded_matches_uninterrupted": {
            "save models": (_save_models, (d["ours"], d["torch"])),
            "load models": (_load_models, (d["ours"], d["torch"]))},
        "test_torch_helpers_sharded_round_trip": {
            "helpers save": (_helpers_save, (d["helpers"],)), "helpers load": (_helpers_load, (d["helpers"], False))},
        "test_torch_helpers_full_state_dict": {"full helpers": (_full_helpers, ())},
    }, 2, timeout=300)


@pytest.fixture(scope="module")
def at_3(request, directories, at_2):
    """World 3: the world-2 checkpoints resharded on load (after the world-2 launch), and more."""
    d = directories
    return launch_phase(request, {
        "test_dcp_save_at_2_load_resharded_matches_uninterrupted": {
            "load models": (_load_models, (d["ours"], d["torch"]))},
        "test_torch_helpers_sharded_round_trip": {"helpers load": (_helpers_load, (d["helpers"], True))},
        "test_torch_helpers_full_state_dict": {"full helpers": (_full_helpers, ())},
        "test_checkpoint_wrapped_blocks_save_their_pieces": {
            f"wrapped round trip {b}": (_wrapped_round_trip, (d[f"wrapped-{b}"], b)) for b in (True, False)},
    }, 3, timeout=300)
