"""Checkpoints of QLoRA models across run kinds, and a plain save after one given up on.

* A frozen NF4 weight (torchao's ``NF4Tensor``) is held by ``fully_shard`` as bytes and saved as
  its canonical bytes, by DDP, ZeRO and plain models as the subclass: each checkpoint loads into
  the other kind, as every other weight does (Note [quantized storage across run kinds] in
  fusedist/checkpoint/_load_plan.py), with the optimizer over all parameters too, and through
  the Checkpointer, whose snapshot stages the subclass's inner tensors. The loaded model's
  outputs and continued losses equal the saved model's bit for bit (same NF4 bytes, same fp32
  adapters, the same AdamW on both sides). A weight of other block sizes is refused by name.
* ``fusedist.checkpoint.save`` after a save given up on a hanging disk waits for the slow rank
  before its first collective, as a Checkpointer's save does (Note [a plain save given up on] in
  fusedist/checkpoint/api.py): it started the collective at once, which timed out on the rank
  still writing and broke the process group for good.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed

pytest.importorskip("torchao")

EXACT = dict(rtol=0, atol=0)


def _qlora(seed: int) -> nn.Sequential:
    from test_qlora_nf4 import qlora_model

    return qlora_model(seed)


def _kinds():
    import fusedist
    from test_qlora_nf4 import shard

    return {"fsdp": lambda s: shard(_qlora(s), fusedist.fully_shard),
            "ddp": lambda s: fusedist.DistributedDataParallel(_qlora(s)),
            "plain": _qlora}


def _optimizers():
    import fusedist

    return {"adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
            "zero2": lambda m: fusedist.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2, stage=2)}


def _outputs(m) -> torch.Tensor:
    from test_qlora_nf4 import batch

    with torch.no_grad():
        return m(batch(9, 0, 1))


def _qlora_worker(rank, world, path):
    import fusedist
    from fusedist.checkpoint import CheckpointError
    from test_qlora_nf4 import _nf4, steps

    kinds, optimizers = _kinds(), _optimizers()
    for (src, src_opt), (dst, dst_opt), periodic in [(("fsdp", "adamw"), ("ddp", "adamw"), False),
                                                     (("ddp", "zero2"), ("fsdp", "adamw"), False),
                                                     (("ddp", "adamw"), ("fsdp", "adamw"), True)]:
        what = f"{src} ({src_opt}) -> {dst} ({dst_opt}){' by a Checkpointer' if periodic else ''}"
        saved = kinds[src](0)
        opt = optimizers[src_opt](saved)
        steps(saved, opt, range(1), rank, world)
        directory = os.path.join(path, what.replace(" ", "_"))
        loaded = kinds[dst](1)
        loaded_opt = optimizers[dst_opt](loaded)
        assert not torch.equal(_outputs(loaded), _outputs(saved))
        if periodic:  # (its snapshot stages the NF4 weights of the DDP model)
            saver = fusedist.checkpoint.Checkpointer(directory)
            saver.restore(saved, opt)
            saver.save(3)
            saver.close()
            restorer = fusedist.checkpoint.Checkpointer(directory)
            assert restorer.restore(loaded, loaded_opt) == 3, what
            restorer.close()
        else:
            fusedist.checkpoint.save(directory, saved, opt)
            fusedist.checkpoint.load(directory, loaded, loaded_opt)
        torch.testing.assert_close(_outputs(loaded), _outputs(saved), **EXACT, msg=what)
        torch.testing.assert_close(steps(loaded, loaded_opt, (5,), rank, world),
                                   steps(saved, opt, (5,), rank, world), **EXACT, msg=what)
    # saved sharded at two ranks, loaded by a plain model at one
    import torch.distributed as dist

    sharded = kinds["fsdp"](0)
    steps(sharded, optimizers["adamw"](sharded), range(1), rank, world)
    fusedist.checkpoint.save(os.path.join(path, "sharded"), sharded)
    expected = _outputs(sharded)
    single = dist.new_group([0])
    if rank == 0:
        plain = _qlora(1)
        fusedist.checkpoint.load(os.path.join(path, "sharded"), plain, process_group=single)
        torch.testing.assert_close(_outputs(plain), expected, **EXACT)
        # a weight of other block sizes is refused by name, never loaded as other bytes
        other = _qlora(1)
        other[0].weight = nn.Parameter(_nf4()[2](torch.randn(256, 128), block_size=32), requires_grad=False)
        with pytest.raises(CheckpointError, match=r"'0\.weight' .* 16992 bytes of quantized storage .* has "):
            fusedist.checkpoint.load(os.path.join(path, "sharded"), other, process_group=single)
        fusedist.checkpoint.save(os.path.join(path, "other-blocks"), other, process_group=single)
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"'0\.weight' .* NF4Tensor .* inner tensors are .* same block sizes"):
        fusedist.checkpoint.load(os.path.join(path, "other-blocks"), kinds["fsdp"](1))


def test_nf4_checkpoints_cross_between_fully_shard_ddp_zero_and_plain_models(tmp_path):
    run_distributed(_qlora_worker, 2, str(tmp_path))


def _given_up_worker(rank, world, root):
    import fusedist
    from fusedist import checkpoint
    from fusedist.checkpoint import CheckpointError, _writer, api

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(nn.Linear(6, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A hanging disk, scaled down: a save waits 1 s for a peer's writes, the collectives 2 s
    # (FUSEDIST_TIMEOUT_S), and rank 1's file of the first save takes 4 s.
    _writer.collective_timeout = lambda: datetime.timedelta(seconds=1)
    _writer.IO_LIMIT_S = 0.5
    real = api._write

    def slow(path, name, *args, **kwargs):
        if rank == 1 and path.endswith("given-up"):
            time.sleep(4.0)
        return real(path, name, *args, **kwargs)

    api._write = slow
    out = {}
    try:
        checkpoint.save(f"{root}/given-up", model, opt, per_rank={"rank": rank})
        out["first"] = "saved"
    except CheckpointError as exc:
        out["first"] = str(exc)
    with torch.no_grad():
        model.module.weight.add_(1.0)
    for attempt in range(10):  # each raises on every rank until the slow write has ended
        try:
            checkpoint.save(f"{root}/next", model, opt, extra={"attempt": attempt}, per_rank={"rank": rank})
            break
        except CheckpointError as exc:
            assert "given up" in str(exc), exc
    loaded = nn.Linear(6, 4)
    out["extra"] = checkpoint.load(f"{root}/next", loaded)
    out["loaded"] = torch.equal(loaded.weight, model.module.weight)
    out["attempt"] = attempt
    # (its claim and files, removed once settled, and the directory rank 0 made for it)
    out["left"] = sorted(os.listdir(f"{root}/given-up")) if os.path.isdir(f"{root}/given-up") else None
    return out


def test_a_plain_save_after_one_given_up_on_waits_for_the_slow_rank(tmp_path):
    results = run_distributed(_given_up_worker, 2, str(tmp_path), timeout=60, env={"FUSEDIST_TIMEOUT_S": "2"})
    for out in results:
        assert "storage seems to hang" in out["first"] and "given up" in out["first"]
        assert out["loaded"] and out["extra"] == {"attempt": out["attempt"]}
    assert results[0]["left"] is None
