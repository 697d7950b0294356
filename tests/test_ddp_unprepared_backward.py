"""A backward that no DDP forward prepared (Note [a backward no DDP forward prepared] in
fusedist/ddp/prepared.py) accumulates local gradients, as with torch DDP: one through
``model.module``; the next synchronized backward reduces them with its own, and a step right
after one is refused. A second backward through the wrapper's output (two losses of one
forward) synchronizes again, where torch's leaves it local and its ranks diverge: the result is
torch's for the sum of the losses. Compared with torch DDP on 2 gloo ranks, with rank-dependent
inputs so that a reduced gradient differs from a local one."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed


def _pair():
    import fusedist

    out = []
    for cls in (nn.parallel.DistributedDataParallel, fusedist.DistributedDataParallel):
        torch.manual_seed(0)
        out.append(cls(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))))
    return out


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _exact(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def _bare_and_retained(rank, world_size):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    torch_ddp, ours = _pair()
    for model in (torch_ddp, ours):
        model.module(x).sum().backward()                      # through the bare module: local
    bare = _grads(ours)
    local = torch.autograd.grad(ours.module(x).sum(), list(ours.parameters()))
    _exact(bare, local)
    _exact(bare, _grads(torch_ddp))
    with pytest.raises(RuntimeError, match="not synchronized.*model.module"):
        torch.optim.SGD(ours.parameters(), lr=0.1).step()     # the ranks would diverge
    for model in (torch_ddp, ours):
        model((2 * x)).sum().backward()                       # synchronized: the sum, reduced
    _exact(_grads(ours), _grads(torch_ddp))
    moved = [float((a - b).abs().max()) for a, b in zip(_grads(ours), bare)]
    # two losses of one forward: the second backward synchronizes too (torch's is local)
    for model in (torch_ddp, ours):
        model.zero_grad()
    y = ours(x).sum()
    y.backward(retain_graph=True)
    y.backward()
    torch_ddp(x).sum().mul(2).backward()                      # torch, both losses in one backward
    _exact(_grads(ours), _grads(torch_ddp))
    torch.optim.SGD(ours.parameters(), lr=0.1).step()         # synchronized: the step is taken
    return moved


def test_backward_through_the_module_is_local_and_a_second_loss_synchronizes():
    moved = run_distributed(_bare_and_retained, 2)
    assert all(d > 1e-3 for per_rank in moved for d in per_rank)  # the synchronized backward did reduce


def _one_rank_diagnoses(rank, world_size):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    grads, took = [], []
    for model in _pair():
        t0 = time.monotonic()
        if rank == 0:  # a saliency map on one rank, then training on both
            x0 = x.clone().requires_grad_()
            model.module(x0).sum().backward()
            model.zero_grad()
        model(x).sum().backward()
        took.append(time.monotonic() - t0)
        grads.append(_grads(model))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    return took[1]


def test_a_backward_on_one_rank_alone_pairs_no_collective():
    """It used to all-reduce a bucket that the other rank, in its forward, paired with a check
    of its own: both waited out the collective timeout."""
    took = run_distributed(_one_rank_diagnoses, 2, env={"FUSEDIST_TIMEOUT_S": "20"}, timeout=90)
    assert max(took) < 10, took
