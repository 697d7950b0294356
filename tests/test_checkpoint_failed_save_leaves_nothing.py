"""A save that fails on one rank (a full disk, a value that cannot be pickled, a user's
state_dict hook raising, a rank killed mid-write) raises on every rank naming that rank and the
cause, keeps the checkpoint the directory held, and leaves nothing new behind: no directory,
no rank file, no temporary (Note [a failed save leaves nothing] in
fusedist/checkpoint/_failed_save.py). The next save to the same path succeeds. 2 ranks on gloo;
the saved tensors are compared bitwise with the model's own (a save and load copies bytes, no
arithmetic), and the pipelined parts with the parameters they saved."""

import errno
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from fusedist.testing import run_distributed
from shared_rank_launch import launch_for_selected, results_of

# A failure must be raised at once, not after a collective timed out: the timeout is long.
SLOW_TIMEOUT = {"FUSEDIST_TIMEOUT_S": "30"}
CAUSES = {"full disk": "No space left on device", "unpicklable extra": "Can't pickle", "hook": "state_dict hook failed"}


def _tree(path: str):
    """Every name under ``path`` (None when it does not exist)."""
    if not os.path.exists(path):
        return None
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, dirs, files in os.walk(path) for n in dirs + files)


def _full_disk(path, obj):
    raise OSError(errno.ENOSPC, "No space left on device")


def _raising_hook(*args, **kwargs):
    raise RuntimeError("state_dict hook failed")


def _attempt(rank: int, fail_rank: int, how: str, save, hooked: nn.Module, path: str):
    """Run ``save()`` with ``how`` injected on ``fail_rank``; (error text or None, seconds, what
    ``path`` holds when the save returned), seen by every rank before any rank goes on."""
    import fusedist.checkpoint._files as files

    real, hook = files.atomic_torch_save, None
    if rank == fail_rank and how == "full disk":
        files.atomic_torch_save = _full_disk
    if rank == fail_rank and how == "hook":
        hook = hooked.register_state_dict_pre_hook(_raising_hook)
    start = time.monotonic()
    try:
        save()
        error = None
    except Exception as exc:  # noqa: BLE001 - reported back to the test
        error = f"{type(exc).__name__}: {exc}"
    finally:
        files.atomic_torch_save = real
        if hook is not None:
            hook.remove()
    seconds = time.monotonic() - start
    left = _tree(path)
    dist.barrier()
    return error, seconds, left


def _plain_worker(rank, world_size, root):
    import fusedist
    from fusedist.checkpoint import load

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(models.MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    warnings.filterwarnings("ignore", message=".*cannot be read back by load")  # (the unpicklable extra)
    for case, fail_rank, how, extra in (("fresh, full disk", 1, "full disk", None),
                                        ("fresh, unpicklable extra", 0, "", {"f": lambda: 0}),
                                        ("fresh, hook", 1, "hook", None)):
        path = os.path.join(root, case.replace(" ", "_").replace(",", ""))
        out[case] = _attempt(rank, fail_rank, how, lambda: fusedist.checkpoint.save(
            path, model, opt, extra=extra, per_rank={"rank": rank}), model.module, path)
    path = os.path.join(root, "kept")
    fusedist.checkpoint.save(path, model, opt, per_rank={"rank": rank})
    saved = models.flat_params(model).clone()
    before = _tree(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    for case, fail_rank, how in (("over, full disk", 0, "full disk"), ("over, hook", 1, "hook")):
        error, seconds, left = _attempt(rank, fail_rank, how, lambda: fusedist.checkpoint.save(
            path, model, opt, per_rank={"rank": rank}), model.module, path)
        fresh = models.MLP()
        load(path, fresh)
        out[case] = (error, seconds, left == before, torch.equal(models.flat_params(fresh), saved))
    fusedist.checkpoint.save(os.path.join(root, "fresh_full_disk"), model, opt)  # the next save succeeds
    fresh = models.MLP()
    load(os.path.join(root, "fresh_full_disk"), fresh)
    out["again"] = torch.equal(models.flat_params(fresh), models.flat_params(model))
    return out


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The failed saves of the plain, pipelined and Checkpointer tests in one launch (the killed
    rank's test has its own: it ends a rank)."""
    root = lambda: str(tmp_path_factory.mktemp("failed-save"))  # noqa: E731
    return launch_for_selected(request, {
        "test_a_failed_save_raises_on_every_rank_and_leaves_nothing_new": {"plain": (_plain_worker, (root(),))},
        "test_a_failed_pipelined_save_raises_on_every_rank_and_leaves_nothing_new": {
            "pipelined": (_pipelined_worker, (root(),))},
        "test_a_failed_checkpointer_save_leaves_no_step_directory": {
            "checkpointer": (_checkpointer_worker, (root(),))},
    }, 2, timeout=120, env=SLOW_TIMEOUT)


def test_a_failed_save_raises_on_every_rank_and_leaves_nothing_new(launched):
    results = results_of(launched, "plain")
    for rank, out in enumerate(results):
        for case, fail_rank in (("fresh, full disk", 1), ("fresh, unpicklable extra", 0), ("fresh, hook", 1)):
            error, seconds, left = out[case]
            assert error is not None and error.startswith("CheckpointError"), (rank, case, error)
            assert f"rank {fail_rank} " in error and CAUSES[case.split(", ")[1]] in error, (rank, case, error)
            assert seconds < 10, (rank, case, seconds)  # raised at once, not at the collective timeout
            assert left is None, (rank, case, left)  # the directory the save made is gone
        for case in ("over, full disk", "over, hook"):
            error, seconds, unchanged, loads = out[case]
            assert error is not None and CAUSES[case.split(", ")[1]] in error and seconds < 10, (rank, case, error)
            assert unchanged and loads, (rank, case, unchanged, loads)  # the old checkpoint, as it was
        assert out["again"], rank


def _pipelined_worker(rank, world_size, root):
    """A pipelined save (one stage per rank) failing on rank 1, fresh and over a checkpoint."""
    import fusedist
    from fusedist.checkpoint import load

    groups = [dist.new_group([0]), dist.new_group([1])]
    torch.manual_seed(rank)
    part = nn.ModuleDict({f"stage{rank}": nn.Linear(4, 4)})
    path, out = os.path.join(root, "pipelined"), {}

    def save():
        fusedist.checkpoint.save(path, part, None, per_rank={"rank": rank}, process_group=groups[rank], pipeline=True)

    for case in ("full disk", "hook"):
        out[f"fresh, {case}"] = _attempt(rank, 1, case, save, part, path)
    save()
    saved, before = {k: v.clone() for k, v in part.state_dict().items()}, _tree(path)
    with torch.no_grad():
        part[f"stage{rank}"].weight.add_(1.0)
    for case in ("full disk", "hook"):
        error, seconds, left = _attempt(rank, 1, case, save, part, path)
        out[f"over, {case}"] = (error, seconds, left == before)
    fresh = nn.ModuleDict({f"stage{rank}": nn.Linear(4, 4)})
    load(path, [fresh], process_group=groups[rank], pipeline=True)
    out["loaded"] = all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    return out


def test_a_failed_pipelined_save_raises_on_every_rank_and_leaves_nothing_new(launched):
    for rank, out in enumerate(results_of(launched, "pipelined")):
        for case in ("fresh, full disk", "fresh, hook"):
            error, seconds, left = out[case]
            assert error is not None and "rank 1 " in error and CAUSES[case.split(", ")[1]] in error, (rank, error)
            assert seconds < 10 and left is None, (rank, case, seconds, left)
        for case in ("over, full disk", "over, hook"):
            error, seconds, unchanged = out[case]
            assert error is not None and seconds < 10 and unchanged, (rank, case, error, unchanged)
        assert out["loaded"], rank


def _checkpointer_worker(rank, world_size, root):
    import fusedist.checkpoint._files as files
    from fusedist.checkpoint import Checkpointer, load, layout

    torch.manual_seed(0)
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, keep=None)
    ckpt.restore(model, opt)
    ckpt.save(1)
    ckpt.wait()
    out, real = {}, files.atomic_torch_save
    for step, fail_rank in ((2, 1), (2, None), (2, 0)):  # fails, is saved again, fails rewriting it
        if fail_rank is None:
            saved = models.flat_params(model).clone()
        before = _tree(root)
        if rank == fail_rank:
            files.atomic_torch_save = _full_disk
        try:
            ckpt.save(step)
            ckpt.wait()
            error = None
        except Exception as exc:  # noqa: BLE001 - reported back to the test
            error = f"{type(exc).__name__}: {exc}"
        files.atomic_torch_save = real
        out[(step, fail_rank)] = (error, _tree(root) == before)  # (the ranks leave a save together)
        dist.barrier()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    ckpt.close()
    out["steps"] = [(e.step, e.complete) for e in layout.scan(root)]
    fresh = models.MLP()
    load(layout.step_dir(root, 2), fresh)
    out["loaded"] = torch.equal(models.flat_params(fresh), saved)
    return out


def test_a_failed_checkpointer_save_leaves_no_step_directory(launched):
    results = results_of(launched, "checkpointer")
    for rank, out in enumerate(results):
        for key in ((2, 1), (2, 0)):
            error, unchanged = out[key]
            assert error is not None and f"rank {key[1]} could not write" in error, (rank, key, error)
            assert "No space left on device" in error, (rank, key, error)
            assert unchanged, (rank, key)  # no step-2 left by the fresh save; the rewrite leaves no file
        assert out[(2, None)][0] is None, (rank, out[(2, None)])
        assert out["steps"] == [(2, True), (1, True)], (rank, out["steps"])
        assert out["loaded"], rank


def _killed_worker(rank, world_size, root):
    import fusedist
    import fusedist.checkpoint._files as files
    from fusedist.checkpoint import load

    torch.manual_seed(0)
    model = models.MLP()
    fusedist.checkpoint.save(root, model, per_rank={"rank": rank})
    saved, before = models.flat_params(model).clone(), _tree(root)
    real = files.atomic_write

    def killed_mid_write(path, write):
        def partial(f):
            f.write(b"\0" * 64)
            f.flush()
            os._exit(3)  # the process dies with its temporary half-written
        return real(path, partial)

    if rank == 1:
        files.atomic_write = killed_mid_write
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    start = time.monotonic()
    try:
        fusedist.checkpoint.save(root, model, per_rank={"rank": rank})
        error = None
    except Exception as exc:  # noqa: BLE001 - reported back to the test
        error = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()  # (a load with the dead rank in the group would wait for it)
    fresh = models.MLP()
    load(root, fresh)
    return error, time.monotonic() - start, _tree(root) == before, torch.equal(models.flat_params(fresh), saved)


def test_a_rank_killed_mid_write_is_named_and_its_half_written_file_removed(tmp_path):
    """Rank 1 dies inside its write over a complete checkpoint: rank 0 names it once its beat
    stopped (the collective timeout, short here), and the directory holds the old checkpoint
    alone -- the dead rank's temporary and rank 0's new file are removed."""
    results = run_distributed(_killed_worker, 2, str(tmp_path), env={"FUSEDIST_TIMEOUT_S": "1.5"}, timeout=60,
                              expect_failure=True)
    assert results[1][0] == "error" and "exited with code 3" in results[1][1], results[1]
    status, value = results[0]
    assert status == "ok", results[0]
    error, seconds, unchanged, loads = value
    assert error is not None and "rank(s) [1]" in error, error
    assert seconds < 10, seconds
    assert unchanged and loads, (unchanged, loads)
