"""Checkpointer.restore at its edges, against torch's objects and the documented promises:

* a restore refused for objects that do not match the checkpoint (a sampler of another seed or
  dataset, an LR scheduler the checkpoint holds no state for) changes nothing, on every rank:
  model, optimizer, LR scheduler and sampler are as before (Note [a refused restore changes
  nothing] in fusedist/checkpoint/_restore.py); the matching objects then restore the saved
  model bit for bit;
* a ResumableDistributedSampler restored at another world size keeps the saved epoch: its
  order is torch's DistributedSampler's after ``set_epoch(saved epoch)`` (Note [a per-rank
  position at another world size]);
* a corrupt newest checkpoint over incomplete older ones: every one skipped is named, in a
  warning and in the final error.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

from phased_launches import launch_phase
from shared_rank_launch import results_of

ENV = {"FUSEDIST_TIMEOUT_S": "30"}


def _model_and_opt(seed: int):
    import fusedist

    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _train(model, opt, sched, rank: int) -> None:
    g = torch.Generator().manual_seed(7 + rank)
    opt.zero_grad()
    nn.functional.mse_loss(model(torch.randn(5, 6, generator=g)), torch.randn(5, 3, generator=g)).backward()
    opt.step()
    if sched is not None:
        sched.step()


def _sampler_state(sampler) -> dict:
    return {k: v for k, v in vars(sampler).items() if k != "dataset"}


def _everything(model, opt, sched, sampler) -> tuple:
    return ([p.detach().clone() for p in model.parameters()], len(opt.state), opt.param_groups[0]["lr"],
            None if sched is None else sched.state_dict(), _sampler_state(sampler))


def _same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1:] == b[1:]


def _refusals(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer, CheckpointError, ElasticDistributedSampler
    from fusedist.checkpoint.resume import ResumableDistributedSampler

    data = list(range(40))
    per_rank, elastic = os.path.join(root, "per_rank"), os.path.join(root, "elastic")
    # Saved: a per-rank sampler with an LR scheduler; an elastic sampler without one.
    for where, kind, with_sched in ((per_rank, ResumableDistributedSampler, True),
                                    (elastic, ElasticDistributedSampler, False)):
        model, opt, sched = _model_and_opt(0)
        sched = sched if with_sched else None
        sampler = kind(data, num_replicas=world_size, rank=rank, seed=3)
        sampler.set_epoch(1)
        next(iter(sampler))
        sampler.advance(4)
        ck = Checkpointer(where, every_steps=1, async_save=False)
        ck.restore(model, opt, lr_scheduler=sched, sampler=sampler)
        _train(model, opt, sched, rank)
        ck.save(1)
        ck.close()
    saved = [p.detach().clone() for p in model.parameters()]
    attempts = [  # (root, sampler kind, its seed, its dataset, an LR scheduler registered)
        (per_rank, ResumableDistributedSampler, 4, data, True),
        (per_rank, ResumableDistributedSampler, 3, data[:32], True),
        (elastic, ElasticDistributedSampler, 5, data, False),
        (elastic, ElasticDistributedSampler, 3, data, True),  # the checkpoint holds no LR scheduler state
    ]
    out = []
    for where, kind, seed, dataset, with_sched in attempts:
        model, opt, sched = _model_and_opt(9)
        sched = sched if with_sched else None
        sampler = kind(dataset, num_replicas=world_size, rank=rank, seed=seed)
        before = _everything(model, opt, sched, sampler)
        rng = torch.get_rng_state()
        ck = Checkpointer(where, every_steps=1, async_save=False)
        with pytest.raises(CheckpointError) as info:
            ck.restore(model, opt, lr_scheduler=sched, sampler=sampler)
        out.append((_same(before, _everything(model, opt, sched, sampler)), torch.equal(rng, torch.get_rng_state()),
                    "Nothing was loaded" in str(info.value)))
        ck.close()
    # The matching objects restore fine afterwards.
    for where, kind, with_sched in ((per_rank, ResumableDistributedSampler, True),
                                    (elastic, ElasticDistributedSampler, False)):
        model, opt, sched = _model_and_opt(9)
        sampler = kind(data, num_replicas=world_size, rank=rank, seed=3)
        ck = Checkpointer(where, every_steps=1, async_save=False)
        step = ck.restore(model, opt, lr_scheduler=sched if with_sched else None, sampler=sampler)
        ck.close()
        out.append((step, all(torch.equal(a, b) for a, b in zip(saved, model.parameters())), sampler.epoch))
    return out


def test_a_refused_restore_changes_nothing_on_any_rank(launched):
    for out in results_of(launched, "refusals"):
        assert out[:4] == [(True, True, True)] * 4, out
        assert out[4:] == [(1, True, 1), (1, True, 1)], out


def _save_mid_epoch(rank, world_size, root, epoch):
    from fusedist.checkpoint import Checkpointer
    from fusedist.checkpoint.resume import ResumableDistributedSampler

    model, opt, _ = _model_and_opt(0)
    sampler = ResumableDistributedSampler(list(range(30)), num_replicas=world_size, rank=rank, seed=11)
    sampler.set_epoch(epoch)
    next(iter(sampler))
    sampler.advance(3)
    ck = Checkpointer(root, every_steps=1, async_save=False)
    ck.restore(model, opt, sampler=sampler)
    _train(model, opt, None, rank)
    ck.save(1)
    ck.close()


def _restore_elsewhere(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer
    from fusedist.checkpoint.resume import ResumableDistributedSampler

    model, opt, _ = _model_and_opt(5)
    sampler = ResumableDistributedSampler(list(range(30)), num_replicas=world_size, rank=rank, seed=11)
    ck = Checkpointer(root, every_steps=1, async_save=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ck.restore(model, opt, sampler=sampler)
    ck.close()
    return step, list(sampler), [str(w.message) for w in caught if "data position" in str(w.message)]


def test_a_per_rank_sampler_at_another_world_size_keeps_the_saved_epoch(launched):
    results_of(launched, "save at epoch 3")
    torch_sampler = DistributedSampler(list(range(30)), num_replicas=1, rank=0, seed=11)
    torch_sampler.set_epoch(3)
    [(step, order, said)] = results_of(launched, "restore at world size 1")
    assert step == 1 and order == list(torch_sampler), order
    assert len(said) == 1 and "epoch 3 is restored" in said[0], said


def _corrupt_over_incomplete(rank, world_size, root):
    from fusedist.checkpoint import Checkpointer, CheckpointError

    model, opt, _ = _model_and_opt(0)
    ck = Checkpointer(root, every_steps=1, keep=None, async_save=False)
    ck.restore(model, opt)
    for step in (1, 2, 3):
        _train(model, opt, None, rank)
        ck.save(step)
    ck.close()
    for step in (1, 2):  # killed before their manifests
        os.remove(os.path.join(root, f"step-{step:08d}", "manifest.json"))
    common = os.path.join(root, "step-00000003", "common.pt")
    data = bytearray(open(common, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(common, "wb").write(bytes(data))
    model, opt, _ = _model_and_opt(9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError) as info:
            Checkpointer(root, every_steps=1, async_save=False).restore(model, opt)
    return str(info.value), [str(w.message) for w in caught if "skipping incomplete" in str(w.message)]


def test_every_skipped_checkpoint_is_named_when_none_loads(launched):
    [(error, skipped)] = results_of(launched, "corrupt over incomplete")
    assert "step 3" in error and "corrupt" in error, error
    for step in (1, 2):
        assert f"step {step} (" in error and f"step-{step:08d}" in error, error
        assert any(f"step-{step:08d} (step {step})" in w for w in skipped), skipped


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The scenarios at world size 2 in one launch, then those at world size 1 in another."""
    refusals, epoch3, incomplete = (str(tmp_path_factory.mktemp(name) / "ckpt")
                                    for name in ("refusals", "epoch3", "incomplete"))
    out = launch_phase(request, {
        "test_a_refused_restore_changes_nothing_on_any_rank": {"refusals": (_refusals, (refusals,))},
        "test_a_per_rank_sampler_at_another_world_size_keeps_the_saved_epoch": {
            "save at epoch 3": (_save_mid_epoch, (epoch3, 3))},
    }, 2, timeout=120, env=ENV)
    out.update(launch_phase(request, {
        "test_a_per_rank_sampler_at_another_world_size_keeps_the_saved_epoch": {
            "restore at world size 1": (_restore_elsewhere, (epoch3,))},
        "test_every_skipped_checkpoint_is_named_when_none_loads": {
            "corrupt over incomplete": (_corrupt_over_incomplete, (incomplete,))},
    }, 1, timeout=120, env=ENV))
    return out
