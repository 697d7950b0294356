"""The layout of a fully_shard model's NF4 weights in torch's distributed checkpoint (DCP).

``dcp.save(model.state_dict())`` of a ``fully_shard`` QLoRA model holds each NF4 weight as its
canonical bytes; NF4 weights of other scaler block sizes can have the same byte count, and such
a checkpoint loaded into one of them -- through ``fusedist.checkpoint.load`` or torch's
``dcp.load`` into the model's state dict -- gave other numbers, silently. The chunks now record
the layout (Note [the layout of quantized storage in DCP] in fusedist/fsdp/dcp.py): a mismatch
is refused by name with both layouts, a matching load gives the saved model's outputs, and a
checkpoint without the record still loads.
"""

from __future__ import annotations

import os

import pytest
import torch

from fusedist.testing import run_distributed

EXACT = dict(rtol=0, atol=0)
REFUSED = r"0\.weight' .*quantization_factor \(2,\).*quantization_factor \(4,\).*block sizes"


def _worker(rank, world, path):
    import torch.distributed.checkpoint as dcp

    import fusedist
    from fusedist.checkpoint import CheckpointError, load
    from fusedist.fsdp.dcp import ShardedPiece
    from test_checkpoint_nf4_dcp_pipelined_block_sizes_and_given_up_dir import _other_scaler_blocks, _outputs
    from test_qlora_nf4 import qlora_model, shard

    def sharded(seed, other=False):
        m = qlora_model(seed)
        return shard(_other_scaler_blocks(m) if other else m, fusedist.fully_shard)

    def dcp_load(m, directory):
        sd = m.state_dict()
        dcp.load({"model": sd}, checkpoint_id=os.path.join(path, directory))
        m.load_state_dict(sd)

    src = sharded(0)
    dcp.save({"model": src.state_dict()}, checkpoint_id=os.path.join(path, "new"))
    old = src.state_dict()  # (a checkpoint written before the layout was recorded)
    for v in old.values():
        if isinstance(v, ShardedPiece):
            v._fs_layout = None
    dcp.save({"model": old}, checkpoint_id=os.path.join(path, "old"))
    # other scaler block sizes, same byte count: refused by name, nothing loaded
    for what, m, loader, error in [
            ("fusedist load -> fully_shard", sharded(1, other=True), lambda m: load(os.path.join(path, "new"), m),
             CheckpointError),
            ("fusedist load -> ddp", fusedist.DistributedDataParallel(_other_scaler_blocks(qlora_model(1))),
             lambda m: load(os.path.join(path, "new"), m), CheckpointError),
            ("dcp.load -> fully_shard", sharded(1, other=True), lambda m: dcp_load(m, "new"), BaseException)]:
        before = _outputs(m)
        with pytest.raises(error, match=REFUSED):
            loader(m)
        torch.testing.assert_close(_outputs(m), before, **EXACT, msg=what)
    # the same layout loads the saved model, with the record and without it
    for what, directory, loader in [("fusedist load", "new", lambda m, d: load(os.path.join(path, d), m)),
                                    ("dcp.load", "new", dcp_load), ("fusedist load, old", "old",
                                    lambda m, d: load(os.path.join(path, d), m)), ("dcp.load, old", "old", dcp_load)]:
        m = sharded(1)
        loader(m, directory)
        torch.testing.assert_close(_outputs(m), _outputs(src), **EXACT, msg=what)


def test_nf4_layout_is_recorded_in_torch_dcp_and_other_block_sizes_are_refused(tmp_path):
    pytest.importorskip("torchao")
    run_distributed(_worker, 2, str(tmp_path), timeout=120)
