"""A parameter no rank used in a synchronized backward keeps the gradient it held on each rank (left
from a ``no_sync`` step or an earlier step without ``zero_grad``, or assigned by hand), as torch's DDP:
its bucket's all-reduce must not average it in. Parameters used on some ranks only are averaged, the
local stale gradient included, as torch. Each scenario trains fusedist's and torch's DDP from the same
seed on 2 gloo ranks and compares every synchronized step's gradients and the final weights, rank by
rank; the scenarios share one launch of the ranks (``launched``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import models
from shared_rank_launch import launch_for_selected, results_of


class _Parts(nn.Module):
    """``a`` always runs; ``b``, ``c``, ``d`` only where the step's plan names them."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x, uses):
        h = self.a(x)
        for name in uses:
            h = torch.tanh(getattr(self, name)(h))
        return h


# A step: (zero_grad first, synchronized, the parts each rank uses, {part: gradient assigned by hand, + rank}).
# c: no rank uses it, holding a gradient; b: used on rank 0 only, holding one; d: no gradient (stays None);
# then a no_sync step that uses c on rank 0 and d on rank 1 (used for the used map: averaged), and a step
# that uses neither b nor c nor d, whose b still holds its last gradient plus one assigned by hand.
_CHANGING = [
    (True, True, ("b", ""), {"c": 0.5, "b": 1.5}),
    (True, False, ("c", "d"), {}),
    (False, True, ("", ""), {"b": 2.5}),
    (True, True, ("b", "b"), {"c": -0.5}),
]
# For ZeRO stage 2: the same, without gradients on parameters no rank uses (see _zero_stage2).
_ZERO = [
    (True, True, ("b", ""), {"b": 1.5}),
    (True, False, ("c", "d"), {}),
    (False, True, ("", ""), {}),
    (True, True, ("b", "b"), {}),
]
# The same parts every step (static_graph): c never used, d used by both ranks, b by neither.
_STATIC = [
    (True, True, ("d", "d"), {"c": 0.5}),
    (False, True, ("d", "d"), {}),
    (True, True, ("d", "d"), {"c": 1.5, "b": -1.0}),
]


def _train(model, opt, plan, rank, hold):
    """Run ``plan``; per synchronized step the gradients (None where none), then the weights."""
    module, gen, held, grads = model.module, torch.Generator().manual_seed(100 + rank), [], []
    for zero, sync, uses, by_hand in plan:
        if zero:
            opt.zero_grad()
        for part, base in by_hand.items():
            for p in getattr(module, part).parameters():
                p.grad = torch.full_like(p, base + rank)
                if hold:
                    held.append(p.grad)  # (a gradient the user holds stays p.grad)
        x = torch.randn(3, 4, generator=gen)
        if sync:
            model(x, uses[rank]).pow(2).sum().backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
        else:
            with model.no_sync():
                model(x, uses[rank]).pow(2).sum().backward()
    return grads, [p.detach().clone() for p in model.parameters()]


def _against_torch(rank, world, seed, plan, ours, theirs, hook=False, hold=False):
    import fusedist

    torch.manual_seed(seed)
    base = _Parts()
    runs = []
    for wrap, kwargs in ((nn.parallel.DistributedDataParallel, theirs), (fusedist.DistributedDataParallel, ours)):
        model = wrap(copy.deepcopy(base), **kwargs)
        if hook:
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (both warn of the unused parameters)
            runs.append(_train(model, torch.optim.SGD(model.parameters(), lr=0.1), _CHANGING if plan == "changing"
                               else _STATIC, rank, hold))
    models.assert_same_steps(*runs)
    return [g is None for g in runs[1][0][-1]]


def _zero_stage2(rank, world, seed):
    """ZeRO stage 2 releases the buckets, so no gradient is exposed: the weights step as torch's
    ZeroRedundancyOptimizer over torch's DDP, parameters used on some ranks and no_sync steps included.
    Not planned: a gradient held by a parameter no rank uses, which torch's optimizer steps with its
    owner's own (whole parameters per rank) and stage 2's shards (cut across parameters) hold averaged."""
    import fusedist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(seed)
    base = _Parts()
    weights = []
    for zero in (lambda m: ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1),
                 lambda m: fusedist.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, stage=2, lr=0.1)):
        wrap = nn.parallel.DistributedDataParallel if not weights else fusedist.DistributedDataParallel
        model = wrap(copy.deepcopy(base), find_unused_parameters=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, params = _train(model, zero(model), _ZERO, rank, hold=False)
        weights.append(params)
    for name, (want, got) in zip([n for n, _ in base.named_parameters()], zip(*weights)):
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}")


_FIND = {"find_unused_parameters": True}


def test_unused_everywhere_keeps_each_ranks_gradient_as_torch(launched):
    for no_grad in results_of(launched, "default"):
        assert no_grad == [False] * 6 + [True] * 2, no_grad  # (d: unused and no gradient, None)


def test_kept_with_gradient_copies_and_held_gradients(launched):
    results_of(launched, "gradient copies")
    results_of(launched, "held gradients")


def test_kept_with_a_static_graph(launched):
    results_of(launched, "static graph")


def test_kept_with_a_comm_hook(launched):
    results_of(launched, "comm hook")


def test_zero_stage2_over_ddp_steps_as_torch(launched):
    results_of(launched, "zero stage 2")


@pytest.fixture(scope="module")
def launched(request):
    seed = int(torch.randint(0, 10_000, ()).item())
    return launch_for_selected(request, {
        "test_unused_everywhere_keeps_each_ranks_gradient_as_torch": {
            "default": (_against_torch, (seed, "changing", _FIND, _FIND))},
        "test_kept_with_gradient_copies_and_held_gradients": {
            "gradient copies": (_against_torch, (seed, "changing", dict(_FIND, gradient_as_bucket_view=False), _FIND)),
            "held gradients": (_against_torch, (seed, "changing", _FIND, _FIND, False, True))},
        "test_kept_with_a_static_graph": {
            "static graph": (_against_torch, (seed, "static", {"static_graph": True}, {"static_graph": True}))},
        "test_kept_with_a_comm_hook": {"comm hook": (_against_torch, (seed, "changing", _FIND, _FIND, True))},
        "test_zero_stage2_over_ddp_steps_as_torch": {"zero stage 2": (_zero_stage2, (seed,))},
    }, 2, timeout=240)
