"""A backward that no DDP forward prepared (Note [a backward no DDP forward prepared] in
fusedist/ddp/reducer.py) accumulates local gradients, as with torch DDP: one through
``model.module``, and a second backward of a graph kept with ``retain_graph=True``. The next
synchronized backward reduces them with its own. Compared with torch DDP on 2 gloo ranks, with
rank-dependent inputs so that a reduced gradient differs from a local one."""

from __future__ import annotations

import time

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


def _bare_and_retained(rank, world_size):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    results = []
    for model in _pair():
        model.module(x).sum().backward()                      # through the bare module: local
        bare = _grads(model)
        local = torch.autograd.grad(model.module(x).sum(), list(model.parameters()))
        y = model(2 * x).sum()
        y.backward(retain_graph=True)                         # synchronized: the sum, reduced
        synced = _grads(model)
        y.backward()                                          # the retained graph again: local
        results.append((bare, local, synced, _grads(model)))
    (t_bare, t_local, t_synced, t_after), (bare, local, synced, after) = results
    for a, b, c in zip(bare, local, t_bare):
        torch.testing.assert_close(a, b, rtol=0, atol=0)      # nothing reduced
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    for ours, theirs in ((synced, t_synced), (after, t_after)):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    return [float((a - b).abs().max()) for a, b in zip(synced, bare)]


def test_backward_through_the_module_or_a_retained_graph_is_local_as_torchs():
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
