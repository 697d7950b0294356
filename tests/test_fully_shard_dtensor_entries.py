"""State-dict entries of a ``fully_shard`` model read as FSDP2's DTensor entries -- ``to_local()``,
``placements``, ``device_mesh``, ``full_tensor()`` -- and entries that outlive their model (Note
[entries read as DTensors] in fusedist/fsdp/dtensor_view.py), against torch's FSDP2 on the same
model and mesh, 2 gloo ranks in one launch. Tensor-parallel entries: tests/test_fully_shard_tensor_parallel.py.
Sharing that launch: the pieces' gradients answer FSDP2's names as a tensor subclass, not through
``torch.Tensor`` (Note [gradients read as DTensors] in fusedist/fsdp/grad_view.py); a group unit's
parameters named from the root; the root's tree compared by a fingerprint (Note [the tree's
fingerprint] in tree_names.py); a module inside a gathered unit called on its own, resharded before
its backward (Note [a unit's module called on its own while gathered] in child_calls.py), and refused
before the root's first forward (Note [a unit's module called on its own before its root's first forward]).
"""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
from torch import nn

import fusedist
import models
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


_NAMES = ("placements", "device_mesh", "full_tensor", "to_local")


class _Net3(nn.Module):
    """Odd sizes: the root unit's flat layout cuts ``a``/``b`` elsewhere than FSDP2's chunks."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 7), nn.Linear(7, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _whole(model) -> dict:
    from fusedist.fsdp import full_state_dict

    return {k: v.clone() for k, v in full_state_dict(model).items()}


def _train(shard, seed: int, rank: int, foreach: bool, **kw):
    """Two AdamW steps with torch's clip (a small max norm: it clips) on ``shard``'s model."""
    torch.manual_seed(seed)
    model = _Net3()
    shard(model.b, **kw)
    shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    gen = torch.Generator().manual_seed(seed + rank)
    norms = []
    for _ in range(2):
        model(torch.randn(4, 5, generator=gen)).square().mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    return model, opt, norms


def _grads_are_local(rank: int, world: int, seed: int, where: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from torch.utils._foreach_utils import _has_foreach_support

    import fusedist

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for foreach in (True, False):
        ours, opt, norms = _train(fusedist.fully_shard, seed, rank, foreach)
        theirs, _, their_norms = _train(torch_fully_shard, seed, rank, foreach, mesh=mesh)
        whole = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
        out[f"foreach={foreach}"] = (max(float((v - whole[k]).abs().max()) for k, v in _whole(ours).items()),
                                     max(abs(a - b) for a, b in zip(norms, their_norms)))
    ours(torch.randn(2, 5)).sum().backward()
    grad = ours.a.weight.grad
    out["grad"] = (type(grad).__name__, all(hasattr(grad, n) for n in _NAMES),
                   type(grad * 2) is torch.Tensor, not hasattr(grad.clone(), "to_local"),
                   _has_foreach_support([grad], grad.device))  # (torch's clip scales it with a foreach kernel)
    buffer = io.BytesIO()
    torch.save({"g": grad}, buffer)
    buffer.seek(0)
    saved, copied = torch.load(buffer, weights_only=True)["g"], copy.deepcopy(grad)
    out["copies"] = [(type(t) is torch.Tensor, torch.equal(t, grad)) for t in (saved, copied)]
    out["torch.Tensor"] = [n for n in _NAMES if n in vars(torch.Tensor) or hasattr(torch.Tensor, n)]
    out["plain"] = [n for n in _NAMES if hasattr(torch.zeros(2), n)]
    out["params"] = _params_as_subclass(ours, rank)
    # torch's distributed checkpoint: save with gradients held, load into a fresh model and optimizer
    dcp.save({"model": get_model_state_dict(ours), "optim": get_optimizer_state_dict(ours, opt)},
             checkpoint_id=where)
    fresh, fresh_opt, _ = _train(fusedist.fully_shard, seed + 1, rank, True)
    sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=where)
    set_model_state_dict(fresh, sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
    mine = _whole(ours)
    out["dcp"] = max(float((v - mine[k]).abs().max()) for k, v in _whole(fresh).items())
    return out


def _params_as_subclass(model, rank: int) -> dict:
    """The pieces answer FSDP2's names as an ``nn.Parameter`` subclass: ``nn.Parameter`` gains nothing
    (a plain parameter of any model answers none of the names), a piece prints, saves and copies as a
    plain parameter, stays a foreach type for torch.optim, and a piece ``to_empty`` replaced (a model
    built on the meta device) is one too."""
    from torch.optim.optimizer import _foreach_supported_types

    import fusedist

    p = model.a.weight
    out = {"type": (type(p).__name__, isinstance(p, nn.Parameter), all(hasattr(p, n) for n in _NAMES),
                    type(p) in _foreach_supported_types),
           "nn.Parameter": [n for n in vars(nn.Parameter) if n in _NAMES or "fusedist" in n]
           + [n for n in _NAMES if hasattr(nn.Parameter(torch.zeros(2)), n) or hasattr(nn.Linear(2, 2).weight, n)],
           "repr": (repr(p) == "Parameter containing:\n" + repr(p.detach())[:-1] + ", requires_grad=True)",
                    repr(p.grad) == repr(p.grad.detach()))}
    buffer = io.BytesIO()
    torch.save(p, buffer)
    buffer.seek(0)
    saved, copied = torch.load(buffer, weights_only=True), copy.deepcopy(p)
    out["copies"] = [(isinstance(t, nn.Parameter), torch.equal(t, p)) for t in (saved, copied)]
    with torch.device("meta"):
        meta = _Net3()
    fusedist.fully_shard(meta.b)
    fusedist.fully_shard(meta)
    meta.to_empty(device="cpu")
    out["to_empty"] = sorted({(type(q).__name__, hasattr(q, "placements")) for q in meta.parameters()})
    return out


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.lin(x))


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _tree_fingerprint(rank: int, world: int, seed: int) -> dict:
    """Unit paths after each change of the tree, and how many full comparisons ran."""
    import fusedist
    from fusedist.fsdp.state import state_of

    torch.manual_seed(seed)
    model = _Stack()
    blocks = list(model.layers)
    for block in blocks:
        fusedist.fully_shard(block)
    fusedist.fully_shard(model)
    x = torch.randn(2, 4)

    def seen() -> tuple:
        names = {id(m): n for n, m in model.named_modules()}
        ok = all(state_of(b).unit.path == names.get(id(b), state_of(b).unit.path) for b in blocks)
        return ok, [state_of(b).unit.path for b in blocks], state_of(model).ctx.tree.full_compares

    out = {}
    for _ in range(3):
        model(x).sum().backward()
    out["unchanged"] = seen()
    model.layers.insert(0, nn.Identity())  # (no hook sees it: the dict's length does)
    model(x).sum().backward()
    out["insert"] = seen()
    del model.layers[0]
    model(x).sum().backward()
    out["del"] = seen()
    model.layers[1] = model.layers[1]  # (a registration: the hook counts it, the full comparison finds no change)
    model(x).sum().backward()
    out["same"] = seen()
    d = model.layers._modules  # same length, no hook: on the way to sharded modules, seen by the spine
    d["0"], d["1"] = d["1"], d["0"]
    model(x).sum().backward()
    out["swap forward"] = seen()
    model.check_consistency()
    out["swap checked"] = seen()
    blocks[0].__dict__["_modules"] = dict(blocks[0]._modules)  # a watched dict replaced by a copy: watched again
    for _ in range(2):
        model(x).sum().backward()
    out["copied"] = seen()
    return out


def _replaced_refused(rank: int, world: int, seed: int) -> dict:
    """A module the units hold replaced after the first forward -- by assignment (a block given to
    fully_shard, the ModuleList holding them, a Linear inside a block), by a direct write of
    ``_modules`` under its key, or by a block's whole ``_modules`` replaced -- refused at the next forward;
    each put back, the model trains on and computes as the unsharded one."""
    import fusedist

    torch.manual_seed(seed)
    ref = _Stack()
    torch.manual_seed(seed)
    model = _Stack()
    for block in model.layers:
        fusedist.fully_shard(block)
    fusedist.fully_shard(model)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed + rank))
    model(x).sum().backward()
    layers, blocks = model.layers, list(model.layers)
    lin1, lin2 = blocks[1].lin, blocks[2].lin
    saved0, act0 = blocks[0]._modules, blocks[0].act

    def copy_then_write() -> None:
        blocks[1].__dict__["_modules"] = dict(blocks[1]._modules)  # the same modules: trains on
        model(x).sum().backward()
        blocks[1]._modules["lin"] = nn.Linear(4, 4)  # (into the copy)

    def refused(replace, restore) -> str:
        model(x).sum().backward()  # (the tree as last seen: an earlier restore's registration is not this one's)
        replace()
        try:
            model(x).sum().backward()
            message = ""
        except RuntimeError as e:
            message = str(e)
        restore()
        return message

    out = {
        "block": refused(lambda: layers.__setitem__(1, _Block()), lambda: layers.__setitem__(1, blocks[1])),
        "direct": refused(lambda: layers._modules.__setitem__("2", _Block()),
                          lambda: layers._modules.__setitem__("2", blocks[2])),
        "list": refused(lambda: setattr(model, "layers", nn.ModuleList([_Block() for _ in range(3)])),
                        lambda: setattr(model, "layers", layers)),
        "inner": refused(lambda: setattr(blocks[0], "lin", nn.Linear(4, 4)),
                         lambda: setattr(blocks[0], "lin", blocks[0]._fs_state().unit.registrations[0][0][0])),
        # (inside a unit, no registration: the spine reaches the modules holding the unit's parameters)
        "inner direct": refused(lambda: blocks[1]._modules.__setitem__("lin", nn.Linear(4, 4)),
                                lambda: blocks[1]._modules.__setitem__("lin", lin1)),
        "inner shares": refused(lambda: blocks[2]._modules.__setitem__("lin", _sharing(blocks[2].lin)),
                                lambda: blocks[2]._modules.__setitem__("lin", lin2)),
        # a block's whole ``_modules`` dict replaced: no length changes, no write counted
        "inner whole": refused(lambda: setattr(blocks[0], "_modules", {"lin": nn.Linear(4, 4), "act": act0}),
                               lambda: blocks[0].__dict__.__setitem__("_modules", saved0)),
        "inner copy then direct": refused(copy_then_write, lambda: blocks[1]._modules.__setitem__("lin", lin1)),
    }
    y = model(x)
    y.sum().backward()  # (a training step after the refusals)
    out["restored"] = float((y - ref(x)).detach().abs().max())
    # a module holding none of the unit's parameters, replaced directly: followed, as in the unsharded model
    blocks[1]._modules["act"] = ref.layers[1]._modules["act"] = nn.GELU()
    y = model(x)
    y.sum().backward()
    out["act followed"] = float((y - ref(x)).detach().abs().max())
    return out


def _sharing(lin):
    """A new Linear holding ``lin``'s parameters (pieces of a unit)."""
    new = nn.Linear(4, 4)
    new.weight, new.bias = lin.weight, lin.bias
    return new


def _group_names(rank: int, world: int, seed: int) -> dict:
    """Every parameter of a group unit named from the root, as ``named_parameters()`` (and FSDP2)."""
    import fusedist
    from fusedist.fsdp.owners import owner_of
    from fusedist.fsdp.tree_names import param_path

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 5), nn.Tanh()), nn.Linear(5, 2))
    fusedist.fully_shard([net[1], net[2]])
    fusedist.fully_shard(net)
    net(torch.randn(3, 4)).sum().backward()
    out = {"paths": [(n, param_path(*owner_of(p))) for n, p in net.named_parameters()], "messages": []}
    for n, p in net.named_parameters():
        for what in (p, p.grad):
            try:
                what.to_local()
            except RuntimeError as e:
                out["messages"].append((n, str(e)))
    return out


def _build_chain():
    return nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 5)),
                         nn.Linear(5, 2))


def _child_alone_while_gathered(rank: int, world: int, seed: int) -> dict:
    """A gathered unit's module called on its own under grad, the unit resharded before that
    call's backward: the input's gradient and the stepped parameters against the unsharded model
    (the ranks' inputs differ: the mean of their gradients)."""
    import fusedist

    torch.manual_seed(seed)
    ref = _build_chain()
    torch.manual_seed(seed)
    net = _build_chain()
    fusedist.fully_shard(net[1], reshard_after_forward=False)
    fusedist.fully_shard(net)
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    xs = [torch.randn(3, 6, generator=torch.Generator().manual_seed(seed + r)) for r in range(world)]
    with torch.no_grad():
        net(torch.randn(3, 4))  # an evaluation forward: net[1] stays gathered
    x = xs[rank].clone().requires_grad_(True)
    loss = net[1][0](x).square().sum()
    net[1].reshard()
    loss.backward()
    opt.step()
    ref_grads = []
    for r, xr in enumerate(xs):
        xr = xr.clone().requires_grad_(True)
        ref[1][0](xr).square().sum().backward()
        ref_grads.append(xr.grad)
    for p in ref.parameters():
        if p.grad is not None:
            p.grad /= world
    ref_opt.step()
    whole, mine = ref.state_dict(), _whole(net)
    return {"x grad": float((x.grad - ref_grads[rank]).abs().max()),
            "params": max(float((v - whole[k]).abs().max()) for k, v in mine.items()),
            "resharded": not net[1]._fs_state().unit.is_unsharded}


def _child_alone_before_root_forward(rank: int, world: int, seed: int) -> dict:
    """A module of a unit gathered by ``unshard()`` before the root's first forward, called on its own:
    refused under grad, naming itself; under ``no_grad`` the unsharded module's output; then a training
    step of the whole model as the unsharded model's (the mean of the ranks' gradients)."""
    import fusedist

    torch.manual_seed(seed)
    ref = _build_chain()
    torch.manual_seed(seed)
    net = _build_chain()
    fusedist.fully_shard(net[1])
    fusedist.fully_shard(net)
    net[1].unshard()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed + rank))
    out = {"refused": None}
    try:
        net[1][0](x.clone().requires_grad_(True)).sum()
    except RuntimeError as e:
        out["refused"] = str(e)
    with torch.no_grad():
        out["no_grad"] = float((net[1][0](x) - ref[1][0](x)).abs().max())
    net[1].reshard()
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + 10 + r)) for r in range(world)]
    net(xs[rank]).square().sum().backward()
    opt.step()
    for xr in xs:
        ref(xr).square().sum().backward()
    for p in ref.parameters():
        p.grad /= world
    ref_opt.step()
    whole, mine = ref.state_dict(), _whole(net)
    out["params"] = max(float((v - whole[k]).abs().max()) for k, v in mine.items())
    return out


JOBS = {
    "test_entries_read_as_fsdp2_dtensors": {"entries": (_entries_as_fsdp2, (1234,))},
    "test_entries_outlive_their_model": {"outlive": (_entries_outlive_model, (4321,))},
    "test_grads_read_as_fsdp2_dtensor_grads": {"grads": (_grads_as_fsdp2, (2468,))},
    "test_tree_compared_by_fingerprint": {"tree": (_tree_fingerprint, (97,))},
    "test_replaced_sharded_submodule_refused_at_next_forward": {"replaced": (_replaced_refused, (23,))},
    "test_group_unit_parameters_named_from_the_root": {"group": (_group_names, (11,))},
    "test_module_called_alone_while_gathered_then_resharded": {"alone": (_child_alone_while_gathered, (5,))},
    "test_module_called_alone_before_the_root_forward_is_refused": {
        "alone early": (_child_alone_before_root_forward, (6,))},
}


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    where = str(tmp_path_factory.mktemp("ck"))  # (torch DCP's checkpoint of the gradients' scenario)
    jobs = dict(JOBS, test_grads_answer_as_a_subclass_and_train_as_fsdp2={"grads local": (_grads_are_local,
                                                                                           (1357, where))},
                test_a_block_removed_after_the_first_forward_trains_as_fsdp2={
                    "block_removed": (_block_removed, (str(tmp_path_factory.mktemp("removed_block_ckpt")),))},
                test_a_gradient_before_the_first_forward_is_refused_by_name={
                    "grad_first": (_grad_before_forward, ())})
    return launch_for_selected(request, jobs, 2, timeout=240)


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


def test_grads_answer_as_a_subclass_and_train_as_fsdp2(launched):
    """No name is added to ``torch.Tensor`` or ``nn.Parameter``: a piece is a ``ShardParam`` and its
    ``.grad`` a ``ShardGrad`` that answer the four names and print as plain ones, ops on them give
    plain tensors; AdamW (foreach and not) with torch's clip trains as
    FSDP2 (fp32, sums in another order: a few ulps of values ~1e-1); torch DCP round-trips."""
    for rank, out in enumerate(results_of(launched, "grads local")):
        for foreach in (True, False):
            params, norms = out[f"foreach={foreach}"]
            assert params <= 1e-5 and norms <= 1e-5, (rank, foreach, params, norms)
        assert out["grad"] == ("ShardGrad", True, True, True, True), (rank, out["grad"])
        assert out["torch.Tensor"] == [] and out["plain"] == [], (rank, out)
        assert out["copies"] == [(True, True), (True, True)], (rank, out["copies"])  # torch.save, deepcopy: plain
        params = out["params"]
        assert params["type"] == ("ShardParam", True, True, True), (rank, params)
        assert params["nn.Parameter"] == [] and all(params["repr"]), (rank, params)
        assert params["copies"] == [(True, True), (True, True)], (rank, params)
        assert params["to_empty"] == [("ShardParam", True)], (rank, params)
        assert out["dcp"] == 0.0, rank


def test_tree_compared_by_fingerprint(launched):
    """Forwards over an unchanged tree run no full comparison; an insert, a delete, an assignment
    (torch's registration hook) and a same-length direct write of the dict on the way to sharded
    modules (the spine) are followed at the next forward; a block's ``_modules`` replaced by a copy is
    compared in full once, its copy then watched."""
    for rank, out in enumerate(results_of(launched, "tree")):
        assert out["unchanged"] == (True, ["layers.0", "layers.1", "layers.2"], 0), (rank, out)
        assert out["insert"] == (True, ["layers.1", "layers.2", "layers.3"], 1), (rank, out)
        assert out["del"] == (True, ["layers.0", "layers.1", "layers.2"], 2), (rank, out)
        assert out["same"] == (True, ["layers.0", "layers.1", "layers.2"], 3), (rank, out)
        assert out["swap forward"] == (True, ["layers.1", "layers.0", "layers.2"], 4), (rank, out)
        assert out["swap checked"] == (True, ["layers.1", "layers.0", "layers.2"], 5), (rank, out)
        assert out["copied"] == (True, ["layers.1", "layers.0", "layers.2"], 6), (rank, out)


def test_replaced_sharded_submodule_refused_at_next_forward(launched):
    """A block given to fully_shard replaced by assignment or by a direct ``_modules`` write under its key,
    the ModuleList holding the blocks replaced, a block's Linear replaced (by assignment, or by a direct write:
    a new Linear, or one holding the unit's pieces, which failed on a shard-sized weight; the block's whole
    ``_modules`` dict replaced, or replaced by a copy and then written): the next forward is
    refused on every rank naming the place (FSDP2 trains on silently, the new parameters unsharded and
    unreduced); put back, the model's output is the unsharded model's (fp32, the same weights and ops: 1e-6).
    A block's activation (no parameters) replaced directly is followed: the output is the unsharded model's."""
    for rank, out in enumerate(results_of(launched, "replaced")):
        for key, place, cls in (("block", "layers.1", "_Block"), ("direct", "layers.2", "_Block"),
                                ("list", "layers", "ModuleList"), ("inner", "layers.0.lin", "Linear"),
                                ("inner direct", "layers.1.lin", "Linear"), ("inner shares", "layers.2.lin", "Linear"),
                                ("inner whole", "layers.0.lin", "Linear"),
                                ("inner copy then direct", "layers.1.lin", "Linear")):
            message = out[key]
            assert f"submodule '{place}' ({cls}) was replaced by a new {cls}" in message, (rank, key, message)
        assert out["restored"] <= 1e-6, (rank, out)
        assert out["act followed"] <= 1e-6, (rank, out)


def test_group_unit_parameters_named_from_the_root(launched):
    """``fully_shard([net[1], net[2]])``: its parameters are ``1.0.weight`` ... in messages (were
    ``[1, 2].[0].0.weight``), as ``named_parameters()`` names them."""
    for rank, out in enumerate(results_of(launched, "group")):
        assert all(name == path for name, path in out["paths"]), (rank, out["paths"])
        assert out["messages"], rank
        for name, message in out["messages"]:
            assert f"of parameter '{name}'" in message and "[" not in message.split("(shape")[0], (rank, message)


def test_module_called_alone_while_gathered_then_resharded(launched):
    """The call's backward gathers the unit again (it read freed storage: "setStorage ... size 0",
    as FSDP2's does): the input's gradient and the stepped parameters are the unsharded model's
    (fp32, a mean of 2 in another order: 1e-6), and the unit is resharded after."""
    for rank, out in enumerate(results_of(launched, "alone")):
        assert isinstance(out, dict), (rank, out)
        assert out["x grad"] <= 1e-6 and out["params"] <= 1e-6 and out["resharded"], (rank, out)


def test_module_called_alone_before_the_root_forward_is_refused(launched):
    """A unit gathered by ``unshard()`` before its root's first forward: a module of it called on its own
    under grad is refused at the call on every rank, naming the module (it failed in its backward,
    "setStorage ... storage of size 0" once resharded as FSDP2's, else on the missing iteration); under
    ``no_grad`` it is the unsharded module (same weights and op: exact); the model then trains as the
    unsharded one (fp32, a mean of 2 in another order: 1e-6)."""
    for rank, out in enumerate(results_of(launched, "alone early")):
        message = out["refused"]
        assert message and "module '<Sequential>.0' (Linear)" in message, (rank, message)
        assert "before the model's first forward" in message and "torch.no_grad()" in message, (rank, message)
        assert out["no_grad"] == 0.0 and out["params"] <= 1e-6, (rank, out)


# A unit that leaves the model or is used oddly:
# fully_shard where a unit leaves the model or is used oddly, against torch's FSDP2 (gloo, 2 ranks).
# 
# A sharded block deleted after the first forward (``del model.blocks[1]``) trains as FSDP2 and the
# unsharded model without the block do, its pieces staying in the optimizer (no gradients: not
# stepped), the model's state dict round-trips, and the block frees what it held gathered at the
# next forward (Note [a sharded unit removed] in fusedist/fsdp/tree_names.py). A gathered
# parameter used directly under grad before the first forward is refused by name (Note [a gradient
# before the first forward] in fusedist/fsdp/early_grad.py), where it used to fail with an
# AttributeError from inside the autograd hook.


def _rm_sharded(shard, mesh, base):
    model = copy.deepcopy(base)
    for b in model.blocks:
        shard(b, mesh=mesh, reshard_after_forward=False)  # an evaluation forward leaves them gathered
    shard(model, mesh=mesh)
    return model


def _rm_full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rm_train(model, opt, batches):
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _block_removed(rank, ws, ckpt):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fusedist.fsdp.state import state_of

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(11)  # every rank builds the same model
    base = models.BlockStack(blocks=3)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    batches = [(torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(3)]
    out = {}
    for who, shard in [("torch", fully_shard), ("fusedist", fusedist.fully_shard)]:
        model = _rm_sharded(shard, mesh, base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        _rm_train(model, opt, batches[:1])
        with torch.no_grad():
            model(batches[0][0])  # the blocks stay gathered (reshard_after_forward=False)
        removed = model.blocks[1]
        del model.blocks[1]
        with torch.no_grad():  # an evaluation forward: the removed block is neither run nor prefetched
            out[who + "_eval"] = model(batches[0][0])
        if who == "fusedist":
            out["removed_gathered"] = state_of(removed).unit._gathered_bytes
        _rm_train(model, opt, batches[1:])
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}  # (its entries alias the shards)
        out[who] = {k: _rm_full(v).detach().clone() for k, v in sd.items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model.load_state_dict(sd)
        out[who + "_reloaded"] = {k: _rm_full(v).detach().clone() for k, v in model.state_dict().items()}
        if who == "fusedist":  # torch's distributed checkpoint, saved and loaded back
            import torch.distributed.checkpoint as dcp

            dcp.save(model.state_dict(), checkpoint_id=ckpt)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            sd = model.state_dict()
            dcp.load(sd, checkpoint_id=ckpt)
            model.load_state_dict(sd)
            out["dcp_reloaded"] = {k: _rm_full(v).detach().clone() for k, v in model.state_dict().items()}
            out["full"] = {k: v.clone() for k, v in fusedist.fsdp.full_state_dict(model).items()}
        torch.manual_seed(5)
        x = torch.randn(4, 5)
        out[who + "_after"] = model(x).detach()
    # the unsharded model without the block, each step on the global batch (the ranks' mean loss)
    ref = copy.deepcopy(base)
    everyone = [[(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(3)]
                for g in [torch.Generator().manual_seed(100 + r) for r in range(ws)]]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        if step == 1:
            del ref.blocks[1]
        xs = torch.cat([b[step][0] for b in everyone])
        ys = torch.cat([b[step][1] for b in everyone])
        torch.nn.functional.mse_loss(ref(xs), ys).backward()
        opt.step()
        opt.zero_grad()
    out["ref"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return out


def _grad_before_forward(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(12)
    base = models.BlockStack()
    gen = torch.Generator().manual_seed(200 + rank)
    batches = [(torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(2)]
    out = {}
    for who, shard in [("torch", fully_shard), ("fusedist", fusedist.fully_shard)]:
        model = _rm_sharded(shard, mesh, base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if who == "fusedist":
            model.blocks[0].unshard()
            with pytest.raises(RuntimeError) as err:
                model.blocks[0].fc1.weight.sum().backward()
            out["error"] = str(err.value)
        _rm_train(model, opt, batches)
        out[who] = {k: _rm_full(v).detach().clone() for k, v in model.state_dict().items()}
    return out


def _rm_close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=lambda m, k=k: f"{k}: {m}")


def test_a_block_removed_after_the_first_forward_trains_as_fsdp2(launched):
    for res in results_of(launched, "block_removed"):
        # fp32, 3 AdamW steps, reductions in another order than the global batch's: ~1e-6
        _rm_close(res["fusedist"], res["torch"], 1e-5)
        _rm_close(res["fusedist"], res["ref"], 1e-5)
        _rm_close(res["fusedist_reloaded"], res["fusedist"], 0.0)
        _rm_close(res["dcp_reloaded"], res["fusedist"], 0.0)
        _rm_close(res["full"], res["ref"], 1e-5)
        torch.testing.assert_close(res["fusedist_after"], res["torch_after"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["fusedist_eval"], res["torch_eval"], rtol=1e-5, atol=1e-5)
        assert res["removed_gathered"] == 0, res["removed_gathered"]  # it stayed gathered for good


def test_a_gradient_before_the_first_forward_is_refused_by_name(launched):
    for res in results_of(launched, "grad_first"):
        assert "'fc1.weight'" in res["error"] and "before the model's first forward" in res["error"], res["error"]
        # the refused gradient was dropped: training then equals FSDP2's without the direct use (fp32)
        _rm_close(res["fusedist"], res["torch"], 1e-5)
