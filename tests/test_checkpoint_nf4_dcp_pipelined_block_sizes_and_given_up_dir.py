"""QLoRA NF4 weights across run kinds through torch DCP and pipelined checkpoints, NF4 block
sizes checked beyond the byte count, and no empty directory left by a failed save.

* A DCP checkpoint (``dcp.save`` of the model's state dict) of a ``fully_shard`` model loads into
  a DDP model and one of a DDP model into a ``fully_shard`` one, as fusedist's own checkpoints
  do (Note [quantized storage in a torch distributed checkpoint] in
  fusedist/checkpoint/_from_dcp.py): the DDP one failed with a raw traceback of NF4's copy_.
* A pipelined checkpoint (``pipeline=True``) crosses the same way, with the optimizer over all
  parameters.
* NF4 weights of other scaler block sizes can have the same canonical byte count: a
  ``fully_shard`` checkpoint records the layout, and a load into a weight of another layout is
  refused by name (it loaded other numbers, silently).
* A save given up on (a rank's storage hangs) into a directory rank 0 made for it leaves no
  empty directory once settled; a user's directory stays.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed

EXACT = dict(rtol=0, atol=0)


def _outputs(m) -> torch.Tensor:
    from test_qlora_nf4 import batch

    with torch.no_grad():
        return m(batch(9, 0, 1))


def _other_scaler_blocks(m: nn.Module) -> nn.Module:
    """``m`` with its first NF4 weight quantized at scaler block 128 (the default 256's byte count)."""
    from test_qlora_nf4 import _nf4

    m[0].weight = nn.Parameter(_nf4()[2](torch.randn(256, 128), block_size=64, scaler_block_size=128),
                               requires_grad=False)
    return m


def _nf4_worker(rank, world, path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fusedist
    from fusedist.checkpoint import CheckpointError, load, save
    from test_qlora_nf4 import qlora_model, shard

    def sharded(seed, other=False):
        m = qlora_model(seed)
        return shard(_other_scaler_blocks(m) if other else m, fusedist.fully_shard)

    src_sh, src_ddp = sharded(0), fusedist.DistributedDataParallel(qlora_model(2))
    dcp.save({"model": src_sh.state_dict()}, checkpoint_id=os.path.join(path, "dcp-sh"))
    dcp.save({"model": src_ddp.module.state_dict()}, checkpoint_id=os.path.join(path, "dcp-ddp"))
    save(os.path.join(path, "sh"), src_sh)
    group = dist.group.WORLD
    save(os.path.join(path, "pp-sh"), src_sh, torch.optim.AdamW(src_sh.parameters()), process_group=group,
         pipeline=True)
    save(os.path.join(path, "pp-ddp"), src_ddp.module, torch.optim.AdamW(src_ddp.parameters()), process_group=group,
         pipeline=True)
    # DCP: fully_shard -> DDP, DDP -> fully_shard, DDP -> DDP
    for what, directory, make, ref in [
            ("dcp fully_shard -> ddp", "dcp-sh", lambda: fusedist.DistributedDataParallel(qlora_model(1)), src_sh),
            ("dcp ddp -> fully_shard", "dcp-ddp", lambda: sharded(1), src_ddp),
            ("dcp ddp -> ddp", "dcp-ddp", lambda: fusedist.DistributedDataParallel(qlora_model(1)), src_ddp)]:
        m = make()
        load(os.path.join(path, directory), m)
        torch.testing.assert_close(_outputs(m), _outputs(ref), **EXACT, msg=what)
    # pipelined, with the optimizer over all parameters (the NF4 ones hold no state)
    for what, directory, m, ref in [("pipelined fully_shard -> plain", "pp-sh", qlora_model(1), src_sh),
                                    ("pipelined plain -> fully_shard", "pp-ddp", sharded(1), src_ddp)]:
        load(os.path.join(path, directory), m, torch.optim.AdamW(m.parameters()), process_group=group, pipeline=True)
        torch.testing.assert_close(_outputs(m), _outputs(ref), **EXACT, msg=what)
    # other scaler block sizes, same byte count: refused by name, into either kind, pipelined too
    for what, directory, m, kw in [("plain", "sh", fusedist.DistributedDataParallel(_other_scaler_blocks(
            qlora_model(1))), {}), ("fully_shard", "sh", sharded(1, other=True), {}),
            ("pipelined", "pp-sh", _other_scaler_blocks(qlora_model(1)), dict(process_group=group, pipeline=True))]:
        before = _outputs(m)
        with pytest.raises(CheckpointError, match=r"'0\.weight' .* quantization_factor \(2,\) .* quantization_factor "
                                                  r"\(4,\) .*block sizes"):
            load(os.path.join(path, directory), m, **kw)
        torch.testing.assert_close(_outputs(m), before, **EXACT, msg=what)  # (nothing loaded)


def test_nf4_weights_cross_through_dcp_and_pipelined_checkpoints_and_block_sizes_are_checked(tmp_path):
    pytest.importorskip("torchao")
    run_distributed(_nf4_worker, 2, str(tmp_path), timeout=240)


def _given_up_worker(rank, world, root):
    import datetime
    import time

    import fusedist
    from fusedist.checkpoint import CheckpointError, _writer, api, save

    model = fusedist.DistributedDataParallel(nn.Linear(4, 2))
    # A hanging disk, scaled down: rank 1's file of each given-up save takes 1.5 s, a save waits
    # 0.5 s for a peer's writes (Note [a plain save given up on] in fusedist/checkpoint/api.py).
    _writer.collective_timeout = lambda: datetime.timedelta(seconds=1)
    _writer.IO_LIMIT_S = 0.5
    real = api._write

    def slow(path, name, *args, **kwargs):
        if rank == 1 and not path.endswith("next"):
            time.sleep(1.5)
        return real(path, name, *args, **kwargs)

    api._write = slow
    for directory in (f"{root}/made", f"{root}/users"):  # made by the save; the user's own (empty)
        with pytest.raises(CheckpointError, match="given up"):
            save(directory, model, per_rank={"rank": rank})
        for _ in range(10):  # the next save settles the given-up one once the slow write ended
            try:
                save(f"{root}/next", model, per_rank={"rank": rank})
                break
            except CheckpointError as exc:
                assert "given up" in str(exc), exc
    return os.path.exists(f"{root}/made"), os.listdir(f"{root}/users")


def test_a_save_given_up_on_leaves_no_directory_it_made(tmp_path):
    os.makedirs(tmp_path / "users")
    results = run_distributed(_given_up_worker, 2, str(tmp_path), timeout=60, env={"FUSEDIST_TIMEOUT_S": "2"})
    assert results[0] == (False, [])
