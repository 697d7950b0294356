"""State-dict entries of a ``fully_shard`` model read as FSDP2's DTensor entries -- ``to_local()``,
``placements``, ``device_mesh``, ``full_tensor()`` -- and entries that outlive their model (Note
[entries read as DTensors] in fusedist/fsdp/dtensor_view.py), against torch's FSDP2 on the same
model and mesh, 2 gloo ranks in one launch. Tensor-parallel entries: tests/test_fully_shard_tensor_parallel.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


class _Net(nn.Module):
    """Odd sizes, so that the root unit's flat layout cuts ``a``/``b``/``d`` elsewhere than FSDP2's
    per-parameter chunks; ``d`` has one row (FSDP2 leaves rank 1 an empty chunk); ``c`` is alone
    in its unit and sharded on dim 1 (its piece *is* FSDP2's chunk: ``to_local()`` without a gather)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 4)
        self.c, self.d = nn.Linear(4, 6, bias=False), nn.Linear(6, 1)

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def _build(shard, seed: int, **kwargs):
    from torch.distributed.tensor import Shard

    torch.manual_seed(seed)
    model = _Net()
    shard(model.c, shard_placement_fn=lambda p: Shard(1), **kwargs)
    shard(model, **kwargs)
    return model


def _meshes(name: str):
    """(fusedist's fully_shard kwargs, FSDP2's) for a 1-D mesh, a process group, HSDP."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if name == "hsdp":
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        return dict(mesh=mesh), dict(mesh=mesh)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    return (dict(process_group=dist.group.WORLD) if name == "process_group" else dict(mesh=mesh)), dict(mesh=mesh)


def _step(model, seed: int, rank: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed + rank))
    model(x).square().mean().backward()
    opt.step()
    return opt


def _as_dtensor(entry) -> dict:
    """What code written for FSDP2 reads of an entry; the DTensor rebuilt from them made whole."""
    from torch.distributed.tensor import DTensor

    local = entry.to_local()
    mesh = entry.device_mesh
    rebuilt = DTensor.from_local(local, mesh, entry.placements, run_check=False, shape=entry.size(),
                                 stride=torch.empty(entry.size(), device="meta").stride())
    return dict(local=local.clone(), placements=repr(tuple(entry.placements)), mesh=mesh.mesh.tolist(),
                device=mesh.device_type, rebuilt=rebuilt.full_tensor(), full=entry.full_tensor())


def _compare(ours: dict, theirs: dict) -> dict:
    """Per key: shapes, the largest difference of each tensor read, and whether placements and
    mesh agree."""
    out = {}
    for k, t in theirs.items():
        o = ours[k]
        diffs = {n: float((o[n].float() - t[n].float()).abs().max()) if t[n].numel() else 0.0
                 for n in ("local", "rebuilt", "full")}
        out[k] = dict(shapes=(tuple(o["local"].shape), tuple(t["local"].shape)), diffs=diffs,
                      placements=(o["placements"], t["placements"]),
                      mesh=(o["mesh"], o["device"]) == (t["mesh"], t["device"]))
    return out


def _entries_as_fsdp2(rank: int, world: int, seed: int) -> dict:
    """Each mesh kind: ``model.state_dict()``'s entries cloned before a step (copies only: equal
    bit for bit) and the optimizer state's after it (fp32 AdamW over gradients reduced in another
    order: a few ulps), read as DTensors on both sides."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    out = {}
    for name in ("mesh", "process_group", "hsdp"):
        ours_kw, theirs_kw = _meshes(name)
        reads = []
        for shard, kw in ((fusedist.fully_shard, ours_kw), (torch_fully_shard, theirs_kw)):
            model = _build(shard, seed, **kw)
            kept = {k: v.clone() for k, v in model.state_dict().items()}
            opt = _step(model, seed, rank)
            state = get_optimizer_state_dict(model, opt)["state"]
            moments = {f"{k}.{n}": v for k, st in state.items() for n, v in st.items() if v.dim()}
            reads.append(({k: _as_dtensor(v) for k, v in kept.items()},
                          {k: _as_dtensor(v) for k, v in moments.items()}))
            if shard is fusedist.fully_shard:  # the one piece that is FSDP2's chunk: its own storage
                entry = model.state_dict()["c.weight"]
                out[f"{name} aliased"] = entry.to_local().data_ptr() == entry.local().data_ptr()
        out[name] = _compare(reads[0][0], reads[1][0])
        out[f"{name} optimizer"] = _compare(reads[0][1], reads[1][1])
    return out


def _entries_outlive_model(rank: int, world: int, seed: int) -> dict:
    """``sd = model.state_dict(); del model``: FSDP2's entries still answer everything (a DTensor
    holds its shard and mesh), and so must fusedist's, without keeping the model alive."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    reads, alive = [], []
    for shard in (fusedist.fully_shard, torch_fully_shard):
        model = _build(shard, seed, **_meshes("mesh")[0])
        sd = model.state_dict()
        alive.append(weakref.ref(model))
        del model
        gc.collect()
        reads.append({k: _as_dtensor(v) for k, v in sd.items()})
    return dict(freed=alive[0]() is None, compared=_compare(reads[0], reads[1]))


def _read_grad(g, fsdp2: bool) -> dict:
    """What code written for FSDP2 reads of a sharded gradient: placements, mesh, the whole
    gradient, this rank's shard (or, for ours, the refusal where the piece is not that shard)."""
    out = dict(placements=repr(tuple(g.placements)), mesh=(g.device_mesh.mesh.tolist(), g.device_mesh.device_type),
               full=g.full_tensor().clone())
    try:
        out["local"] = g.to_local().clone()
    except RuntimeError as e:
        if fsdp2:
            raise
        out["local"] = str(e)
    return out


def _grads_as_fsdp2(rank: int, world: int, seed: int) -> dict:
    """Each mesh kind: ``p.grad`` of every parameter read as FSDP2's DTensor gradient after a
    backward, after a second one accumulated into it, and after ``zero_grad()`` and a third
    (fresh gradients); a clone of a gradient, or a tensor assigned as ``.grad`` by the user, does
    not answer (as a plain tensor)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    out = {}
    for name in ("mesh", "process_group", "hsdp"):
        ours_kw, theirs_kw = _meshes(name)
        reads = []
        for shard, kw in ((fusedist.fully_shard, ours_kw), (torch_fully_shard, theirs_kw)):
            model = _build(shard, seed, **kw)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(seed + rank)
            seen = {}  # what a gradient hook reads (the optimizer-in-backward recipe's place)
            for n, p in model.named_parameters():
                p.register_post_accumulate_grad_hook(lambda q, n=n: seen.setdefault(n, repr(tuple(q.grad.placements))))
            read = [seen]
            for step in range(3):
                if step == 2:
                    opt.zero_grad()
                model(torch.randn(3, 5, generator=gen)).square().mean().backward()
                if step:
                    read.append({n: _read_grad(p.grad, shard is torch_fully_shard)
                                 for n, p in model.named_parameters()})
            reads.append(read)
            if shard is fusedist.fully_shard:
                p = model.c.weight  # the one piece that is FSDP2's chunk: to_local() is the gradient's storage
                out[f"{name} aliased"] = p.grad.to_local().data_ptr() == p.grad.data_ptr()
                out[f"{name} clone answers"] = hasattr(p.grad.clone(), "to_local")
                p.grad = torch.zeros_like(p)
                out[f"{name} assigned answers"] = hasattr(p.grad, "placements")
        out[f"{name} hooks"] = (reads[0][0], reads[1][0])
        for step in range(2):
            ours, theirs = reads[0][step + 1], reads[1][step + 1]
            out[f"{name} {step}"] = {
                k: dict(placements=(ours[k]["placements"], t["placements"]), mesh=ours[k]["mesh"] == t["mesh"],
                        full=float((ours[k]["full"] - t["full"]).abs().max()),
                        local=(ours[k]["local"] if isinstance(ours[k]["local"], str) else
                               float((ours[k]["local"] - t["local"]).abs().max())
                               if ours[k]["local"].shape == t["local"].shape else "shape"))
                for k, t in theirs.items()}
    return out


JOBS = {
    "test_entries_read_as_fsdp2_dtensors": {"entries": (_entries_as_fsdp2, (1234,))},
    "test_entries_outlive_their_model": {"outlive": (_entries_outlive_model, (4321,))},
    "test_grads_read_as_fsdp2_dtensor_grads": {"grads": (_grads_as_fsdp2, (2468,))},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, JOBS, 2, timeout=240)


def _check(compared: dict, what: str, tol: float) -> None:
    for key, c in compared.items():
        assert c["shapes"][0] == c["shapes"][1], (what, key, c)
        assert max(c["diffs"].values()) <= tol, (what, key, c)
        assert c["placements"][0] == c["placements"][1], (what, key, c)
        assert c["mesh"], (what, key, c)


def test_entries_read_as_fsdp2_dtensors(launched):
    """``to_local()`` is FSDP2's shard (shape and values, an empty chunk included), ``placements``
    and ``device_mesh`` are FSDP2's (``Replicate()`` first under HSDP, ``Shard(1)`` where
    ``shard_placement_fn`` says so), and a DTensor rebuilt from them is the whole parameter --
    on a 1-D mesh, a process group and an HSDP mesh."""
    for rank, out in enumerate(results_of(launched, "entries")):
        for name in ("mesh", "process_group", "hsdp"):
            _check(out[name], f"{name}, rank {rank}", 0.0)
            _check(out[f"{name} optimizer"], f"{name} optimizer, rank {rank}", 1e-6)  # fp32 moments: a few ulps
            assert out[f"{name} aliased"], (name, rank)
            assert out[name]["d.weight"]["shapes"][0] == ((1, 6) if rank == 0 else (0, 6))
        assert out["hsdp"]["a.weight"]["placements"][0] == "(Replicate(), Shard(dim=0))"
        assert out["mesh"]["c.weight"]["placements"][0] == "(Shard(dim=1),)"


def test_entries_outlive_their_model(launched):
    for rank, out in enumerate(results_of(launched, "outlive")):
        assert out["freed"], rank  # the entries do not keep the model alive
        _check(out["compared"], f"rank {rank}", 0.0)


def test_grads_read_as_fsdp2_dtensor_grads(launched):
    """``p.grad.placements`` / ``device_mesh`` are FSDP2's, ``p.grad.full_tensor()`` is FSDP2's
    whole gradient (fp32 sums of two ranks' gradients in another order: a few ulps of values
    ~1e-1), ``p.grad.to_local()`` FSDP2's shard where the piece is that shard (``c.weight``, dim-1
    sharded: the gradient's own storage) and a refusal naming the parameter elsewhere -- after an
    accumulation and after ``zero_grad()`` too, and in a gradient hook, on a 1-D mesh, a process
    group and an HSDP mesh."""
    for rank, out in enumerate(results_of(launched, "grads")):
        for name in ("mesh", "process_group", "hsdp"):
            for step in range(2):
                for key, c in out[f"{name} {step}"].items():
                    what = (name, step, key, rank, c)
                    assert c["placements"][0] == c["placements"][1] and c["mesh"], what
                    assert c["full"] <= 1e-6, what
                    if isinstance(c["local"], str):
                        assert key != "c.weight", what
                        assert f"p.grad.to_local() of parameter '{key}'" in c["local"], what
                    else:
                        assert c["local"] <= 1e-6, what
            assert out[f"{name} aliased"], (name, rank)
            hooks = out[f"{name} hooks"]
            assert hooks[0] == hooks[1] and len(hooks[0]) == 7, (name, rank, hooks)
            assert not out[f"{name} clone answers"] and not out[f"{name} assigned answers"], (name, rank)
        assert out["hsdp 0"]["a.weight"]["placements"][0] == "(Replicate(), Shard(dim=0))"
        assert out["mesh 1"]["c.weight"]["placements"][0] == "(Shard(dim=1),)"


def test_a_piece_made_outside_a_state_dict_names_itself():
    """A ShardedPiece not made by ``state_dict()`` knows no group to gather over: refused at
    once on the calling rank (no collective started), naming its region and shape."""
    from fusedist.fsdp.dcp import ShardedPiece

    piece = ShardedPiece.wrap(torch.zeros(2, 3), (4, 3), 6, 12)
    for read in (piece.full_tensor, piece.to_local):
        with pytest.raises(RuntimeError, match=r"elements \[6, 12\) of a parameter of shape \(4, 3\)"):
            read()
    with pytest.raises(AttributeError, match="was not made by a fully_shard model's state_dict"):
        piece.placements


def test_chunks_are_fsdp2s_at_any_world_size():
    """The chunk ``to_local()`` gives each rank is FSDP2's own (``_chunk_with_empty``: torch.chunk,
    then empty chunks past the last one -- 4 rows over 3 ranks are 2, 2 and 0), for any length and
    world size, not only those the 2-rank launch meets."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from fusedist.fsdp.dtensor_view import _chunk

    for n in range(10):
        for world in range(1, 6):
            theirs = _chunk_with_empty(torch.arange(n), world, dim=0)
            for rank in range(world):
                start, size = _chunk((n, 3), 0, world, rank)
                assert torch.equal(torch.arange(n)[start:start + size], theirs[rank]), (n, world, rank)
