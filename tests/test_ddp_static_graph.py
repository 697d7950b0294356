"""``static_graph=True`` on fusedist's DistributedDataParallel (Note [gradients that arrive
twice] in fusedist/ddp/static_graph.py): a block called twice in one forward under reentrant
activation checkpointing delivers its gradient twice per backward. Compared on 2 gloo ranks
with torch DDP's ``static_graph=True`` and with the single-process run on the global batch
(torch DDP without ``static_graph`` trains wrong here, and fusedist refuses it by name).
The two-rank scenarios share one launch of the ranks (``launched``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shared_rank_launch import launch_for_selected, results_of

WIDTH = 256  # a 256x256 weight is large enough for its bucket to fold the division into the copies


class SharedBlocks(nn.Module):
    """``shared`` runs first and last, each block inside a reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.middle = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(WIDTH, 4)
        self.twice = True

    def forward(self, x):
        blocks = [self.shared, *self.middle] + ([self.shared] if self.twice else [])
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(x)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, WIDTH, generator=g).requires_grad_(), torch.randn(8, 4, generator=g)


def _train(model, world_rank, world, steps, accumulate=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            x, y = _batch(world_rank, step * accumulate + micro)
            sync = micro == accumulate - 1
            ctx = model.no_sync() if not sync else _null()
            with ctx:
                nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _truth(base, world, steps, accumulate=1):
    """One process, the global batch: the mean of the ranks' losses."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            batches = [_batch(r, step * accumulate + micro) for r in range(world)]
            loss = sum(nn.functional.mse_loss(model(x), y) for x, y in batches) / world
            loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _parity_worker(rank, world, views, accumulate, late):
    import fusedist

    base = SharedBlocks()
    # A bucket per parameter (the head's two in the first; each later one reaches the 943 B
    # cap alone): the shared block's gradient first arrives early in backward (from its last
    # call) and again at the end; its bucket must wait for the second arrival. Each 256x256
    # weight alone in its bucket is large enough to fold the division into the copies --
    # except the shared one's, whose second gradient is added onto the first.
    opts = dict(bucket_cap_mb_list=[0.001, 0.0009])
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), static_graph=True, **opts)
    if late:  # torch's private switch after construction
        ours = fusedist.DistributedDataParallel(copy.deepcopy(base), gradient_as_bucket_view=views, **opts)
        ours._set_static_graph()
    else:
        ours = fusedist.DistributedDataParallel(copy.deepcopy(base), static_graph=True,
                                                gradient_as_bucket_view=views, **opts)
    steps = 4
    got = _train(ours, rank, world, steps, accumulate)
    # torch's static graph fails an internal assert under no_sync here: the global batch only.
    want = _train(ref, rank, world, steps, accumulate) if accumulate == 1 else None
    truth = _truth(base, world, steps, accumulate)
    folded = {name: b.fold is not None for b in ours.buckets for name in b.names if name.endswith("0.weight")}

    def diff(a, b):
        return max((x - y).abs().max().item() for x, y in zip(a, b))

    moved = diff(truth, [p.detach() for p in base.parameters()])
    return diff(got, truth), want and diff(want, truth), moved, len(ours.buckets), folded


PARITY_CASES = [(True, 1, False), (False, 1, False), (True, 2, True)]


@pytest.mark.parametrize("views,accumulate,late", PARITY_CASES,
                         ids=["gradient views", "gradient copies", "no_sync accumulation, _set_static_graph"])
def test_static_graph_matches_torch_and_the_global_batch(launched, views, accumulate, late):
    """SGD with momentum is linear in the gradients, so the weights differ from the
    single-process run by the fp32 rounding of the sums (3e-8 measured, 1e-6 allowed on
    weights of order 0.1); a gradient reduced without its second arrival, or divided twice,
    moves them by 1e-3 or more."""
    for ours, torchs, moved, buckets, folded in results_of(launched, f"parity {views} {accumulate} {late}"):
        assert moved > 1e-2, moved  # the runs trained
        assert buckets >= 5, buckets
        assert torchs is None or torchs <= 1e-6, torchs  # the reference itself
        assert ours <= 1e-6, ours
        assert folded == {"shared.0.weight": False, "middle.0.0.weight": True, "middle.1.0.weight": True}, folded


def _error_worker(rank, world):
    import fusedist

    errors = {}
    x, y = _batch(rank, 0)
    model = fusedist.DistributedDataParallel(SharedBlocks())
    try:
        nn.functional.mse_loss(model(x), y).backward()
    except RuntimeError as exc:
        errors["not static"] = str(exc)

    model = fusedist.DistributedDataParallel(SharedBlocks(), static_graph=True)
    nn.functional.mse_loss(model(x), y).backward()  # learns: the shared block arrives twice
    model.module.twice = False
    try:
        nn.functional.mse_loss(model(x), y).backward()
    except RuntimeError as exc:
        errors["fewer"] = str(exc)

    model = fusedist.DistributedDataParallel(SharedBlocks(), static_graph=True)
    model.module.twice = False
    nn.functional.mse_loss(model(x), y).backward()  # learns: once each
    model.module.twice = True
    try:
        nn.functional.mse_loss(model(x), y).backward()
    except RuntimeError as exc:
        errors["more"] = str(exc)
    return errors


def test_a_second_arrival_without_static_graph_or_a_changed_graph_raises_by_name(launched):
    for rank, errors in enumerate(results_of(launched, "errors")):
        assert f"(rank {rank}): parameter 'shared.0.bias' received its gradient twice" in errors["not static"]
        assert "static_graph=True" in errors["not static"] and "use_reentrant=False" in errors["not static"]
        assert "['shared.0.weight', 'shared.0.bias']" in errors["fewer"] or "shared.0" in errors["fewer"]
        assert "fewer times in this backward than in the first" in errors["fewer"]
        assert "received its gradient 2 times in this backward, 1 in the first one" in errors["more"]


def _zero_worker(rank, world, stage):
    import fusedist

    base = SharedBlocks()
    opts = dict(bucket_cap_mb_list=[0.001, 0.0009])  # (as in _parity_worker)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), static_graph=True, **opts)
    zero = fusedist.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, stage=stage, lr=0.5, momentum=0.9)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), static_graph=True, **opts)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for step in range(4):
        x, y = _batch(rank, step)
        for model, opt in ((ours, zero), (ref, ref_opt)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))


@pytest.mark.parametrize("stage", [1, 2])
def test_static_graph_under_zero_matches_torch(launched, stage):
    """ZeRO's shards are ranges of the same buckets: stage 2 reduce-scatters the shared block's
    bucket only after its second arrival too. Same arithmetic as torch's: 1e-6 allowed."""
    for diff in results_of(launched, f"zero {stage}"):
        assert diff <= 1e-6, diff


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    # (the backwards that raise last: every rank raised at the same point, but nothing needs to follow them)
    return launch_for_selected(request, {
        "test_static_graph_matches_torch_and_the_global_batch": {
            f"parity {views} {accumulate} {late}": (_parity_worker, (views, accumulate, late))
            for views, accumulate, late in PARITY_CASES},
        "test_static_graph_under_zero_matches_torch": {f"zero {stage}": (_zero_worker, (stage,)) for stage in (1, 2)},
        "test_a_second_arrival_without_static_graph_or_a_changed_graph_raises_by_name": {
            "errors": (_error_worker, ())},
    }, 2, timeout=360)
