"""Checkpointer background writes and ``load`` under a slow disk and a replaced checkpoint,
found by probing and kept as regression tests: 2 gloo ranks, small models, a short collective
timeout (Note [waiting for a peer's I/O] in fusedist/checkpoint/_writer.py)."""

import os
import shutil
import time

import torch
from torch import nn

import models
from fusedist.testing import run_distributed

SHORT_TIMEOUT = {"FUSEDIST_TIMEOUT_S": "2", "FUSEDIST_STALL_REPORT_S": "1"}
SLOW_S = 2.7  # longer than the collective timeout


def _slow_disk_worker(rank, world_size, root):
    """Step 1: rank 1's file takes longer than the collective timeout to write; step 2: rank 0's
    retention does. Every save must complete (as torch DCP's async_save, whose waits are bounded
    by its process group's 30-minute timeout), and so must the saves after them."""
    import fusedist
    import fusedist.checkpoint._files as files
    from fusedist.checkpoint import Checkpointer, layout

    torch.manual_seed(0)
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, every_steps=1, keep=None)
    ckpt.restore(model, opt)
    real_save, real_retain = files.atomic_torch_save, layout.retain

    def slow_save(path, obj):
        time.sleep(SLOW_S)
        return real_save(path, obj)

    def slow_retain(*args):
        time.sleep(SLOW_S)
        return real_retain(*args)

    gen, params_at, outcome = torch.Generator().manual_seed(0), {}, {}  # the ranks hold one model
    for step in range(1, 4):
        x, y = models.MLP.batch(gen)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        params_at[step] = models.flat_params(model).clone()
        files.atomic_torch_save = slow_save if (step == 1 and rank == 1) else real_save
        layout.retain = slow_retain if (step == 2 and rank == 0) else real_retain
        try:
            ckpt.save(step)
            ckpt.wait()
            outcome[step] = "ok"
        except Exception as exc:  # noqa: BLE001 - what the test reports
            outcome[step] = f"{type(exc).__name__}: {exc}"[:300]
    files.atomic_torch_save, layout.retain = real_save, real_retain
    ckpt.close()
    loaded = {}
    for step in range(1, 4):
        entry = layout.entry(root, step)
        if entry is not None and entry.complete:
            fresh = models.MLP()
            fusedist.checkpoint.load(layout.step_dir(root, step), fresh)
            loaded[step] = torch.equal(models.flat_params(fresh), params_at[step])
    return outcome, loaded


def test_a_write_slower_than_the_collective_timeout_breaks_no_save(tmp_path):
    results = run_distributed(_slow_disk_worker, 2, str(tmp_path), env=SHORT_TIMEOUT, timeout=90)
    for rank, (outcome, loaded) in enumerate(results):
        assert outcome == {1: "ok", 2: "ok", 3: "ok"}, (rank, outcome)
        assert loaded == {1: True, 2: True, 3: True}, (rank, loaded)


def _two_layers(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))


def test_load_reads_one_manifest_when_the_checkpoint_is_replaced_meanwhile(tmp_path, monkeypatch):
    """An ordinary checkpoint replaced by a pipelined one just after ``load`` read its manifest:
    the load reads one of them whole -- never the new manifest with the old one's reader, which
    found no model key (an error with strict=True, nothing loaded with strict=False)."""
    from fusedist import checkpoint
    from fusedist.checkpoint import _files

    target_dir, newer_dir = str(tmp_path / "ckpt"), str(tmp_path / "newer")
    older, newer = _two_layers(1), _two_layers(2)
    checkpoint.save(target_dir, older)
    checkpoint.save(newer_dir, [newer], pipeline=True)
    real, swapped = _files.read_manifest_and_digest, []

    def read_then_replace(directory):
        out = real(directory)
        if not swapped:
            swapped.append(directory)
            os.rename(target_dir, target_dir + ".old")
            shutil.copytree(newer_dir, target_dir)
        return out

    for strict in (True, False):
        if swapped:
            shutil.rmtree(target_dir)
            os.rename(target_dir + ".old", target_dir)
            swapped.clear()
        monkeypatch.setattr(_files, "read_manifest_and_digest", read_then_replace)
        model = _two_layers(3)
        checkpoint.load(target_dir, model, strict=strict)
        monkeypatch.setattr(_files, "read_manifest_and_digest", real)
        assert swapped, strict
        for key, value in model.state_dict().items():
            assert torch.equal(value, newer.state_dict()[key]), (strict, key)


def _slow_sync_save_worker(rank, world_size, root):
    """``fusedist.checkpoint.save`` whose rank 0 takes longer than the collective timeout to write
    its file: the save completes, and the job's process group still works (torch's dcp.save
    waits as long as its process group's timeout allows)."""
    import fusedist
    import fusedist.checkpoint._files as files

    torch.manual_seed(0)
    model = models.MLP()
    real_save = files.atomic_torch_save

    def slow_save(path, obj):
        time.sleep(SLOW_S)
        return real_save(path, obj)

    files.atomic_torch_save = slow_save if rank == 0 else real_save
    outcome = []
    try:
        fusedist.checkpoint.save(root, model)
        outcome.append("saved")
    except Exception as exc:  # noqa: BLE001 - what the test reports
        outcome.append(f"{type(exc).__name__}: {exc}"[:300])
    files.atomic_torch_save = real_save
    total = torch.full((2,), float(rank + 1))
    try:
        torch.distributed.all_reduce(total)
        outcome.append(total.tolist())
    except Exception as exc:  # noqa: BLE001
        outcome.append(f"{type(exc).__name__}: {exc}"[:300])
    fresh = models.MLP()
    fusedist.checkpoint.load(root, fresh)
    return outcome, torch.equal(models.flat_params(fresh), models.flat_params(model))


def test_a_sync_save_slower_than_the_collective_timeout_keeps_the_group_working(tmp_path):
    results = run_distributed(_slow_sync_save_worker, 2, str(tmp_path), env=SHORT_TIMEOUT, timeout=90)
    for rank, (outcome, loaded) in enumerate(results):
        assert outcome == ["saved", [3.0, 3.0]], (rank, outcome)
        assert loaded, rank
