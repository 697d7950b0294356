"""``fusedist.checkpoint.load`` where a file the manifest lists shows late (a network
filesystem's lagging view, a checkpoint still being copied in): it waits up to
``FUSEDIST_CHECKPOINT_VISIBLE_S``, as a Checkpointer's restore does, instead of failing the load
as a lost or truncated file (Note [a plain load waits for lagging files] in
fusedist/checkpoint/_visibility.py). A file changed after the manifest is damaged and still
refused at once. A Checkpointer's restore whose rank 0 sees a file short likewise waits instead of
restoring the previous checkpoint. A file that is not arriving (removed long ago) fails a load and
a restore well under the limit (Note [a file that is not arriving]). Single process: rank 0's own
view lags; the 2-rank cases (another rank's view) are in test_checkpoint_restore_lagging_files.py
and, for a restore of a file not arriving, here (one launch).

Reference: torch's ``load_state_dict`` of the saved model and optimizer state, stepped on the
same inputs: fp32, the same arithmetic on the same values, so exactly equal.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings

import pytest
import torch
from torch import nn

from fusedist import checkpoint
from fusedist.checkpoint import CheckpointError


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _steps(model, opt, seeds) -> None:
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(5, 4, generator=gen)), torch.randn(5, 2, generator=gen)).backward()
        opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _continues_as_torch(model, opt, model_state, opt_state, seeds) -> None:
    """The loaded model and optimizer equal torch's AdamW given the saved state, now and after
    further steps (the same fp32 operations: bitwise)."""
    reference = _net(1)
    reference.load_state_dict(model_state)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch_opt.load_state_dict(opt_state)
    assert torch.equal(_flat(model), _flat(reference))
    _steps(model, opt, seeds)
    _steps(reference, torch_opt, seeds)
    assert torch.equal(_flat(model), _flat(reference))


@pytest.fixture
def saved(tmp_path):
    model = _net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, (1, 2))
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, model, opt)
    return path, model.state_dict(), opt.state_dict()


def _late(path: str, short: bool) -> str:
    """Hide common.pt (or leave a short copy of it, written before the manifest, at its name);
    returns where the whole file waits."""
    name = os.path.join(path, "common.pt")
    aside = name + ".arriving"
    os.rename(name, aside)
    if short:
        with open(aside, "rb") as f, open(name, "wb") as out:
            out.write(f.read()[:100])
        written = os.stat(os.path.join(path, "manifest.json")).st_mtime
        os.utime(name, (written - 5, written - 5))
    return aside


@pytest.mark.parametrize("short", [False, True], ids=["missing", "short"])
def test_a_plain_load_waits_for_a_file_that_shows_late(saved, monkeypatch, short):
    path, model_state, opt_state = saved
    monkeypatch.setenv("FUSEDIST_CHECKPOINT_VISIBLE_S", "30")
    aside = _late(path, short)
    arrives = threading.Timer(0.8, os.replace, (aside, os.path.join(path, "common.pt")))
    arrives.start()
    model = _net(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    t0 = time.monotonic()
    try:
        checkpoint.load(path, model, opt)
    finally:
        arrives.join()
    assert time.monotonic() - t0 >= 0.7  # (it did wait for the file)

    _continues_as_torch(model, opt, model_state, opt_state, (3, 4))


def test_a_file_that_never_shows_fails_after_the_wait_and_a_damaged_one_at_once(saved, monkeypatch):
    path, _, _ = saved
    monkeypatch.setenv("FUSEDIST_CHECKPOINT_VISIBLE_S", "0.3")
    damaged = path + "-damaged"
    shutil.copytree(path, damaged)
    _late(path, short=False)
    model = _net(1)
    before = _flat(model).clone()
    with pytest.raises(CheckpointError, match=r"rank 0 does not see common\.pt \(missing\), after waiting 0\.3 s "
                                              r"\(FUSEDIST_CHECKPOINT_VISIBLE_S\).*Nothing was loaded"):
        checkpoint.load(path, model)
    assert torch.equal(before, _flat(model))
    # truncated after the checkpoint was complete: not late, so not waited for
    monkeypatch.setenv("FUSEDIST_CHECKPOINT_VISIBLE_S", "30")
    with open(os.path.join(damaged, "common.pt"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(damaged, "common.pt")) - 10)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"common\.pt has \d+ bytes, the manifest says \d+ \(truncated"):
        checkpoint.load(damaged, model)
    assert time.monotonic() - t0 < 10 and torch.equal(before, _flat(model))


def _old_manifest(monkeypatch) -> None:
    """The manifest as a load sees it an hour after it was written (its inode change time
    cannot be back-dated, so the load's clock is moved on instead)."""
    from fusedist.checkpoint import _visibility

    monkeypatch.setattr(_visibility, "_wall_clock", lambda: time.time() + 3600)


def test_a_file_that_is_not_arriving_fails_without_the_whole_wait(saved, monkeypatch):
    """Note [a file that is not arriving]: the manifest older than the wait limit and nothing in
    the directory changing, a missing file is not waited for the whole limit."""
    from fusedist.checkpoint._visibility import QUIET_S

    path, _, _ = saved
    monkeypatch.setenv("FUSEDIST_CHECKPOINT_VISIBLE_S", "30")
    _old_manifest(monkeypatch)
    _late(path, short=False)
    model = _net(1)
    before = _flat(model).clone()
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"rank 0 does not see common\.pt \(missing\)\. Its manifest was "
                                              r"written more than 30 s ago.*not arriving.*Nothing was loaded"):
        checkpoint.load(path, model)
    assert QUIET_S <= time.monotonic() - t0 < 15 and torch.equal(before, _flat(model))


def _copied_in(aside: str, path: str, seconds: float) -> None:
    """Copy ``aside`` to ``path`` over ``seconds``, as a copy tool does: growing under a temporary
    name, renamed at the end."""
    with open(aside, "rb") as f:
        data = f.read()
    part, chunks = path + ".part", 10
    with open(part, "wb") as out:
        for i in range(chunks):
            out.write(data[i * len(data) // chunks:(i + 1) * len(data) // chunks])
            out.flush()
            time.sleep(seconds / chunks)
    os.replace(part, path)


@pytest.mark.parametrize("how", ["copied in under an old manifest", "late under a recent manifest"])
def test_a_file_still_arriving_is_waited_for_past_the_quiet_window(saved, monkeypatch, how):
    """The other side of Note [a file that is not arriving]: a file still being copied in (the
    directory changes) or a manifest not older than the limit (a host's view may lag) is waited
    for past QUIET_S, and the load then matches torch's load_state_dict of the saved state."""
    from fusedist.checkpoint._visibility import QUIET_S

    path, model_state, opt_state = saved
    monkeypatch.setenv("FUSEDIST_CHECKPOINT_VISIBLE_S", "30")
    aside = _late(path, short=False)
    target = os.path.join(path, "common.pt")
    if how.startswith("copied"):
        _old_manifest(monkeypatch)
        arrives = threading.Thread(target=_copied_in, args=(aside, target, QUIET_S + 1.5))
    else:
        arrives = threading.Timer(QUIET_S + 1.5, os.replace, (aside, target))
    arrives.start()
    model = _net(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        checkpoint.load(path, model, opt)
    finally:
        arrives.join()
    _continues_as_torch(model, opt, model_state, opt_state, (3,))


def test_a_checkpointer_waits_for_a_file_rank_0_sees_short(tmp_path, monkeypatch):
    """Rank 0 of a restore sees a listed file short, not changed since the manifest: a file still
    arriving, which restore waits for (it was taken as truncated and the previous checkpoint
    restored in its place, undoing a step)."""
    from fusedist.checkpoint import Checkpointer, layout

    root = str(tmp_path / "run")
    model = _net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(root, every_steps=1, keep=None, async_save=False) as ckpt:
        assert ckpt.restore(model, opt) == 0
        for step in (1, 2):
            _steps(model, opt, (step,))
            ckpt.save(step)
    model_state, opt_state = model.state_dict(), opt.state_dict()
    monkeypatch.setenv("FUSEDIST_CHECKPOINT_VISIBLE_S", "30")
    path = layout.step_dir(root, 2)
    aside = _late(path, short=True)
    arrives = threading.Timer(0.8, os.replace, (aside, os.path.join(path, "common.pt")))
    arrives.start()
    fresh = _net(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    try:
        with _no_skip_warning():
            with Checkpointer(root, every_steps=1, keep=None, async_save=False) as again:
                assert again.restore(fresh, fresh_opt) == 2
    finally:
        arrives.join()
    _continues_as_torch(fresh, fresh_opt, model_state, opt_state, (3,))


class _no_skip_warning:
    """Fails where restore warned that it skipped a checkpoint."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self._caught = self._catch.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        skipped = [str(w.message) for w in self._caught if "skipping" in str(w.message)]
        assert not skipped, skipped


def test_a_checkpointer_restore_stops_for_a_file_that_is_not_arriving(tmp_path, monkeypatch):
    """Note [a file that is not arriving] in a Checkpointer's restore: its newest checkpoint lost a
    listed file long ago (the manifest an hour old, nothing changing), so the restore fails well
    under the wait limit, naming the file, and restores nothing -- not the previous checkpoint
    either, which would undo a step (it waited the whole limit, 60 s by default)."""
    from fusedist.checkpoint import Checkpointer, layout
    from fusedist.checkpoint._visibility import QUIET_S

    root = str(tmp_path / "run")
    model = _net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(root, every_steps=1, keep=None, async_save=False) as ckpt:
        assert ckpt.restore(model, opt) == 0
        for step in (1, 2):
            _steps(model, opt, (step,))
            ckpt.save(step)
    monkeypatch.setenv("FUSEDIST_CHECKPOINT_VISIBLE_S", "30")
    _old_manifest(monkeypatch)
    os.remove(os.path.join(layout.step_dir(root, 2), "common.pt"))
    fresh = _net(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    before = _flat(fresh).clone()
    t0 = time.monotonic()
    with _no_skip_warning(), pytest.raises(CheckpointError, match=r"cannot restore step 2 .*common\.pt listed in "
                                                                  r"the manifest is missing.*not arriving"):
        with Checkpointer(root, every_steps=1, keep=None, async_save=False) as again:
            again.restore(fresh, fresh_opt)
    assert QUIET_S <= time.monotonic() - t0 < 15
    assert torch.equal(before, _flat(fresh)) and not fresh_opt.state


def _trained_run(root: str):
    """Steps 1 and 2 of a 2-rank DDP + AdamW run saved under ``root``; the model and optimizer
    state after step 1 (torch's own state dicts: the reference a fallback must restore)."""
    import copy

    from fusedist.checkpoint import Checkpointer

    model, opt = _ddp_run(0)
    with Checkpointer(root, every_steps=1, keep=None, async_save=False) as ckpt:
        ckpt.restore(model, opt)
        for step in (1, 2):
            _steps(model, opt, (step,))
            ckpt.save(step)
            if step == 1:
                first = copy.deepcopy((model.module.state_dict(), opt.state_dict()))
    torch.distributed.barrier()
    return first


def _ddp_run(seed: int):
    import fusedist

    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(_net(seed))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


class _Shown:
    """A file's stat as a host shows it: another size and modification time, the rest as it is."""

    def __init__(self, real, size: int, mtime: float):
        self._real, self.st_size, self.st_mtime, self.st_mtime_ns = real, size, mtime, int(mtime * 1e9)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _restore_with_rank_1_seeing(root: str, rank: int, shown):
    """Restore ``root``'s run on fresh objects while rank 1's ``os.stat`` of rank-00001.pt of step
    2 goes through ``shown(real stat)``; returns (restored step or the error, seconds, warnings,
    the fresh model and optimizer)."""
    from fusedist.checkpoint import Checkpointer, layout

    target, real_stat = os.path.abspath(os.path.join(layout.step_dir(root, 2), "rank-00001.pt")), os.stat

    def stat(p, *args, **kwargs):
        if rank == 1 and isinstance(p, str) and os.path.abspath(p) == target:
            return shown(p, real_stat)
        return real_stat(p, *args, **kwargs)

    model, opt = _ddp_run(1)
    os.stat = stat
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Checkpointer(root, every_steps=1, keep=None, async_save=False) as again:
                outcome = again.restore(model, opt)
    except CheckpointError as exc:
        outcome = str(exc)
    finally:
        os.stat = real_stat
    return outcome, time.monotonic() - t0, [str(w.message) for w in caught], model, opt


def _restore_on_a_damaged_view(rank, world_size, root):
    """Rank 1's host shows rank-00001.pt of the newest checkpoint 10 bytes short and modified now,
    after its manifest (truncated or replaced there since the save); rank 0 sees it whole. The
    manifest is recent and the wait limit 20 s: the restore waited the whole limit for a file that
    no lagging view explains, then refused. Damaged, it is a corrupt checkpoint: the previous one
    is restored at once, with a warning naming the rank and the file."""
    first = _trained_run(root)
    os.environ["FUSEDIST_CHECKPOINT_VISIBLE_S"] = "20"

    def shown(p, real_stat):
        real = real_stat(p)
        return _Shown(real, real.st_size - 10, time.time())

    outcome, took, caught, model, opt = _restore_with_rank_1_seeing(root, rank, shown)
    same_model = all(torch.equal(v, first[0][k]) for k, v in model.module.state_dict().items())
    saved_state, state = first[1]["state"], opt.state_dict()["state"]
    same_opt = saved_state.keys() == state.keys() and all(
        torch.equal(state[i][k], saved_state[i][k]) for i in saved_state for k in saved_state[i])
    return outcome, took, caught, same_model, same_opt


def _restore_on_a_lost_view(rank, world_size, root):
    """Rank 1's host lost sight of rank-00001.pt of the newest checkpoint long ago (every stat of
    it fails; the manifest an hour old), rank 0 sees it whole: the restore's wait for every rank
    (``await_visible``) stops once nothing is arriving."""
    from fusedist.checkpoint import _visibility

    _trained_run(root)
    os.environ["FUSEDIST_CHECKPOINT_VISIBLE_S"] = "20"
    _visibility._wall_clock = lambda: time.time() + 3600

    def shown(p, real_stat):
        raise FileNotFoundError(2, "No such file or directory", p)

    before = _flat(_ddp_run(1)[0].module).clone()
    error, took, _, model, opt = _restore_with_rank_1_seeing(root, rank, shown)
    return error, took, torch.equal(before, _flat(model.module)), bool(opt.state)


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    from shared_rank_launch import launch_for_selected

    root = str(tmp_path_factory.mktemp("views"))
    # (the damaged view first: the lost view's scenario moves the clock on for the rest of the launch)
    return launch_for_selected(request, {
        "test_a_checkpointer_restore_takes_a_file_a_rank_sees_changed_since_the_save_for_corrupt":
            {"damaged": (_restore_on_a_damaged_view, (os.path.join(root, "damaged"),))},
        "test_a_checkpointer_restore_stops_for_a_file_a_rank_lost_sight_of":
            {"lost": (_restore_on_a_lost_view, (os.path.join(root, "lost"),))},
    }, 2, timeout=150)


def test_a_checkpointer_restore_takes_a_file_a_rank_sees_changed_since_the_save_for_corrupt(two_ranks):
    from shared_rank_launch import results_of

    from fusedist.checkpoint._visibility import QUIET_S

    for rank, (outcome, took, caught, same_model, same_opt) in enumerate(results_of(two_ranks, "damaged")):
        assert outcome == 1, (rank, outcome)
        assert took < QUIET_S, (rank, took)  # (not waited for)
        assert same_model and same_opt, rank  # torch's state after step 1, exactly
        if rank == 0:
            assert any("checkpoint of step 2" in w and "rank 1 sees rank-00001.pt (" in w
                       and "changed after it was written" in w and "trying the previous one" in w
                       for w in caught), caught


def test_a_checkpointer_restore_stops_for_a_file_a_rank_lost_sight_of(two_ranks):
    from shared_rank_launch import results_of

    from fusedist.checkpoint._visibility import QUIET_S

    for rank, (error, took, untouched, has_state) in enumerate(results_of(two_ranks, "lost")):
        assert isinstance(error, str) and "rank 1 does not see rank-00001.pt (not there)" in error, (rank, error)
        assert "not arriving" in error and "cannot restore step 2" in error, (rank, error)
        assert QUIET_S <= took < 12, (rank, took)
        assert untouched and not has_state, rank
