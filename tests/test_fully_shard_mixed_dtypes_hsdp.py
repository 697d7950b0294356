"""Units of mixed dtypes (bf16 weights beside fp32 norm and router, Note [dtype sections] in
fusedist/fsdp/layout.py) on an HSDP mesh, with fp16 reduction and with an all-reduce hook.

World 4 on gloo as a (2 replicas, 2 shards) mesh. The reference is torch's FSDP2 on the same
mesh with the fp32 modules as units of their own (FSDP2 refuses trainable mixed dtypes in one
unit: tests/test_fully_shard_mixed_dtypes.py), so every parameter is gathered, reduce-scattered
over two ranks and all-reduced over two replicas in the same dtype as fusedist's sections: sums
of two values round alike, and gradients and AdamW steps agree to a rounding of their dtype
(bf16 ``rtol=2**-7``, fp32 ``1e-5``, fp16 reduction ``2**-10`` relative on top of its dtype).
The clip's total norm (torch's ``clip_grad_norm_`` on both models: the global norm over fusedist's
pieces, Note [torch's clip on sharded gradients]) takes bf16 norms of bf16 gradients in either
library, so the clipped gradients and the steps after it follow the looser bounds of the 1-D test.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedist
from fusedist.testing import run_distributed
from test_fully_shard_mixed_dtypes import (CLIPPED, STEPPED, Net, _batch, _check_grads, _check_params,
                                           _shard_ours, _shard_torch)

REPLICAS, SHARDS = 2, 2
WORLD = REPLICAS * SHARDS
FP16_REDUCED = dict(rtol=2 ** -7, atol=1e-5)  # a bf16 or fp16 rounding of each reduced value


def _train_pair(rank, mesh, what, ours_kw, torch_kw, steps=3, clip_at=2):
    torch.manual_seed(0)
    ref = Net()
    ours = copy.deepcopy(ref)
    _shard_torch(ref, mesh, split=True, **torch_kw)
    _shard_ours(ours, mesh, **ours_kw)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    grads_tol = FP16_REDUCED if "fp16" in what else None
    for step in range(steps):
        for model in (ref, ours):
            x, y = _batch(rank, step)
            F.mse_loss(model(x), y).backward()
        if grads_tol:
            _check_grads(ref, ours, f"{what} step {step}", fp32=grads_tol)
        else:
            _check_grads(ref, ours, f"{what} step {step}")
        if step == clip_at:
            n_ref = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05)
            n_ours = torch.nn.utils.clip_grad_norm_(list(ours.parameters()), 0.05)
            torch.testing.assert_close(n_ours.float(), n_ref.full_tensor().float(), rtol=2 ** -7, atol=0.0)
            _check_grads(ref, ours, f"{what} clipped", fp32=CLIPPED)
        o_ref.step(), o_ours.step()
        o_ref.zero_grad(), o_ours.zero_grad()
    _check_params(ref, ours, what, fp32=STEPPED, bf16=STEPPED)
    return ref, ours


def _hsdp(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("dp_replicate", "dp_shard"))
    bf16_mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fp16_reduce = dict(reduce_dtype=torch.float16)
    for what, mp in (("plain", {}), ("mp", bf16_mp), ("fp16 reduce", fp16_reduce)):
        ours_kw = {"mp_policy": fusedist.MixedPrecisionPolicy(**mp)} if mp else {}
        torch_kw = {"mp_policy": TorchMP(**mp)} if mp else {}
        _train_pair(rank, mesh, f"hsdp {what}", ours_kw, torch_kw)

    # the all-reduce hook: after the all-reduce across replicas (both replicas see the same
    # values), its in-place change reaching .grad; once per trainable dtype section of a unit
    torch.manual_seed(0)
    ref = Net()
    ours = copy.deepcopy(ref)
    _shard_torch(ref, mesh, split=True)
    _shard_ours(ours, mesh)
    seen = {"ref": [], "ours": []}

    def hook_for(key):
        def hook(out):
            seen[key].append((out.dtype, out.detach().float().sum()))
            out.mul_(2.0)  # elementwise: the same gradients in either grouping
        return hook

    for key, model in (("ref", ref), ("ours", ours)):
        units = [m for m in model.modules() if hasattr(m, "set_all_reduce_hook")]
        for m in units:
            m.set_all_reduce_hook(hook_for(key))
        x, y = _batch(rank, 0)
        F.mse_loss(model(x), y).backward()
    _check_grads(ref, ours, "hsdp all-reduce hook")
    sections = sum(len([s for s in m._fs_state().unit.layout.sections if s.trainable])
                   for m in ours.modules() if hasattr(m, "_fs_state") and m._fs_state() is not None)
    dtypes = sorted({str(d) for d, _ in seen["ours"]})
    mine = torch.stack([s for _, s in seen["ours"]])
    everyone = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(everyone, mine)
    replica_partner = rank ^ SHARDS  # the same shard rank in the other replica
    return dict(calls=(len(seen["ours"]), sections), dtypes=dtypes,
                after_all_reduce=torch.equal(everyone[replica_partner], mine))


def test_mixed_dtype_units_on_hsdp_with_fp16_reduction_and_all_reduce_hook():
    for res in run_distributed(_hsdp, WORLD, timeout=300):
        calls, sections = res["calls"]
        assert calls == sections and sections > 0, res
        assert res["dtypes"] == ["torch.bfloat16", "torch.float32"], res
        assert res["after_all_reduce"] is True, res
