"""fully_shard with an fp16 ``reduce_dtype``: the gradient average does not overflow where the
average itself fits fp16 (Note [fp16 reduction] in fsdp/grads.py), as with torch's FSDP2.

At world size 3 every rank's gradients are scaled so that the largest is 40000 (fp16 holds up
to 65504), and the ranks' gradients are nearly equal, so their sum exceeds 65504 -- an fp16 sum
would be inf -- while the average does not. fusedist (pre-divide by 2, sum, divide by 1.5) and
torch's FSDP2 (the same factors) must both give the exact fp32 average within fp16 rounding:
each rank's gradient is rounded to fp16 once (relative 2^-11), the pre-division by a power of
two is exact, and the two additions and the post-division round once each, so the error is
below 4 half-ulps of the largest value: 4 * 2^-11 * max|avg| ~ 2e-3 * max|avg|.
"""

from __future__ import annotations

import copy

import torch

import models
from fusedist.testing import run_distributed

LIMIT = 40000.0


def _grads_after_one_step(model, x, scale, lr=1e-3):
    """The applied gradient, whole: (before - after) / lr of one SGD step."""
    import fusedist

    def whole(m):
        sd = m.state_dict()
        if any(hasattr(v, "full_tensor") for v in sd.values()):
            return {k: v.full_tensor().detach().clone() for k, v in sd.items()}
        return {k: v.clone() for k, v in fusedist.fsdp.full_state_dict(m).items()}

    before = whole(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    (model(x) * scale).sum().backward()
    opt.step()
    after = whole(model)
    return {k: (before[k] - after[k]) / lr for k in before}


def _worker(rank, ws):
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    base, x, scale, local, total = models.fp16_sum_overflow_case(rank, LIMIT)
    exact, pos = {}, 0
    for n, p in base.named_parameters():
        exact[n] = (total[pos:pos + p.numel()] / ws).view(p.shape)
        pos += p.numel()

    out = {"sum exceeds fp16": total.abs().max().item(), "largest rank gradient": local.abs().max().item()}
    for who in ("fusedist", "torch"):
        model = copy.deepcopy(base)
        if who == "fusedist":
            mp = fusedist.MixedPrecisionPolicy(reduce_dtype=torch.float16)
            shard = fusedist.fully_shard
        else:
            mp, shard = TorchMP(reduce_dtype=torch.float16), torch_fully_shard
        for i in (0, 2):
            shard(model[i], mesh=mesh, mp_policy=mp)
        shard(model, mesh=mesh, mp_policy=mp)
        applied = _grads_after_one_step(model, x, scale)
        top = max(v.abs().max().item() for v in exact.values())
        out[who] = (all(torch.isfinite(v).all().item() for v in applied.values()),
                    max((applied[k] - exact[k]).abs().max().item() for k in exact) / top)
    return out


def test_fp16_reduce_does_not_overflow_where_the_average_fits():
    for rank, out in enumerate(run_distributed(_worker, 3)):
        assert out["largest rank gradient"] <= LIMIT * 1.0001
        assert out["sum exceeds fp16"] > 65504, out  # the scenario: an fp16 sum would overflow
        for who in ("fusedist", "torch"):
            finite, rel = out[who]
            assert finite, (rank, who, out)
            assert rel < 2e-3, (rank, who, rel)
