"""DDP and ZeRO-2 with an fp16 ``reduce_dtype``: the gradient average does not overflow where
the average itself fits fp16, as with torch DDP's ``fp16_compress_hook`` (which divides by N
before the sum) and torch's FSDP2 (``fp16_divisors`` in ``fusedist/_dtypes.py``, its rule).

Every rank's gradients are scaled so that the largest is 40000 (fp16 holds up to 65504) and
the ranks' gradients are nearly equal, so their sum exceeds 65504 -- an undivided fp16 sum
would be inf -- while the average does not. At N = 2 the rule divides by 2 before the sum; at
N = 6 by 4 before and 1.5 after (60000 at most in between; a division by 2 before, the
nearest power of two to sqrt(6), would leave 120000). The applied gradient must be the
exact fp32 average within fp16 rounding: each rank's gradient rounds to fp16 once (relative
2^-11), the pre-division by a power of two is exact, and the additions and the post-division
round once each, so the error stays below 4 half-ulps of the largest value, ~2e-3 of it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import models
from fusedist.testing import run_distributed

LIMIT = 40000.0
LR = 1e-3


def _applied_gradient(model, params, opt, x, scale):
    """The gradient one SGD step applied, whole: (before - after) / lr."""
    before = [p.detach().clone() for p in params]
    (model(x) * scale).sum().backward()
    opt.step()
    return torch.cat([((b - p.detach()) / LR).reshape(-1) for b, p in zip(before, params)])


def _worker(rank, ws):
    import fusedist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    base, x, scale, _, total = models.fp16_sum_overflow_case(rank, LIMIT)
    exact = total / ws

    out = {"sum exceeds fp16": total.abs().max().item()}
    for who in ("fusedist DDP", "fusedist ZeRO-2", "torch DDP fp16 hook"):
        if who == "torch DDP fp16 hook":
            model = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            model = fusedist.DistributedDataParallel(copy.deepcopy(base), reduce_dtype=torch.float16)
        params = list(model.parameters())
        if who == "fusedist ZeRO-2":
            opt = fusedist.ZeroRedundancyOptimizer(params, torch.optim.SGD, stage=2, lr=LR)
        else:
            opt = torch.optim.SGD(params, lr=LR)
        applied = _applied_gradient(model, params, opt, x, scale)
        out[who] = (torch.isfinite(applied).all().item(), ((applied - exact).abs().max() / exact.abs().max()).item())
    return out


@pytest.mark.parametrize("world_size", [2, 6])
def test_fp16_reduce_does_not_overflow_where_the_average_fits(world_size):
    for rank, out in enumerate(run_distributed(_worker, world_size, timeout=180)):
        assert out["sum exceeds fp16"] > 65504, out  # the scenario: an fp16 sum would overflow
        for who in ("fusedist DDP", "fusedist ZeRO-2", "torch DDP fp16 hook"):
            finite, rel = out[who]
            assert finite, (rank, who, out)
            assert rel < 2e-3, (rank, who, rel)


def test_fp16_divisors_are_torch_fsdp2s():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    from fusedist._dtypes import fp16_divisors
    from fusedist.ddp.strategy import divide_factors

    class Group:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    for n in range(1, 65):
        pre, post, _, _ = _get_gradient_divide_factors(Group(n), None, torch.float16)
        assert fp16_divisors(n) == (pre, post), n
        assert divide_factors(n, torch.float16) == (pre, post), n
        assert divide_factors(n, torch.float32) == (n, 1.0)
