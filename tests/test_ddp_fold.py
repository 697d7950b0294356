"""The averaging division folded into the gradient copies (Note [division folded into the copy]
in fusedist/ddp/strategy.py), against the unfolded path and torch DDP, at world sizes 2 and 3.

Each scenario runs twice in one process, with folding forced on (every bucket folds) and off
(no bucket does): both multiply each gradient by the same ``1 / world_size`` once, so the
averaged gradients must be bitwise equal; and against torch DDP on the same data within
1e-6 (fp32 gradients of magnitude ~0.1: the sum order of gloo vs bucket boundaries, a few
ulps). Every scenario also asserts which path it exercised, so a fold that silently stopped
happening fails here.
"""

import contextlib
import copy

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed

ALWAYS, NEVER = 0, 1 << 62


class Branchy(nn.Module):
    """Two Linear layers and a branch used only when asked (an unused parameter's path)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(48, 48)
        self.b = nn.Linear(48, 8)
        self.side = nn.Linear(48, 8)

    def forward(self, x, use_side=True):
        h = torch.tanh(self.a(x))
        out = self.b(h)
        return out + self.side(h) if use_side else out


def _grads(model):
    return {n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}


def _run(model, schedule, gen, set_to_none=True):
    """Run ``schedule``: a list of (sync, use_side) micro-batches, after one zero_grad."""
    for p in model.parameters():
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()
    for sync, use_side in schedule:
        x = torch.randn(6, 48, generator=gen)
        ctx = model.no_sync() if not sync else contextlib.nullcontext()
        with ctx:
            model(x, use_side=use_side).pow(2).sum().backward()


SCENARIOS = {
    # name: (schedule, set_to_none, DDP kwargs, expect unfolded views)
    "fresh gradients": ([(True, True)], True, {}, False),
    "no_sync then sync": ([(False, True), (True, True)], True, {}, True),
    "zero_grad(set_to_none=False)": ([(True, True)], False, {}, True),
    "gradient views off": ([(True, True)], True, {"gradient_as_bucket_view": False}, False),
    # 'side' gets a gradient under no_sync, none in the synchronized backward: its earlier
    # gradient is averaged at the end of backward (the unused-parameter path).
    "unused after no_sync": ([(False, True), (True, False)], True, {"find_unused_parameters": True}, True),
    "unused after no_sync, views off": ([(False, True), (True, False)], False,
                                        {"find_unused_parameters": True, "gradient_as_bucket_view": False}, True),
}


def _fold_worker(rank, world_size):
    import fusedist
    from fusedist.ddp import strategy

    results = {}
    for name, (schedule, set_to_none, kwargs, expect_unfolded) in SCENARIOS.items():
        torch.manual_seed(7)
        base = Branchy()
        grads, used = {}, {}
        for label, threshold in (("fold", ALWAYS), ("plain", NEVER)):
            strategy.FOLD_MIN_ELEMENTS_PER_PARAM = threshold
            model = fusedist.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.005,
                                                     first_bucket_cap_mb=0.002, **kwargs)
            for step in range(2):  # the second runs on the rebuilt (final) layout
                _run(model, schedule, torch.Generator().manual_seed(100 * step + rank), set_to_none)
            buckets = model.reducer.layout.buckets
            used[label] = (sum(b.fold is not None for b in buckets), sum(len(b.unfolded) for b in buckets),
                           len(buckets))
            grads[label] = _grads(model)
        torch_kwargs = {"find_unused_parameters": True} if kwargs.get("find_unused_parameters") else {}
        ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **torch_kwargs)
        for step in range(2):
            _run(ref, schedule, torch.Generator().manual_seed(100 * step + rank), set_to_none)
        want = _grads(ref)
        folded, unfolded, n_buckets = used["fold"]
        assert folded == n_buckets, f"{name}: {folded} of {n_buckets} buckets folded their division"
        assert used["plain"][0] == 0, f"{name}: a bucket folded with folding off"
        assert (unfolded > 0) == expect_unfolded, f"{name}: {unfolded} views scaled at launch"
        assert grads["fold"].keys() == want.keys(), (name, sorted(grads["fold"]), sorted(want))
        for n in want:
            assert torch.equal(grads["fold"][n], grads["plain"][n]), f"{name}: {n} differs between the two paths"
            err = (grads["fold"][n] - want[n]).abs().max().item()
            assert err < 1e-6, f"{name}: {n} differs from torch DDP by {err}"
        results[name] = (folded, unfolded)
    return results


def _zero2_worker(rank, world_size):
    """ZeRO stage 2's reduce-scatter folds too: parameters after AdamW steps, bitwise."""
    import fusedist
    from fusedist.ddp import strategy

    torch.manual_seed(3)
    base = Branchy()
    finals = {}
    for label, threshold in (("fold", ALWAYS), ("plain", NEVER)):
        strategy.FOLD_MIN_ELEMENTS_PER_PARAM = threshold
        model = fusedist.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.005, first_bucket_cap_mb=0.002)
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with model.no_sync():
                model(torch.randn(6, 48, generator=gen)).pow(2).sum().backward()
            model(torch.randn(6, 48, generator=gen)).pow(2).sum().backward()
            opt.step()
        folded = sum(b.fold is not None for b in model.reducer.layout.buckets)
        assert (folded > 0) == (label == "fold"), (label, folded)
        finals[label] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(finals["fold"], finals["plain"]):
        assert torch.equal(a, b)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_folded_division_matches_unfolded_and_torch(world_size):
    results = run_distributed(_fold_worker, world_size)
    assert results[0].keys() == SCENARIOS.keys()


def test_zero2_folded_division_is_bitwise_the_same():
    assert run_distributed(_zero2_worker, 2) == [True, True]
