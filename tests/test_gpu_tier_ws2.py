"""The GPU tier at world size 2, each check against torch in the same run, on both devices.

Every test body here runs twice: on ``cpu`` (gloo, always) and on ``cuda`` (NCCL, when the
machine has room for two ranks: two GPUs, or one shared through
``FUSEDIST_TEST_RANKS_PER_GPU=2``, Note [several ranks on one GPU] in
fusedist/testing/shared_gpu.py). Only the device changes, so the logic is exercised by the
CPU suite and the GPU run checks the CUDA paths (NCCL, the direct communicator, pinned
offload staging, Triton kernels, torch's own ``nn.SyncBatchNorm``).

One spawn per device runs every section (a 2-rank spawn costs ~4 s on CPU, more on a GPU:
a CUDA context and NCCL init per rank); a section that raises is reported by its test alone.

Sections and their tolerances:

* **bf16 reduce** (``reduce_dtype=torch.bfloat16`` and torch's ``_MixedPrecision(reduce_dtype=
  bf16)`` spelling) against torch DDP with the bf16 compression hook (torch's own on NCCL; a
  copy of it on gloo, where torch refuses its hook) and against fp32 torch DDP. With two ranks
  both sides do the same arithmetic: each rank's gradient rounded once to bf16, halved (exact),
  summed with one more bf16 rounding; so they must agree to one bf16 rounding of the gradient
  (2^-8 relative to its largest element, where a dropped or doubled term is ~50%). Against fp32
  the gradients must differ (else bf16 did not happen) by at most those two roundings, with
  4x headroom for cancellation (2^-6 of the largest element); after 4 SGD steps (lr 0.05,
  momentum 0.9: the accumulated step multiplier is 9.05 * 0.05 = 0.45) the parameters stay
  within 2e-3 of fp32 (as tests/test_ddp.py's "reduce bf16" case, measured ~1e-4).
* **fp16 model + FP32 masters + fusedist's GradScaler** (``FusedAdamW(master_weights=True)``)
  against torch's recipe for the same thing: torch DDP on the fp16 model, FP32 master copies
  receiving the fp16 gradients, ``torch.optim.AdamW`` on the masters, ``torch.amp.GradScaler``,
  masters copied back into the fp16 weights. Rank 1's loss is made inf at step 2, so both must
  skip that step and back the scale off identically. Gradients are the same fp16 computation on
  both sides; the optimizers differ by a few fp32 ulps per step, which can flip the fp16
  rounding of a weight by one ulp and perturb later gradients by ~1e-3 relative: so masters
  within 1e-4 (a tenth of one AdamW update at lr 1e-3; a missed or extra step moves ~1e-3) and
  fp16 weights within 2 fp16 ulps (2^-9 relative).
* **ZeRO-1/2 with ``offload="cpu"``** (FusedAdamW and torch AdamW inside) against torch DDP +
  torch AdamW: fp32, 6 steps at lr 1e-2; only summation order and the fused kernel's operation
  order differ (a few ulps per step): 1e-5, as tests/test_nccl_multirank_gpu.py's ZeRO case.
* **SyncBatchNorm** against torch's ``nn.SyncBatchNorm`` on CUDA (the same per-rank inputs),
  and on CPU, where torch's has no kernel, against ``nn.BatchNorm2d`` on the concatenated
  global batch (tests/test_syncbn.py's oracle and helpers). fp32 tolerances of test_syncbn.py.
* **Stage 3**: ``fusedist.fully_shard`` against torch FSDP2 (tests/test_fully_shard.py's core
  checks on the run's device): fp32 ``rtol=1e-5, atol=1e-6`` on losses, 1e-5 on weights.
* **Stage 3 on meta, async save**: built on the meta device, ``to_empty`` onto the run's
  device, ``fusedist.fsdp.init_parameters``: equal bit for bit to the unsharded model given the
  same seed on that device (each rank draws the whole values; nothing is rounded); then a
  ``dcp.async_save`` taken while a step runs, loaded into another meta-built model: the saved
  step's weights bit for bit (a copy).
* **Stage 3 with CPU offload**, fusedist's GradScaler (an inf on one rank) and torch's clip
  (global over the pieces), against the same model without offload: ``rtol=1e-5`` (the
  offloaded AdamW step runs on the host).
* **Stage 3 with FSDP2's all-gather extension** (weights gathered as int8 rows and fp32
  scales, one byte buffer per unit) against FSDP2: fp32 ``rtol=1e-5, atol=1e-6``.
"""

from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_rank_slots
from torch import nn

from fusedist.testing import device_for_rank, run_distributed

WORLD = 2
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_rank_slots(WORLD)])]
BF16_ULP, FP16_ULP = 2.0**-7, 2.0**-10


def _device(rank: int, device_type: str) -> torch.device:
    return torch.device("cuda", device_for_rank(rank)) if device_type == "cuda" else torch.device("cpu")


def _ddp_kw(device):
    return dict(device_ids=[device.index]) if device.type == "cuda" else {}


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(gen, device, dtype=torch.float32):
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    return x.to(device, dtype), y.to(device)


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in params]).cpu()


def _bf16_compress_hook(process_group, bucket):
    """torch's ``bf16_compress_hook`` (cast, divide, all-reduce, copy back), for gloo, where
    torch refuses to register its own."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


# ------------------------------------------------------------------------------- sections
def _bf16_reduce(rank, world_size, device):
    import fusedist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel.distributed import _MixedPrecision

    torch.manual_seed(0)
    base = _mlp().to(device)
    kw = _ddp_kw(device)
    ref16 = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kw)
    ref16.register_comm_hook(None, default_hooks.bf16_compress_hook if device.type == "cuda" else _bf16_compress_hook)
    models = {
        "ref32": nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kw),
        "ref16": ref16,
        "ours": fusedist.DistributedDataParallel(copy.deepcopy(base), reduce_dtype=torch.bfloat16,
                                                 bucket_cap_mb=0.002, first_bucket_cap_mb=0.001, **kw),
        "ours_mp": fusedist.DistributedDataParallel(
            copy.deepcopy(base), mixed_precision=_MixedPrecision(reduce_dtype=torch.bfloat16), **kw),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in models.items()}
    gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
    first_grads = None
    for step in range(4):
        x, y = _batch(gen, device)
        for k, m in models.items():
            opts[k].zero_grad()
            F.mse_loss(m(x), y).backward()
        if step == 0:
            first_grads = {k: [p.grad.detach().float().cpu().clone() for p in m.parameters()]
                           for k, m in models.items()}
        for opt in opts.values():
            opt.step()
    return dict(grads=first_grads, params={k: _flat(m.parameters()) for k, m in models.items()},
                reduce_dtypes=(models["ours"].config.reduce_dtype, models["ours_mp"].config.reduce_dtype),
                buckets=len(models["ours"].buckets))


def _fp16_master(rank, world_size, device, steps=6, bad_step=2):
    import fusedist
    from fusedist.amp import GradScaler
    from fusedist.optim import FusedAdamW

    torch.manual_seed(0)
    base = _mlp().to(device).half()
    kw = _ddp_kw(device)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), **kw)
    opt = FusedAdamW(ours.parameters(), lr=1e-3, weight_decay=0.01, master_weights=True)
    scaler = GradScaler(device.type, init_scale=2.0**10, growth_interval=3)
    # torch's recipe: DDP on the fp16 model, FP32 masters, AdamW on the masters, GradScaler.
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kw)
    masters = [p.detach().float().clone().requires_grad_(True) for p in ref.module.parameters()]
    opt_ref = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.01)
    scaler_ref = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=3)
    gen = torch.Generator().manual_seed(200 + rank)
    scales, skipped = [], []
    for step in range(steps):
        x, y = _batch(gen, device, torch.float16)
        before = _flat(ours.parameters())
        for model in (ours, ref):
            loss = F.mse_loss(model(x).float(), y)
            if rank == 1 and step == bad_step:
                loss = loss * float("inf")  # only rank 1's local gradients are inf/nan
            (scaler if model is ours else scaler_ref).scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        for m, p in zip(masters, ref.module.parameters()):
            m.grad = p.grad.float()
        scaler_ref.step(opt_ref)
        scaler_ref.update()
        opt_ref.zero_grad()
        ref.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, ref.module.parameters()):
                p.copy_(m)
        skipped.append((scaler.last_step_skipped, torch.equal(before, _flat(ours.parameters()))))
        scales.append((scaler.get_scale(), scaler_ref.get_scale()))
    params = list(ours.parameters())
    return dict(
        scales=scales, skipped=skipped, dtypes={p.dtype for p in params},
        masters=_flat(opt.state[p]["master_param"] for p in params), masters_ref=_flat(masters),
        params=_flat(params), params_ref=_flat(ref.parameters()),
        rounded=all(torch.equal(p.detach(), opt.state[p]["master_param"].to(p.dtype)) for p in params),
    )


def _zero_offload(rank, world_size, device, steps=6):
    import fusedist
    from fusedist.optim import FusedAdamW

    torch.manual_seed(0)
    base = _mlp().to(device)
    kw = _ddp_kw(device)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kw)
    runs = {"torch": (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01))}
    for stage in (1, 2):
        for name, inner in (("FusedAdamW", FusedAdamW), ("torch AdamW", torch.optim.AdamW)):
            model = fusedist.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.002,
                                                     first_bucket_cap_mb=0.001, **kw)
            opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), inner, stage=stage, lr=1e-2,
                                                   weight_decay=0.01, offload="cpu")
            runs[(stage, name)] = (model, opt)
    gen = torch.Generator().manual_seed(300 + rank)
    for _ in range(steps):
        x, y = _batch(gen, device)
        for model, opt in runs.values():
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    flat_ref = _flat(ref.parameters())
    out = {}
    for key, (model, opt) in runs.items():
        if key == "torch":
            continue
        opt.wait_for_params()
        stats = opt.memory_stats()
        out[key] = dict(diff=(_flat(model.parameters()) - flat_ref).abs().max().item(),
                        flat=_flat(model.parameters()), offload=stats["offload"],
                        host_bytes=stats["host_bytes"], total_bytes=stats["total_bytes"],
                        param_device=next(model.parameters()).device.type)
    return out


def _syncbn(rank, world_size, device):
    from test_syncbn import FP32_TOL, _all_reduce_sum, _global_data, _rank_slice, _run_steps

    from fusedist.nn import SyncBatchNorm

    sizes, C, tail = (5, 3), 6, (4, 4)  # unequal per-rank batches
    xs, dys, weight, bias = _global_data(sizes, C, tail, seed=11, steps=2)
    my_xs = [_rank_slice(x, sizes, rank).to(device) for x in xs]
    my_dys = [_rank_slice(dy, sizes, rank).to(device) for dy in dys]
    grad_tol = dict(rtol=1e-4, atol=1e-4)  # sums over 2 * 80 * 16 products (test_syncbn.py's NCCL case)

    def init(m):
        with torch.no_grad():
            m.weight.copy_(weight)
            m.bias.copy_(bias)
        return m.to(device)

    out = {}
    for layout in ("contiguous", "channels_last"):
        ours = init(SyncBatchNorm(C))
        y, dx = _run_steps(ours, my_xs, my_dys, layout, torch.float32)
        if device.type == "cuda":
            ref = init(nn.SyncBatchNorm(C))
            ref_y, ref_dx = _run_steps(ref, my_xs, my_dys, layout, torch.float32)
            ref_gw, ref_gb = _all_reduce_sum(ref.weight.grad), _all_reduce_sum(ref.bias.grad)
            reference = "torch.nn.SyncBatchNorm"
        else:  # no CPU kernel for torch's SyncBatchNorm: BatchNorm on the global batch
            ref = init(nn.BatchNorm2d(C))
            ref_y, ref_dx = _run_steps(ref, xs, dys, "contiguous", torch.float32)
            ref_y, ref_dx = _rank_slice(ref_y, sizes, rank), _rank_slice(ref_dx, sizes, rank)
            ref_gw, ref_gb = ref.weight.grad, ref.bias.grad
            reference = "nn.BatchNorm2d on the global batch"
        torch.testing.assert_close(y.detach(), ref_y.detach(), **FP32_TOL)
        torch.testing.assert_close(dx, ref_dx, **FP32_TOL)
        torch.testing.assert_close(_all_reduce_sum(ours.weight.grad), ref_gw, **grad_tol)
        torch.testing.assert_close(_all_reduce_sum(ours.bias.grad), ref_gb, **grad_tol)
        torch.testing.assert_close(ours.running_mean, ref.running_mean, **FP32_TOL)
        torch.testing.assert_close(ours.running_var, ref.running_var, **FP32_TOL)
        assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 2
        out[layout] = dict(reference=reference, y_diff=(y.detach() - ref_y).abs().max().item(),
                           running_var=ours.running_var.cpu().tolist(),
                           moved=(ours.running_mean.abs().max().item(), (ours.running_var - 1).abs().max().item()))
    return out


def _stage3(rank, world_size, device):
    import fusedist
    from test_fully_shard import Net, _full_torch, _gathering, _max_diff, _shard_both, _train
    from test_fully_shard import _batch as _fs_batch
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))

    def batch(r, step):
        return tuple(t.to(device) for t in _fs_batch(r, step))

    out = {}
    for reshard in (True, False):
        torch.manual_seed(0)
        ref = Net().to(device)
        ours = copy.deepcopy(ref)
        numel = sum(p.numel() for p in ref.parameters())
        _shard_both(ref, ours, mesh, reshard_after_forward=reshard)
        o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        o_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
        seen = []
        ours.blocks[0].fc2.register_forward_hook(lambda *_: seen.append(_gathering(ours.blocks[1])))
        l_ref, l_ours = _train(ref, o_ref, rank, 4, batch=batch), _train(ours, o_ours, rank, 4, batch=batch)
        x, _ = batch(rank, 99)
        with torch.no_grad():
            e_ref, e_ours = ref(x), ours(x)
        full = fusedist.fsdp.full_state_dict(ours)
        out[reshard] = dict(
            losses=(l_ref, l_ours), weights=_max_diff({k: v.cpu() for k, v in _full_torch(ref).items()}, full),
            eval=(e_ref - e_ours).abs().max().item(), local=sum(p.numel() for p in ours.parameters()),
            numel=numel, prefetch_seen=seen, gathered_after_eval=ours.memory_stats()["gathered_bytes"],
            param_devices={p.device.type for p in ours.parameters()})
    return out


def _stage3_meta_async(rank, world_size, device):
    """fully_shard built on meta, ``to_empty`` onto the run's device, ``init_parameters``; then
    ``dcp.async_save`` while a step runs, loaded into another meta-built model."""
    import os
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from test_fully_shard import Net
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist

    mesh = init_device_mesh(device.type, (world_size,))

    def built(seed):
        with torch.device("meta"):
            model = Net()
        for block in model.blocks:
            fusedist.fully_shard(block, mesh=mesh)
        fusedist.fully_shard(model, mesh=mesh)
        model.to_empty(device=device)
        torch.manual_seed(seed)
        fusedist.fsdp.init_parameters(model)
        return model

    model = built(7)
    torch.manual_seed(99)
    ref = Net().to(device)
    torch.manual_seed(7)
    ref.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    at_init = fusedist.fsdp.full_state_dict(model)
    init_diff = max((at_init[k].to(device) - v).abs().max().item() for k, v in ref.state_dict().items())

    where = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    group = dist.new_group(backend="gloo")  # the save's collectives beside the step's
    future = dcp.async_save({"model": model.state_dict()}, checkpoint_id=os.path.join(where[0], "ck"),
                            process_group=group)
    x = torch.randn(6, 8, device=device, generator=None)
    model(x).square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()  # the weights change while the save runs
    future.result()
    fresh = built(8)
    sd = fresh.state_dict()
    dcp.load({"model": sd}, checkpoint_id=os.path.join(where[0], "ck"), process_group=group)
    fresh.load_state_dict(sd)
    loaded = fusedist.fsdp.full_state_dict(fresh)
    return dict(init=init_diff, loaded=max((loaded[k] - at_init[k]).abs().max().item() for k in at_init),
                devices={p.device.type for p in fresh.parameters()})


def _stage3_offload(rank, world_size, device):
    """fully_shard with ``CPUOffloadPolicy`` on the run's device (pieces, gradients and AdamW in
    host memory), trained with fusedist's GradScaler (an inf on rank 0 at step 2) and torch's
    clip: found-inf and the norm are all-reduced over the communicator's device, the pieces'
    values staying in host memory. Against the same model without offload."""
    import fusedist
    from test_fully_shard import Net, _poison_one_rank
    from test_fully_shard import _batch as _fs_batch
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    out = {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = Net().to(device)
        kw = dict(offload_policy=fusedist.CPUOffloadPolicy(pin_memory=device.type == "cuda")) if offload else {}
        for block in model.blocks:
            fusedist.fully_shard(block, mesh=mesh, **kw)
        fusedist.fully_shard(model, mesh=mesh, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = fusedist.amp.GradScaler(device.type, init_scale=2.0 ** 10, growth_interval=2)
        norms, losses = [], []
        for step in range(4):
            x, y = (t.to(device) for t in _fs_batch(rank, step))
            loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if step == 2:
                _poison_one_rank(model, rank)
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
        full = fusedist.fsdp.full_state_dict(model)
        out[offload] = dict(norms=norms, losses=losses, scale=float(scaler.get_scale()),
                            weights={k: v.detach().cpu() for k, v in full.items()},
                            devices=sorted({p.device.type for p in model.parameters()}))
    return out


def _stage3_extension(rank, world_size, device):
    """fully_shard over weights gathered as int8 rows and fp32 scales (FSDP2's all-gather
    extension; tests/test_fully_shard_extension.py's test subclass), against FSDP2 on the run's
    device: on CUDA the bytes go through the direct-NCCL communicator as uint8."""
    from test_fully_shard_extension import batch, full_of, rowwise_model, shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fusedist

    mesh = init_device_mesh(device.type, (world_size,))
    out = {}
    for ours in (True, False):
        m = shard(rowwise_model(device), fusedist.fully_shard if ours else fully_shard, mesh=mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            loss = m(batch(step, rank, world_size).to(device)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[ours] = {"losses": losses, "weights": {k: v.cpu() for k, v in full_of(m, ours).items()},
                     "type": type(m[0].weight).__name__, "device": m[0].weight.device.type}
    return out


SECTIONS = {"bf16_reduce": _bf16_reduce, "fp16_master": _fp16_master, "zero_offload": _zero_offload,
            "syncbn": _syncbn, "stage3": _stage3, "stage3_meta_async": _stage3_meta_async,
            "stage3_offload": _stage3_offload, "stage3_extension": _stage3_extension}


def _selected_sections() -> list:
    """``FUSEDIST_TIER_SECTIONS`` (comma-separated names): run only those sections, for a short
    rerun on a GPU; the other sections' tests skip, saying so."""
    names = [n.strip() for n in os.environ.get("FUSEDIST_TIER_SECTIONS", "").split(",") if n.strip()]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        raise ValueError(f"FUSEDIST_TIER_SECTIONS names unknown sections {unknown}; known: {sorted(SECTIONS)}")
    return names or list(SECTIONS)


def _tier(rank, world_size, device_type, names):
    device = _device(rank, device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = {}
    for name in names:
        section = SECTIONS[name]
        try:
            out[name] = ("ok", section(rank, world_size, device))
        except Exception:  # noqa: BLE001 - the section's test reports it
            out[name] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="module", params=DEVICES)
def tier(request):
    device_type = request.param
    results = run_distributed(_tier, WORLD, device_type, _selected_sections(),
                              backend="nccl" if device_type == "cuda" else "gloo",
                              timeout=400 if device_type == "cuda" else 240)
    return device_type, results


def _section(tier, name):
    device_type, results = tier
    if name not in results[0]:
        pytest.skip(f"section {name} not selected (FUSEDIST_TIER_SECTIONS)")
    for rank, res in enumerate(results):
        status, value = res[name]
        assert status == "ok", f"{name} on {device_type}, rank {rank}:\n{value}"
    return device_type, [res[name][1] for res in results]


# ------------------------------------------------------------------------------- tests
def test_ddp_bf16_reduce_matches_torch_ddp(tier):
    _, per_rank = _section(tier, "bf16_reduce")
    for r in per_rank:
        assert r["reduce_dtypes"] == (torch.bfloat16, torch.bfloat16)
        assert r["buckets"] > 1
        g = r["grads"]
        differs_from_fp32 = False
        for i, (g32, g16, go, gmp) in enumerate(zip(g["ref32"], g["ref16"], g["ours"], g["ours_mp"])):
            top = g32.abs().max().item()
            assert (go - g16).abs().max().item() <= 2**-8 * top, (i, (go - g16).abs().max().item(), top)
            err32 = (go - g32).abs().max().item()
            assert err32 <= 2**-6 * top, (i, err32, top)
            differs_from_fp32 |= err32 > 0
            assert torch.equal(go, gmp), i  # the mixed_precision spelling is the same reduction
        assert differs_from_fp32, "reduce_dtype=bf16 gave the fp32 gradients: no bf16 reduction happened"
        p = r["params"]
        assert (p["ours"] - p["ref16"]).abs().max().item() < 1e-4, (p["ours"] - p["ref16"]).abs().max().item()
        assert (p["ours"] - p["ref32"]).abs().max().item() < 2e-3, (p["ours"] - p["ref32"]).abs().max().item()
    assert torch.equal(per_rank[0]["params"]["ours"], per_rank[1]["params"]["ours"])


def test_fp16_master_weights_and_scaler_match_torch_recipe(tier):
    _, per_rank = _section(tier, "fp16_master")
    for r in per_rank:
        assert r["dtypes"] == {torch.float16}
        # Only the step with rank 1's inf is skipped, on every rank, parameters untouched.
        assert r["skipped"] == [(False, False), (False, False), (True, True)] + [(False, False)] * 3, r["skipped"]
        # Scale: backed off at the inf, grown after 3 good steps, as torch's GradScaler.
        assert [a for a, _ in r["scales"]] == [b for _, b in r["scales"]] == [1024.0, 1024.0, 512.0, 512.0, 512.0,
                                                                             1024.0], r["scales"]
        assert r["rounded"], "fp16 weights are not their FP32 masters rounded"
        master_diff = (r["masters"] - r["masters_ref"]).abs().max().item()
        assert master_diff < 1e-4, master_diff
        bound = FP16_ULP * 2 * r["params_ref"].abs() + 2**-24
        assert bool(((r["params"] - r["params_ref"]).abs() <= bound).all()), \
            (r["params"] - r["params_ref"]).abs().max().item()
    assert torch.equal(per_rank[0]["params"], per_rank[1]["params"])


def test_zero_offload_matches_torch_ddp(tier):
    device_type, per_rank = _section(tier, "zero_offload")
    for r in per_rank:
        assert len(r) == 4
        for key, v in r.items():
            assert v["diff"] < 1e-5, (key, v["diff"])
            # offloaded: masters and AdamW state in host memory, parameters on the device
            assert v["offload"] == "cpu" and v["host_bytes"] >= v["total_bytes"] > 0, (key, v)
            assert v["param_device"] == device_type, key
    for key in per_rank[0]:
        assert torch.equal(per_rank[0][key]["flat"], per_rank[1][key]["flat"]), key


def test_syncbn_matches_torch(tier):
    device_type, per_rank = _section(tier, "syncbn")
    want = "torch.nn.SyncBatchNorm" if device_type == "cuda" else "nn.BatchNorm2d on the global batch"
    for layout in ("contiguous", "channels_last"):
        assert per_rank[0][layout]["reference"] == want
        assert per_rank[0][layout]["running_var"] == per_rank[1][layout]["running_var"], layout
        assert min(per_rank[0][layout]["moved"]) > 0.01  # the running statistics were updated


def test_fully_shard_matches_torch_fsdp2(tier):
    device_type, per_rank = _section(tier, "stage3")
    for res in per_rank:
        for reshard, r in res.items():
            torch.testing.assert_close(r["losses"][1], r["losses"][0], rtol=1e-5, atol=1e-6)
            assert r["weights"] < 1e-5, (reshard, r["weights"])
            assert r["eval"] < 1e-5, (reshard, r["eval"])
            assert r["local"] <= r["numel"] / WORLD + 64 * WORLD, (r["local"], r["numel"])
            assert r["param_devices"] == {device_type}
            assert r["prefetch_seen"] == [False, True, True, True, True], r["prefetch_seen"]
            assert r["gathered_after_eval"] == 0


def test_fully_shard_offload_with_scaler_and_torch_clip(tier):
    """Offloaded pieces in host memory: the global norm, the skipped step and the weights equal
    the model on the device's (the AdamW step runs on the host there: a few ulps)."""
    device_type, per_rank = _section(tier, "stage3_offload")
    for r in per_rank:
        on, off = r[False], r[True]
        assert off["devices"] == ["cpu"] and on["devices"] == [device_type], (on["devices"], off["devices"])
        assert off["norms"][2] == on["norms"][2] == float("inf")  # rank 0's inf, seen on every rank
        torch.testing.assert_close(torch.tensor(off["norms"]), torch.tensor(on["norms"]), rtol=1e-5, atol=0.0)
        torch.testing.assert_close(torch.tensor(off["losses"]), torch.tensor(on["losses"]), rtol=1e-5, atol=1e-6)
        assert off["scale"] == on["scale"] == 2.0 ** 10  # grown after steps 0-1, backed off at step 2
        for k, v in on["weights"].items():
            torch.testing.assert_close(off["weights"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert per_rank[0][True]["norms"] == per_rank[1][True]["norms"]  # the norm is global


def test_fully_shard_meta_init_and_async_save(tier):
    device_type, per_rank = _section(tier, "stage3_meta_async")
    for r in per_rank:
        assert r["init"] == 0.0, r  # the unsharded model's initialization, bit for bit
        assert r["loaded"] == 0.0, r  # the weights of the step the save was taken at
        assert r["devices"] == {device_type}


def test_fully_shard_all_gather_extension_matches_fsdp2(tier):
    """The same bytes gathered and dequantized on both sides: losses and weights as FSDP2's
    (tests/test_fully_shard_extension.py's tolerance after no clip: fp32 rounding only)."""
    device_type, per_rank = _section(tier, "stage3_extension")
    for r in per_rank:
        ours, ref = r[True], r[False]
        assert ours["type"] == "RowwiseInt8Weight" and ours["device"] == device_type
        torch.testing.assert_close(ours["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        for k, v in ref["weights"].items():
            torch.testing.assert_close(ours["weights"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
