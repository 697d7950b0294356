"""``Checkpointer.restore`` where a host's view of the checkpoint lags (a network filesystem
showing another host's new files late): on another rank or on rank 0 itself (the manifest shows
before a file it lists), restore waits for the files and, when they do not show, fails naming
them instead of restoring an older checkpoint; a save whose rank 0 sees another rank's file late
waits for it instead of failing (Note [a checkpoint another rank does not see yet] in
fusedist/checkpoint/_visibility.py), and so does a plain load (Note [a plain load waits for lagging
files]). 2 gloo ranks, one launch."""

import os
import time
import warnings

import pytest
import torch

import models
from fusedist.testing import run_distributed


def _hide(path: str, seconds: float):
    """Make ``path`` look absent to this process for ``seconds`` (every stat, so every
    existence and size check); returns the undo."""
    real_stat, t0 = os.stat, time.monotonic()

    def stat(p, *args, **kwargs):
        if isinstance(p, str) and os.path.abspath(p) == path and time.monotonic() - t0 < seconds:
            raise FileNotFoundError(2, "No such file or directory", p)
        return real_stat(p, *args, **kwargs)

    os.stat = stat
    return lambda: setattr(os, "stat", real_stat)


def _lagging_worker(rank, world_size, root):
    import fusedist
    from fusedist.checkpoint import Checkpointer, layout

    def zero_model(seed):
        torch.manual_seed(seed)
        model = fusedist.DistributedDataParallel(models.MLP())
        return model, fusedist.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)

    model, opt = zero_model(0)
    ckpt = Checkpointer(root, every_steps=1, keep=None, async_save=False)
    ckpt.restore(model, opt)
    gen, saved = torch.Generator().manual_seed(rank), {}
    for step in (1, 2):
        x, y = models.MLP.batch(gen)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        ckpt.save(step)
        saved[step] = models.flat_params(model.module).clone()
    ckpt.close()
    torch.distributed.barrier()
    lagging = os.path.join(layout.step_dir(root, 2), "rank-00001.pt")
    out = {}
    # (case, the rank whose host lags, how long, how long restore may wait)
    for case, late, lag_s, wait_s in (("shows", 1, 1.0, "30"), ("never", 1, 60.0, "0.3"),
                                      ("rank 0 shows", 0, 1.0, "30"), ("rank 0 never", 0, 60.0, "0.3"),
                                      ("rank 0 shows, step=2", 0, 1.0, "30")):
        os.environ["FUSEDIST_CHECKPOINT_VISIBLE_S"] = wait_s
        undo = _hide(lagging, lag_s) if rank == late else (lambda: None)
        fresh, fresh_opt = zero_model(1)
        again = Checkpointer(root, every_steps=1, keep=None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                step = again.restore(fresh, fresh_opt, step=2 if case.endswith("step=2") else None)
            except Exception as exc:  # noqa: BLE001 - what the test checks
                step = f"{type(exc).__name__}: {exc}"
        undo()
        again.close()
        out[case] = (step, torch.equal(models.flat_params(fresh.module), saved[2]),
                     torch.equal(models.flat_params(fresh.module), saved[1]), [str(w.message) for w in caught])
    # A plain load where rank 1's host shows a rank file late: it waits too (it failed the load as
    # a lost file: Note [a plain load waits for lagging files]).
    os.environ["FUSEDIST_CHECKPOINT_VISIBLE_S"] = "30"
    undo = _hide(lagging, 1.0) if rank == 1 else (lambda: None)
    fresh, fresh_opt = zero_model(1)
    try:
        fusedist.checkpoint.load(layout.step_dir(root, 2), fresh, fresh_opt)
        outcome = "loaded"
    except Exception as exc:  # noqa: BLE001 - what the test checks
        outcome = f"{type(exc).__name__}: {exc}"
    undo()
    out["plain load"] = (outcome, torch.equal(models.flat_params(fresh.module), saved[2]))
    # Rank 0's host sees a rank file late when its save is about to list it: the save waits for
    # it (it failed, naming a misconfigured directory) -- a Checkpointer's and a plain one.
    os.environ["FUSEDIST_CHECKPOINT_VISIBLE_S"] = "30"
    for case in ("checkpointer save", "plain save"):
        where = os.path.join(root, case.replace(" ", "-"))
        written = layout.step_dir(where, 3) if case == "checkpointer save" else where
        undo = _hide(os.path.join(written, "rank-00001.pt"), 1.0) if rank == 0 else (lambda: None)
        try:
            if case == "checkpointer save":
                saving = Checkpointer(where, every_steps=1, async_save=False)
                saving.restore(model, opt)
                saving.save(3)
                saving.close()
            else:
                fusedist.checkpoint.save(where, model, opt)
            outcome = "saved"
        except Exception as exc:  # noqa: BLE001 - what the test checks
            outcome = f"{type(exc).__name__}: {exc}"
        undo()
        fresh, fresh_opt = zero_model(1)
        if outcome == "saved":
            fusedist.checkpoint.load(written, fresh, fresh_opt)
        out[case] = (outcome, torch.equal(models.flat_params(fresh.module), saved[2]))
    return out


def test_restore_and_save_wait_for_a_lagging_rank_file_and_never_fall_back_past_it(tmp_path):
    t0 = time.perf_counter()
    results = run_distributed(_lagging_worker, 2, str(tmp_path), timeout=120)
    for rank, out in enumerate(results):
        step, is_step2, is_step1, caught = out["shows"]
        assert (step, is_step2) == (2, True), (rank, out["shows"])
        assert not any("trying the previous one" in w for w in caught), (rank, caught)
        step, is_step2, is_step1, caught = out["never"]
        assert isinstance(step, str) and step.startswith("CheckpointError"), (rank, step)
        assert "rank 1 does not see rank-00001.pt (not there)" in step, (rank, step)
        assert "FUSEDIST_CHECKPOINT_VISIBLE_S" in step and "step 2" in step, (rank, step)
        assert not is_step1, rank  # the older checkpoint was not loaded in its place
        # Rank 0's host: the manifest shows before the file it lists (a copy under way, a lagging view).
        step, is_step2, is_step1, caught = out["rank 0 shows"]
        assert (step, is_step2) == (2, True), (rank, out["rank 0 shows"])
        assert not any("skipping incomplete" in w for w in caught), (rank, caught)
        assert out["rank 0 shows, step=2"][:2] == (2, True), (rank, out["rank 0 shows, step=2"])
        step, is_step2, is_step1, caught = out["rank 0 never"]
        assert isinstance(step, str) and step.startswith("CheckpointError"), (rank, step)
        assert "rank-00001.pt listed in the manifest is missing" in step and "step 2" in step, (rank, step)
        assert "FUSEDIST_CHECKPOINT_VISIBLE_S" in step and not is_step1, (rank, step)
        assert out["checkpointer save"] == ("saved", True), (rank, out["checkpointer save"])
        assert out["plain save"] == ("saved", True), (rank, out["plain save"])
        assert out["plain load"] == ("loaded", True), (rank, out["plain load"])
    assert time.perf_counter() - t0 < 60


def test_the_visibility_wait_setting_is_checked(monkeypatch):
    from fusedist.checkpoint import _visibility

    monkeypatch.delenv("FUSEDIST_CHECKPOINT_VISIBLE_S", raising=False)
    assert _visibility.wait_limit() == _visibility.DEFAULT_WAIT_S
    monkeypatch.setenv("FUSEDIST_CHECKPOINT_VISIBLE_S", "0")
    assert _visibility.wait_limit() == 0.0
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv("FUSEDIST_CHECKPOINT_VISIBLE_S", bad)
        with pytest.raises(ValueError, match="FUSEDIST_CHECKPOINT_VISIBLE_S must be a finite number"):
            _visibility.wait_limit()
