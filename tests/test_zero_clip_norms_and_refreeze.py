"""ZeroRedundancyOptimizer probes against torch (2-3 gloo ranks, one launch per world size):

* ``clip_grad_norm_`` with ``norm_type=inf`` (and other p-norms) in both stages, called as the
  optimizer's method, as ``fusedist.clip_grad_norm_`` and as torch's clip (stage 2 hands its
  parameters over): the total norm and the trained parameters match torch DDP + torch's clip,
  also with a GradScaler, and a NaN gradient on one rank makes the norm NaN on every rank;
* a layer frozen after the optimizer was built and made trainable again (stage 2): the step
  after the unfreeze applies its averaged gradient, as torch DDP (rebuilt) + torch's optimizer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

INF = float("inf")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _pair(base, stage, lr):
    """fusedist DDP + ZeRO(SGD with momentum) and torch DDP + SGD, from the same weights."""
    import fusedist

    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, stage=stage, lr=lr, momentum=0.9)
    return ours, theirs, opt, torch.optim.SGD(theirs.parameters(), lr=lr, momentum=0.9)


def _batch(rank, step):
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _clip_worker(rank, ws, stage, norm_type):
    import fusedist

    ours, theirs, opt, ref = _pair(_net(), stage, lr=0.1)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    clips = [lambda: opt.clip_grad_norm_(0.3, norm_type),
             lambda: fusedist.clip_grad_norm_(ours.parameters(), 0.3, norm_type),
             lambda: nn.utils.clip_grad_norm_(ours.parameters(), 0.3, norm_type)]
    worst = 0.0
    for step, clip in enumerate(clips + clips):
        scaled = step >= len(clips)
        x = _batch(rank, step)
        opt.zero_grad()
        ref.zero_grad()
        loss = ours(x).square().sum()
        (scaler.scale(loss) if scaled else loss).backward()
        theirs(x).square().sum().backward()
        if scaled:
            scaler.unscale_(opt)
        ours_norm, torch_norm = clip(), nn.utils.clip_grad_norm_(theirs.parameters(), 0.3, norm_type)
        worst = max(worst, abs(ours_norm.item() - torch_norm.item()) / torch_norm.item())
        if scaled:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        ref.step()
    # A NaN on one rank only: torch's norm of the averaged gradients is NaN (a max all-reduce
    # must not drop it).
    opt.zero_grad()
    (ours(_batch(rank, 9)).sum() * (float("nan") if rank == 1 else 1.0)).backward()
    nan_norm = opt.clip_grad_norm_(0.3, norm_type).item()
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(0.3, norm_type, error_if_nonfinite=True)
    return worst, _diff(ours, theirs), nan_norm


NORM_TYPES = [INF, 1.0]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_clip_grad_norm_with_inf_and_p_norms_matches_torch(stage, norm_type, launched3):
    for norm_err, param_err, nan_norm in results_of(launched3, f"clip {stage} {norm_type}"):
        assert norm_err < 1e-6, norm_err
        assert param_err < 1e-6, param_err
        assert nan_norm != nan_norm, nan_norm


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _refreeze_worker(rank, ws, stage, set_to_none):
    ours, theirs, opt, ref = _pair(_TwoLayers(), stage, lr=0.05)
    for step in range(6):
        if step in (2, 4):  # frozen for two steps, then trainable again
            for m in (ours.module, theirs.module):
                m.a.requires_grad_(step == 4)
            theirs = nn.parallel.DistributedDataParallel(theirs.module)  # torch DDP fixes its set at wrap
        x = _batch(rank, step)
        for m, o in ((ours, opt), (theirs, ref)):
            o.zero_grad(set_to_none=set_to_none)
            m(x).square().sum().backward()
            o.step()
    return _diff(ours, theirs)


REFREEZE = [(2, True), (2, False), (1, True)]


@pytest.mark.parametrize("stage,set_to_none", REFREEZE)
def test_layer_frozen_then_unfrozen_again_trains_as_torch(stage, set_to_none, launched2):
    for diff in results_of(launched2, f"refreeze {stage} {set_to_none}"):
        assert diff < 1e-6, diff


# One launch per world size for the selected tests' cases (each builds its own models and
# optimizers).
@pytest.fixture(scope="module")
def launched3(request):
    return launch_for_selected(request, {"test_clip_grad_norm_with_inf_and_p_norms_matches_torch": {
        f"clip {stage} {norm_type}": (_clip_worker, (stage, norm_type))
        for stage in (1, 2) for norm_type in NORM_TYPES},
    }, 3, timeout=360)


@pytest.fixture(scope="module")
def launched2(request):
    return launch_for_selected(request, {"test_layer_frozen_then_unfrozen_again_trains_as_torch": {
        f"refreeze {stage} {none}": (_refreeze_worker, (stage, none)) for stage, none in REFREEZE},
    }, 2, timeout=300)
