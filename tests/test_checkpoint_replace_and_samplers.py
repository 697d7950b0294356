"""The Checkpointer saving a step it holds already, and the edges a demanding user meets.

* A step saved again (``save(N)`` after ``maybe_save(N)``, a restart saving the step it
  restored) keeps the complete ``step-N`` until the new one is complete (Note [saving a step
  again] in fusedist/checkpoint/_replace.py): a rewrite failing on any rank, or killed
  before its manifest, leaves the old checkpoint loadable; one killed leaves files that
  restore warns about and the next complete save removes.
* A full disk on one rank's background write is raised on every rank at the next save or
  at ``close()``, within seconds, and ``keep=1`` never prunes the last complete checkpoint
  for a save that failed.
* The ranks' ElasticDistributedSampler positions must agree at a save (Note [one data
  position for the job] in fusedist/checkpoint/_sampler_state.py); a sampler refusing the
  saved position on one rank fails the restore on every rank.
* Two Checkpointers of one program on one root, a root under a file, a file named like a
  step directory, ``restore(step=...)`` of no step count or of an incomplete step.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from fusedist.testing import run_distributed
from shared_rank_launch import launch_for_selected, results_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model, opt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
    opt.step()


def _files_of(path) -> list:
    return sorted(os.listdir(path))


def _restored(root: str, **kw):
    """(step, parameters) a fresh model restores from ``root``."""
    from fusedist.checkpoint import Checkpointer

    fresh = _net(99)
    ckpt = Checkpointer(root)
    step = ckpt.restore(fresh, torch.optim.AdamW(fresh.parameters()), **kw)
    return step, models.flat_params(fresh)


# ----------------------------------------------------------------------------- a step saved again


def test_a_step_saved_again_keeps_the_complete_one_until_the_rewrite_is(tmp_path, monkeypatch):
    """``maybe_save(2)`` then ``save(2)`` with newer weights: the rewrite failing (a full disk)
    left no step-2 (the old one was removed first), and with keep=1 nothing at all. Now the
    old step-2 is complete throughout the rewrite -- even at the moment the new rank file is
    written and the new manifest is not -- survives a failed one untouched, and a rewrite that
    completes replaces it, leaving only the new files."""
    from fusedist.checkpoint import Checkpointer, CheckpointError, _files, layout, load

    root = str(tmp_path)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, every_steps=2, keep=1)  # asynchronous saves
    assert ckpt.restore(model, opt) == 0
    _step(model, opt, 1)
    _step(model, opt, 2)
    assert ckpt.maybe_save(2)
    ckpt.wait()
    saved = models.flat_params(model).clone()
    old_files = _files_of(layout.step_dir(root, 2))
    _step(model, opt, 3)  # the same step count, newer weights: the rewrite holds other values

    real_save, seen = _files.torch.save, []

    def full_disk_at_common(obj, f):
        """The rank file is written; the common file hits a full disk."""
        if ".common." in os.path.basename(f.name):
            fresh = _net(5)
            load(layout.step_dir(root, 2), fresh)
            seen.append((layout.entry(root, 2).complete, torch.equal(models.flat_params(fresh), saved)))
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real_save(obj, f)

    monkeypatch.setattr(_files.torch, "save", full_disk_at_common)
    ckpt.save(2)
    with pytest.raises(CheckpointError, match=r"step 2 .*No space left on device.*complete checkpoint of that step "
                                              r"written before is kept"):
        ckpt.wait()
    assert seen == [(True, True)]  # mid-rewrite: the old step-2 complete and loadable
    assert [(e.step, e.complete) for e in layout.scan(root)] == [(2, True)]
    assert _files_of(layout.step_dir(root, 2)) == old_files  # the failed rewrite's files removed
    step, params = _restored(root)
    assert step == 2 and torch.equal(params, saved)

    monkeypatch.setattr(_files.torch, "save", real_save)
    ckpt.save(2)
    ckpt.close()
    step, params = _restored(root)
    assert step == 2 and torch.equal(params, models.flat_params(model))
    new_files = _files_of(layout.step_dir(root, 2))
    assert not set(new_files) & (set(old_files) - {"manifest.json"}), (old_files, new_files)
    assert len(new_files) == 3 and all(n in ("manifest.json",) or ".pt" in n for n in new_files), new_files
    fresh = _net(7)
    load(layout.step_dir(root, 2), fresh)  # still an ordinary save()-format directory
    assert torch.equal(models.flat_params(fresh), models.flat_params(model))


_KILLED_REWRITE = r"""
import os, sys, time, torch
from torch import nn
from fusedist.checkpoint import Checkpointer, _files

root = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
ckpt = Checkpointer(root, every_steps=2, keep=2, async_save=False)
assert ckpt.restore(model) == 2  # a restarted run: it saves the step it restored again
real_save = torch.save

def hang_at_common(obj, f):  # the rank file is complete; killed while the common file is written
    real_save(obj, f)
    if ".common." in os.path.basename(f.name):
        f.flush()
        print("WRITING", flush=True)
        time.sleep(600)

_files.torch.save = hang_at_common
with torch.no_grad():
    model[0].weight.add_(1.0)
ckpt.save(2)
"""


def test_a_rewrite_killed_before_its_manifest_leaves_the_old_step(tmp_path):
    """A restarted run saves the step it restored again and is SIGKILLed before the new
    manifest: the complete step-2 was gone (removed first), and the restart went back to
    nothing. Now restore loads the old step-2, warning of the killed rewrite's files, and
    the next complete save removes them."""
    from fusedist.checkpoint import Checkpointer, layout

    root = str(tmp_path)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, every_steps=2, keep=2, async_save=False)
    ckpt.restore(model, opt)
    _step(model, opt, 1)
    _step(model, opt, 2)
    ckpt.maybe_save(2)
    ckpt.close()
    saved = models.flat_params(model).clone()
    old_files = _files_of(layout.step_dir(root, 2))

    proc = subprocess.Popen([sys.executable, "-c", _KILLED_REWRITE, root], stdout=subprocess.PIPE,
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        line = proc.stdout.readline()
        assert line.strip() == b"WRITING", line
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    leftovers = sorted(set(_files_of(layout.step_dir(root, 2))) - set(old_files))
    assert len(leftovers) == 2 and any(n.startswith("rank-00000.") for n in leftovers), leftovers

    with pytest.warns(UserWarning, match=r"step-00000002 holds files of an interrupted save .*rank-00000\."):
        step, params = _restored(root)
    assert step == 2 and torch.equal(params, saved)

    ckpt = Checkpointer(root, every_steps=2, keep=2, async_save=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ckpt.restore(model, opt) == 2
    _step(model, opt, 3)
    _step(model, opt, 4)
    ckpt.maybe_save(4)
    ckpt.close()
    assert [(e.step, e.complete, e.leftovers) for e in layout.scan(root)] == [(4, True, ()), (2, True, ())]
    assert _files_of(layout.step_dir(root, 2)) == old_files


# ----------------------------------------------------------------------------- a full disk


def _full_disk_worker(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer, _files, layout

    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, every_steps=2, keep=1)  # asynchronous
    ckpt.restore(model, opt)
    _step(model, opt, 1)
    ckpt.save(2)
    ckpt.wait()
    real_save = _files.torch.save

    def full(obj, f):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    out = {}
    _files.torch.save = full if rank == 1 else real_save
    _step(model, opt, 2)
    ckpt.save(2)  # a rewrite of the newest step, failing in the background on rank 1
    out["rewrite"] = _timed(ckpt.wait)
    _step(model, opt, 3)
    ckpt.save(4)  # keep=1: a failing save of a new step
    out["close"] = _timed(ckpt.close)
    _files.torch.save = real_save
    dist.barrier()
    out["steps"] = [(e.step, e.complete) for e in layout.scan(root)]
    # With space again, a restart saves the step it restored over it: every rank's new files.
    ckpt = Checkpointer(root, every_steps=2, keep=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the incomplete step 4
        out["restored"] = ckpt.restore(model, opt)
    _step(model, opt, 4)
    ckpt.save(2)
    ckpt.close()
    fresh = _net(9)
    out["rewritten"] = (Checkpointer(root).restore(fresh), torch.equal(models.flat_params(fresh),
                                                                        models.flat_params(model)))
    dist.barrier()
    out["files"] = sorted(n for n in os.listdir(layout.step_dir(root, 2)) if n.endswith(".pt"))
    return out


def _timed(fn):
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported back to the test
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The full disk and the data positions scenarios at 2 ranks in one launch."""
    return launch_for_selected(request, {
        "test_a_full_disk_on_one_rank_fails_every_rank_and_keeps_the_last_checkpoint": {
            "full disk": (_full_disk_worker, (str(tmp_path_factory.mktemp("full-disk")),))},
        "test_ranks_whose_elastic_positions_differ_are_refused_naming_them": {
            "positions": (_positions_worker, (str(tmp_path_factory.mktemp("positions")),))},
    }, 2, timeout=150, env={"FUSEDIST_TIMEOUT_S": "60"})


def test_a_full_disk_on_one_rank_fails_every_rank_and_keeps_the_last_checkpoint(launched):
    """Rank 1's background writes hit a full disk: the rewrite of step 2 is raised on both
    ranks at the next wait, the save of step 4 at close(), within seconds (the collective
    timeout is 60 s), naming rank 1; with keep=1 the complete step-2 stays, and the old
    one -- not a half-written new one. With space again, a restart's rewrite of step 2
    replaces every rank's files."""
    results = results_of(launched, "full disk")
    for rank, out in enumerate(results):
        for case, kept in (("rewrite", "complete checkpoint of that step written before is kept"),
                           ("close", "incomplete checkpoint is removed")):
            kind, text, seconds = out[case] or (None, "", 0)
            assert kind == "CheckpointError", (rank, case, out[case])
            assert "rank 1 could not write" in text and "No space left" in text and kept in text, (rank, case, text)
            assert seconds < 30, (rank, case, seconds)
        assert out["steps"] == [(2, True)], (rank, out["steps"])
        assert out["restored"] == 2 and out["rewritten"] == (2, True), (rank, out)
        assert len(out["files"]) == 3 and all(n.count(".") == 2 for n in out["files"]), out["files"]


# ----------------------------------------------------------------------------- the ranks' data positions


def _positions_worker(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer, ElasticDistributedSampler, layout

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ElasticDistributedSampler(range(40), shuffle=True, seed=3)
    ckpt = Checkpointer(root, async_save=False)
    ckpt.restore(model, opt, sampler=sampler)
    list(iter(sampler))
    out = {}
    sampler.advance(4 if rank == 0 else 2)  # rank 1 missed an advance(2)
    out["differ"] = _timed(lambda: ckpt.save(1))
    out["written"] = os.path.exists(layout.step_dir(root, 1))
    sampler.advance(0 if rank == 0 else 2)
    out["agree"] = _timed(lambda: ckpt.save(1))
    ckpt.close()

    # A resume with another seed on rank 1: refused on every rank, not on rank 1 alone.
    other = ElasticDistributedSampler(range(40), shuffle=True, seed=3 if rank == 0 else 4)
    out["restore seed"] = _timed(lambda: Checkpointer(root).restore(_net(), sampler=other))
    # No sampler on rank 1 at a save.
    ckpt = Checkpointer(root, async_save=False)
    ckpt.restore(model, opt, sampler=ElasticDistributedSampler(range(40), shuffle=True, seed=3))
    if rank == 1:
        ckpt._state["sampler"] = None
    out["kinds"] = _timed(lambda: ckpt.save(2))
    ckpt.close()
    resumed = ElasticDistributedSampler(range(40), shuffle=True, seed=3)
    out["resumed"] = (Checkpointer(root).restore(_net(), sampler=resumed), resumed.consumed)
    dist.barrier()
    return out


def test_ranks_whose_elastic_positions_differ_are_refused_naming_them(launched):
    """Only rank 0's ElasticDistributedSampler position was saved, whatever the others' was:
    a rank that missed an advance() resumed at rank 0's position, repeating or skipping
    samples silently. Now the save is refused on every rank, before anything is written,
    naming each rank's value (Note [one data position for the job]); so is a sampler missing
    on one rank; the save goes through once the positions agree. A restore whose sampler
    refuses the position on one rank (another seed) fails on every rank at once."""
    results = results_of(launched, "positions")
    for rank, out in enumerate(results):
        kind, text, seconds = out["differ"] or (None, "", 0)
        assert kind == "CheckpointError", (rank, out["differ"])
        assert "consumed is 8 on ranks [0], 4 on ranks [1]" in text and "Nothing was written for step 1" in text, text
        assert not out["written"] and out["agree"] is None, (rank, out)
        kind, text, seconds = out["restore seed"] or (None, "", 0)
        assert kind == "CheckpointError" and "rank 1: ValueError" in text and "seed=3" in text, (rank, text)
        assert seconds < 30, (rank, seconds)
        kind, text, _ = out["kinds"] or (None, "", 0)
        assert kind == "CheckpointError", (rank, out["kinds"])
        assert "ElasticDistributedSampler on ranks [0], None on ranks [1]" in text, text
        assert out["resumed"] == (1, 8), (rank, out["resumed"])


# ----------------------------------------------------------------------------- roots and steps


def test_two_checkpointers_saving_to_one_root_in_one_process(tmp_path):
    """A second Checkpointer of the program given the same root (by another path to it too)
    took the root's lease at its first save -- the same run -- and the first one's next save
    failed from the background thread, blaming 'a restarted instance of this same run',
    while each replaced and pruned the other's steps. Now the second's save is refused in the
    save call, nothing written, and the first goes on; once the first is closed another may
    save. Restoring from the root meanwhile is fine."""
    from fusedist.checkpoint import Checkpointer, CheckpointError, layout

    root = str(tmp_path / "ckpt")
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = Checkpointer(root, every_steps=1, keep=2)  # asynchronous
    first.restore(model, opt)
    _step(model, opt, 1)
    first.maybe_save(1)
    first.wait()
    os.symlink(root, str(tmp_path / "link"))
    for path in (root, str(tmp_path / "link") + "/."):
        second = Checkpointer(path, every_steps=1, keep=1)
        assert second.restore(_net(3)) == 1  # reading: fine
        with pytest.raises(CheckpointError, match=r"cannot save step 2 to .*another Checkpointer of this process "
                                                  r"saves to .*use one per root.*Nothing was written"):
            second.save(2)
    _step(model, opt, 2)
    first.maybe_save(2)
    first.close()
    assert [e.step for e in layout.scan(root)] == [2, 1]
    second = Checkpointer(str(tmp_path / "link"), every_steps=1, keep=1)
    assert second.restore(model, opt) == 2
    second.save(3)
    second.close()
    assert [e.step for e in layout.scan(root)] == [3]


def test_roots_and_steps_a_save_cannot_use(tmp_path):
    """A root under a file failed the first save from the background thread, a save interval
    later: now refused in the save call. A file named like a step directory is neither
    replaced nor restored: its step's save fails naming it, the file untouched, and the
    earlier checkpoints stay. ``restore(step=...)`` of no step count (``True`` restored step
    1), or of an incomplete step, is refused by name."""
    from fusedist.checkpoint import Checkpointer, CheckpointError, layout

    (tmp_path / "file").write_text("not a directory")
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    under_file = Checkpointer(str(tmp_path / "file" / "ckpt"), every_steps=1)
    assert under_file.restore(model, opt) == 0
    with pytest.raises(CheckpointError, match=r"cannot save step 1 .*lies under .*file, which is a file, not a "
                                              r"directory.*Nothing was written"):
        under_file.save(1)
    under_file.close()

    root = str(tmp_path / "ckpt")
    ckpt = Checkpointer(root, every_steps=1, keep=1)
    ckpt.restore(model, opt)
    _step(model, opt, 1)
    ckpt.save(1)
    os.makedirs(root, exist_ok=True)
    with open(layout.step_dir(root, 2), "w") as f:
        f.write("a file of the user's")
    ckpt.save(2)
    with pytest.raises(CheckpointError, match=r"saving step 2 .*step-00000002 exists and is not a directory.*"
                                              r"Move it away.*nothing was written"):
        ckpt.wait()
    with open(layout.step_dir(root, 2)) as f:
        assert f.read() == "a file of the user's"
    os.makedirs(layout.step_dir(root, 3))  # a save killed before its manifest
    for bad in (True, "1", -1, 1.0):
        with pytest.raises(ValueError, match=r"restore: step must be a non-negative int"):
            Checkpointer(root).restore(_net(4), step=bad)
    with pytest.raises(CheckpointError, match=r"cannot restore step 3 .*no manifest .*complete checkpoints: "
                                              r"steps \[1\]"):
        Checkpointer(root).restore(_net(4), step=3)
    ckpt.close()
    assert [(e.step, e.complete) for e in layout.scan(root)] == [(3, False), (1, True)]


def _peer_dies_after_the_manifest_worker(rank, ws, root):
    from fusedist.checkpoint import Checkpointer, layout

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root)
    ckpt.restore(model, opt)
    if rank == 1:
        real, agreed = ckpt._coord.all_gather, []

        def dies_at_the_last_exchange(obj, *args, **kwargs):
            if sys._getframe(1).f_code.co_name == "agree":  # the save's "everyone succeeded?" exchanges
                agreed.append(obj)
                if len(agreed) == 2:  # the one after the manifest: rank 0 has written it
                    os._exit(0)
            return real(obj, *args, **kwargs)

        ckpt._coord.all_gather = dies_at_the_last_exchange
    _step(model, opt, 1)
    ckpt.save(1)
    outcome = _timed(ckpt.wait)
    entry = layout.entry(root, 1)
    return outcome, entry is not None and entry.complete


def test_a_peer_dying_after_the_manifest_is_not_reported_as_an_incomplete_checkpoint(tmp_path):
    """The save's last exchange follows the manifest: a peer dying there leaves a complete
    checkpoint, which the error must not call incomplete and skipped (it sent users to an
    older one)."""
    results = run_distributed(_peer_dies_after_the_manifest_worker, 2, str(tmp_path), timeout=120, pg_timeout=20,
                              expect_failure=True)
    status, value = results[0]
    assert status == "ok", value
    (kind, message, _), complete = value
    assert complete, "step 1 should be complete"
    assert kind == "CheckpointError" and "written completely and loads" in message, message
    assert "incomplete and will be skipped" not in message, message


# ----------------------------------------------------------------------------- a newer fusedist's checkpoints


def _as_newer_format(path: str, step=None) -> None:
    """Mark the checkpoint in ``path`` as written by a newer fusedist (its manifest's format
    version above ours), of ``step`` if given."""
    import json

    from fusedist.checkpoint import _files

    name = os.path.join(path, _files.MANIFEST)
    with open(name) as f:
        manifest = json.load(f)
    manifest["version"] = _files.VERSION + 1
    if step is not None:
        manifest["checkpointer"]["step"] = step
    with open(name, "w") as f:
        json.dump(manifest, f)


def test_checkpoints_of_a_newer_fusedist_are_never_skipped_silently_or_removed(tmp_path):
    """Note [checkpoints of a newer fusedist] in fusedist/checkpoint/layout.py: a downgraded job
    used to skip them as incomplete, restore an older step with a warning, and prune them. Now
    restore refuses while one is the newest (naming the step to continue from), restoring that
    step explicitly sets them aside instead of removing them, retention below the newest keeps
    them, and a save into one fails naming it."""
    from fusedist.checkpoint import Checkpointer, CheckpointError, _files, _replace, layout

    root = str(tmp_path / "ckpt")
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(root, every_steps=1, keep=2, async_save=False) as ckpt:
        ckpt.restore(model, opt)
        for step in (1, 2, 3):
            _step(model, opt, step)
            ckpt.save(step)
    _as_newer_format(layout.step_dir(root, 3))
    other = _net(4)
    newer_bytes = sorted((n, os.path.getsize(os.path.join(layout.step_dir(root, 3), n)))
                         for n in os.listdir(layout.step_dir(root, 3)))

    with pytest.raises(CheckpointError, match=r"holds checkpoints written by a newer fusedist \(steps \[3\]: it was "
                                              r"written by a newer fusedist \(format version \d+; this one reads "
                                              r"versions up to \d+\)\); restoring an older one would silently go "
                                              r"back past them\. Upgrade fusedist, or restore\(\.\.\., step=2\)"):
        Checkpointer(root).restore(other, torch.optim.AdamW(other.parameters()))
    entry = layout.entry(root, 3)
    assert not entry.complete and entry.newer_format == _files.VERSION + 1
    # a save of its step cannot replace it
    save_id, why = _replace.prepare(root, 3)
    assert save_id == "" and "written by a newer fusedist" in why and "left as it is" in why
    assert layout.entry(root, 3).newer_format

    # continuing from step 2 on purpose: the first save sets the newer one aside, whole
    fresh = _net(5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with Checkpointer(root, every_steps=1, keep=1, async_save=False) as ckpt:
        assert ckpt.restore(fresh, fresh_opt, step=2) == 2
        _step(fresh, fresh_opt, 30)
        with pytest.warns(UserWarning, match=r"set aside as \['abandoned-step-00000003'\]"):
            ckpt.save(3)
    aside = os.path.join(root, "abandoned-step-00000003")
    assert sorted((n, os.path.getsize(os.path.join(aside, n))) for n in os.listdir(aside)) == newer_bytes
    assert [e.step for e in layout.scan(root) if e.complete] == [3]

    # one below the newest checkpoint this fusedist reads: restored past, and kept by retention
    os.rename(aside, layout.step_dir(root, 1))
    _as_newer_format(layout.step_dir(root, 1), step=1)
    assert layout.entry(root, 1).newer_format
    with Checkpointer(root, every_steps=1, keep=1, async_save=False) as ckpt:
        assert ckpt.restore(fresh, fresh_opt) == 3
        for step in (4, 5):
            _step(fresh, fresh_opt, step)
            ckpt.save(step)
    assert [(e.step, e.complete, bool(e.newer_format)) for e in layout.scan(root)] == [(5, True, False),
                                                                                    (1, False, True)]
