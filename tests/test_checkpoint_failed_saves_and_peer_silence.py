"""What a failed ``Checkpointer`` save reports and leaves, and how long a silent peer is waited for.

* A save that fails on its way (a peer lost in one of its exchanges) says what it left, and
  only a checkpoint whose manifest this save wrote is called complete: a rewrite of a step
  that failed before its manifest was reported "written completely and loads", while the
  checkpoint in place was the one it was to replace.
* Only a save that completed counts for the step check (Note [steps only go forward] in
  fusedist/checkpoint/_schedule.py): after a failed ``save(3)``, ``save(2)`` was refused as
  going backwards, although the run's newest checkpoint was step 1.
* ``FUSEDIST_CHECKPOINT_PEER_SILENCE_S`` / ``Checkpointer(peer_silence_s=)``: how long a
  rank's beat may stop before its peers give it up (Note [waiting for a peer's I/O] in
  fusedist/checkpoint/_writer.py), checked before anything is exchanged or written.

Single process: a peer lost is an exchange of the save's coordinator raising, as a gloo
exchange does when a peer dies (the multi-rank deaths are in test_resume.py and
test_checkpoint_replace_and_samplers.py). The reference is the model's own state at each save:
a checkpoint restores exactly (float32 copies, no arithmetic), so the check is ``torch.equal``.
"""

from __future__ import annotations

import errno

import pytest
import torch
from torch import nn

from fusedist import checkpoint
from fusedist.checkpoint import CheckpointError, Checkpointer, layout


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model, opt, seed: int) -> dict:
    """One training step on fresh random inputs; the model's state after it."""
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _loaded(root: str, step: int) -> dict:
    fresh = _net(99)
    checkpoint.load(layout.step_dir(root, step), fresh)
    return fresh.state_dict()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _peer_lost_at(ckpt, exchange: int, silent: bool = False) -> None:
    """Make the ``exchange``-th exchange of the next save's written part (1: the directory and
    save id agreed, 2: the rank files listed, 4: after the manifest) raise as a gloo exchange
    does when a peer died in it, or (``silent``) as the I/O barrier before it does when the
    peer's beat stopped."""
    real_persist, real_gather, calls = ckpt._persist, ckpt._coord.all_gather, [0]

    def exchange_with_a_dead_peer(obj, *args, **kwargs):
        calls[0] += 1
        if calls[0] == exchange and silent:
            error = CheckpointError("rank 0: rank(s) [1] showed no sign of life for 2 s")
            error.silent_ranks = [1]
            raise error
        if calls[0] == exchange:
            raise ConnectionError("Connection closed by peer (rank 1)")
        return real_gather(obj, *args, **kwargs)

    def persist(*args):
        ckpt._coord.all_gather = exchange_with_a_dead_peer
        try:
            real_persist(*args)
        finally:
            ckpt._coord.all_gather, ckpt._persist = real_gather, real_persist

    ckpt._persist = persist


@pytest.mark.parametrize("async_save,silent", [(True, False), (False, False), (True, True)],
                         ids=["async", "sync", "async-silent-peer"])
@pytest.mark.parametrize("exchange,rewritten", [(1, False), (2, False), (4, True)],
                         ids=["lost-at-the-directory", "lost-at-the-rank-files", "lost-after-the-manifest"])
def test_a_failed_rewrite_never_reports_the_replaced_checkpoint_as_its_own(tmp_path, async_save, silent, exchange,
                                                                           rewritten):
    root = str(tmp_path / "ckpt")
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, async_save=async_save)
    ckpt.restore(model, opt)
    first = _step(model, opt, 1)
    ckpt.save(1)
    ckpt.wait()
    second = _step(model, opt, 2)  # step 1 saved again, of other values (a restarted run's own step 1)
    _peer_lost_at(ckpt, exchange, silent)
    with pytest.raises(CheckpointError) as caught:
        ckpt.save(1)
        ckpt.wait()
    message = str(caught.value)
    lost = "no sign of life for 2 s" if silent else "ConnectionError: Connection closed by peer"
    assert "save of step 1" in message and lost in message, message
    entry = layout.entry(root, 1)
    assert entry is not None and entry.complete
    if rewritten:  # lost after its manifest: the new checkpoint is in place
        assert "written completely and loads" in message, message
        assert _same(_loaded(root, 1), second)
    else:
        assert "written completely" not in message, message
        assert "this save's state was not written" in message and "complete checkpoint of step 1 saved before" \
            in message, message
        assert _same(_loaded(root, 1), first)
    assert ckpt.last_saved_step == 1
    ckpt.close()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_step_below_a_failed_save_can_be_saved(tmp_path, monkeypatch, async_save):
    """save(3) fails (a full disk); the run is still at step 1, so save(2) must be taken, and
    restore continues from it, with the model's state of step 2."""
    import fusedist.checkpoint._files as files

    root = str(tmp_path / "ckpt")
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, keep=None, async_save=async_save)
    ckpt.restore(model, opt)
    states = {1: _step(model, opt, 1)}
    ckpt.save(1)
    states[2] = _step(model, opt, 2)
    ckpt.wait()
    real = files.atomic_torch_save

    def full_disk(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "atomic_torch_save", full_disk)
    with pytest.raises(CheckpointError, match="saving step 3 .*No space left on device"):
        ckpt.save(3)
        ckpt.wait()
    monkeypatch.setattr(files, "atomic_torch_save", real)
    assert ckpt.last_saved_step == 1
    ckpt.save(2)  # was: ValueError, "this run is at step 3"
    ckpt.close()
    assert [(e.step, e.complete) for e in layout.scan(root)] == [(2, True), (1, True)]
    assert _same(_loaded(root, 2), states[2])
    fresh = _net(7)
    again = Checkpointer(root)
    assert again.restore(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1)) == 2
    assert _same(fresh.state_dict(), states[2])
    again.close()


def test_a_step_in_flight_is_not_saved_twice_and_one_below_a_completed_save_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, every_steps=2)
    ckpt.restore(model, opt)
    _step(model, opt, 1)
    assert ckpt.maybe_save(2) and not ckpt.maybe_save(2)  # the second call while step 2 is in flight
    assert len(ckpt.stats) == 1
    with pytest.raises(ValueError, match=r"save\(1\): this run is at step 2"):
        ckpt.save(1)  # once step 2 completed
    ckpt.close()


@pytest.mark.parametrize("value", ["0", "1.5", "-3", "nan", "inf", "ten"])
def test_a_bad_peer_silence_setting_is_refused_before_anything_is_written(tmp_path, monkeypatch, value):
    monkeypatch.setenv("FUSEDIST_CHECKPOINT_PEER_SILENCE_S", value)
    with pytest.raises(ValueError, match=r"FUSEDIST_CHECKPOINT_PEER_SILENCE_S must be a finite number of seconds "
                                         r"of at least 2"):
        Checkpointer(str(tmp_path / "a"))
    with pytest.raises(ValueError, match="FUSEDIST_CHECKPOINT_PEER_SILENCE_S"):
        checkpoint.save(str(tmp_path / "b"), _net())
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_peer_silence_argument_and_its_setting(tmp_path, monkeypatch):
    from fusedist.checkpoint import _writer

    for bad in (True, -1, 1.0, "5", float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"Checkpointer\(peer_silence_s=...\) must be a finite number"):
            Checkpointer(str(tmp_path), peer_silence_s=bad)
    assert Checkpointer(str(tmp_path))._coord.silence == _writer.SILENT_AFTER_S == 10.0
    monkeypatch.setenv("FUSEDIST_CHECKPOINT_PEER_SILENCE_S", "3.5")
    assert Checkpointer(str(tmp_path))._coord.silence == 3.5
    assert Checkpointer(str(tmp_path), peer_silence_s=2)._coord.silence == 2.0  # the argument wins


def test_a_save_given_up_on_after_its_manifest_says_its_checkpoint_is_whole(tmp_path):
    """A barrier given up on after the manifest (a peer's retention hung: Note [a save given up
    on] in fusedist/checkpoint/_writer.py) raises on every rank; the checkpoint is complete
    all the same, and counts as saved."""
    root = str(tmp_path / "ckpt")
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root)
    ckpt.restore(model, opt)
    saved = _step(model, opt, 1)
    real = ckpt._persist

    def retention_given_up(*args):
        real(*args)
        error = CheckpointError("rank 0: the other ranks were not done with the save (its retention) after 1800 s")
        error.given_up = True
        raise error

    ckpt._persist = retention_given_up
    ckpt.save(1)
    with pytest.raises(CheckpointError, match=r"after 1800 s \(its checkpoint was written completely and loads"):
        ckpt.wait()
    ckpt._persist = real
    assert ckpt.last_saved_step == 1 and _same(_loaded(root, 1), saved)
    with pytest.raises(ValueError, match=r"save\(0\): this run is at step 1"):
        ckpt.save(0)
    ckpt.close()
