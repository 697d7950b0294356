"""ZeRO's shards and fully_shard's pieces cut parameters between ranks, so only optimizers
whose update is elementwise may step them (Note [elementwise optimizers only] in
fusedist/optim/elementwise.py): FusedLAMB and torch's LBFGS, Adafactor and Muon are refused by name (by
ZeroRedundancyOptimizer at construction, over fully_shard pieces at the first step), an
optimizer of unknown kind is taken with a warning (once per class), and one that declares itself
elementwise is taken silently and trains as on whole tensors. Why the refusal: LAMB stepped per
slice differs from LAMB on whole tensors, shown with the slices a 2-rank ZeRO would take.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


class SignDescent(torch.optim.Optimizer):
    """An elementwise optimizer of the user's own (Lion-like: the sign of momentum)."""

    _fusedist_elementwise = True

    def __init__(self, params, lr=1e-2, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                m.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(m.sign(), alpha=-group["lr"])


def _undeclared():
    """An optimizer of unknown kind, a class of its own for each scenario: the warning comes once
    per class in a process, and the scenarios of this file share their processes."""
    return type("Undeclared", (SignDescent,), {"_fusedist_elementwise": None})


def _worker(rank, world):
    import fusedist
    from fusedist.optim import FusedLAMB

    out = {}
    Undeclared = _undeclared()
    model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2)))
    for name, cls in (("lamb", FusedLAMB), ("lbfgs", torch.optim.LBFGS), ("adafactor", torch.optim.Adafactor),
                      ("muon", torch.optim.Muon)):
        try:
            fusedist.ZeroRedundancyOptimizer(model.parameters(), cls, lr=1e-2)
        except ValueError as exc:
            out[name] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            fusedist.ZeroRedundancyOptimizer(model.parameters(), Undeclared, lr=1e-2)
        fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    out["warnings"] = [str(w.message) for w in caught if "elementwise" in str(w.message)]

    # A declared elementwise optimizer trains as on whole tensors (stage 2: the shards cut
    # the 16x8 weight between the ranks).
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    zero = fusedist.ZeroRedundancyOptimizer(ours.parameters(), SignDescent, stage=2, lr=1e-2)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_opt = SignDescent(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
        for model_, opt in ((ours, zero), (ref, ref_opt)):
            opt.zero_grad()
            nn.functional.mse_loss(model_(x), y).backward()
            opt.step()
    out["diff"] = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))
    return out


@pytest.fixture(scope="module")
def launched(request):
    """The 2-rank scenarios of the tests below that pytest runs, in one launch of the ranks."""
    return launch_for_selected(request, {
        "test_zero_takes_elementwise_optimizers_only": {"zero": (_worker, ())},
        "test_fully_shard_refuses_lamb_at_its_first_step": {"fully_shard": (_fully_shard_worker, ())},
    }, world=2, timeout=180)


def test_zero_takes_elementwise_optimizers_only(launched):
    for out in results_of(launched, "zero"):
        assert "ZeroRedundancyOptimizer: FusedLAMB cannot step flat slices of each rank's shard: LAMB's trust ratio" \
            in out["lamb"], out["lamb"]
        assert "without sharding" in out["lamb"]
        assert "LBFGS cannot step flat slices" in out["lbfgs"], out["lbfgs"]
        assert "Adafactor cannot step flat slices of each rank's shard: it keeps factored" in out["adafactor"]
        assert "Muon cannot step flat slices of each rank's shard: it orthogonalizes" in out["muon"]
        assert len(out["warnings"]) == 1, out["warnings"]  # once per class, none for torch's AdamW
        assert "Undeclared steps flat slices of each rank's shard" in out["warnings"][0]
        # Sign updates are +-lr exactly: the same signs give the same weights bit for bit.
        assert out["diff"] == 0.0, out["diff"]


def test_lamb_on_slices_is_not_lamb():
    """What the refusal prevents: FusedLAMB given the two halves of each parameter (the flat
    slices two ranks would hold) moves the weights differently from FusedLAMB on the whole
    parameters, far beyond rounding (per-slice trust ratios)."""
    from fusedist.optim import FusedLAMB

    torch.manual_seed(0)
    whole = [nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(16))]
    halves = [nn.Parameter(t.detach().reshape(-1)[i * t.numel() // 2:(i + 1) * t.numel() // 2].clone())
              for t in whole for i in range(2)]
    opt_whole = FusedLAMB(whole, lr=1e-2, weight_decay=0.01)
    opt_halves = FusedLAMB(halves, lr=1e-2, weight_decay=0.01)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in whole]
        for p, gr in zip(whole, grads):
            p.grad = gr
        for i, p in enumerate(halves):
            t = grads[i // 2].reshape(-1)
            p.grad = t[(i % 2) * t.numel() // 2:((i % 2) + 1) * t.numel() // 2].clone()
        opt_whole.step()
        opt_halves.step()
    joined = [torch.cat([halves[2 * k].detach(), halves[2 * k + 1].detach()]) for k in range(2)]
    diff = max((w.detach().reshape(-1) - j).abs().max().item() for w, j in zip(whole, joined))
    assert diff > 1e-4, diff


def _fully_shard_worker(rank, world):
    import fusedist
    from fusedist.optim import FusedLAMB

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))
    fusedist.fully_shard(model[0])
    fusedist.fully_shard(model)
    out = {}
    Undeclared = _undeclared()
    model(torch.randn(4, 8)).sum().backward()
    lamb = FusedLAMB(model.parameters(), lr=1e-2)
    try:
        lamb.step()
    except ValueError as exc:
        out["lamb"] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Undeclared(model.parameters(), lr=1e-2).step()
        torch.optim.AdamW(model.parameters(), lr=1e-2).step()
        SignDescent(model.parameters(), lr=1e-2).step()
    out["warnings"] = [str(w.message) for w in caught if "elementwise" in str(w.message)]
    return out


def test_fully_shard_refuses_lamb_at_its_first_step(launched):
    for out in results_of(launched, "fully_shard"):
        assert "fully_shard: FusedLAMB cannot step this rank's pieces of the parameters" in out["lamb"], out["lamb"]
        assert len(out["warnings"]) == 1 and "Undeclared steps this rank's pieces" in out["warnings"][0], \
            out["warnings"]
