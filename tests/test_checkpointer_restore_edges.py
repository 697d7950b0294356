"""Checkpointer.restore's promises at their edges, 2 gloo ranks, DDP + torch's AdamW (whose
rank files hold the per-rank state alone: the RNG states):

* a restore that fails changes nothing: a corrupt rank file is found before the model and
  the optimizer are loaded (they were loaded first, behind a CheckpointError saying nothing
  was changed);
* a ResumableDistributedSampler restored at the saving world size from a checkpoint without a
  position for it is refused on every rank, as an ElasticDistributedSampler is (the epoch
  silently started over, with a warning naming the wrong world size);
* a state keeps its containers' types through the asynchronous save's staging, as through
  ``torch.save``: MultiStepLR's milestones stay a Counter, whose ``step(epoch)`` needs one.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from phased_launches import launch_phase, on_rank_0
from shared_rank_launch import results_of

ENV = {"FUSEDIST_TIMEOUT_S": "30"}


def _model_and_opt(seed: int):
    import fusedist

    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps: int, rank: int, sched=None) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(6, 8, generator=g)), torch.randn(6, 4, generator=g)).backward()
        opt.step()
        if sched is not None:
            sched.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _save_two_steps(rank, world_size, root, with_scheduler=False):
    from fusedist.checkpoint import Checkpointer

    model, opt = _model_and_opt(0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5) if with_scheduler else None
    ck = Checkpointer(root, every_steps=1, async_save=with_scheduler)  # (the staging is the async save's)
    ck.restore(model, opt, lr_scheduler=sched)
    _train(model, opt, 2, rank, sched)
    ck.save(2)
    ck.close()


def _restore_after_corruption(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer, CheckpointError

    model, opt = _model_and_opt(9)
    before = _flat(model).clone()
    with pytest.raises(CheckpointError, match="rank-00001.pt is corrupt"):
        Checkpointer(root, every_steps=1, async_save=False).restore(model, opt)
    return torch.equal(before, _flat(model)), len(opt.state)


def _corrupt_rank_1_file(root):
    path = os.path.join(root, "step-00000002", "rank-00001.pt")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_a_restore_that_fails_on_a_rank_file_changes_nothing(launched):
    results_of(launched, "save, to corrupt")
    results_of(launched, "corrupt rank 1's file")
    assert results_of(launched, "restore after corruption") == [(True, 0), (True, 0)]


def _restore_resumable_sampler(rank, world_size, root):
    from torch.utils.data import TensorDataset

    from fusedist.checkpoint import Checkpointer, CheckpointError
    from fusedist.checkpoint.resume import ResumableDistributedSampler

    model, opt = _model_and_opt(0)
    sampler = ResumableDistributedSampler(TensorDataset(torch.arange(20)), shuffle=False)
    with pytest.raises(CheckpointError, match="holds no sampler position for this ResumableDistributedSampler"):
        Checkpointer(root, every_steps=1, async_save=False).restore(model, opt, sampler=sampler)
    return True


def test_a_resumable_sampler_without_a_saved_position_is_refused(launched):
    results_of(launched, "save, without a sampler")
    assert results_of(launched, "restore a resumable sampler") == [True, True]


def _restore_scheduler(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer

    model, opt = _model_and_opt(0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[7], gamma=0.5)
    ck = Checkpointer(root, every_steps=1, async_save=True)
    assert ck.restore(model, opt, lr_scheduler=sched) == 2
    ck.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch deprecates step(epoch))
        sched.step(4)  # the closed form: needs milestones.elements()
    return type(sched.milestones).__name__, dict(sched.milestones), opt.param_groups[0]["lr"]


def test_a_counter_in_a_saved_state_stays_a_counter(launched):
    results_of(launched, "save with a scheduler")
    for kind, milestones, lr in results_of(launched, "restore the scheduler"):
        assert kind == "Counter" and milestones == {2: 1, 4: 1}
        assert lr == pytest.approx(1e-2 * 0.25)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Every test's save, the change to its files and its restore, in one launch of 2 ranks."""
    corrupt, sampler, counter = (str(tmp_path_factory.mktemp(name) / "ckpt") for name in ("corrupt", "sampler",
                                                                                           "counter"))
    return launch_phase(request, {
        "test_a_restore_that_fails_on_a_rank_file_changes_nothing": {
            "save, to corrupt": (_save_two_steps, (corrupt,)),
            "corrupt rank 1's file": (on_rank_0, (_corrupt_rank_1_file, corrupt)),
            "restore after corruption": (_restore_after_corruption, (corrupt,))},
        "test_a_resumable_sampler_without_a_saved_position_is_refused": {
            "save, without a sampler": (_save_two_steps, (sampler,)),
            "restore a resumable sampler": (_restore_resumable_sampler, (sampler,))},
        "test_a_counter_in_a_saved_state_stays_a_counter": {
            "save with a scheduler": (_save_two_steps, (counter, True)),
            "restore the scheduler": (_restore_scheduler, (counter,))},
    }, 2, timeout=120, env=ENV)
