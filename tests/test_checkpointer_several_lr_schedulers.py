"""A Checkpointer of the whole model given several LR schedulers (Note [several LR schedulers
of one model] in fusedist/checkpoint/_snapshot.py), 2 gloo ranks, DDP + torch's AdamW:

* a step decay and an exponential decay stepped side by side on one optimizer, saved mid-run
  and restored into fresh objects, go on as in the uninterrupted run: every learning rate and
  parameter equal (the first scheduler's state was loaded into both, so the exponential decay
  resumed with the step decay's gamma);
* a restore registering another number of schedulers than were saved is refused on every
  rank, naming both counts (as any restore failing after the model and optimizer state were
  loaded: restoring again with the right objects goes on as above).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed

ENV = {"FUSEDIST_TIMEOUT_S": "30"}


def _job(seed: int, lr: float):
    import fusedist

    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    steps = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    return model, opt, [steps, decay]


def _train(model, opt, schedulers, steps, rank, seed, lrs):
    for step in steps:
        g = torch.Generator().manual_seed(seed + 100 * step + rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(6, 8, generator=g)), torch.randn(6, 4, generator=g)).backward()
        opt.step()
        for s in schedulers:
            s.step()
        lrs.append(opt.param_groups[0]["lr"])


def _resume_side_by_side(rank, world, root, seed, lr):
    from fusedist.checkpoint import CheckpointError, Checkpointer

    model, opt, schedulers = _job(seed, lr)
    whole = []
    _train(model, opt, schedulers, range(7), rank, seed, whole)

    model, opt, schedulers = _job(seed, lr)
    ck = Checkpointer(root, every_steps=3, async_save=False)
    ck.restore(model, opt, lr_scheduler=schedulers)
    first = []
    _train(model, opt, schedulers, range(3), rank, seed, first)
    ck.maybe_save(3)
    ck.close()

    fresh, fresh_opt, fresh_schedulers = _job(seed + 1, lr / 3)
    with pytest.raises(CheckpointError, match=r"holds the states of 2 LR schedulers, and restore\(\) "
                                              r"registered 1: pass the schedulers it was saved with"):
        Checkpointer(root, every_steps=3, async_save=False).restore(fresh, fresh_opt,
                                                                   lr_scheduler=fresh_schedulers[:1])

    ck = Checkpointer(root, every_steps=3, async_save=False)
    assert ck.restore(fresh, fresh_opt, lr_scheduler=fresh_schedulers) == 3
    rest = []
    _train(fresh, fresh_opt, fresh_schedulers, range(3, 7), rank, seed, rest)
    ck.close()
    assert first + rest == whole, (first + rest, whole)
    return [p.detach().clone() for p in fresh.parameters()], [p.detach().clone() for p in model.parameters()]


def _uninterrupted(rank, world, seed, lr):
    model, opt, schedulers = _job(seed, lr)
    _train(model, opt, schedulers, range(7), rank, seed, [])
    return [p.detach().clone() for p in model.parameters()]


def test_several_schedulers_resume_each_its_own_schedule(tmp_path):
    seed, lr = random.randrange(10_000), random.uniform(5e-3, 2e-2)
    resumed = run_distributed(_resume_side_by_side, 2, str(tmp_path), seed, lr, timeout=120, env=ENV)
    whole = run_distributed(_uninterrupted, 2, seed, lr, timeout=120, env=ENV)
    for (params, _), ref in zip(resumed, whole):
        for p, q in zip(params, ref):
            assert torch.equal(p, q)
