"""The scaler protocol across ranks: a sharded fused optimizer that overrides the reduce hook
skips together on every rank and clips with the global norm, matching one-process torch."""

from __future__ import annotations

import torch

from fusedist.amp import GradScaler
from fusedist.comm import get_communicator
from fusedist.optim import FusedAdamW, clip_grad_norm_
from fusedist.testing.multiprocess import run_distributed

SHAPES = [(5,), (3, 7), (11,), (2, 2)]
OVERFLOW_STEPS = {2, 5}


class ShardedAdamW(FusedAdamW):
    """Minimal sharded optimizer: steps this rank's parameters, reports a global flag/norm."""

    def __init__(self, all_params, rank, world_size, **kwargs):
        self._all_params = all_params
        super().__init__(all_params[rank::world_size], **kwargs)
        self._comm = get_communicator()

    def _fusedist_grad_params(self):
        return [p for p in self._all_params if p.grad is not None]

    def _fusedist_reduce_found_inf_and_norm(self, found_inf, sumsq):
        self._comm.all_reduce(found_inf, op="max", tag="found_inf")
        self._comm.all_reduce(sumsq, op="sum", tag="grad_sumsq")
        return found_inf, sumsq


def _make_params():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]


def _set_scaled_grads(params, scale, step, overflow_owner):
    gen = torch.Generator().manual_seed(10 + step)
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=gen) * scale
    if step in OVERFLOW_STEPS:
        params[overflow_owner].grad.view(-1)[0] = float("inf")


def _sharded_vs_torch(rank, world_size):
    ours, theirs = _make_params(), _make_params()
    opt = ShardedAdamW(ours, rank, world_size, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    scaler.scale(torch.ones(()))
    ref_scaler.scale(torch.ones(()))
    for step in range(8):
        # Every rank holds full gradients (as after a DDP all-reduce); the inf lands in a
        # tensor only rank 1 steps, so rank 0 learns about it only through the reduce hook.
        _set_scaled_grads(ours, scaler.get_scale(), step, overflow_owner=1)
        _set_scaled_grads(theirs, ref_scaler.get_scale(), step, overflow_owner=1)
        scaler.unscale_(opt)
        ref_scaler.unscale_(ref)
        norm = clip_grad_norm_(ours, 1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        assert opt.step_context.clip_coef is not None, "fast path expected"
        scaler.step(opt)
        ref_scaler.step(ref)
        scaler.update()
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
        assert scaler.last_step_skipped == (step in OVERFLOW_STEPS)
    for i in range(rank, len(SHAPES), world_size):
        torch.testing.assert_close(ours[i].detach(), theirs[i].detach(), rtol=0, atol=1e-6)
    return scaler.get_scale()


def test_sharded_optimizer_protocol_two_ranks():
    scales = run_distributed(_sharded_vs_torch, 2, env={"FUSEDIST_KERNEL_BACKEND": "torch"})
    assert scales[0] == scales[1]
