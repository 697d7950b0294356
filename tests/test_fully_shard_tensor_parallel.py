"""``fully_shard`` over tensor-parallel modules (FSDP2's 2-D recipe: ``parallelize_module`` on
``mesh["tp"]``, then ``fully_shard`` on ``mesh["dp"]``) against torch's FSDP2 on the same 2x2
gloo mesh (Note [tensor-parallel parameters] in fusedist/fsdp/tensor_parallel.py).

The model has every kind of placement torchtitan's plans give: a ``RowwiseParallel`` embedding
(``Shard(0)`` of the vocabulary), ``ColwiseParallel`` (``Shard(0)``) and ``RowwiseParallel``
(``Shard(1)``, with a ``Replicate()`` bias) linears, ``SequenceParallel`` norms (``Replicate()``
weights whose gradients are ``Partial``) and a ``ColwiseParallel`` output layer; a vocabulary of
13 splits the embedding and output layer unevenly over the tensor-parallel ranks, so the root
unit's layout differs between them.
Checked: losses and the clip's global norm equal FSDP2's (fp32 AdamW; bf16 gathers with fp32
reduction and ``reshard_after_forward=False``; accumulation without gradient sync; activation
checkpointing of the blocks and an evaluation forward), full model and optimizer state dicts equal
FSDP2's, ``full_tensor()`` of ``model.state_dict()``'s and the optimizer state's entries equal
FSDP2's DTensor entries' (also cloned entries, and dim-1 sharded HSDP ones), as are their ``to_local()``,
``placements`` and ``device_mesh``, ``CPUOffloadPolicy``
against FSDP2's, torch's distributed checkpoint both ways,
fusedist's own full state dict round trip into a model built on the meta device, ``init_parameters``
on such a model equal to the unsharded model's initialization, per-parameter gradient norms (the
Lightning helper's) equal to FSDP2's DTensor gradients' norms, the GradScaler skipping on every rank when one rank's
piece holds an inf (only the tensor-parallel reduction of the flag reaches two of the four
ranks), and the refusals. A plain unit beside the tensor-parallel ones (a head left out of the plan):
norms and clip as FSDP2's, also built on the meta device, the scaler's skip on every rank, and the
clip's refusal of gradients the tensor-parallel ranks should hold alike that differ. fusedist's own
checkpoint format: tests/test_checkpoint_tensor_parallel.py (and the HSDP test below).
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fusedist.testing import run_distributed

VOCAB, HIDDEN = 13, 8  # 13: local tensors of unequal sizes (7 and 6 rows of the embedding)
# Note [one norm on every tensor-parallel rank]: gradients of a parameter held alike whose pieces'
# sums of squares round apart where the two tensor-parallel ranks' layouts cut it (see the test)
PINNED_GRADIENT = (0.5186367630958557, -1.3125219345092773, 0.1919950693845749, 0.5427713394165039,
                   -2.2187793254852295)


class _FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.w2 = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.ffn = _FeedForward()

    def forward(self, x):
        return x + self.ffn(self.norm(x))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def _build(mesh, shard, seed=0, meta=False, dp=None, **kwargs):
    """torchtitan's plan in small: activations sharded on the sequence between the blocks'
    parts (SequenceParallel norms, whose Replicate() weights get Partial gradients)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = _Net()
    parallelize_module(model, mesh["tp"], {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {
            "norm": SequenceParallel(),
            "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "ffn.w1": ColwiseParallel(), "ffn.w2": RowwiseParallel(output_layouts=Shard(1))})
        shard(block, mesh=mesh["dp"] if dp is None else dp, **kwargs)
    shard(model, mesh=mesh["dp"] if dp is None else dp, **kwargs)
    return model


def _train(model, mesh, seed, steps=3, clip=None, accumulate=1, dp_rank=None):
    """Losses (and the clip's total norms) of ``steps`` AdamW steps on this data-parallel rank's
    batches (the tensor-parallel ranks of a group see the same batch), each of ``accumulate``
    micro-batches, all but the last without gradient sync."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + (mesh["dp"].get_local_rank() if dp_rank is None else dp_rank))
    losses, norms = [], []
    for _ in range(steps):
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)
            ids = torch.randint(0, VOCAB, (4, 6), generator=g)
            loss = nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
            loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return opt, losses, norms


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _against_fsdp2(mesh, seed, root, dp=None, dp_rank=None) -> tuple:
    """fusedist and FSDP2 trained alike (fp32 AdamW with the clip), their full model and
    optimizer state dicts compared, and each side's checkpoint (torch's distributed checkpoint)
    loaded into a fresh model of the other: (results, our model, our full state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    full = StateDictOptions(full_state_dict=True)
    out = {}
    ours, theirs = _build(mesh, fusedist.fully_shard, seed, dp=dp), _build(mesh, torch_fully_shard, seed, dp=dp)
    opt_ours, *trained_ours = _train(ours, mesh, seed, clip=0.5, dp_rank=dp_rank)
    opt_theirs, *trained_theirs = _train(theirs, mesh, seed, clip=0.5, dp_rank=dp_rank)
    out["fp32"] = (trained_ours, trained_theirs)
    model_ours, model_theirs = get_model_state_dict(ours, options=full), get_model_state_dict(theirs, options=full)
    out["model state"] = _max_diff(model_ours, model_theirs)
    out["shapes"] = {k: tuple(v.shape) for k, v in model_ours.items()}
    a, b = (get_optimizer_state_dict(ours, opt_ours, options=full)["state"],
            get_optimizer_state_dict(theirs, opt_theirs, options=full)["state"])
    out["optimizer state"] = max(_max_diff(a[k], b[k]) for k in b)
    out.update(_dcp_both_ways(mesh, seed, root, (ours, model_ours), (theirs, model_theirs), dp=dp))
    return out, ours, model_ours


def _dcp_both_ways(mesh, seed, root, ours: tuple, theirs: tuple, dp=None) -> dict:
    """Each side's model (``(model, its full state dict)``) saved by torch's distributed
    checkpoint and loaded into a fresh model of the other side, built from another seed (every
    value overwritten by the load): ``{"dcp ours->torch": max difference, "dcp torch->ours": ...}``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    out = {}
    for name, (saved, whole), shard in (("ours->torch", ours, torch_fully_shard),
                                        ("torch->ours", theirs, fusedist.fully_shard)):
        where = os.path.join(root, name)
        dcp.save(saved.state_dict(), checkpoint_id=where)
        fresh = _build(mesh, shard, seed + 1, dp=dp)
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=where)
        fresh.load_state_dict(sd)
        out[f"dcp {name}"] = _max_diff(get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True)),
                                       whole)
    return out


class _Cut(nn.Module):
    """A ColwiseParallel linear of 3 output rows (2 and 1 on the tensor-parallel ranks) beside a
    plain parameter of 5 in one unit: the unit's layout cuts the plain parameter 5 | 0 on one
    tensor-parallel rank, 4 | 1 on the other."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 3)
        self.scale = nn.Parameter(torch.ones(len(PINNED_GRADIENT)))

    def forward(self, x):
        return self.lin(x).sum() + (self.scale * torch.tensor(PINNED_GRADIENT)).sum()


def _pinned(mesh) -> list:
    """The clip's norms over ``_Cut``, whose plain parameter's gradient is ``PINNED_GRADIENT``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import fusedist

    model = _Cut()
    parallelize_module(model, mesh["tp"], {"lin": ColwiseParallel(output_layouts=Replicate())})
    fusedist.fully_shard(model, mesh=mesh["dp"])
    model(torch.ones(2, 1)).backward()
    return [float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),
            float(fusedist.clip_grad_norm_(model.parameters(), 1.0))]


def _worker(rank, world_size, seed, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out, ours, model_ours = _against_fsdp2(mesh, seed, root)
    try:  # (a failure before any collective, alike on every rank: its own test reports it)
        out["full_tensor"] = _entries_made_whole(mesh, seed, mesh["dp"].get_local_rank())
    except Exception:  # noqa: BLE001
        out["full_tensor"] = traceback.format_exc()

    # fusedist's full state dict, loaded into a model built on the meta device, trains on as ours
    whole = fusedist.fsdp.full_state_dict(ours)
    out["fusedist full"] = _max_diff(whole, model_ours)
    meta = _build(mesh, fusedist.fully_shard, seed + 3, meta=True)
    meta.to_empty(device="cpu")
    fusedist.fsdp.load_full_state_dict(meta, whole)
    out["meta"] = (_train(meta, mesh, seed + 4)[1], _train(ours, mesh, seed + 4)[1])
    # or initialized there as the unsharded model is from the same RNG state: each global parameter
    # drawn whole (fan-in from its global shape), each rank keeping its part; also by an init that
    # gives a weight new ``.data``
    def new_data(m):
        if isinstance(m, nn.Linear):
            m.weight.data = torch.randn_like(m.weight) * 0.05
            nn.init.normal_(m.bias, std=0.01)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()

    out["init"] = []
    for init_fn in (None, new_data):
        meta = _build(mesh, fusedist.fully_shard, seed, meta=True)
        meta.to_empty(device="cpu")
        torch.manual_seed(seed + 5)
        fusedist.fsdp.init_parameters(meta, init_fn)
        unsharded = _Net()
        torch.manual_seed(seed + 5)
        unsharded.apply(init_fn or (lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None))
        out["init"].append(_max_diff(fusedist.fsdp.full_state_dict(meta), unsharded.state_dict()))

    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = _build(mesh, fusedist.fully_shard, seed, mp_policy=fusedist.MixedPrecisionPolicy(**mp),
                  reshard_after_forward=False)
    theirs = _build(mesh, torch_fully_shard, seed, mp_policy=TorchMixedPrecision(**mp), reshard_after_forward=False)
    out["bf16"] = (_train(ours, mesh, seed)[1], _train(theirs, mesh, seed)[1])
    # CPUOffloadPolicy: pieces in host memory, as FSDP2's (the step on them, the clip across both groups)
    ours = _build(mesh, fusedist.fully_shard, seed, offload_policy=fusedist.CPUOffloadPolicy(pin_memory=False))
    theirs = _build(mesh, torch_fully_shard, seed, offload_policy=TorchCPUOffload(pin_memory=False))
    out["offload"] = (_train(ours, mesh, seed, clip=0.5)[1:], _train(theirs, mesh, seed, clip=0.5)[1:])
    ours, theirs = _build(mesh, fusedist.fully_shard, seed), _build(mesh, torch_fully_shard, seed)
    out["accumulation"] = (_train(ours, mesh, seed, steps=2, accumulate=2)[1],
                           _train(theirs, mesh, seed, steps=2, accumulate=2)[1])

    # per-parameter gradient norms (the Lightning helper's): each global parameter's, as FSDP2's
    # DTensor gradients give them
    from fusedist.integrations.lightning_grad_norm import grad_norm

    ours, theirs = _build(mesh, fusedist.fully_shard, seed), _build(mesh, torch_fully_shard, seed)
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(seed + mesh["dp"].get_local_rank()))
    for model in (ours, theirs):
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    out["grad norms"] = [({key.split("/", 1)[1]: float(v) for key, v in grad_norm(ours, p).items() if "/" in key},
                          {name: float(q.grad.full_tensor().norm(p)) for name, q in theirs.named_parameters()})
                         for p in (2.0, float("inf"))]

    # activation checkpointing of every block (torchtitan's default), then an evaluation forward
    from torch.utils.checkpoint import checkpoint

    forward = _Block.forward
    _Block.forward = lambda self, x: checkpoint(forward, self, x, use_reentrant=False)
    try:
        runs = []
        for shard in (fusedist.fully_shard, torch_fully_shard):
            model = _build(mesh, shard, seed)
            _, losses, norms = _train(model, mesh, seed, steps=2, clip=0.5)
            model.eval()
            with torch.no_grad():
                evaluated = model(torch.arange(12).view(2, 6) % VOCAB).sum().item()
            runs.append((losses, norms, evaluated))
        out["checkpointed"] = runs
    finally:
        _Block.forward = forward

    # one rank's inf: every rank skips (ranks 0 and 2 learn of it only over the tensor-parallel group)
    model = _build(mesh, fusedist.fully_shard, seed)
    opt, out["scaler"] = _scaler_step_with_inf_on(3, rank, model, seed)
    out["refusals"] = _refusals(mesh)
    out["other root"] = _dp_mesh_of_another_root(mesh, seed)
    # the pinned gradients of the test below, on the same mesh (one launch of the 4 ranks for both)
    out["pinned"] = _pinned(mesh)
    # a plain unit beside the tensor-parallel ones (the tests below), on the same mesh
    out["plain"] = _plain_scenarios(mesh, rank, seed)
    return out


def _scaler_step_with_inf_on(bad_rank: int, rank: int, model, seed: int):
    """One FusedAdamW step under fusedist's GradScaler with an inf in ``bad_rank``'s first piece:
    (the optimizer, (whether this rank's parameters stayed as they were, the scale after))."""
    import fusedist

    opt = fusedist.optim.FusedAdamW(model.parameters(), lr=1e-2)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    before = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(seed))
    scaler.scale(nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())).backward()
    if rank == bad_rank:
        next(p for p in model.parameters() if p.numel()).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    return opt, (all(torch.equal(x, p) for x, p in zip(before, model.parameters())), scaler.get_scale())


def _whole_entries(state: dict) -> dict:
    """FSDP2's export recipe: every entry of ``model.state_dict()`` made whole by ``full_tensor()``."""
    return {k: v.full_tensor() for k, v in state.items()}


def _as_dtensors(state: dict) -> dict:
    """What code written for FSDP2 reads of each entry besides ``full_tensor()`` (Note [entries read
    as DTensors] in fusedist/fsdp/dtensor_view.py): its placements, mesh and local shard."""
    return {k: (repr(tuple(v.placements)), v.device_mesh.mesh.tolist(), v.to_local().clone()) for k, v in state.items()}


def _dtensor_mismatch(ours: dict, theirs: dict, tol: float) -> list:
    """The keys whose placements, mesh or local shard (shape, then values within ``tol``) differ."""
    bad = []
    for k, (placements, mesh, local) in theirs.items():
        p, m, lo = ours[k]
        if (p, m, tuple(lo.shape)) != (placements, mesh, tuple(local.shape)) or \
                (local.numel() and float((lo.float() - local.float()).abs().max()) > tol):
            bad.append((k, p, placements, m, mesh, tuple(lo.shape), tuple(local.shape)))
    return bad


def _parameters_as_dtensors(model) -> dict:
    """What torchtitan-style code reads of each parameter as a DTensor (Note [parameters read as
    DTensors] in fusedist/fsdp/param_view.py): placements, mesh, ``full_tensor()`` and
    ``to_local()`` -- or, for ours, its refusal where the piece is not FSDP2's shard."""
    out = {}
    for name, p in model.named_parameters():
        try:
            local = p.to_local().detach().clone()
        except RuntimeError as e:
            local = str(e)
        out[name] = (repr(tuple(p.placements)), p.device_mesh.mesh.tolist(), p.full_tensor().detach(), local)
    return out


def _parameter_mismatch(ours: dict, theirs: dict, tol: float) -> tuple:
    """(names whose placements, mesh, whole values or local shard differ, names whose to_local() was refused)."""
    bad, refused = [], []
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    for k, (placements, mesh, whole, local) in theirs.items():
        p, m, w, lo = ours[k]
        if (p, m) != (placements, mesh) or float((w - whole).abs().max()) > tol:
            bad.append((k, p, placements, m, mesh))
        elif isinstance(lo, str):
            # (named by its path, or before the root's first forward by its name in its unit)
            named = f"'{k}'" in lo or f"{k.split('.', 2)[-1]}' of fully_shard(" in lo
            refused.append(k) if named and "not the shard FSDP2 gives it" in lo else bad.append((k, lo))
        elif lo.shape != local.shape or (local.numel() and float((lo - local).abs().max()) > tol):
            bad.append((k, tuple(lo.shape), tuple(local.shape)))
    return bad, refused


def _entries_made_whole(mesh, seed, rank) -> dict:
    """``full_tensor()`` of ``model.state_dict()``'s entries (Note [whole entries] in
    fusedist/fsdp/whole_entry.py) against FSDP2's DTensor entries: tensor-parallel ones, entries
    cloned before another optimizer step (their own values, not the parameters'), the optimizer
    state's entries (``get_optimizer_state_dict``), and an HSDP
    model whose 2-D weights are sharded on dim 1 (entries that are boxes, pieces held twice)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Shard

    import fusedist

    out = {}
    ours, theirs = _build(mesh, fusedist.fully_shard, seed), _build(mesh, torch_fully_shard, seed)
    kept, moments, reads = [], [], []
    for model in (ours, theirs):
        opt = _train(model, mesh, seed, steps=1)[0]
        kept.append({k: v.clone() for k, v in model.state_dict().items()})
        reads.append(_as_dtensors(kept[-1]))
        ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(seed + rank))
        model(ids).float().square().mean().backward()
        opt.step()
        state = get_optimizer_state_dict(model, opt)["state"]
        moments.append(_whole_entries({f"{k}.{n}": v for k, st in state.items() for n, v in st.items() if v.dim()}))
    try:  # (a failure before any collective, alike on every rank: its own test reports it)
        out["tp parameters"] = _parameter_mismatch(_parameters_as_dtensors(ours), _parameters_as_dtensors(theirs),
                                                   1e-6)
    except Exception:  # noqa: BLE001
        out["tp parameters"] = traceback.format_exc()
    plain = nn.Linear(2, 2)  # (not sharded: none of the names, as before)
    out["plain parameter"] = [hasattr(plain.weight, n)
                              for n in ("placements", "device_mesh", "full_tensor", "to_local")]
    out["tp cloned"] = _max_diff(_whole_entries(kept[0]), _whole_entries(kept[1]))
    out["tp as dtensors"] = _dtensor_mismatch(*reads, tol=1e-6)  # (_StridedShard where both shard dim 0)
    out["tp now"] = _max_diff(_whole_entries(ours.state_dict()), _whole_entries(theirs.state_dict()))
    out["tp optimizer"] = _max_diff(*moments)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    models = []
    for shard in (fusedist.fully_shard, torch_fully_shard):
        torch.manual_seed(seed)
        model = _Net()
        for m in (*model.blocks, model):
            shard(m, mesh=hsdp, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
        try:
            read = _parameters_as_dtensors(model)
        except Exception:  # noqa: BLE001
            read = traceback.format_exc()
        models.append((_whole_entries(model.state_dict()), _as_dtensors(model.state_dict()), read))
    out["hsdp parameters"] = models[0][2] if isinstance(models[0][2], str) else \
        _parameter_mismatch(models[0][2], models[1][2], 0.0)
    out["hsdp dim 1"] = _max_diff(models[0][0], models[1][0])
    out["hsdp as dtensors"] = _dtensor_mismatch(models[0][1], models[1][1], tol=0.0)
    return out


def _refusals(mesh) -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import fusedist

    out = {}
    cases = {
        "placement": dict(shard_placement_fn=lambda p: Shard(1) if p.dim() > 1 else None, mesh=mesh["dp"]),
        "same mesh": dict(mesh=mesh["tp"]),
    }
    for name, kwargs in cases.items():
        block = _Block()
        parallelize_module(block, mesh["tp"], {"ffn.w1": ColwiseParallel()})
        try:
            fusedist.fully_shard(block, **kwargs)
            out[name] = None
        except (NotImplementedError, ValueError) as exc:
            out[name] = str(exc)
    return out


def _dp_mesh_of_another_root(mesh, seed: int) -> dict:
    """Tensor parallelism on ``mesh["tp"]``, ``fully_shard`` on a mesh of the same data-parallel ranks
    built on its own (another root mesh, which FSDP2 refuses at fully_shard: "Cannot concatenate
    DeviceMeshes derived from different device meshs"): one SGD step against the unsharded model on
    both data-parallel ranks' batches, and ``device_mesh``'s answer (no mesh holds both)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fusedist

    ranks = mesh.mesh.t().contiguous()  # (dp, tp) of ``mesh`` as (tp, dp): rows are the data-parallel groups
    dp = DeviceMesh("cpu", ranks, mesh_dim_names=("tp_of_other", "dp_of_other"))["dp_of_other"]
    torch.manual_seed(seed)
    plain = _FeedForward()
    model = _FeedForward()
    model.load_state_dict(plain.state_dict())
    parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fusedist.fully_shard(model, mesh=dp)
    xs = [torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(seed + r)) for r in range(2)]
    model(xs[mesh["dp"].get_local_rank()]).square().sum().backward()
    sum(plain(x).square().sum() for x in xs).div(2).backward()
    for m in (model, plain):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    whole = fusedist.fsdp.full_state_dict(model)
    out = {"weights": max((whole[k] - v).abs().max().item() for k, v in plain.state_dict().items())}
    entry = model.state_dict()["w1.weight"]
    out["placements"] = [str(p) for p in entry.placements]
    for what, get in (("entry mesh", lambda: entry.device_mesh),
                      ("parameter mesh", lambda: model.w1.weight.device_mesh)):
        try:
            out[what] = repr(get())
        except RuntimeError as exc:
            out[what] = str(exc)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    seed = int(torch.randint(0, 10_000, ()).item())
    root = str(tmp_path_factory.mktemp("tp"))
    return seed, run_distributed(_worker, 4, seed, root, timeout=300)


def test_training_and_clip_match_fsdp2_with_tensor_parallelism(results):
    seed, per_rank = results
    for rank, out in enumerate(per_rank):
        (losses, norms), (ref_losses, ref_norms) = out["fp32"]
        # fp32: the same reductions as FSDP2, summed in another order where the layouts differ
        # (the norm's sum, uneven pieces): a few ulps
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6,
                                   msg=f"seed {seed}, rank {rank}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0,
                                   msg=f"seed {seed}, rank {rank}")
        assert out["model state"] < 1e-6 and out["optimizer state"] < 1e-6, (seed, rank, out)
        assert out["shapes"]["blocks.0.ffn.w2.weight"] == (HIDDEN, 2 * HIDDEN)  # global shapes
        for got, want in zip(*out["checkpointed"]):  # losses, norms, an evaluation forward's sum
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                       msg=f"seed {seed}, rank {rank}")
        ours, theirs = out["accumulation"]  # set_requires_gradient_sync(False) micro-batches
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-6, atol=1e-6,
                                   msg=f"seed {seed}, rank {rank}")
        (ours, our_norms), (theirs, their_norms) = out["offload"]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-6, atol=1e-6,
                                   msg=f"offload, seed {seed}, rank {rank}")
        torch.testing.assert_close(torch.tensor(our_norms), torch.tensor(their_norms), rtol=1e-5, atol=0,
                                   msg=f"offload, seed {seed}, rank {rank}")
        for ours, theirs in out["grad norms"]:  # fp32 sums in another order: a few ulps
            assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
            for name in theirs:
                assert ours[name] == pytest.approx(theirs[name], rel=1e-5), (seed, rank, name, ours[name], theirs[name])
        # bf16 gathers, fp32 reduction: the same casts on both sides
        ours, theirs = out["bf16"]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-5,
                                   msg=f"seed {seed}, rank {rank}")


def test_state_dict_entries_full_tensor_as_fsdp2(results):
    """``{k: v.full_tensor() for k, v in model.state_dict().items()}`` gives FSDP2's whole parameters
    (and the optimizer state's entries FSDP2's whole moments):
    the same values after the same fp32 steps (a few ulps: the clip's norm sums in another order,
    as in the training test), and bit for bit for an untrained HSDP model (copies only)."""
    seed, per_rank = results
    for rank, out in enumerate(per_rank):
        got = out["full_tensor"]
        assert isinstance(got, dict), f"rank {rank}: {got}"
        assert max(got["tp cloned"], got["tp now"], got["tp optimizer"]) < 1e-6, (seed, rank, got)
        assert got["hsdp dim 1"] == 0.0, (seed, rank, got)
        # to_local(), placements and device_mesh as FSDP2's DTensor entries
        assert got["tp as dtensors"] == [] and got["hsdp as dtensors"] == [], (seed, rank, got)


def test_parameters_answer_as_fsdp2_dtensor_parameters(results):
    """``p.placements``, ``p.device_mesh`` and ``p.full_tensor()`` of ``model.parameters()`` as FSDP2's
    DTensor parameters (they raised AttributeError): tensor-parallel after an fp32 step (a few ulps,
    as above), HSDP with 2-D weights on dim 1 bit for bit. ``p.to_local()`` is FSDP2's shard where
    the piece is that shard -- every 2-D weight of the dim-1 model -- and elsewhere refused on
    every rank, naming the parameter; a parameter no unit holds has none of the names."""
    seed, per_rank = results
    for rank, out in enumerate(per_rank):
        got = out["full_tensor"]
        assert isinstance(got, dict), f"rank {rank}: {got}"
        assert isinstance(got["tp parameters"], tuple), f"rank {rank}: {got['tp parameters']}"
        assert isinstance(got["hsdp parameters"], tuple), f"rank {rank}: {got['hsdp parameters']}"
        bad, refused = got["tp parameters"]
        assert bad == [], (seed, rank, bad)
        assert refused == per_rank[0]["full_tensor"]["tp parameters"][1], (seed, rank, refused)
        bad, refused = got["hsdp parameters"]
        assert bad == [], (seed, rank, bad)
        # (1-D parameters stay on dim 0, cut by the flat layout: refused where not FSDP2's chunk)
        assert all("bias" in k or "norm" in k for k in refused), (seed, rank, refused)
        assert got["plain parameter"] == [False] * 4, (rank, got["plain parameter"])


def test_checkpoints_interchange_with_fsdp2(results):
    seed, per_rank = results
    for rank, out in enumerate(per_rank):
        assert out["dcp ours->torch"] == 0.0 and out["dcp torch->ours"] == 0.0, (seed, rank, out)
        assert out["fusedist full"] == 0.0, (seed, rank)
        meta, ref = out["meta"]
        assert meta == ref, (seed, rank)
        assert out["init"] == [0.0, 0.0], (seed, rank, out["init"])  # the same draws: bit for bit


def test_held_alike_parameters_stay_bit_identical_across_tensor_parallel_ranks(results):
    """Note [one norm on every tensor-parallel rank] (fusedist/fsdp/holder.py): the clip's norm
    has the same bits on every rank, so every copy of a parameter the tensor-parallel ranks hold
    alike is scaled by the same coefficient. With ``PINNED_GRADIENT`` the sums of squares of the
    plain parameter's pieces, cut differently on the two tensor-parallel ranks, round an ulp
    apart (each rank taking its own figure: 5.5898247 and 5.5898252): the copies drifted apart
    and a checkpoint written from the first rank's copies loaded 7e-9 off on the second. Also
    the clip's norms of the random-seed training."""
    per_rank = results[1]
    for norms in ([out["pinned"] for out in per_rank], [out["fp32"][0][1] for out in per_rank]):
        assert all(n == norms[0] for n in norms), norms


def test_grad_scaler_skips_on_every_rank(results):
    _, per_rank = results
    assert [out["scaler"] for out in per_rank] == [(True, 128.0)] * 4


def test_refusals_name_the_parameter(results):
    out = results[1][0]["refusals"]
    assert "parameter 'ffn.w1.weight' is tensor-parallel and shard_placement_fn gave Shard(1)" in out["placement"]
    assert "overlap the data-parallel group's" in out["same mesh"]


def test_data_parallel_mesh_of_another_root_trains_and_names_the_missing_mesh(results):
    """FSDP2 refuses a data-parallel mesh not of the tensor-parallel mesh's root; fusedist trains as the
    unsharded model, and ``device_mesh`` (no mesh holds both) names the parameter and the way out."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for out in results[1]:
        out = out["other root"]
        assert out["weights"] < 1e-6, out  # (fp32: the two batches' gradients summed in another order)
        # (FSDP2's placements on one root mesh: the data-parallel shard strided over the ColwiseParallel one)
        assert out["placements"] == [str(_StridedShard(0, split_factor=2)), str(Shard(0))], out
        for what in ("entry mesh", "parameter mesh"):
            assert "device_mesh of parameter 'w1.weight'" in out[what] and "mesh['dp']" in out[what], out[what]


# ------------------------------------------------ a plain unit beside tensor-parallel ones
# A head left out of the plan with a fully_shard unit of its own on mesh["dp"] (Note [plain units
# beside tensor-parallel ones] in fusedist/fsdp/holder.py, Note [checking what is held alike] in
# fusedist/fsdp/held_alike.py). The reference is torch's FSDP2 on the same model, its head made a
# DTensor replicated over the tensor-parallel mesh (``distribute_module``) so that FSDP2's own
# ``clip_grad_norm_`` can take the whole model: with the head on mesh["dp"] alone its DTensors are
# on another mesh than the rest's, which FSDP2's clip refuses. Run in the launch of ``results``.
IN, HID, OUT = 6, 8, 5  # (a plain unit beside tensor-parallel ones, below)
MAX_NORM = 0.05  # below every norm these models have: the clip scales
ORDERS = (2.0, float("inf"), 1.0)


def _plain_net():
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, IN), nn.Linear(IN, OUT))


def _build_plain(mesh, seed: int, fsdp2: bool = False, meta: bool = False, one_by_one: bool = False):
    """m[0] ColwiseParallel, m[2] RowwiseParallel (a Replicate() bias), m[3] the head: a plain
    Linear with a unit of its own on mesh["dp"] (FSDP2: replicated over mesh["tp"] first), the
    root a unit of the rest; ``one_by_one``: a unit for each linear and none at the root."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fusedist

    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = _plain_net()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if fsdp2:
        distribute_module(model[3], mesh["tp"],
                          input_fn=lambda m, inputs, tp: tuple(DTensor.from_local(x, tp, [Replicate()], run_check=False)
                                                               for x in inputs),
                          output_fn=lambda m, out, tp: out.to_local())
    shard = torch_fully_shard if fsdp2 else fusedist.fully_shard
    for module in (model[0], model[2], model[3]) if one_by_one else (model[3], model):
        shard(module, mesh=mesh["dp"])
    return model


def _plain_backward(model, mesh, seed: int, scale=None) -> None:
    """A backward on this data-parallel rank's batch (the tensor-parallel ranks of a group see the same one)."""
    g = torch.Generator().manual_seed(seed * 10 + mesh["dp"].get_local_rank())
    x, y = torch.randn(3, IN, generator=g), torch.randn(3, OUT, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    (loss if scale is None else scale(loss)).backward()


def _plain_whole(value) -> float:
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


def _plain_full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _plain_norms(model, mesh, seed: int, clip, norm_type: float) -> dict:
    """Per-parameter gradient norms (Lightning's helper for ours, each DTensor gradient's for
    FSDP2), torch's ``get_total_norm`` of the gradients, the clip's norm, and the parameters
    after one clipped SGD step (lr 1: their change is the clipped gradient itself)."""
    from fusedist.integrations.lightning_grad_norm import grad_norm

    _plain_backward(model, mesh, seed)
    out = {}
    if isinstance(next(model.parameters()).grad, DTensor):  # (FSDP2's; ours: Lightning's helper)
        out["per parameter"] = {n: float(q.grad.full_tensor().norm(norm_type)) for n, q in model.named_parameters()}
    else:
        out["per parameter"] = {key.split("/", 1)[1]: float(v) for key, v in grad_norm(model, norm_type).items()
                                if "/" in key}
    out["total"] = _plain_whole(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type))
    out["clip"] = _plain_whole(clip(model.parameters(), MAX_NORM, norm_type))
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    out["state"] = _plain_full_state(model)
    return out


def _plain_against_fsdp2(mesh, rank, seed):
    """For each norm order: FSDP2's figures, then ours by torch's clip, by fusedist's clip, by
    torch's clip with a unit for each linear and none at the root (no call sees the units
    together: the clip measures their holders jointly), and by torch's clip on our model built on
    the meta device (``to_empty``, then FSDP2's initial values loaded)."""
    import fusedist

    out = {}
    for norm_type in ORDERS:
        theirs = _build_plain(mesh, seed, fsdp2=True)
        initial = _plain_full_state(theirs)
        runs = [_plain_norms(theirs, mesh, seed, torch.nn.utils.clip_grad_norm_, norm_type)]
        for clip in (torch.nn.utils.clip_grad_norm_, fusedist.clip_grad_norm_):
            runs.append(_plain_norms(_build_plain(mesh, seed), mesh, seed, clip, norm_type))
        one_by_one = _build_plain(mesh, seed, one_by_one=True)
        runs.append(_plain_norms(one_by_one, mesh, seed, torch.nn.utils.clip_grad_norm_, norm_type))
        meta = _build_plain(mesh, seed + 1, meta=True)
        meta.to_empty(device="cpu")
        fusedist.fsdp.load_full_state_dict(meta, initial)
        runs.append(_plain_norms(meta, mesh, seed, torch.nn.utils.clip_grad_norm_, norm_type))
        out[norm_type] = runs
    return out


def _plain_scaler_skips(mesh, rank, seed, which):
    """Two optimizers, one over the plain head's parameters only, and an inf in rank 3's piece
    of the head's gradient: (whether this rank's head stayed as it was, whether its body moved,
    the scale after the update)."""
    import fusedist

    model = _build_plain(mesh, seed)
    head = list(model[3].parameters())
    body = [p for p in model.parameters() if all(p is not q for q in head)]
    if which == "torch":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        opts = [torch.optim.SGD(body, lr=0.1), torch.optim.SGD(head, lr=0.1)]
    else:
        scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        opts = [fusedist.optim.FusedAdamW(body, lr=0.1), fusedist.optim.FusedAdamW(head, lr=0.1)]
    before = [p.detach().clone() for p in model.parameters()]
    _plain_backward(model, mesh, seed, scale=scaler.scale)
    if rank == 3:
        head[0].grad.view(-1)[0] = float("inf")
    for opt in opts:
        scaler.step(opt)
    scaler.update()
    same = [torch.equal(b, p) for b, p in zip(before, model.parameters())]
    head_ids = {id(p) for p in head}
    moved = [not s for s, p in zip(same, model.parameters()) if id(p) not in head_ids and p.numel()]
    return (all(s for s, p in zip(same, model.parameters()) if id(p) in head_ids),
            any(moved) or not moved,  # (this rank's pieces of the body: some may be empty)
            scaler.get_scale())


def _norm_readers() -> dict:
    """Each way of reading the gradients' norms, by name: f(model), a collective."""
    import fusedist
    from fusedist.integrations.lightning_grad_norm import grad_norm

    readers = {}
    for suffix, order in (("", 2.0), (" inf", float("inf"))):
        readers["torch" + suffix] = lambda m, p=order: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM, p)
        readers["fusedist" + suffix] = lambda m, p=order: fusedist.clip_grad_norm_(m.parameters(), MAX_NORM, p)
        readers[f"grad_norm {order}"] = lambda m, p=order: grad_norm(m, p)  # (per-parameter norms: Lightning's)
    return readers


def _plain_refused(mesh, rank, seed, where):
    """Gradients of pieces held alike made to differ on tensor-parallel rank 1 (``where``: the
    plain head's weight or the Replicate() bias of the tensor-parallel unit): the error of each
    clip, of order 2 and inf, and of the per-parameter norms."""
    out = {}
    for name, read in _norm_readers().items():
        model = _build_plain(mesh, seed)
        _plain_backward(model, mesh, seed)
        if mesh["tp"].get_local_rank() == 1:
            (model[3].weight if where == "head" else model[2].bias).grad.mul_(1.5)
        try:
            read(model)
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = str(e)
    return out

def _kind(x) -> str:
    x = float(x)
    return "nan" if math.isnan(x) else "inf" if math.isinf(x) else "finite"


@contextlib.contextmanager
def _max_like_fmax():
    """fusedist's communicator's float max all-reduces drop NaN while inside, as NCCL's ``fmax``
    does (gloo's keeps it), so that the NaN flags are what carries a NaN."""
    from fusedist.comm.torch_comm import TorchCommunicator

    plain = TorchCommunicator._all_reduce

    def fmax(self, tensor, op):
        if op == "max" and tensor.is_floating_point():
            tensor.nan_to_num_(nan=-float("inf"), posinf=float("inf"), neginf=-float("inf"))
        return plain(self, tensor, op)

    TorchCommunicator._all_reduce = fmax
    try:
        yield
    finally:
        TorchCommunicator._all_reduce = plain


def _plain_nonfinite(mesh, rank, seed):
    """An inf or a NaN written into a gradient held alike (the plain head's weight, the Replicate()
    bias of the tensor-parallel unit) on tensor-parallel rank 1 only: per (value, where), what
    each norm reads -- FSDP2's clip, torch's and fusedist's clips of order 2 and inf (their
    totals' kinds), the per-parameter norms (the kind of each parameter's), and torch's clip with
    ``error_if_nonfinite`` (its error or "no error"). A NaN also where a max all-reduce drops
    it (NCCL's), for ours."""

    def damaged(value, where, fsdp2=False):
        model = _build_plain(mesh, seed, fsdp2=fsdp2)
        _plain_backward(model, mesh, seed)
        if mesh["tp"].get_local_rank() == 1:
            g = (model[3].weight if where == "head" else model[2].bias).grad
            g = g.to_local() if fsdp2 else g
            if g.numel():  # (a data-parallel rank's piece may be empty; the other's is not)
                g.view(-1)[0] = value
        return model

    out = {}
    for value, where, fmax in ((float("inf"), "head", False), (float("inf"), "bias", False),
                               (float("nan"), "head", False), (float("nan"), "head", True)):
        read = {}
        for order in (2.0, float("inf")) if not fmax else ():  # (FSDP2's collectives are torch's own)
            read[f"fsdp2 {order}"] = _kind(_plain_whole(torch.nn.utils.clip_grad_norm_(
                damaged(value, where, fsdp2=True).parameters(), MAX_NORM, order)))
        with _max_like_fmax() if fmax else contextlib.nullcontext():
            _ours_nonfinite(read, damaged, value, where)
        out[f"{value} {where}" + (" fmax" if fmax else "")] = read
    return out


def _ours_nonfinite(read: dict, damaged, value: float, where: str) -> None:
    """Into ``read``: what each of our norms reads of ``damaged(value, where)``'s gradients."""
    import fusedist
    from fusedist.integrations.lightning_grad_norm import grad_norm

    for order in (2.0, float("inf")):
        model = damaged(value, where)  # (the per-parameter norms leave the gradients as they are)
        read[f"per parameter {order}"] = {key.split("/", 1)[1]: _kind(v)
                                          for key, v in grad_norm(model, order).items() if "/" in key}
        read[f"torch {order}"] = _kind(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, order))
        read[f"fusedist {order}"] = _kind(fusedist.clip_grad_norm_(damaged(value, where).parameters(), MAX_NORM, order))
    try:
        torch.nn.utils.clip_grad_norm_(damaged(value, where).parameters(), MAX_NORM, error_if_nonfinite=True)
        read["raises"] = "no error"
    except RuntimeError as e:
        read["raises"] = str(e)


# name: (function, seed offset, more arguments), each called as fn(mesh, rank, seed + offset, *more)
_PLAIN_SCENARIOS = {
    "nonfinite": (_plain_nonfinite, 3, ()),
    "fsdp2": (_plain_against_fsdp2, 0, ()),
    **{f"scaler {which}": (_plain_scaler_skips, 1, (which,)) for which in ("torch", "fusedist")},
    **{f"refused {where}": (_plain_refused, 2, (where,)) for where in ("head", "bias")},
}


def _plain_scenarios(mesh, rank, seed) -> dict:
    """Each scenario's result, or its traceback (a failure fails its own test only)."""
    out = {}
    for name, (fn, offset, more) in _PLAIN_SCENARIOS.items():
        try:
            out[name] = (True, fn(mesh, rank, seed + offset, *more))
        except Exception:  # noqa: BLE001
            out[name] = (False, f"rank {rank}: {traceback.format_exc()}")
    return out


def _plain_results(results, name: str) -> list:
    per_rank = [out["plain"][name] for out in results[1]]
    for passed, value in per_rank:
        assert passed, value
    return [value for _, value in per_rank]


def test_plain_unit_norms_and_clip_match_fsdp2(results):
    """Per-parameter norms, ``get_total_norm`` and the clip's norm as FSDP2's, and the clipped
    step's parameters as FSDP2's (fp32, summed in another order over the groups: 1e-5 relative on
    the norms, 1e-6 on the parameters), for norms of order 2, inf and 1; also for our model
    built on the meta device, whose ``to_empty`` replaced the pieces (they used to lose their
    mark of being held alike: the head's and the Replicate() bias's gradients were counted on
    both tensor-parallel ranks)."""
    for rank, out in enumerate(_plain_results(results, "fsdp2")):
        for norm_type, (ref, *ours) in out.items():
            for how, got in zip(("torch's clip", "fusedist's clip", "one by one", "built on meta"), ours):
                where = (results[0], rank, norm_type, how)
                assert got["per parameter"].keys() == ref["per parameter"].keys(), where
                for name, want in ref["per parameter"].items():
                    assert got["per parameter"][name] == pytest.approx(want, rel=1e-5), (where, name)
                assert got["total"] == pytest.approx(ref["total"], rel=1e-5), (where, got["total"], ref["total"])
                assert got["clip"] == pytest.approx(ref["clip"], rel=1e-5), (where, got["clip"], ref["clip"])
                for name, want in ref["state"].items():
                    torch.testing.assert_close(got["state"][name], want, rtol=1e-6, atol=1e-6, msg=f"{where} {name}")


def test_an_inf_in_a_plain_unit_on_one_tensor_parallel_rank_skips_everywhere(results):
    """The head's optimizer skips on every rank (ranks 0 and 2 learn of rank 3's inf only over
    the tensor-parallel group), the body's steps everywhere, and every rank halves its scale --
    torch's GradScaler and fusedist's."""
    for which in ("torch", "fusedist"):
        assert _plain_results(results, f"scaler {which}") == [(True, True, 128.0)] * 4, which


def test_gradients_held_alike_that_differ_are_refused_by_the_clip(results):
    """Every rank raises (the same figures everywhere: no rank is left waiting), naming the
    parameter, its unit and the ranks' figures, with what to do -- the clip of order 2 and of
    order inf, and the per-parameter norms Lightning's ``grad_norm`` logs (these two took the
    first tensor-parallel rank's figure unchecked)."""
    for where, named in (("head", "'3.weight' of fully_shard(Linear), a unit with no tensor-parallel parameters ("),
                         ("bias", "'2.bias' of the root module (Sequential) (")):
        for rank, out in enumerate(_plain_results(results, f"refused {where}")):
            assert out.keys() == {"torch", "fusedist", "torch inf", "fusedist inf", "grad_norm 2.0", "grad_norm inf"}
            for name, msg in out.items():
                assert "differ between the ranks of a tensor-parallel group" in msg, (where, rank, name, msg)
                assert named in msg and "on tensor-parallel rank 1)" in msg and msg.count("' of ") == 1, \
                    (where, rank, name, msg)
                assert "the same batch" in msg, (where, rank, name, msg)


def test_a_nonfinite_gradient_held_alike_on_one_tensor_parallel_rank_is_seen_everywhere(results):
    """An inf or NaN in a gradient held alike on one tensor-parallel rank makes every rank's norm
    non-finite, of the same kind -- the clips' totals of order 2 (as over FSDP2's DTensor
    gradients) and inf, that parameter's own norm -- and torch's clip with ``error_if_nonfinite``
    raises on every rank, as over FSDP2's (Note [a non-finite gradient held alike on one rank] in
    fusedist/fsdp/held_alike.py). The norms took the first tensor-parallel rank's figure: finite
    everywhere, the clip scaled the inf by a finite coefficient. FSDP2's clip of order inf drops a
    NaN (gloo's max all-reduce), where the unsharded model's norm is NaN: ours keeps it, also
    where the max all-reduce drops NaN (NCCL's), by the NaN flags of every rank."""
    for rank, out in enumerate(_plain_results(results, "nonfinite")):
        for case, read in out.items():
            kind, where = case.split()[:2]
            name = "3.weight" if where == "head" else "2.bias"
            what = (rank, case, read)
            if "fsdp2 2.0" in read:  # the reference: FSDP2's norm on every rank
                assert read["fsdp2 2.0"] == kind, what
                assert read["fsdp2 inf"] == (kind if kind == "inf" else "finite"), what
            for order in ("2.0", "inf"):
                assert read[f"torch {order}"] == read[f"fusedist {order}"] == kind, (order, what)
                per = read[f"per parameter {order}"]
                assert per[name] == kind and all(v == "finite" for n, v in per.items() if n != name), (order, what)
            assert "non-finite" in read["raises"], what


# ------------------------------------------------------------- HSDP with tensor parallelism
def _unsharded_reference(seed: int, dp_world: int, steps: int = 3, clip: float = 0.5) -> tuple:
    """The model trained as ``_train`` trains it on ``dp_world`` data-parallel ranks, in one
    process on the global batch: each step the mean of every rank's loss on its own batch (the
    gradient fully_shard averages over the data-parallel ranks), the clip, fp32 AdamW. Returns
    (each rank's losses, the clip's norms, the model, the optimizer)."""
    torch.manual_seed(seed)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gens = [torch.Generator().manual_seed(seed + r) for r in range(dp_world)]
    losses, norms = [[] for _ in range(dp_world)], []
    for _ in range(steps):
        per_rank = []
        for g in gens:
            ids = torch.randint(0, VOCAB, (4, 6), generator=g)
            per_rank.append(nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()))
        (sum(per_rank) / dp_world).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        for r, loss in enumerate(per_rank):
            losses[r].append(loss.item())
    return losses, norms, model, opt


def _hsdp_worker(rank, world_size, seed, root):
    """torchtitan's 3-D mesh: (replicate 2, shard 2, tensor-parallel 2), fully_shard on the
    (dp_replicate, dp_shard) mesh. Training is checked against the unsharded model on the global
    batch (in each rank's process: FSDP2's DTensor training on 8 ranks of 2 cores cost most of
    the launch; training parity with FSDP2 under tensor parallelism is the 4-rank test's), and
    the checkpoints against FSDP2 models on the same mesh."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import fusedist

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dp = mesh["dp_replicate", "dp_shard"]
    dp_rank = mesh["dp_replicate"].get_local_rank() * 2 + mesh["dp_shard"].get_local_rank()
    full = StateDictOptions(full_state_dict=True)
    out = {}
    ours = _build(mesh, fusedist.fully_shard, seed, dp=dp)
    opt, losses, norms = _train(ours, mesh, seed, clip=0.5, dp_rank=dp_rank)
    ref_losses, ref_norms, ref, ref_opt = _unsharded_reference(seed, 4)
    out["fp32"] = ((losses, norms), (ref_losses[dp_rank], ref_norms))
    whole = get_model_state_dict(ours, options=full)
    out["model state"] = _max_diff(whole, ref.state_dict())
    state = get_optimizer_state_dict(ours, opt, options=full)["state"]
    ref_state = {name: ref_opt.state[p] for name, p in ref.named_parameters()}
    out["optimizer state"] = max(_max_diff({k: v for k, v in state[name].items() if k != "step"},
                                           {k: v for k, v in ref_state[name].items() if k != "step"})
                                 for name in ref_state)

    # torch's distributed checkpoint both ways with FSDP2 on the same mesh (untrained FSDP2 models:
    # what is interchanged is the layout of the chunks, not training)
    theirs = _build(mesh, torch_fully_shard, seed + 2, dp=dp)
    # the entries read as DTensors: (Replicate(), _StridedShard or Shard, tensor-parallel placements) on
    # the 3-D mesh, as FSDP2's (Note [entries read as DTensors] in fusedist/fsdp/dtensor_view.py)
    twin = _build(mesh, fusedist.fully_shard, seed + 2, dp=dp)
    out["as dtensors"] = _dtensor_mismatch(_as_dtensors(twin.state_dict()), _as_dtensors(theirs.state_dict()), 0.0)
    out.update(_dcp_both_ways(mesh, seed, root, (ours, whole), (theirs, get_model_state_dict(theirs, options=full)),
                              dp=dp))

    # fusedist.checkpoint (Note [tensor-parallel checkpoints]): one replica's pieces, a parameter
    # the tensor-parallel ranks hold alike written by the first of them; loaded exactly
    fusedist.checkpoint.save(os.path.join(root, "fusedist"), ours)
    fresh = _build(mesh, fusedist.fully_shard, seed + 1, dp=dp)
    fusedist.checkpoint.load(os.path.join(root, "fusedist"), fresh)
    out["fusedist.checkpoint"] = _max_diff(fusedist.fsdp.full_state_dict(fresh), whole)

    # one rank's inf: every rank skips (rank 7 shares no shard group with rank 0; the flag
    # reaches it over the tensor-parallel and replicate groups)
    _, out["scaler"] = _scaler_step_with_inf_on(7, rank, _build(mesh, fusedist.fully_shard, seed, dp=dp), seed)

    # a tensor-parallel group across the data-parallel mesh's diagonal (rank 0 with rank 6: in
    # neither its shard group {0, 2} nor its replicate group {0, 4}) overlaps that mesh too
    diagonal = DeviceMesh("cpu", torch.tensor([[0, 6], [2, 4], [1, 7], [3, 5]]), mesh_dim_names=("pair", "tp"))
    block = _Block()
    parallelize_module(block, diagonal["tp"], {"ffn.w1": ColwiseParallel()})
    with pytest.raises(ValueError) as refused:
        fusedist.fully_shard(block, mesh=dp)
    out["diagonal"] = str(refused.value)
    return out


def test_hsdp_with_tensor_parallelism_matches_the_unsharded_model_and_fsdp2_checkpoints(tmp_path):
    """fully_shard on (dp_replicate, dp_shard) over tensor-parallel modules, on 8 ranks: training
    with the clip and the full model and optimizer state dicts as the unsharded model's on the
    global batch, torch's distributed checkpoint both ways with FSDP2 on the same 3-D mesh, the
    state-dict entries' to_local(), placements and device_mesh as FSDP2's, the GradScaler's skip,
    and a tensor-parallel mesh that overlaps the data-parallel one refused on every rank
    (accumulation without sync is tested under HSDP and under tensor parallelism apart:
    test_fully_shard_hsdp.py, the 2-D test above)."""
    seed = int(torch.randint(0, 10_000, ()).item())
    # (pg_timeout: 8 ranks time-share 2 loaded cores; a collective may wait on a descheduled rank)
    per_rank = run_distributed(_hsdp_worker, 8, seed, str(tmp_path), timeout=300, pg_timeout=120)
    for rank, out in enumerate(per_rank):
        # fp32, gradients summed in another order than the one process's (over shard, replicate and
        # tensor-parallel groups): a few ulps, amplified a little by three AdamW steps
        for got, want in zip(*out["fp32"]):  # losses, then clip norms
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6,
                                       msg=f"seed {seed}, rank {rank}")
        assert out["model state"] < 1e-5 and out["optimizer state"] < 1e-5, (seed, rank, out)
        assert out["dcp ours->torch"] == 0.0 and out["dcp torch->ours"] == 0.0, (seed, rank, out)
        assert out["fusedist.checkpoint"] == 0.0, (seed, rank, out)
        assert out["as dtensors"] == [], (seed, rank, out["as dtensors"])
    assert [out["scaler"] for out in per_rank] == [(True, 128.0)] * 8
    for rank, out in enumerate(per_rank):
        assert "overlap the data-parallel group's" in out["diagonal"], (rank, out["diagonal"])
