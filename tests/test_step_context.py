"""StepContext on its own: what unscale_ and clip record, what step() reads, and the
registry clip_grad_norm_ uses to find the optimizer whose norm was recorded."""

import gc

import pytest
import torch

from fusedist.optim import step_context as sc
from fusedist.optim import FusedAdamW


def test_effective_inv_scale_prefers_the_scale_passed_by_step():
    ctx = sc.StepContext()
    assert ctx.effective_inv_scale(None) is None
    ctx.inv_scale = torch.tensor([0.25])
    assert ctx.effective_inv_scale(None).item() == 0.25
    scale = torch.tensor(3.0)  # reciprocal in fp64, rounded once, as torch's scaler does
    assert ctx.effective_inv_scale(scale).item() == torch.tensor(1 / 3.0, dtype=torch.float64).float().item()


def test_record_clip_matches_torch_and_composes():
    grads = [torch.randn(5) * 3, torch.randn(7)]
    sumsq = sum((g.double() ** 2).sum() for g in grads).float().reshape(1)
    ctx = sc.StepContext()
    norm = ctx.record_clip(sumsq, 1.0, error_if_nonfinite=False)
    ref = [g.clone() for g in grads]
    ref_norm = torch.linalg.vector_norm(torch.cat(ref))
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    assert ctx.clip_coef.item() == pytest.approx(min(1.0, 1.0 / (ref_norm.item() + 1e-6)), rel=1e-6)
    # A second clip sees the first one's result: the coefficients multiply.
    first = ctx.clip_coef.clone()
    second_norm = ctx.record_clip(sumsq, 0.5, error_if_nonfinite=False)
    assert second_norm.item() == pytest.approx((ref_norm * first).item(), rel=1e-6)
    assert ctx.clip_coef.item() == pytest.approx(first.item() * 0.5 / (second_norm.item() + 1e-6), rel=1e-6)
    with pytest.raises(RuntimeError, match="non-finite"):
        sc.StepContext().record_clip(torch.tensor([float("inf")]), 1.0, error_if_nonfinite=True)
    assert sc.StepContext().record_clip(sumsq, 1.0, False, torch.bfloat16).dtype == torch.bfloat16


def test_step_consumes_and_clears_the_context():
    p = torch.nn.Parameter(torch.ones(4))
    opt = FusedAdamW([p], lr=0.1)
    p.grad = torch.full((4,), 8.0)
    opt.step_context.inv_scale = torch.tensor([0.125])  # a lazy unscale: the grad is really 1
    opt.step_context.clip_coef = torch.tensor([0.5])
    opt.step()
    ref = torch.nn.Parameter(torch.ones(4))
    ref.grad = torch.full((4,), 0.5)
    torch.optim.AdamW([ref], lr=0.1).step()
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-7)
    assert opt.step_context == sc.StepContext()


def test_pending_registry_forgets_used_and_dropped_optimizers():
    opt = FusedAdamW([torch.nn.Parameter(torch.ones(2))])
    opt.step_context.grad_sumsq = torch.ones(1)
    sc.mark_pending(opt)
    assert opt in sc.pending_contexts()
    opt.step_context.grad_sumsq = None  # used up (or stale)
    assert opt not in sc.pending_contexts()
    opt.step_context.grad_sumsq = torch.ones(1)
    sc.mark_pending(opt)
    del opt
    gc.collect()
    assert sc.pending_contexts() == []
