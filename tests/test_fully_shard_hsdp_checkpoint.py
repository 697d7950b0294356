"""``fusedist.checkpoint`` of an HSDP ``fully_shard`` model (2 replicas x 2 shards, world 4 on
gloo), Note [HSDP checkpoints] in fusedist/checkpoint/stage3.py: a save writes one file per
rank and each element once (the first replica's ranks hold the pieces, the second's files
none); a load into a fresh HSDP model and optimizer continues training exactly as the run that
saved (fp32, the same operations in the same order: compared bit for bit); a 1-D
``fully_shard`` model over the 4 ranks and an HSDP model load each other's checkpoints with
the same whole parameters; the Checkpointer saves and restores it. Before, the two shard groups
each took themselves for the whole job and their saves into one directory collided.
"""

from __future__ import annotations

import os

import torch

from fusedist.testing import run_distributed
from test_fully_shard_api_parity import EXACT, LM, _ids, _loss, _seed

WORLD, REPLICAS, SHARDS = 4, 2, 2


def _model(mesh):
    import fusedist

    torch.manual_seed(0)
    model = LM()
    for block in model.blocks:
        fusedist.fully_shard(block, mesh=mesh)
    fusedist.fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model, opt, seed, rank, steps, first=0):
    for step in range(first, first + steps):
        _loss(model, *_ids(seed, rank, step)).backward()
        opt.step()
        opt.zero_grad()


def _whole(model) -> dict:
    from fusedist.fsdp import full_state_dict

    return {k: v.clone() for k, v in full_state_dict(model).items()}


def _same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], **EXACT, msg=lambda m: f"{what}: {k}: {m}")


def _worker(rank, ws, seed, root):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist

    hsdp = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("dp_replicate", "dp_shard"))
    flat = init_device_mesh("cpu", (WORLD,))
    saved = os.path.join(root, "hsdp")

    model, opt = _model(hsdp)
    _train(model, opt, seed, rank, 2)
    fusedist.checkpoint.save(saved, model, opt)
    at_save = _whole(model)
    _train(model, opt, seed, rank, 2, first=2)
    went_on = _whole(model)

    # One file per rank; the second replica's (ranks 2, 3 on the mesh [[0, 1], [2, 3]]) hold no piece.
    if rank == 0:
        for r in range(WORLD):
            shard = torch.load(os.path.join(saved, f"rank-{r:05d}.pt"), weights_only=False)
            pieces = len(shard["model_shard"]["fragments"]), len(shard["optimizer_shard"]["fragments"])
            assert (pieces == (0, 0)) == (r >= SHARDS), f"seed {seed}: rank {r}'s file holds {pieces} fragments"
    dist.barrier()

    # A fresh HSDP model and optimizer resume exactly.
    model, opt = _model(hsdp)
    fusedist.checkpoint.load(saved, model, opt)
    _same(_whole(model), at_save, f"seed {seed}, HSDP load")
    _train(model, opt, seed, rank, 2, first=2)
    _same(_whole(model), went_on, f"seed {seed}, HSDP resume")

    # A 1-D model over the 4 ranks reads it, and writes one an HSDP model reads.
    model, opt = _model(flat)
    fusedist.checkpoint.load(saved, model, opt)
    _same(_whole(model), at_save, f"seed {seed}, 1-D load of an HSDP save")
    flat_saved = os.path.join(root, "flat")
    fusedist.checkpoint.save(flat_saved, model, opt)
    model, opt = _model(hsdp)
    fusedist.checkpoint.load(flat_saved, model, opt)
    _same(_whole(model), at_save, f"seed {seed}, HSDP load of a 1-D save")

    # The Checkpointer: save a step, restore it into a fresh HSDP model.
    ckpt = fusedist.checkpoint.Checkpointer(os.path.join(root, "periodic"), keep=2)
    model, opt = _model(hsdp)
    assert ckpt.restore(model, opt) == 0
    _train(model, opt, seed, rank, 2)
    ckpt.save(2)
    ckpt.close()
    ckpt = fusedist.checkpoint.Checkpointer(os.path.join(root, "periodic"), keep=2)
    fresh, fresh_opt = _model(hsdp)
    assert ckpt.restore(fresh, fresh_opt) == 2
    ckpt.close()
    _same(_whole(fresh), _whole(model), f"seed {seed}, Checkpointer restore")
    return True


def test_hsdp_checkpoints_save_once_and_load_anywhere(tmp_path):
    seed = _seed()
    assert all(run_distributed(_worker, WORLD, seed, str(tmp_path), timeout=300))
