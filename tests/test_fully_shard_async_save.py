"""fully_shard state dicts through ``torch.distributed.checkpoint.async_save`` (Note [staging a
piece] in fusedist/fsdp/dcp.py): the staged copy holds each rank's piece, so a checkpoint
saved while training goes on loads the weights and optimizer state of the step it was taken
at, bit for bit, as torch's FSDP2 does in the same run.
"""

from __future__ import annotations

import os

import pytest
import torch

from fusedist.testing import run_distributed
from test_fully_shard_dcp import _full, _make, _train


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _async_worker(rank, ws, where):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ckpt_group = dist.new_group(backend="gloo")  # the save's collectives run beside training's
    out = {}
    for kind in ("ours", "torch"):
        model = _make(kind, ws, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        _train(model, opt, rank, ws, 0, 2)
        at_save = _full(model)
        msd, osd = get_state_dict(model, opt)
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(where, kind),
                                process_group=ckpt_group)
        _train(model, opt, rank, ws, 2, 4)  # the weights and the state change while the save runs
        future.result()

        fresh = _make(kind, ws, 1)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        _train(fresh, fresh_opt, rank, ws, 0, 1)  # other values everywhere, state included
        msd, osd = get_state_dict(fresh, fresh_opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(where, kind))
        set_state_dict(fresh, fresh_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        out[kind, "loaded"] = _diff(_full(fresh), at_save)
        _train(fresh, fresh_opt, rank, ws, 2, 4)
        out[kind, "continued"] = _diff(_full(fresh), _full(model))
    return out


def test_async_save_while_training_loads_the_saved_step(tmp_path):
    for rank, out in enumerate(run_distributed(_async_worker, 2, str(tmp_path), timeout=300)):
        for kind in ("ours", "torch"):
            assert out[kind, "loaded"] == 0.0, (rank, kind, out)
            assert out[kind, "continued"] == 0.0, (rank, kind, out)


def test_the_default_stager_keeps_the_piece_and_a_plain_copy_is_refused():
    """No process group needed: a piece of a 4 x 3 parameter (elements [4, 10), rows cut
    mid-row) staged by torch's default stager, and copied into a whole-shaped tensor."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    from fusedist.fsdp.dcp import ShardedPiece

    flat = torch.arange(20, dtype=torch.float32)  # the piece's neighbours live in the same storage
    piece = ShardedPiece.wrap(flat[4:10], (4, 3), 4, 10)
    staged = StateDictStager().stage({"w": piece})["w"]
    assert isinstance(staged, ShardedPiece)
    assert staged.shape == piece.shape and staged.size() == torch.Size((4, 3))
    assert torch.equal(staged.local(), flat[4:10]) and staged.element_range == (4, 10)
    assert staged.__create_chunk_list__() == piece.__create_chunk_list__()
    flat[4:10] = -1.0
    assert torch.equal(staged.local(), torch.arange(4, 10, dtype=torch.float32))  # a copy, not an alias
    with pytest.raises(ValueError, match=r"whole parameter's shape \(4, 3\).*elements \[4, 10\)"):
        torch.empty(piece.size()).copy_(piece)
    torch.empty(piece.shape).copy_(piece)  # the piece's own shape is fine
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    with pytest.raises(ValueError, match="BlockingAsyncStager"):
        BlockingAsyncStager().stage({"w": piece})
