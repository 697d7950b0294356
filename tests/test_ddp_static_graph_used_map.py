"""``static_graph=True`` with parameters that some ranks never use: gradients as torch DDP's, the
used map all-reduced in the first backward only (Note [the used map of a static graph] in
``fusedist/ddp/unused.py``), and a clear error on the rank whose set of used parameters changes.
2 gloo ranks, fresh random inputs. The two-rank scenarios share one launch of the ranks (``launched``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import models
from shared_rank_launch import launch_for_selected, results_of


class _Heads(nn.Module):
    """Rank 0 adds head ``c``; rank 1 never uses it (a rank-dependent but static graph)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, use_c: bool):
        h = torch.relu(self.a(x))
        return self.b(h) + self.c(h) if use_c else self.b(h)


def _train(model, rank, seed, uses_c, steps=4, freeze_at=None):
    """Per step: the gradients after backward; then the final parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed + rank)
    grads = []
    for step in range(steps):
        if step == freeze_at:
            model.module.c.requires_grad_(False)
        opt.zero_grad()
        model(torch.randn(3, 4, generator=gen), uses_c(step)).pow(2).sum().backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _count_used_map_reductions(model) -> list:
    comm, tags = model.reducer.comm, []
    all_reduce = comm.all_reduce

    def counting(tensor, *args, **kwargs):
        tags.append(kwargs.get("tag"))
        return all_reduce(tensor, *args, **kwargs)

    comm.all_reduce = counting
    return tags


def _rank_dependent_worker(rank, world_size, seed):
    import fusedist

    torch.manual_seed(seed)
    base = _Heads()
    uses_c = lambda step: rank == 0  # noqa: E731
    ref = _train(nn.parallel.DistributedDataParallel(copy.deepcopy(base), static_graph=True), rank, seed, uses_c)
    model = fusedist.DistributedDataParallel(copy.deepcopy(base), static_graph=True)
    tags = _count_used_map_reductions(model)
    # The per-step cross-rank check (on by default) must not take the ranks' different unused
    # sets for a divergence: static_graph accepts them, as torch does.
    models.assert_same_steps(ref, _train(model, rank, seed, uses_c))
    assert tags.count("ddp used-parameter map") == 1, tags


def test_static_graph_rank_dependent_unused_matches_torch_and_reduces_the_used_map_once(launched):
    results_of(launched, "rank dependent")


def _changed_graph_worker(rank, world_size, seed):
    import fusedist

    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(_Heads(), static_graph=True)
    # Rank 1 starts using head c in the last step: its graph is not static.
    uses_c = lambda step: rank == 0 or step == 2  # noqa: E731
    if rank == 1:
        with pytest.raises(RuntimeError, match=r"rank 1\): with static_graph=True .*\['c.weight', 'c.bias'\]"):
            _train(model, rank, seed, uses_c, steps=3)
    else:
        _train(model, rank, seed, uses_c, steps=3)


def test_static_graph_names_the_parameters_whose_use_changed(launched):
    results_of(launched, "changed graph")


class _Optional(nn.Module):
    """Head ``b`` is used where ``use_b``; head ``c`` always."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, use_b: bool):
        h = torch.relu(self.a(x))
        return self.c(h) + self.b(h) if use_b else self.c(h)


def _unfreeze_worker(rank, world_size, seed):
    import torch.distributed as dist

    import fusedist

    torch.manual_seed(seed)
    base = _Optional()
    base.c.requires_grad_(False)
    model = fusedist.DistributedDataParallel(copy.deepcopy(base), static_graph=True)
    reference = copy.deepcopy(base)  # the same steps, gradients averaged by hand
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    gen = torch.Generator().manual_seed(seed + rank)
    for step in range(5):
        if step == 2:  # c joins the trainable set: the reducer re-buckets, the used map is learned again
            for m in (model.module, reference):
                m.c.requires_grad_(True)
        x = torch.randn(3, 4, generator=gen)
        for m, opt in zip((model, reference), opts):
            opt.zero_grad()
            m(x, rank == 0).pow(2).sum().backward()
        for p in reference.parameters():  # (every trainable one is used by some rank)
            if p.requires_grad:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad)
                p.grad = grad / world_size
        for (name, got), want in zip(model.module.named_parameters(), reference.parameters()):
            assert (got.grad is None) == (want.grad is None), (step, name)
            if want.grad is not None:
                torch.testing.assert_close(got.grad, want.grad, msg=f"step {step}, {name}")
        for opt in opts:
            opt.step()


def test_static_graph_learns_the_used_map_again_after_the_trainable_set_grows(launched):
    results_of(launched, "unfreeze")


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    def seed():
        return int(torch.randint(0, 10_000, ()).item())

    # (the changed graph last: only rank 1 raises there, nothing needs to follow it)
    return launch_for_selected(request, {
        "test_static_graph_rank_dependent_unused_matches_torch_and_reduces_the_used_map_once": {
            "rank dependent": (_rank_dependent_worker, (seed(),))},
        "test_static_graph_learns_the_used_map_again_after_the_trainable_set_grows": {
            "unfreeze": (_unfreeze_worker, (seed(),))},
        "test_static_graph_names_the_parameters_whose_use_changed": {
            "changed graph": (_changed_graph_worker, (seed(),))},
    }, 2, timeout=300)
