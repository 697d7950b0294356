"""Checkpointer failures found by probing (full disk during an asynchronous save), each kept
as a regression test: 2 ranks on gloo, small models, bounded collective timeouts."""

import errno

import torch

import models
from fusedist.testing import run_distributed

FAST_FAILURE = {"FUSEDIST_TIMEOUT_S": "10", "FUSEDIST_STALL_REPORT_S": "1"}


def _full_disk_worker(rank, world_size, root):
    """Rank 1's file of step 4 fails with ENOSPC in the background write. The error comes out of
    ``maybe_save(6)`` on every rank; the loop reports it, saves step 6 again and trains on."""
    import fusedist
    import fusedist.checkpoint._files as files
    from fusedist.checkpoint import CheckpointError, Checkpointer, layout

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(models.MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, every_steps=2, keep=None)
    ckpt.restore(model, opt)
    gen = torch.Generator().manual_seed(rank)
    real_save, errors, params_at = files.atomic_torch_save, [], {}

    def full_disk(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    for step in range(10):
        x, y = models.MLP.batch(gen)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        params_at[step + 1] = models.flat_params(model).clone()
        if step + 1 == 4:
            ckpt.wait()  # step 2 is written before the disk fills
            if rank == 1:
                files.atomic_torch_save = full_disk
        try:
            ckpt.maybe_save(step + 1)
        except CheckpointError as exc:
            files.atomic_torch_save = real_save  # space freed
            errors.append((step + 1, str(exc)))
            ckpt.save(step + 1)  # what the error says to do
    ckpt.close()
    complete = {s: (layout.entry(root, s) is not None and layout.entry(root, s).complete) for s in (2, 4, 6, 8, 10)}
    restored = {}
    for s in (2, 6):
        fresh = models.MLP()
        fusedist.checkpoint.load(layout.step_dir(root, s), fresh)
        restored[s] = torch.equal(models.flat_params(fresh), params_at[s])
    return errors, complete, restored


def test_full_disk_during_async_save_is_reported_and_the_next_step_is_saved_on_retry(tmp_path):
    results = run_distributed(_full_disk_worker, 2, str(tmp_path), env=FAST_FAILURE, timeout=90)
    for rank, (errors, complete, restored) in enumerate(results):
        assert [s for s, _ in errors] == [6], (rank, errors)
        message = errors[0][1]
        assert "saving step 4" in message and "rank 1 could not write" in message, message
        assert "No space left on device" in message, message
        # The step whose save raised the error is named as not saved, with what to do.
        assert "The checkpoint of step 6 was not saved" in message and "call save(6) again" in message, message
        # The previous checkpoint is kept, the failed one skipped, the later ones written.
        assert complete == {2: True, 4: False, 6: True, 8: True, 10: True}, (rank, complete)
        assert restored == {2: True, 6: True}, (rank, restored)
