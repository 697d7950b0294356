"""``fully_shard`` over meshes beyond the plain (2, 2) HSDP and (dp, tp) layouts, and
``fusedist.replicate`` over a sub-mesh, against torch (FSDP2, torch's replicate, or the unsharded
model) on fresh random inputs, 4 gloo ranks.

HSDP: meshes with a dim of size 1 ((1, 4), (4, 1)), a 2-D mesh whose shard groups are not runs
of consecutive ranks (``DeviceMesh`` over ``[[0, 2], [1, 3]]``), a 1-D sub-mesh of a 2-D one
(``mesh["shard"]``) and a ``("dp", "cp")`` mesh (context-parallel ranks hold the same
parameters: sharding over them is data parallelism, which FSDP2 runs) train as FSDP2 on the
same mesh (losses, the clip's norm, the weights after AdamW); micro-batches under
``set_requires_all_reduce(False)`` that use different parameters (a branch taken in one
micro-batch only) give the gradients of plain accumulation (FSDP2's
``set_requires_gradient_sync``); torch's sharded model and optimizer state dicts of the same
mesh load into the fusedist model. Tensor parallel: a (4, 1) and a (1, 4) (dp, tp) mesh, the
latter with a layer of 3 output rows over 4 tensor-parallel ranks (one rank's local tensor is
empty), against FSDP2 or, where FSDP2 cannot run it, the unsharded model. ``replicate`` with
``device_mesh=mesh["dp"]`` broadcasts each group's first rank's weights and averages within the
group, as torch's replicate.

Tolerances: fp32 throughout; both sides run the same ops and reductions, so a few ulps of the
loss scale (1e-5 relative) cover the orders in which norms and sums are added. A wrong group
(replicas averaged as shards, a lost partial sum, a wrong broadcast source) is off by far more.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.nn.functional as F
from torch import nn

import models
from fusedist.testing import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)


def _seed() -> int:
    return random.SystemRandom().randrange(2 ** 31)


def _full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _norm(value) -> float:
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ------------------------------------------------------------------------------ HSDP meshes
def _pair(mesh, shard_blocks: bool = True):
    """The same BlockStack (sizes not divisible by 2 or 4) under FSDP2 and under fusedist."""
    torch.manual_seed(0)
    ref = models.BlockStack(d_in=7, d=11, d_out=5)
    ours = copy.deepcopy(ref)
    return models.shard_both(ref, ours, mesh, lambda model: model.blocks if shard_blocks else ())


def _train(model, seed: int, data_rank: int, steps: int = 3) -> list:
    """(loss, clipped norm) of each AdamW step on this data-parallel rank's batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + 100 * data_rank + step)
        x, y = torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out.append((loss.item(), _norm(norm)))
        opt.step()
        opt.zero_grad()
    return out


def _meshes(rank):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    names = ("replicate", "shard")
    return {
        "(1, 4)": init_device_mesh("cpu", (1, 4), mesh_dim_names=names),
        "(4, 1)": init_device_mesh("cpu", (4, 1), mesh_dim_names=names),
        "[[0, 2], [1, 3]]": DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=names),
        "mesh['shard']": init_device_mesh("cpu", (2, 2), mesh_dim_names=names)["shard"],
        # context-parallel ranks hold the same parameters: HSDP sharded over them, as FSDP2 runs it
        "('dp', 'cp')": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp")),
    }


class _Branches(nn.Module):
    """A unit whose parameters ``a`` and ``b`` (same shapes) each get a gradient only in the
    micro-batches that take their branch."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 9)
        self.a, self.b = nn.Linear(9, 9), nn.Linear(9, 9)
        self.block = nn.Sequential(nn.Linear(9, 9), nn.Tanh())
        self.head = nn.Linear(9, 4)

    def forward(self, x, which: int):
        h = self.inp(x)
        return self.head(self.block(self.a(h) if which == 0 else self.b(h)))


def _partial_sums_across_branches(rank, seed) -> list:
    """Max weight difference after steps of micro-batches (branch a, then b; then b, then a),
    all but the last under ``set_requires_all_reduce(False)`` (fusedist) against the same under
    FSDP2's ``set_requires_gradient_sync(False)`` -- plain accumulation, the sum both describe."""
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = []
    for pattern in ((0, 1), (1, 0)):
        torch.manual_seed(0)
        ref = _Branches()
        ours = copy.deepcopy(ref)
        for shard, model in ((torch_fully_shard, ref), (fusedist.fully_shard, ours)):
            shard(model.block, mesh=mesh)
            shard(model, mesh=mesh)
        for model in (ref, ours):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(2):
                for k, which in enumerate(pattern):
                    last = k == len(pattern) - 1
                    if model is ours:
                        model.set_requires_all_reduce(last)
                    else:
                        model.set_requires_gradient_sync(last)
                    g = torch.Generator().manual_seed(seed + 100 * rank + 10 * step + k)
                    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 4, generator=g)
                    F.mse_loss(model(x, which), y).backward()
                opt.step()
                opt.zero_grad()
        out.append(_max_diff(_full(ref), _full(ours)))
    return out


def _torch_sharded_state_loads(rank, seed) -> tuple:
    """FSDP2's sharded model and optimizer state dicts (DTensors on the HSDP mesh) set into the
    fusedist model: the largest differences of the full model and optimizer states after."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref, ours = _pair(mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for model, opt, shift in ((ref, opts[0], 0), (ours, opts[1], 1)):  # ours: other data, other state
        g = torch.Generator().manual_seed(seed + rank + shift)
        model(torch.randn(4, 7, generator=g)).square().mean().backward()
        opt.step()
    set_model_state_dict(ours, get_model_state_dict(ref))
    set_optimizer_state_dict(ours, opts[1], get_optimizer_state_dict(ref, opts[0]))
    full = StateDictOptions(full_state_dict=True)
    a, b = (get_optimizer_state_dict(m, o, options=full)["state"] for m, o in ((ref, opts[0]), (ours, opts[1])))
    return _max_diff(_full(ref), _full(ours)), max(_max_diff(a[k], b[k]) for k in a)


def _hsdp_worker(rank, world_size, seed):
    out = {}
    for name, mesh in _meshes(rank).items():
        data_rank = rank if mesh.ndim == 2 else mesh.get_local_rank()
        ref, ours = _pair(mesh)
        out[name] = (_train(ref, seed, data_rank), _train(ours, seed, data_rank), _max_diff(_full(ref), _full(ours)))
    out["branches"] = _partial_sums_across_branches(rank, seed)
    out["torch sharded state"] = _torch_sharded_state_loads(rank, seed)
    return out


def test_hsdp_meshes_partial_sums_and_torch_sharded_state_match_fsdp2():
    """Meshes with a dim of size 1, shard groups of non-consecutive ranks, a 1-D sub-mesh and a
    (dp, cp) mesh train as FSDP2; partial sums over micro-batches using different parameters are plain
    accumulation; FSDP2's sharded state dicts load into the fusedist model."""
    seed = _seed()
    for rank, out in enumerate(run_distributed(_hsdp_worker, 4, seed, timeout=240)):
        what = f"seed {seed}, rank {rank}"
        for name in ("(1, 4)", "(4, 1)", "[[0, 2], [1, 3]]", "mesh['shard']", "('dp', 'cp')"):
            ref, ours, weights = out[name]
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), **TOL, msg=f"{what}, {name}")
            assert weights < 1e-5, f"{what}, {name}: weights differ by {weights}"
        assert max(out["branches"]) < 1e-5, f"{what}: partial sums across branches {out['branches']}"
        model, optim = out["torch sharded state"]
        assert model == 0.0 and optim == 0.0, f"{what}: FSDP2's sharded state loaded with differences {model}, {optim}"


# ------------------------------------------------------------------ tensor parallel, replicate
class _MLP(nn.Module):
    def __init__(self, out: int):
        super().__init__()
        self.w1, self.w2, self.out = nn.Linear(8, 12), nn.Linear(12, 8), nn.Linear(8, out)

    def forward(self, x):
        return self.out(x + self.w2(torch.relu(self.w1(x))))


def _tp_model(mesh, shard, out: int):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = _MLP(out)
    parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel(),
                                           "out": ColwiseParallel(output_layouts=Replicate())})
    if shard is not None:
        shard(model, mesh=mesh["dp"])
    return model


def _tp_train(model, seed, data_rank, steps=3) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + 100 * data_rank + step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, model.out.out_features, generator=g)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out.append((loss.item(), _norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))))
        opt.step()
        opt.zero_grad()
    return out


def _replicate_on_sub_mesh(rank, seed, mesh) -> tuple:
    """torch's replicate and fusedist's over ``mesh["dp"]`` (groups {0, 2} and {1, 3}) from
    different weights on every rank: (their losses, ours, largest weight difference)."""
    import fusedist
    from torch.distributed._composable.replicate import replicate as torch_replicate

    runs = []
    for replicate in (torch_replicate, fusedist.replicate):
        torch.manual_seed(seed + rank)  # each group must start from its first rank's weights
        model = replicate(models.BlockStack(d_in=7, d=11, d_out=5), device_mesh=mesh["dp"])
        runs.append((_train(model, seed, mesh["dp"].get_local_rank()), torch.cat([
            p.detach().reshape(-1) for p in model.parameters()])))
    (theirs, a), (ours, b) = runs
    return theirs, ours, float((a - b).abs().max())


def _tp_worker(rank, world_size, seed):
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    runs = []
    for shard in (torch_fully_shard, fusedist.fully_shard):
        model = _tp_model(mesh, shard, out=3)
        runs.append((_tp_train(model, seed, mesh["dp"].get_local_rank()), _full(model)))
    out["(4, 1)"] = (runs[0][0], runs[1][0], _max_diff(runs[0][1], runs[1][1]))
    # 3 output rows over 4 ranks: FSDP2 fails on the empty local tensor, so the reference is the
    # unsharded model on the batch every rank shares (one data-parallel rank)
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    plain = _MLP(3)
    ours = _tp_model(mesh, fusedist.fully_shard, out=3)
    out["(1, 4)"] = (_tp_train(plain, seed, 0), _tp_train(ours, seed, 0), _max_diff(plain.state_dict(), _full(ours)))
    out["replicate"] = _replicate_on_sub_mesh(rank, seed, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "x")))
    return out


def test_tensor_parallel_on_size_one_dims_and_replicate_on_a_sub_mesh():
    """(dp, tp) meshes of shapes (4, 1) and (1, 4) (an empty local tensor included) train as
    FSDP2 or the unsharded model; replicate over a sub-mesh trains as torch's replicate."""
    seed = _seed()
    for rank, out in enumerate(run_distributed(_tp_worker, 4, seed, timeout=240)):
        for name in ("(4, 1)", "(1, 4)", "replicate"):
            what = f"seed {seed}, rank {rank}, {name}"
            ref, ours, weights = out[name]
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), **TOL, msg=what)
            assert weights < 1e-5, f"{what}: weights differ by {weights}"


def _units_on_two_groups(rank, world_size):
    import torch.distributed as dist

    import fusedist

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fusedist.fully_shard(model[1], process_group=dist.new_group([0, 1]))  # the same ranks, another group
    fusedist.fully_shard(model)
    try:
        model(torch.randn(3, 4))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_units_on_different_groups_under_one_root_are_refused_naming_them():
    """The refusal named neither the units nor their groups."""
    for text in run_distributed(_units_on_two_groups, 2, timeout=60):
        assert ("the units under one root must share one mesh / process group: the root module (Sequential) over "
                "2 shards (communicator #" in text and "and '1' (Linear) over 2 shards (communicator #" in text), text
