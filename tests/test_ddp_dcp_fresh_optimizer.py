"""torch's distributed-checkpoint resume over a fresh fusedist DDP model: ``get_optimizer_state_dict``
and ``set_optimizer_state_dict`` create a fresh optimizer's state with one zero-gradient step at lr 0
(Note [torch's state-creating step] in fusedist/reliability/optimizer_guard.py). The step guard
refused it on every rank as a step before any backward; torch's DDP takes it. After a resume
through it, training matches torch DDP's (fp32, 1e-6), and a real step before any backward is
still refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed


def _worker(rank, world_size, seed):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    import fusedist

    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    # What a checkpoint holds: the state of a few torch AdamW steps on an unwrapped copy.
    trained = copy.deepcopy(base)
    saved_opt = torch.optim.AdamW(trained.parameters(), lr=0.01)
    for _ in range(2):
        trained(torch.randn(3, 4)).square().sum().backward()
        saved_opt.step()
        saved_opt.zero_grad()
    saved = saved_opt.state_dict()
    runs = []
    for wrap in (nn.parallel.DistributedDataParallel, fusedist.DistributedDataParallel):
        model = wrap(copy.deepcopy(trained))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        get_optimizer_state_dict(model, opt)  # the state-creating step
        set_optimizer_state_dict(model, opt, copy.deepcopy(saved))  # (a load may alias the tensors)
        gen = torch.Generator().manual_seed(seed + rank)
        for _ in range(2):
            model(torch.randn(3, 4, generator=gen)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
        if wrap is fusedist.DistributedDataParallel:
            assert model.watch.optimizer_steps == 2  # the state-creating step is not counted
            again = fusedist.DistributedDataParallel(copy.deepcopy(base))
            step_early = torch.optim.AdamW(again.parameters(), lr=0.01)
            for p in again.parameters():
                p.grad = torch.ones_like(p)
            with pytest.raises(RuntimeError, match="step\\(\\) was called before any backward"):
                step_early.step()
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_dcp_resume_of_a_fresh_optimizer_over_fusedist_ddp():
    run_distributed(_worker, 2, int(torch.randint(0, 10_000, ()).item()), timeout=120)
