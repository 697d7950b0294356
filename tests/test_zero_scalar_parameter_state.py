"""A 0-dim parameter (CLIP's ``logit_scale``) in ZeroRedundancyOptimizer's state dicts, against
torch's AdamW (2 gloo ranks, stages 1 and 2): torch's full state loads into ZeRO and ZeRO's
consolidated state loads into torch's AdamW, and either continues as the uninterrupted torch run.

Its moments are 0-dim like its ``step``; taken for scalars, they were copied whole into the
flat shards and the first step failed ("output with shape [] doesn't match the broadcast shape
[12]"). fp32, a few AdamW steps on values of order 1: 1e-6 absolute.
"""

from __future__ import annotations

import copy

import pytest
import torch

from models import LogitScaled
from shared_rank_launch import launch_for_selected, results_of

ATOL = 1e-6


def _loss(model, x):
    return model(x).square().mean()


def _worker(rank, world, stage):
    import fusedist

    torch.manual_seed(0)
    base = LogitScaled(out=3)
    xs = [torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    mine = slice(2 * rank, 2 * rank + 2)

    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for x in xs:  # the uninterrupted run, on the global batch
        ref_opt.zero_grad()
        _loss(ref, x).backward()
        ref_opt.step()

    # torch's state after two steps into ZeRO, then two more steps there
    half = copy.deepcopy(base)
    half_opt = torch.optim.AdamW(half.parameters(), lr=0.05)
    for x in xs[:2]:
        half_opt.zero_grad()
        _loss(half, x).backward()
        half_opt.step()
    model = fusedist.DistributedDataParallel(copy.deepcopy(half))
    zero = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.05)
    zero.load_state_dict(half_opt.state_dict())
    for x in xs[2:]:
        zero.zero_grad()
        _loss(model, x[mine]).backward()
        zero.step()
    for a, b in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=ATOL)

    # ZeRO's consolidated state after two steps into torch's AdamW, two more steps there
    model = fusedist.DistributedDataParallel(copy.deepcopy(base))
    zero = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.05)
    for x in xs[:2]:
        zero.zero_grad()
        _loss(model, x[mine]).backward()
        zero.step()
    zero.consolidate_state_dict(to=0)
    full = zero.state_dict() if rank == 0 else None
    if rank == 0:
        after = copy.deepcopy(model.module)
        after_opt = torch.optim.AdamW(after.parameters(), lr=0.05)
        after_opt.load_state_dict(full)
        for x in xs[2:]:
            after_opt.zero_grad()
            _loss(after, x).backward()
            after_opt.step()
        for a, b in zip(after.parameters(), ref.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=ATOL)


@pytest.fixture(scope="module")
def launched(request):
    """Both stages' scenarios in one launch of 2 ranks (each launch costs a process group and the
    imports of torch in every rank)."""
    return launch_for_selected(request, {"test_a_zero_dim_parameter_state_interchanges_with_torch": {
        f"stage {stage}": (_worker, (stage,)) for stage in (1, 2)}}, 2, timeout=180)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_dim_parameter_state_interchanges_with_torch(stage, launched):
    results_of(launched, f"stage {stage}")  # (the checks are in the ranks: one that fails raises there)
