"""DDP under join and of ``fusedist.replicate`` against torch on gloo ranks: a
submodule replicated after its parent's first forward, the division of newly trainable
parameters' gradients and of torch's averaging hooks under ``divide_by_initial_world_size=False``,
and ranks still training that disagree on ``no_sync()`` under join.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed
from shared_rank_launch import launch_for_selected, results_of


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Sequential(nn.ReLU(), nn.Linear(8, 8))
        self.c = nn.Linear(8, 4)
        self.use_b = True

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(h + self.b(h) if self.use_b else h)


def _max_diff(xs, ys) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(xs, ys))


def _late_replicate_case(rank, world, seed):
    """A submodule replicated after the parent's first forward: torch's replicate trains on (both
    engines reduce it to the same average); fusedist refuses it before anything changes. It used
    to retire the parent's hooks in the middle of the next forward: that step trained unsynchronized."""
    from torch.distributed._composable.replicate import replicate as torch_replicate

    import fusedist

    torch.manual_seed(seed + rank)
    theirs = _Net()
    ours = copy.deepcopy(theirs)
    g = torch.Generator().manual_seed(seed + 10 + rank)
    data = [torch.randn(4, 6, generator=g) for _ in range(3)]
    error = None
    for m, rep in ((theirs, torch_replicate), (ours, fusedist.replicate)):
        rep(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i, x in enumerate(data):
            if i == 1:
                try:
                    rep(m.b)
                except RuntimeError as exc:
                    error = str(exc)
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return _max_diff(theirs.parameters(), ours.parameters()), error


def test_replicate_of_a_submodule_after_the_parents_first_forward_is_refused(launched):
    for rank, (diff, error) in enumerate(results_of(launched, "late replicate")):
        assert error is not None and "already reduced by the data-parallel engine of" in error, error
        assert "'1.weight'" in error, error
        assert diff < 1e-6, f"rank {rank}: {diff} off torch's replicate (the parent still reduces every parameter)"


def _unfrozen_under_join_case(rank, world, seed, divide):
    """A parameter unfrozen while a rank is joined, under join(divide_by_initial_world_size=divide).
    Oracle: torch DDP built with it trainable and unused until then (find_unused_parameters)."""
    from torch.distributed.algorithms import Join as TorchJoin

    import fusedist

    torch.manual_seed(seed)
    base = _Net()
    base.use_b = False
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
    frozen = copy.deepcopy(base)
    frozen.b.requires_grad_(False)
    ours = fusedist.DistributedDataParallel(frozen, find_unused_parameters=True)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    data = [torch.randn(4, 6, generator=g) for _ in range([2, 5][rank])]
    for m, join, unfreeze in ((theirs, TorchJoin, False), (ours, fusedist.Join, True)):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        with join([m], divide_by_initial_world_size=divide):
            for i, x in enumerate(data):
                if i == 3:  # rank 0 has joined
                    m.module.use_b = True
                    if unfreeze:
                        m.module.b.requires_grad_(True)
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    return _max_diff(theirs.module.parameters(), ours.module.parameters())


def test_parameters_unfrozen_under_join_are_divided_by_the_active_ranks(launched):
    seed = launched["seed"]
    for rank, diff in enumerate(results_of(launched, "unfrozen under join")):
        assert diff < 1e-5, \
            f"rank {rank} (seed {seed}): {diff} off torch DDP under Join(divide_by_initial_world_size=False)"


def _mixed_no_sync_case(rank, world, seed):
    """Rank 1 runs one iteration under no_sync() while rank 2 synchronizes (rank 0 has joined).
    torch's DDP aborts in gloo (collective mismatch) or hangs; fusedist raises on every rank."""
    import fusedist

    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with model.join():
            for i in range(3 + rank):
                odd = rank == 1 and i == 3
                with model.no_sync() if odd else contextlib.nullcontext():
                    model(torch.randn(4, 6)).square().mean().backward()
                if not odd:
                    opt.step()
                    opt.zero_grad()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_ranks_disagreeing_on_no_sync_under_join_raise_on_every_rank():
    seed = int(torch.randint(0, 10_000, ()))
    results = run_distributed(_mixed_no_sync_case, 3, seed, timeout=120, env={"FUSEDIST_TIMEOUT_S": "20"})
    for rank, error in enumerate(results):
        assert error is not None, f"rank {rank} did not raise"
        assert "ranks [1] run it under no_sync(), ranks [2] synchronize" in error, f"rank {rank}: {error}"


def _hook_under_join_case(rank, world, seed, hook_name):
    """torch's averaging hooks under join(divide_by_initial_world_size=False): torch's hooks
    divide by the group's size whatever the join asks; fusedist runs them as its own reduction."""
    from torch.distributed.algorithms import Join as TorchJoin
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import fusedist

    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    g = torch.Generator().manual_seed(seed + 1 + rank)
    data = [torch.randn(4, 6, generator=g) for _ in range([2, 4][rank])]
    for m, join in ((theirs, TorchJoin), (ours, fusedist.Join)):
        m.register_comm_hook(None, getattr(default_hooks, hook_name))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with join([m], divide_by_initial_world_size=False):
            for x in data:
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    return _max_diff(theirs.parameters(), ours.parameters())


def test_torch_averaging_hooks_under_join_divide_as_torchs(launched):
    seed = launched["seed"]
    for rank, diff in enumerate(results_of(launched, "hook under join")):
        assert diff < 1e-5, f"rank {rank} (seed {seed}): {diff} off torch DDP + allreduce_hook under Join(divide=False)"


@pytest.fixture(scope="module")
def launched(request):
    """The selected 2-rank cases in one launch, on a fresh random seed (each builds its own
    models; the 3-rank case, which needs a short collective timeout, has its own launch)."""
    seed = int(torch.randint(0, 10_000, ()))
    return {"seed": seed, **launch_for_selected(request, {
        "test_replicate_of_a_submodule_after_the_parents_first_forward_is_refused": {
            "late replicate": (_late_replicate_case, (seed,))},
        "test_parameters_unfrozen_under_join_are_divided_by_the_active_ranks": {
            "unfrozen under join": (_unfrozen_under_join_case, (seed, False))},
        "test_torch_averaging_hooks_under_join_divide_as_torchs": {
            "hook under join": (_hook_under_join_case, (seed, "allreduce_hook"))},
    }, 2, timeout=300)}
