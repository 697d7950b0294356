"""Gradient clipping and update numerics against torch (2 gloo ranks, and one process):

* ``ZeroRedundancyOptimizer.clip_grad_norm_`` (the method, ``fusedist.clip_grad_norm_`` and
  torch's clip) with every order torch's clip takes -- 0 (tensors with a nonzero gradient),
  negative p and -inf, whose totals are not sums over the elements -- in both stages, also over
  some of the parameters in stage 2: the norm and the trained parameters match torch DDP +
  torch's clip;
* a float64 model under stage 2 with clipping: the norm and the parameters match torch's to
  float64 precision (the norm and the clip coefficient are not rounded to float32), also in the
  step that a parameter unfrozen without DDP joins in;
* a model with float32 and float64 parameters, in both stages: the float32 gradients' norm is taken
  in float32 as torch's clip takes it (each gradient's norm in its own dtype), not in float64
  because float64 gradients are beside it, so the norm matches torch's to float64 precision;
* ``FusedSGD`` with ``dampening`` given as a tensor, in float64: torch's update exactly;
* a fused optimizer's float64 gradients clipped after ``GradScaler.unscale_`` (also a lazy
  one): torch's norm and update exactly (the coefficient is not rounded to float32).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

INF = float("inf")
ORDERS = [0.0, -INF, -1.5]


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _batch(rank, step, dtype=torch.float32):
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank)).to(dtype)


def _pair(stage, dtype=torch.float32, optimizer=torch.optim.SGD, **kw):
    import fusedist

    base = _net(dtype)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), optimizer, stage=stage, **kw)
    return ours, theirs, opt, optimizer(theirs.parameters(), **kw)


def _diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _every_order_worker(rank, ws, stage):
    import fusedist

    ours, theirs, opt, ref = _pair(stage, lr=0.1, momentum=0.9)
    clips = [lambda nt: opt.clip_grad_norm_(0.3, nt),
             lambda nt: fusedist.clip_grad_norm_(ours.parameters(), 0.3, nt),
             lambda nt: nn.utils.clip_grad_norm_(ours.parameters(), 0.3, nt)]
    batches = itertools.count()

    def clipped_step(nt, clip_ours, clip_theirs):
        """One step of both sides, clipped by order ``nt``: the norms and then the weights agree."""
        x = _batch(rank, next(batches))
        opt.zero_grad()
        ref.zero_grad()
        ours(x).square().sum().backward()
        theirs(x).square().sum().backward()
        got, want = clip_ours(nt).item(), clip_theirs(nt).item()
        assert got == pytest.approx(want, rel=1e-5, abs=1e-9), (nt, got, want)
        opt.step()
        ref.step()
        assert _diff(ours, theirs) < 1e-5, (nt, _diff(ours, theirs))

    for nt in ORDERS:
        for clip in clips:
            clipped_step(nt, clip, lambda nt: nn.utils.clip_grad_norm_(theirs.parameters(), 0.3, nt))
    if stage == 2:  # some of the parameters (the head left out): scaled in their shards
        for nt in ORDERS:
            clipped_step(nt, lambda nt: fusedist.clip_grad_norm_(list(ours.module[0].parameters()), 0.3, nt),
                         lambda nt: nn.utils.clip_grad_norm_(list(theirs.module[0].parameters()), 0.3, nt))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_clip_takes_every_norm_order_torch_takes(stage, launched):
    results_of(launched, f"every order {stage}")


def _float64_worker(rank, ws):
    ours, theirs, opt, ref = _pair(2, torch.float64, torch.optim.Adam, lr=0.05)
    for step, nt in enumerate([2.0, 1.0, INF, 2.0]):
        x = _batch(rank, step, torch.float64)
        opt.zero_grad()
        ref.zero_grad()
        ours(x).square().sum().backward()
        theirs(x).square().sum().backward()
        got = nn.utils.clip_grad_norm_(ours.parameters(), 0.3, nt)
        want = nn.utils.clip_grad_norm_(theirs.parameters(), 0.3, nt)
        assert got.dtype == torch.float64
        assert abs(got.item() - want.item()) <= 1e-12 * want.item(), (nt, got.item(), want.item())
        opt.step()
        ref.step()
        assert _diff(ours, theirs) < 1e-13, (step, _diff(ours, theirs))


def test_zero_stage2_float64_clip_matches_torch_to_float64_precision(launched):
    results_of(launched, "float64")


def _float64_unfrozen_worker(rank, ws):
    """A float64 model frozen whole at construction, its layers unfrozen one step apart, without
    DDP: the step that a layer joins in is clipped by torch's norm in float64."""
    import fusedist

    base = _net(torch.float64).requires_grad_(False)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, lr=0.1)
    ref = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for step, layer in enumerate([2, 0]):
        ours[layer].requires_grad_(True)
        theirs[layer].requires_grad_(True)
        x = _batch(0, step, torch.float64)  # the same batch on every rank: the gradients are synchronized
        for model, optimizer in ((ours, opt), (theirs, ref)):
            optimizer.zero_grad()
            model(x).square().sum().backward()
        got = opt.clip_grad_norm_(0.01)
        want = nn.utils.clip_grad_norm_([p for p in theirs.parameters() if p.requires_grad], 0.01)
        assert got.dtype == want.dtype == torch.float64
        assert abs(got.item() - want.item()) <= 1e-13 * want.item(), (step, got.item(), want.item())
        opt.step()
        ref.step()
        assert _diff(ours, theirs) < 1e-14, (step, _diff(ours, theirs))


def test_zero_parameter_unfrozen_in_float64_is_clipped_by_torchs_float64_norm(launched):
    results_of(launched, "float64 unfrozen")


class _MixedPrecisionNet(nn.Module):
    """A float64 layer and a float32 vector of 16 elements (one rank's whole slice of its padded
    bucket at 2 ranks, so its norm is taken over the whole tensor as torch's is), the float32
    gradient dominating the norm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Linear(6, 8).double()
        self.narrow = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return self.wide(x.double()).square().sum() + (self.narrow * x.float().sum() * 10).square().sum().double()


def _mixed_precision_worker(rank, ws, stage):
    import fusedist

    base = _MixedPrecisionNet()
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, stage=stage, lr=1e-4)
    ref = torch.optim.SGD(theirs.parameters(), lr=1e-4)
    clips = [lambda: opt.clip_grad_norm_(1.0), lambda: fusedist.clip_grad_norm_(ours.parameters(), 1.0)]
    for step, clip in enumerate(clips):
        x = _batch(rank, step, torch.float64)
        for model, optimizer in ((ours, opt), (theirs, ref)):
            optimizer.zero_grad()
            model(x).backward()
        got, want = clip(), nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
        assert got.dtype == want.dtype == torch.float64
        assert abs(got.item() - want.item()) <= 1e-14 * want.item(), (step, got.item(), want.item())
        opt.step()
        ref.step()
        assert _diff(ours, theirs) < 1e-7, (step, _diff(ours, theirs))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_float32_norm_beside_float64_is_taken_in_float32_as_torchs(stage, launched):
    results_of(launched, f"mixed precision {stage}")


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0])
def test_tensor_norms_take_each_norm_in_its_own_dtype_as_torchs_clip(norm_type):
    """The per-tensor norms the sharded clips add up: an fp32 tensor's in fp32 beside an fp64 one,
    bit for bit torch's (torch.nn.utils.get_total_norm takes each in the tensor's dtype), a bf16
    one's in fp32 (not rounded to bf16: see tensor_norms)."""
    from fusedist.optim.grad_norms import tensor_norms

    g = torch.Generator().manual_seed(5)
    narrow, wide, low = (torch.randn(999, generator=g) * 7, torch.randn(50, generator=g).double(),
                         torch.randn(40, generator=g).bfloat16())
    got = tensor_norms([narrow, wide, low], norm_type)
    want = [torch.linalg.vector_norm(narrow, norm_type), torch.linalg.vector_norm(wide, norm_type),
            torch.linalg.vector_norm(low.float(), norm_type)]
    assert got.dtype == torch.float64
    assert got.tolist() == [w.item() for w in want]


@pytest.fixture(scope="module")
def launched(request):
    """The selected 2-rank cases in one launch (each builds its own models and optimizers)."""
    return launch_for_selected(request, {
        "test_zero_clip_takes_every_norm_order_torch_takes": {
            f"every order {stage}": (_every_order_worker, (stage,)) for stage in (1, 2)},
        "test_zero_stage2_float64_clip_matches_torch_to_float64_precision": {"float64": (_float64_worker, ())},
        "test_zero_parameter_unfrozen_in_float64_is_clipped_by_torchs_float64_norm": {
            "float64 unfrozen": (_float64_unfrozen_worker, ())},
        "test_zero_float32_norm_beside_float64_is_taken_in_float32_as_torchs": {
            f"mixed precision {stage}": (_mixed_precision_worker, (stage,)) for stage in (1, 2)},
    }, 2, timeout=300)


def test_fused_sgd_tensor_dampening_is_torchs_in_float64():
    from fusedist.optim import FusedSGD

    torch.manual_seed(1)
    ours = [torch.randn(7, 5, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64,
                                                                                  requires_grad=True)]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    kw = dict(lr=0.1, momentum=0.9, dampening=torch.tensor(0.1), weight_decay=0.01)
    opt, ref = FusedSGD(ours, **kw), torch.optim.SGD(theirs, **kw)
    for _ in range(4):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-15)


@pytest.mark.parametrize("lazy", [False, True])
def test_fused_optimizer_clip_after_unscale_in_float64_is_torchs(lazy):
    import fusedist
    from fusedist.optim import FusedSGD

    torch.manual_seed(2)
    ours = [torch.randn(9, 4, dtype=torch.float64, requires_grad=True), torch.randn(4, requires_grad=True)]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    opt, ref = FusedSGD(ours, lr=0.1, momentum=0.9), torch.optim.SGD(theirs, lr=0.1, momentum=0.9)
    ours_scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 10, lazy_unscale=lazy)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in ours]
        sum((p * g).sum() for p, g in zip(ours, grads)).mul(ours_scaler.scale(torch.ones(()))).backward()
        sum((q * g).sum() for q, g in zip(theirs, grads)).mul(torch_scaler.scale(torch.ones(()))).backward()
        ours_scaler.unscale_(opt)
        torch_scaler.unscale_(ref)
        got = fusedist.clip_grad_norm_(ours, 0.5)
        want = nn.utils.clip_grad_norm_(theirs, 0.5)
        assert got.dtype == want.dtype == torch.float64 and got.item() == want.item()
        for scaler, o in ((ours_scaler, opt), (torch_scaler, ref)):
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-15 if p.dtype == torch.float64 else 1e-7)
