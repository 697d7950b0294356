"""ZeRO-Offload (``offload="cpu"``) with bf16/fp16 parameters and a parameter that gets no
gradient in a step: torch leaves such a parameter as it is, and so must the host step, which
sends each bucket's whole slice of its half-precision staging up (Note [staging of pieces a
step skips] in ``fusedist/zero/offload.py``).

Reference: the same ZeroRedundancyOptimizer without offload (itself checked against torch),
whose bf16/fp16 results the offloaded step matches bitwise; and torch's rule that a parameter
without a gradient is not changed by the step.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 3)).to(dtype)


def _train(rank, world, dtype, offload, no_grad_steps, reload_at):
    """Five AdamW steps on rank-dependent data (gradients averaged by hand, no DDP); the first
    weight has no gradient in ``no_grad_steps``; at step ``reload_at`` the model is reset to its
    initial weights first. Returns the flat parameters and whether the first weight kept its
    value in each step without a gradient."""
    import fusedist

    gen = torch.Generator().manual_seed(11)
    model = _model(dtype)
    initial = copy.deepcopy(model.state_dict())
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                           process_group=dist.group.WORLD, offload=offload,
                                           bucket_cap_mb=0.0002)
    kept = []
    for step in range(5):
        x, y = torch.randn(world * 4, 7, generator=gen), torch.randn(world * 4, 3, generator=gen)
        if step == reload_at:
            model.load_state_dict(initial)
        rows = slice(rank * 4, rank * 4 + 4)
        nn.functional.mse_loss(model(x[rows].to(dtype)).float(), y[rows]).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        before = model[0].weight.detach().clone()
        if step in no_grad_steps:
            model[0].weight.grad = None
        opt.step()
        opt.zero_grad()
        opt.wait_for_params()
        if step in no_grad_steps:
            kept.append(torch.equal(model[0].weight.detach(), before))
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]), kept


def _worker(rank, world, dtype, no_grad_steps, reload_at):
    runs = {off: _train(rank, world, dtype, off, no_grad_steps, reload_at) for off in (None, "cpu")}
    (ref, ref_kept), (got, got_kept) = runs[None], runs["cpu"]
    return dict(finite=bool(torch.isfinite(got).all()), diff=(ref - got).abs().max().item(),
                ref_kept=ref_kept, kept=got_kept)


DTYPES = [torch.bfloat16, torch.float16]
SKIPS = [((0,), None), ((3,), 3)]


def _scenario(dtype, no_grad_steps, reload_at) -> str:
    return f"{dtype}, no gradient in steps {no_grad_steps}, model reloaded at step {reload_at}"


@pytest.fixture(scope="module")
def launched(request):
    """Every dtype and skip of the test below in one launch of 2 ranks (each launch costs a
    process group and the imports of torch in every rank)."""
    return launch_for_selected(request, {"test_half_precision_parameter_without_gradient_keeps_its_value": {
        _scenario(dtype, *skip): (_worker, (dtype, *skip)) for dtype in DTYPES for skip in SKIPS}}, 2, timeout=300)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("no_grad_steps,reload_at", SKIPS,
                         ids=["no-gradient-in-the-first-step", "no-gradient-after-model-load_state_dict"])
def test_half_precision_parameter_without_gradient_keeps_its_value(dtype, no_grad_steps, reload_at, launched):
    """A first step without the parameter's gradient sent uninitialized staging up (NaN
    weights); a step without it after ``model.load_state_dict`` sent the value from before the
    load up (the weight silently went back). Both now keep the parameter, as torch does."""
    results = results_of(launched, _scenario(dtype, no_grad_steps, reload_at))
    for r in results:
        assert r["ref_kept"] == [True] * len(no_grad_steps)
        assert r["finite"]
        assert r["kept"] == [True] * len(no_grad_steps)
        assert r["diff"] == 0.0
