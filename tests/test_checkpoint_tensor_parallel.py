"""fusedist.checkpoint with ``fully_shard`` over tensor-parallel modules (Note [tensor-parallel
checkpoints] in fusedist/checkpoint/stage3.py): torchtitan's 2-D recipe on a 2x2 gloo mesh
(the model and plan of tests/test_fully_shard_tensor_parallel.py: a RowwiseParallel embedding
of 13 rows, uneven over 2 ranks; ColwiseParallel / RowwiseParallel linears; SequenceParallel
norms, Replicate()), trained with AdamW and the clip, saved with fusedist.checkpoint, and loaded

* into the same 2x2 layout, then trained on: the same losses as the uninterrupted run;
* at another tensor-parallel degree (a 1x4 mesh: 4 tensor-parallel ranks), restored by a
  ``Checkpointer`` from its background save;
* without tensor parallelism: a 1-D fully_shard over the 4 ranks, and an unsharded model with
  torch's AdamW on every rank (the whole parameters and optimizer state, as a DDP run reads them);

and a torch FSDP2 + tensor-parallel model's distributed checkpoint loaded by fusedist.checkpoint.

Exactness: a load moves values and never computes them, so right after each load the global
parameters and the full optimizer state equal the trained model's bit for bit (FSDP2's
``get_model_state_dict`` / ``get_optimizer_state_dict`` with full state dicts, or the unsharded
model's own). The format: region fragments of the global parameters (Note [region fragments]
in fusedist/zero/box_fragments.py), a version-4 manifest.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from fusedist.testing import run_distributed

from test_fully_shard_tensor_parallel import VOCAB, _build, _Net, _train


def _full(model, opt) -> tuple[dict, dict]:
    """The global parameters and the full optimizer state by parameter name (a collective;
    copies: the ``step`` entries would otherwise alias the optimizer's, which steps on)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)
    copies = lambda d: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.items()}  # noqa: E731
    return (copies(get_model_state_dict(model, options=full)),
            {name: copies(s) for name, s in get_optimizer_state_dict(model, opt, options=full)["state"].items()})


def _differences(got: tuple, want: tuple) -> list:
    """Names whose values are not bit for bit the wanted ones (parameters, then optimizer state)."""
    (model, optim), (ref_model, ref_optim) = got, want
    assert model.keys() == ref_model.keys() and optim.keys() == ref_optim.keys(), (sorted(model), sorted(ref_model))
    bad = [k for k in ref_model if not torch.equal(model[k], ref_model[k])]
    for name, state in ref_optim.items():
        assert state.keys() == optim[name].keys(), (name, sorted(state), sorted(optim[name]))
        bad += [f"{name}/{k}" for k, v in state.items()
                if not torch.equal(torch.as_tensor(optim[name][k]), torch.as_tensor(v))]
    return bad


def _fresh_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _worker(rank, world_size, seed, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _build(mesh, fusedist.fully_shard, seed)
    opt, _, _ = _train(model, mesh, seed, clip=0.5)
    saved = _full(model, opt)
    where = os.path.join(root, "fusedist")
    fusedist.checkpoint.save(where, model, opt)
    periodic = fusedist.checkpoint.Checkpointer(os.path.join(root, "periodic"))  # saving in the background
    assert periodic.restore(model, opt) == 0  # a fresh root: registers what its saves hold
    periodic.save(3)
    periodic.close()

    # the same layout: exact, and training continues as the uninterrupted run
    fresh = _build(mesh, fusedist.fully_shard, seed + 1)  # other initial values, all overwritten
    fresh_opt = _fresh_optimizer(fresh)
    fusedist.checkpoint.load(where, fresh, fresh_opt)
    out["same layout"] = _differences(_full(fresh, fresh_opt), saved)
    out["continued"] = (_continue(fresh, fresh_opt, mesh, seed), _continue(model, opt, mesh, seed))

    # 4 tensor-parallel ranks (the embedding's 13 rows: 4, 3, 3, 3), restored by a Checkpointer
    wide = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    fresh = _build(wide, fusedist.fully_shard, seed + 2)
    fresh_opt = _fresh_optimizer(fresh)
    periodic = fusedist.checkpoint.Checkpointer(os.path.join(root, "periodic"), async_save=False)
    out["restored step"] = periodic.restore(fresh, fresh_opt)
    periodic.close()
    out["tp 4"] = _differences(_full(fresh, fresh_opt), saved)

    # no tensor parallelism: fully_shard over the 4 ranks, and an unsharded model on each rank
    torch.manual_seed(seed + 3)
    flat = _Net()
    for block in flat.blocks:
        fusedist.fully_shard(block)
    fusedist.fully_shard(flat)
    flat_opt = _fresh_optimizer(flat)
    fusedist.checkpoint.load(where, flat, flat_opt)
    out["fully_shard 4"] = _differences(_full(flat, flat_opt), saved)
    torch.manual_seed(seed + 4)
    plain = _Net()
    plain_opt = _fresh_optimizer(plain)
    fusedist.checkpoint.load(where, plain, plain_opt)
    names = dict(zip(range(len(list(plain.parameters()))), [n for n, _ in plain.named_parameters()]))
    out["unsharded"] = _differences(
        (plain.state_dict(), {names[i]: s for i, s in plain_opt.state_dict()["state"].items()}), saved)

    # torch FSDP2 + tensor parallelism, saved with torch's distributed checkpoint
    theirs = _build(mesh, torch_fully_shard, seed + 5)
    their_opt, _, _ = _train(theirs, mesh, seed + 5)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(theirs, their_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, "dcp"))
    fresh = _build(mesh, fusedist.fully_shard, seed + 6)
    fresh_opt = _fresh_optimizer(fresh)
    fusedist.checkpoint.load(os.path.join(root, "dcp"), fresh, fresh_opt)
    out["from FSDP2's dcp"] = _differences(_full(fresh, fresh_opt), _full(theirs, their_opt))
    return out


def _continue(model, opt, mesh, seed) -> list:
    """Losses of two more AdamW steps on fresh batches, continuing ``opt``'s state."""
    g = torch.Generator().manual_seed(seed + 100 + mesh["dp"].get_local_rank())
    losses = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (4, 6), generator=g)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_tensor_parallel_checkpoints_load_at_any_layout(tmp_path):
    seed = int(torch.randint(0, 10_000, ()).item())
    per_rank = run_distributed(_worker, 4, seed, str(tmp_path), timeout=300)
    for rank, out in enumerate(per_rank):
        for what in ("same layout", "tp 4", "fully_shard 4", "unsharded", "from FSDP2's dcp"):
            assert out[what] == [], (what, seed, rank, out[what])
        assert out["restored step"] == 3, (rank, out["restored step"])
        ours, uninterrupted = out["continued"]
        assert ours == uninterrupted, (seed, rank, ours, uninterrupted)

    with open(os.path.join(tmp_path, "fusedist", "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["version"] == 4 and manifest["world_size"] == 4, manifest
    # the RowwiseParallel weight (8, 16): every piece is a region of the global weight bounded
    # on both dims (rows of one tensor-parallel rank's block of 8 columns), together tiling it
    regions = []
    for r in range(4):
        shard = torch.load(os.path.join(tmp_path, "fusedist", f"rank-{r:05d}.pt"), weights_only=True)["model_shard"]
        k = shard["keys"].index("blocks.0.ffn.w2.weight")
        regions += [tuple(map(tuple, f["region"])) for f in shard["fragments"].get(k, [])]
    assert {cols for _, cols in regions} == {(0, 8), (8, 8)}, regions
    assert sum(rows[1] for rows, _ in regions) == 2 * 8, regions


def test_region_fragments_must_tile_the_parameter_once():
    import pytest
    from fusedist.zero import state as zstate

    whole = [torch.empty(4, 6, device="meta")]

    def frag(rows, cols, value=1.0):
        return {"region": (rows, cols), "master": torch.full((rows[1] * cols[1],), value), "state": {}}

    # four blocks, in any order, each in its place
    got = zstate.assemble({0: [frag((2, 2), (3, 3), 4), frag((0, 2), (0, 3), 1), frag((0, 2), (3, 3), 2),
                               frag((2, 2), (0, 3), 3)]}, whole, [0], source="s")
    want = torch.tensor([[1.0] * 3 + [2.0] * 3] * 2 + [[3.0] * 3 + [4.0] * 3] * 2)
    assert torch.equal(got[0]["master"].view(4, 6), want)
    for frags, why in (([frag((0, 2), (0, 6)), frag((1, 3), (0, 6))], "overlap"),  # rows 1 twice, 24 in all
                       ([frag((0, 2), (0, 6)), frag((2, 1), (0, 6))], "cover 18"),  # row 3 missing
                       ([frag((0, 4), (0, 3)), frag((0, 4), (3, 4))], "not a non-empty block"),  # past the end
                       ([frag((0, 2), (0, 6)), {"range": (12, 24), "master": torch.ones(12), "state": {}}],
                        "both box and range")):
        with pytest.raises(zstate.StateDictError, match=why):
            zstate.assemble({0: frags}, whole, [0], source="s")


def _settings_worker(rank, world_size, seed, root):
    """Tensor-parallel checkpoints under other settings: CPU offload, fusedist's FusedAdamW,
    bf16 gathers, reshard_after_forward=False with SGD's momentum; each saved at 2x2 and
    loaded at 1x4, exactly."""
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    wide = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    settings = {
        "offload": (dict(offload_policy=fusedist.CPUOffloadPolicy(pin_memory=False)), _fresh_optimizer),
        "FusedAdamW": ({}, lambda m: fusedist.optim.FusedAdamW(m.parameters(), lr=1e-2)),
        "bf16 gathers": (dict(mp_policy=fusedist.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                      reduce_dtype=torch.float32)), _fresh_optimizer),
        "reshard_after_forward=False": (dict(reshard_after_forward=False),
                                        lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)),
    }
    out = {}
    for name, (kwargs, make_optimizer) in settings.items():
        model = _build(mesh, fusedist.fully_shard, seed, **kwargs)
        opt = make_optimizer(model)
        _continue(model, opt, mesh, seed)
        saved = _full(model, opt)
        where = os.path.join(root, name)
        fusedist.checkpoint.save(where, model, opt)
        fresh = _build(wide, fusedist.fully_shard, seed + 1, **kwargs)
        fresh_opt = make_optimizer(fresh)
        fusedist.checkpoint.load(where, fresh, fresh_opt)
        out[name] = _differences(_full(fresh, fresh_opt), saved)
    return out


def test_tensor_parallel_checkpoints_under_other_settings(tmp_path):
    seed = int(torch.randint(0, 10_000, ()).item())
    per_rank = run_distributed(_settings_worker, 4, seed, str(tmp_path), timeout=300)
    for rank, out in enumerate(per_rank):
        for name, bad in out.items():
            assert bad == [], (name, seed, rank, bad)
