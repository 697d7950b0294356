"""HSDP: ``fully_shard`` over a 2-D mesh ``(dp_replicate, dp_shard)`` against torch's FSDP2 with
the same mesh, world 4 on gloo (2 replicas x 2 shards), on fresh random inputs (the seed is in
every failure message). Note [replicate all-reduce] in fusedist/fsdp/replicate.py.

Tolerances. fp32: both libraries reduce the same way -- each reduction adds the two values of
a group once (a + b: one rounding, commutative), the shard group's sum then the replicate
group's, each ``avg`` (or sum, then one division by the same factor in the forced-sum
reference): the same roundings, so gradients, losses and AdamW's weights are compared bit for
bit. fp16 ``reduce_dtype`` with a factor that leaves a division after the sum (the default
R*S = 4: 2 before, 2 after; 3.0): FSDP2 divides in fp16, fusedist in the fp32 shard, one fp16
rounding apart (``FP16``: rtol 2^-10, the
module docstring of test_fully_shard_api_parity.py). bf16 compute (``param_dtype``): the same
ops on the same bf16 values with fp32 reduction, so bit for bit as well. A skipped or doubled
all-reduce is off by a factor of 2 or a different replica's gradient: far outside all of these.

FSDP2 on gloo cannot run its reduction for a divide factor other than the shard size (a
PreMulSum): its reference there runs with ``set_force_sum_reduction_for_comms(True)``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from fusedist.testing import run_distributed
from test_fully_shard_api_parity import EXACT, FP16, _check_grads, _check_params, _ids, _loss, _pair, _seed

WORLD, REPLICAS, SHARDS = 4, 2, 2


def _mesh2d():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("dp_replicate", "dp_shard"))


def _units(model) -> list:
    return [m for m in model.modules() if hasattr(m, "set_reshard_after_backward")]


def _mp_pair(mesh, param_dtype=None, reduce_dtype=None):
    import fusedist
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    return _pair(mesh, wrap_embed=True,
                 ref_kw=dict(mp_policy=TorchMP(param_dtype=param_dtype, reduce_dtype=reduce_dtype)),
                 our_kw=dict(mp_policy=fusedist.MixedPrecisionPolicy(param_dtype=param_dtype,
                                                                      reduce_dtype=reduce_dtype)))


# ------------------------------------------------------------------------------ training
def _training(mesh, seed, rank, steps=3):
    """AdamW over several steps, fp32 and bf16 compute: the same losses, gradients and weights."""
    for param_dtype in (None, torch.bfloat16):
        what = f"seed {seed}, param_dtype={param_dtype}"
        ref, ours = _mp_pair(mesh, param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
        pieces = {n: tuple(p.shape) for n, p in ours.named_parameters()}
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
        for step in range(steps):
            batch = _ids(seed, rank, step)
            losses = []
            for model, opt in zip((ref, ours), opts):
                loss = _loss(model, *batch)
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[1], losses[0], **EXACT, msg=lambda m: f"{what}, step {step}: {m}")
            _check_grads(ref, ours, EXACT, f"{what}, step {step}")
            for opt in opts:
                opt.step()
                opt.zero_grad()
        _check_params(ref, ours, what)
        # pieces are per shard group: the replicas of a shard rank hold the same piece
        assert pieces == {n: tuple(p.shape) for n, p in ours.named_parameters()}
        mine = [p.detach().clone() for p in ours.parameters()]
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, mine)
        peer = rank ^ SHARDS  # the same shard rank in the other replica (mesh [[0, 1], [2, 3]])
        assert all(torch.equal(a, b) for a, b in zip(everyone[peer], mine)), f"{what}: replicas' pieces differ"


# ------------------------------------------------------------------------ reduction switches
def _accumulation(mesh, seed, rank, micro=3):
    """set_requires_gradient_sync(False) and set_requires_all_reduce(False) on all but the last
    micro-batch: FSDP2's gradients after the last one, and after each earlier one the same
    presence of .grad (none under requires_all_reduce(False): FSDP2 keeps the partial sum aside)."""
    for switch in ("set_requires_gradient_sync", "set_requires_all_reduce"):
        what = f"seed {seed}: {switch}(False) on {micro - 1} of {micro} micro-batches"
        ref, ours = _pair(mesh, wrap_embed=True)
        for mb in range(micro):
            last = mb == micro - 1
            for model in (ref, ours):
                getattr(model, switch)(last, recurse=True)
                _loss(model, *_ids(seed, rank, mb), scale=1.0 / micro).backward()
            if not last:
                for model in (ref, ours):
                    assert all(p.grad is None for p in model.parameters()), f"{what}: .grad after micro-batch {mb}"
        _check_grads(ref, ours, EXACT, what)


def _divide_factor(mesh, seed, rank):
    """set_gradient_divide_factor (the total over R*S ranks) and forced sums, fp32 and fp16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    import fusedist

    cases = [  # reduce_dtype, factor, force_sum (fusedist's), tolerance
        (None, None, True, EXACT), (None, 1.0, False, EXACT), (None, 3.0, False, EXACT),
        (torch.float16, None, False, FP16), (torch.float16, 1.0, False, EXACT), (torch.float16, 3.0, False, FP16),
    ]
    for reduce_dtype, factor, force_sum, tol in cases:
        what = f"seed {seed}, reduce_dtype={reduce_dtype}, factor={factor}, force_sum={force_sum}"
        ref, ours = _pair(mesh, ref_kw=dict(mp_policy=TorchMP(reduce_dtype=reduce_dtype)),
                          our_kw=dict(mp_policy=fusedist.MixedPrecisionPolicy(reduce_dtype=reduce_dtype)))
        ref_forced = force_sum or (factor is not None and reduce_dtype != torch.float16)
        for model, forced in ((ref, ref_forced), (ours, force_sum)):
            for m in _units(model):
                if factor is not None:
                    m.set_gradient_divide_factor(factor)
                m.set_force_sum_reduction_for_comms(forced)
        for model in (ref, ours):
            _loss(model, *_ids(seed, rank, 0)).backward()
        _check_grads(ref, ours, tol, what)


def _all_reduce_hook(mesh, seed, rank):
    """The hook runs after the all-reduce across replicas (it sees the same shard on both
    replicas), once per unit and backward, and its in-place change reaches .grad, as FSDP2's;
    a stream is refused on HSDP, as FSDP2 refuses it."""
    ref, ours = _pair(mesh, wrap_embed=True)
    seen = {"ref": [], "ours": []}

    def hook_for(key):
        def hook(out):
            seen[key].append(out.detach().clone())
            out.mul_(2.0)  # elementwise: the same gradients in either layout
        return hook

    for key, model in (("ref", ref), ("ours", ours)):
        for m in _units(model):
            m.set_all_reduce_hook(hook_for(key))
        _loss(model, *_ids(seed, rank, 0)).backward()
    _check_grads(ref, ours, EXACT, f"seed {seed}: all-reduce hook")
    assert len(seen["ours"]) == len(seen["ref"]) == len(_units(ours))
    mine = torch.stack([t.sum() for t in seen["ours"]])
    everyone = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(everyone, mine)
    assert torch.equal(everyone[rank ^ SHARDS], mine), f"seed {seed}: the hook ran before the all-reduce"
    with pytest.raises(ValueError, match="stream cannot be set when using native HSDP"):
        ours.set_all_reduce_hook(lambda out: None, stream=object())
    # with requires_all_reduce(False) neither library runs the hook
    for key, model in (("ref", ref), ("ours", ours)):
        seen[key].clear()
        model.set_requires_all_reduce(False)
        _loss(model, *_ids(seed, rank, 1)).backward()
    assert seen["ours"] == seen["ref"] == []


def _clip_and_scaler(mesh, seed, rank):
    """fusedist.clip_grad_norm_ over the pieces gives torch's clip over FSDP2's DTensor
    gradients (the shard group's norm: replicas hold the same shard); GradScaler's found-inf
    flag raised on one rank skips the step on all four."""
    import fusedist

    ref, ours = _pair(mesh, wrap_embed=True)
    for model in (ref, ours):
        _loss(model, *_ids(seed, rank, 0)).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    got = fusedist.clip_grad_norm_(ours.parameters(), 0.05)
    torch.testing.assert_close(got, want.full_tensor() if hasattr(want, "full_tensor") else want,
                               rtol=1e-6, atol=0.0, msg=lambda m: f"seed {seed}: total norm: {m}")
    _check_grads(ref, ours, dict(rtol=1e-6, atol=1e-9), f"seed {seed}: clipped")

    scaler = fusedist.amp.GradScaler("cpu", init_scale=4.0)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt.zero_grad()
    scaler.scale(_loss(ours, *_ids(seed, rank, 1))).backward()
    if rank == WORLD - 1:  # an overflow on one rank of the other replica only
        next(p for p in ours.parameters() if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in ours.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, p) for a, p in zip(before, ours.parameters())), f"seed {seed}: rank {rank} stepped"
    assert scaler.get_scale() == 2.0


def _all_reduce_overlaps_the_next_unit(mesh, seed, rank):
    """Note [replicate all-reduce]: a unit's all-reduce across replicas is issued asynchronously
    when the next unit's reductions are issued and waited for only afterwards, so it runs while
    that unit's backward and reduce-scatter proceed, instead of stopping the backward."""
    _, ours = _pair(mesh, wrap_embed=True)
    unit = ours._fs_state().unit
    events = []

    def logged(comm, name, kind):
        inner = getattr(comm, name)

        def call(*args, tag="", async_op=False, **kwargs):
            label = tag.replace("fully_shard grads ", "").replace("fully_shard all-reduce ", "")  # the unit
            events.append((kind, label, async_op))
            handle = inner(*args, tag=tag, async_op=async_op, **kwargs)
            if kind == "ar" and async_op:
                wait = handle.wait

                def logged_wait(*a, **k):
                    events.append(("ar wait", label, None))
                    return wait(*a, **k)

                handle.wait = logged_wait
            return handle

        setattr(comm, name, call)

    logged(unit.comm, "reduce_scatter", "rs")
    logged(unit.replicate_comm, "all_reduce", "ar")
    try:
        _loss(ours, *_ids(seed, rank, 0)).backward()
    finally:
        for comm in (unit.comm, unit.replicate_comm):
            comm.__dict__.pop("reduce_scatter", None), comm.__dict__.pop("all_reduce", None)
    scatters = [label for kind, label, _ in events if kind == "rs"]
    assert len(scatters) >= 3 and len(set(scatters)) == len(scatters), events
    where = {(kind, label): i for i, (kind, label, _) in enumerate(events)}
    for k, label in enumerate(scatters):
        assert ("ar", label, True) in events, f"seed {seed}: all-reduce of {label} not asynchronous: {events}"
        if k + 1 < len(scatters):
            nxt = scatters[k + 1]
            assert where[("ar", label)] < where[("rs", nxt)] < where[("ar wait", label)], \
                f"seed {seed}: the all-reduce of {label} did not overlap the reduce-scatter of {nxt}: {events}"


def _reductions(rank, ws, seed):
    mesh = _mesh2d()
    _training(mesh, seed, rank)
    _accumulation(mesh, seed, rank)
    _divide_factor(mesh, seed, rank)
    _all_reduce_hook(mesh, seed, rank)
    _clip_and_scaler(mesh, seed, rank)
    _all_reduce_overlaps_the_next_unit(mesh, seed, rank)
    return True


def test_hsdp_training_and_reductions_match_fsdp2():
    """Over a (2 replicate x 2 shard) mesh: AdamW steps in fp32 and bf16 compute give FSDP2's
    losses, gradients and weights, pieces are per shard group; gradient-sync and all-reduce
    micro-batching, divide factors (fp32, fp16), the all-reduce hook, the global clip and
    GradScaler's found-inf behave as FSDP2's; each all-reduce overlaps the next unit's reduction."""
    seed = _seed()
    assert run_distributed(_reductions, WORLD, seed) == [True] * WORLD, f"seed {seed}"


# ------------------------------------------------------------------------------ checkpoints
def _full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _check_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], **EXACT, msg=lambda m: f"{what}: {k}: {m}")


def _written_once(where: str, full: dict, what: str) -> None:
    """Every element of every parameter is in exactly one saved chunk (replicas hold the same
    pieces: DCP's planner keeps one copy of each)."""
    import math

    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(where).read_metadata().state_dict_metadata
    for k, v in full.items():
        chunks = meta[f"model.{k}"].chunks
        assert sum(math.prod(c.sizes) for c in chunks) == v.numel(), f"{what}: {k}: {len(chunks)} chunks"


def _checkpoints(rank, ws, seed, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    import fusedist

    mesh = _mesh2d()
    ref, ours = _pair(mesh, wrap_embed=True)
    for model in (ref, ours):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _loss(model, *_ids(seed, rank, 0)).backward()
        opt.step()
    want = _full(ref)
    _check_same(_full(ours), want, f"seed {seed}: full state dict (torch's helper)")
    _check_same(fusedist.fsdp.full_state_dict(ours), want, f"seed {seed}: full_state_dict")

    ours_dir, ref_dir = os.path.join(root, "hsdp"), os.path.join(root, "fsdp2")
    dcp.save({"model": ours.state_dict()}, checkpoint_id=ours_dir)
    dcp.save({"model": ref.state_dict()}, checkpoint_id=ref_dir)
    if rank == 0:
        _written_once(ours_dir, want, f"seed {seed}: fusedist HSDP checkpoint")
    one_d = init_device_mesh("cpu", (WORLD,))
    loads = [  # (checkpoint, how the loading model is sharded)
        (ours_dir, "fusedist HSDP", "fusedist", mesh), (ours_dir, "fusedist 1-D", "fusedist", one_d),
        (ours_dir, "FSDP2 HSDP", "torch", mesh), (ref_dir, "fusedist HSDP", "fusedist", mesh),
        (ref_dir, "fusedist 1-D", "fusedist", one_d),
    ]
    for where, into, lib, m in loads:
        fresh_ref, fresh_ours = _pair(m, wrap_embed=True)
        fresh = fresh_ours if lib == "fusedist" else fresh_ref
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=where)
        fresh.load_state_dict(state["model"])
        _check_same(_full(fresh), want, f"seed {seed}: {os.path.basename(where)} loaded into {into}")


# -------------------------------------------------------------------------------- refusals
def _refusals(rank, ws):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    import fusedist

    def refused(mesh, match):
        with pytest.raises(ValueError, match=match):
            fusedist.fully_shard(nn.Linear(4, 4), mesh=mesh)

    refused(init_device_mesh("cpu", (1, REPLICAS, SHARDS), mesh_dim_names=("pp", "dp_replicate", "dp_shard")),
            r"mesh must be 1-D \(shard\) or 2-D \(replicate, shard: HSDP\), got a 3-D mesh")
    refused(init_device_mesh("cpu", (REPLICAS, SHARDS)), "needs mesh_dim_names")
    refused(init_device_mesh("cpu", (SHARDS, REPLICAS), mesh_dim_names=("dp_shard", "dp_replicate")),
            "dim 0 must be the replicate dim and dim 1 the shard dim")
    refused(init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("dp", "tp")), "has a dim named 'tp'")

    # a rank given the 2-D mesh, its shard peer only the shard dim of it: reported at the first
    # forward, on every rank, before an all-reduce the peer would never issue hangs
    mesh = _mesh2d()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    mine = mesh if rank % SHARDS == 0 else mesh["dp_shard"]
    fusedist.fully_shard(model[0], mesh=mine)
    fusedist.fully_shard(model, mesh=mine)
    with pytest.raises(fusedist.RankMismatchError) as caught:
        model(torch.randn(2, 4))
    text = str(caught.value)
    assert "wrapping of the model" in text and "a 2-D (HSDP) mesh: 2 replica(s) x 2 shards" in text, text
    assert "a 1-D mesh: 1 replica(s) x 2 shards" in text, text


# ---------------------------------------------------------------------------------- stalls
def _stalled_all_reduce(rank, ws, seed):
    """The other replica (ranks 2, 3) skips a backward: ranks 0 and 1 finish their
    reduce-scatter and wait in the all-reduce across replicas, which fails within the
    collective timeout naming the unit and with the stall report, as a reduce-scatter would."""
    import datetime

    from torch.distributed import distributed_c10d

    from fusedist.comm import CollectiveError

    os.environ["FUSEDIST_TIMEOUT_S"] = "4"  # read by the communicators of the fresh mesh below
    mesh = _mesh2d()
    _, ours = _pair(mesh, wrap_embed=True)
    _loss(ours, *_ids(seed, rank, 0)).backward()
    store = distributed_c10d._get_default_store()
    if rank >= SHARDS:  # alive, in no collective, until the peers have raised
        store.wait([f"raised {r}" for r in range(SHARDS)], datetime.timedelta(seconds=60))
        return None
    with pytest.raises(CollectiveError) as caught:
        _loss(ours, *_ids(seed, rank, 1)).backward()
    store.set(f"raised {rank}", "yes")
    return str(caught.value)


def _checkpoints_and_refusals(rank, ws, seed, root):
    _checkpoints(rank, ws, seed, root)
    _refusals(rank, ws)
    return _stalled_all_reduce(rank, ws, seed)


def test_hsdp_checkpoints_interchange_and_refusals(tmp_path):
    """An HSDP model's full state dict is FSDP2's; its DCP checkpoint holds each element once
    and loads into fusedist HSDP, a 1-D fully_shard model over the world and FSDP2-HSDP, and an
    FSDP2-HSDP checkpoint loads into fusedist (HSDP and 1-D). A 3-D mesh, a 2-D mesh without
    names, with the shard dim first or with a non-data-parallel dim are refused by name; ranks
    whose meshes differ (2-D against 1-D) raise RankMismatchError at the first forward; an
    all-reduce a replica never joins fails within the timeout with the stall report."""
    seed = _seed()
    out = run_distributed(_checkpoints_and_refusals, WORLD, seed, str(tmp_path))
    assert out[SHARDS:] == [None] * (WORLD - SHARDS), f"seed {seed}: {out}"
    for rank, message in enumerate(out[:SHARDS]):
        assert "fully_shard all-reduce" in message and "Stall report" in message, f"rank {rank}: {message}"
    # The report is over the replicate group, whose rank 0 is global rank 1 on the second shard.
    assert "rank 0 (global rank 1) on" in out[1], out[1]
