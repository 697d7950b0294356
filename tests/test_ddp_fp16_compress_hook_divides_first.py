"""torch's ``fp16_compress_hook`` (and the builtin FP16_COMPRESS) on fusedist's DDP divides as the
hook does: by the whole world size before the fp16 sum. fusedist runs the hook as its own
``reduce_dtype=float16`` reduction, whose fp16 division is otherwise split around the sum (FSDP2's
rule): at 3 ranks a gradient of 50000 on every rank then averaged to inf (25000 x 3 overflows)
where torch's hook gives 49984, and other values rounded differently (Note [compression hooks
divide first] in fusedist/ddp/comm_hook.py). Compared with torch's DDP running the hook at 3
ranks, on gradients near fp16's limit and on random ones: finite where torch's are, and equal
within 2 fp16 ulps (fusedist scales a bucket by 1/N where the hook divides by N, and the sums
may add the ranks in another order: an ulp each).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from fusedist.testing import run_distributed


def _grads(model, x):
    model.zero_grad()
    (model(x).float() * 1.0).sum().backward()
    return torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])


def _worker(rank: int, world: int, seed: int, builtin: bool):
    import fusedist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(seed)
    base = nn.Linear(6, 4).half()
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    if builtin:
        ours._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    else:
        ours.register_comm_hook(None, default_hooks.fp16_compress_hook)
    theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    out = []
    g = torch.Generator().manual_seed(seed + rank)
    for low, high in ((0.0, 1.0), (0.0, 4.0), (15000.0, 20000.0)):  # the last: weight gradients of
        x = (low + torch.rand(3, 6, generator=g) * (high - low)).half()  # 45000-60000, half their sum overflows
        out.append((_grads(ours, x), _grads(theirs, x)))
    return out


def test_fp16_compress_hook_divides_as_torchs_at_three_ranks():
    for builtin in (False, True):
        for rank_out in run_distributed(_worker, 3, 7, builtin, timeout=120):
            for ours, theirs in rank_out:
                assert torch.isfinite(theirs).all() and torch.isfinite(ours).all(), builtin
                assert torch.allclose(ours, theirs, rtol=2**-9, atol=0), (builtin, (ours - theirs).abs().max())
