"""The infinity norm of sharded gradients with a NaN on one rank only is NaN, as torch's
``clip_grad_norm_`` of the whole gradient is, also where the max all-reduce drops NaN as NCCL's
does (``fmax``): ``fully_shard``'s and ZeRO's norms carry a NaN flag beside the max. The
communicator's max is replaced here by one that drops NaN, so the check runs on gloo."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed


def _max_drops_nan():
    """Make every float max all-reduce of fusedist's torch communicator drop NaN (as fmax)."""
    from fusedist.comm.torch_comm import TorchCommunicator

    original = TorchCommunicator._all_reduce

    def fmax_like(self, tensor, op):
        if op == "max" and tensor.is_floating_point():
            tensor.nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        return original(self, tensor, op)

    TorchCommunicator._all_reduce = fmax_like


def _grads_with_nan(model, rank):
    torch.manual_seed(0)  # the same inputs on every rank: the reference is one process's gradient
    model(torch.randn(3, 4)).sum().backward()
    if rank == 1:
        for p in model.parameters():
            if p.grad is not None and p.grad.numel():
                p.grad.view(-1)[0] = float("nan")
                break


def _worker(rank, world_size, which):
    import fusedist

    _max_drops_nan()
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    reference = copy.deepcopy(base)
    reference(torch.randn(3, 4)).sum().backward()
    next(reference.parameters()).grad.view(-1)[0] = float("nan")
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, norm_type=float("inf"))
    assert want.isnan()
    model = copy.deepcopy(base)
    if which == "fully_shard":
        fusedist.fully_shard(model)
        _grads_with_nan(model, rank)
        clip = lambda **kw: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"),  # noqa
                                                           **kw)
    else:  # stage 1: every rank holds the averaged gradient, the norm reads its own slice of it
        ddp = fusedist.DistributedDataParallel(model)
        opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, stage=1, lr=0.1)
        torch.manual_seed(0)
        ddp(torch.randn(3, 4)).sum().backward()
        list(ddp.parameters())[-1].grad.view(-1)[-1] = float("nan")  # in the last rank's slice only
        clip = lambda **kw: opt.clip_grad_norm_(1.0, norm_type=float("inf"), **kw)  # noqa: E731
    got = clip()
    assert got.isnan(), f"rank {rank}: inf norm {got}, torch's: {want}"
    with pytest.raises(RuntimeError, match="non-finite"):
        clip(error_if_nonfinite=True)


@pytest.mark.parametrize("which", ["fully_shard", "zero1"])
def test_inf_norm_keeps_a_nan_from_one_rank(which):
    run_distributed(_worker, 2, which, timeout=120)
