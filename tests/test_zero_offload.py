"""``ZeroRedundancyOptimizer(..., offload="cpu")`` against the same optimizer without offload
(gloo, CPU "device" tensors: the offload code path runs, with plain copies instead of streams).

Tolerance 1e-6 (fp32): both sides see the same averaged gradient shards (same reduce-scatter
or all-reduce, same bucket layout) and, with FusedAdamW on CPU tensors, run the same C++ Adam
kernel (``FUSEDIST_KERNEL_BACKEND=cpu_ext``) with unscale and clip applied inline, so they are
expected to agree bitwise; 1e-6 leaves room only for a different but legal order of the
gradient multipliers. With ``torch.optim.AdamW`` as the inner optimizer the non-offloaded side
runs torch's foreach AdamW, which agrees with the C++ kernel to a few float32 ulp per step
(torch's lerp uses an FMA); over 10 steps of lr 1e-2 on O(0.1) weights that stays far below
1e-6, while a wrong element, a missed step or a wrong clip/scale moves parameters by ~1e-3.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from fusedist.testing import run_distributed

TINY_BUCKETS = dict(bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)  # several buckets
TOL = 1e-6


def _groups(model, lr=1e-2):
    """Two groups with different hyperparameters: weights decay, biases do not."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [dict(params=weights, weight_decay=0.1), dict(params=biases, weight_decay=0.0, lr=lr / 2)]


def _poison(grad):
    grad = grad.clone()
    grad[0, 0] = float("inf")
    return grad


def _train(rank, model, opt, *, steps, scaler=False, clip=None, clip_api="optimizer", inject_at=None,
           dtype=torch.float32, backward_passes=1, materialize=False):
    """``steps`` steps on rank-dependent data; returns the final flat parameters (fp32).
    ``backward_passes`` synchronized backward passes accumulate before each step."""
    import fusedist

    sc = fusedist.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) if scaler else None
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        x, y = models.MLP.batch(gen)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        hook = None
        if step == inject_at and rank == (dist.get_world_size() - 1 if dist.is_initialized() else 0):
            hook = model.module.layers[0].weight.register_hook(_poison)
        for k in range(backward_passes):
            if k:  # another synchronized backward: accumulates into the (copied) gradient shard
                loss = nn.functional.mse_loss(model(x.flip(0).to(dtype)).float(), y)
            (sc.scale(loss) if sc else loss).backward()
        if hook is not None:
            hook.remove()
        if sc is not None and clip is not None:
            sc.unscale_(opt)
            if materialize:
                # What a clip over another parameter set does: the pending unscale is applied to
                # the gradients in place -- after stage 2 already copied them to the host.
                opt._fusedist_materialize_unscale()
        if clip is not None:
            if clip_api == "optimizer":
                opt.clip_grad_norm_(clip)
            else:
                fusedist.clip_grad_norm_(model.parameters(), clip)
        if sc is not None:
            sc.step(opt)
            sc.update()
        else:
            opt.step()
    opt.wait_for_params()
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _pair(rank, *, stage, inner, steps=10, dtype=torch.float32, groups=True, zero_kwargs=None, **train_kwargs):
    """The same DDP model trained with ZeRO(inner) without and with offload; returns
    (max |difference| of the parameters, offloaded params, both optimizers)."""
    import fusedist

    torch.manual_seed(1234)
    base = models.MLP().to(dtype)
    runs = []
    for offload in (None, "cpu"):
        model = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
        params = _groups(model.module) if groups else model.parameters()
        opt = fusedist.ZeroRedundancyOptimizer(params, inner, stage=stage, lr=1e-2, offload=offload,
                                               **(zero_kwargs or {}))
        runs.append((_train(rank, model, opt, steps=steps, dtype=dtype, **train_kwargs), model, opt))
    (a, _, opt_a), (b, model_b, opt_b) = runs
    return (a - b).abs().max().item(), b, model_b, opt_a, opt_b


def _masters_match_bf16_params(opt) -> bool:
    """Every bf16 parameter element this rank owns equals its FP32 master rounded to bf16."""
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]  # the state dict's indexing
    for index, frags in sd["fragments"].items():
        for f in frags:
            lo, hi = f["range"]
            if not torch.equal(params[index].detach().reshape(-1)[lo:hi], f["master"].to(torch.bfloat16)):
                return False
    return bool(sd["fragments"])


def _offload_worker(rank, world_size, directory):
    """Every multi-rank offload check of one world size in one spawn."""
    import fusedist
    from fusedist.optim import FusedAdam, FusedAdamW

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "cpu_ext"  # non-offloaded FusedAdamW: the same C++ kernel
    out = {"parity": {}}
    for stage in (1, 2):
        for name, inner, kw in (
            ("FusedAdamW", FusedAdamW, {}),
            ("torch AdamW", torch.optim.AdamW, {}),
            ("FusedAdam (L2), one group", FusedAdam, dict(groups=False)),
            ("clip", FusedAdamW, dict(clip=0.05)),
            ("scaler+overflow+clip", FusedAdamW, dict(scaler=True, clip=0.05, inject_at=3)),
            ("scaler+overflow+fusedist.clip_grad_norm_", FusedAdamW,
             dict(scaler=True, clip=0.05, inject_at=3, clip_api="fusedist")),
            ("scaler, no unscale_, overflow", torch.optim.AdamW, dict(scaler=True, inject_at=5)),
            ("two backward passes per step", FusedAdamW, dict(backward_passes=2, clip=0.05)),
            ("gradients unscaled in place after their copy", FusedAdamW,
             dict(scaler=True, clip=0.05, inject_at=3, materialize=True)),
            ("overlapped parameter gathers, scaler+overflow+clip", FusedAdamW,
             dict(scaler=True, clip=0.05, inject_at=3, zero_kwargs=dict(overlap_param_gather=True))),
        ):
            diff, flat, _, _, opt = _pair(rank, stage=stage, inner=inner, **kw)
            out["parity"][(stage, name)] = (diff, flat)
        # bf16 parameters, FP32 masters: the offloaded kernel writes the rounded master.
        diff, flat, _, opt_ref, opt = _pair(rank, stage=stage, inner=FusedAdamW, dtype=torch.bfloat16)
        masters = [torch.cat([f["master"] for fr in o.state_dict()["fragments"].values() for f in fr])
                   for o in (opt_ref, opt)]
        out[(stage, "bf16")] = dict(param_diff=diff, master_diff=(masters[0] - masters[1]).abs().max().item(),
                                    rounded=_masters_match_bf16_params(opt))
        if stage == 2:
            out["stats"] = (opt_ref.memory_stats(), opt.memory_stats())
    # The skipped step did not count: the step counter is 3 after 4 steps with one overflow.
    _, _, _, _, opt = _pair(rank, stage=2, inner=FusedAdamW, scaler=True, clip=0.05, inject_at=3, steps=4)
    out["steps_after_skip"] = sorted({float(s["step"]) for s in opt.inner.state.values()})

    # Checkpoints: one trained with offload, one without, both consolidated and saved.
    torch.manual_seed(1234)
    base = models.MLP()
    consolidated = {}
    for offload in (None, "cpu"):
        model = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
        opt = fusedist.ZeroRedundancyOptimizer(_groups(model.module), FusedAdamW, stage=2, lr=1e-2,
                                               offload=offload)
        _train(rank, model, opt, steps=4)
        consolidated[offload] = opt.consolidate_state_dict(to=0)
        fusedist.checkpoint.save(os.path.join(directory, f"offload-{offload}"), model, opt)
    if rank == 0:
        full_a, full_b = consolidated[None], consolidated["cpu"]
        diffs = [abs(float(full_a["state"][i]["step"]) - float(full_b["state"][i]["step"]))
                 for i in full_a["state"]]
        for i, st in full_a["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                diffs.append((st[key] - full_b["state"][i][key]).abs().max().item())
        out["consolidated_diff"] = max(diffs)
        out["consolidated_keys"] = sorted(full_b["state"][0])
    return out


# Worlds 1 (nothing to exchange) and 3 (partitions a world size does not divide); world 2 runs
# in most other tests.
@pytest.fixture(scope="module", params=[1, 3], ids=["world1", "world3"])
def offload_run(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp(f"offload{request.param}"))
    return request.param, directory, run_distributed(_offload_worker, request.param, directory, timeout=300)


def test_offload_matches_non_offloaded(offload_run):
    world_size, _, per_rank = offload_run
    for key, (diff, flat0) in per_rank[0]["parity"].items():
        assert diff < TOL, f"{key}: max |ZeRO - ZeRO offload| = {diff}"
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank]["parity"][key][1], flat0), f"{key}: rank {rank} diverged from rank 0"
    for out in per_rank:
        assert out["steps_after_skip"] == [3.0], out["steps_after_skip"]


def test_offload_bf16_params_are_rounded_fp32_masters(offload_run):
    _, _, per_rank = offload_run
    for out in per_rank:
        for stage in (1, 2):
            r = out[(stage, "bf16")]
            assert r["rounded"], f"stage {stage}: a bf16 parameter is not its FP32 master rounded"
            # Same kernel, same gradients: the FP32 masters agree to the fp32 tolerance, and so
            # the bf16 parameters (their rounding) are equal.
            assert r["master_diff"] < TOL and r["param_diff"] == 0.0, r


def test_offload_memory_stats(offload_run):
    _, _, per_rank = offload_run
    for out in per_rank:
        plain, off = out["stats"]
        assert plain["offload"] is None and plain["host_bytes"] == 0
        assert plain["device_bytes"] == plain["total_bytes"] + plain["gradient_shard_bytes"]
        assert off["offload"] == "cpu" and off["total_bytes"] == plain["total_bytes"]
        # bf16 model: host = fp32 master + 2 moments + fp32 gradient staging + bf16 param staging;
        # the device keeps only the fp32 gradient shard.
        n = off["shard_elements"]
        assert off["device_bytes"] == off["gradient_shard_bytes"] == 4 * n
        assert off["host_bytes"] == off["total_bytes"] + 4 * n + 2 * n, off


def _load_and_train(directory, offload):
    """World size 1, no torch.distributed: load a checkpoint saved at world size 2/3 and train 3 steps."""
    import fusedist
    from fusedist.optim import FusedAdamW

    model = models.MLP()
    opt = fusedist.ZeroRedundancyOptimizer(_groups(model), FusedAdamW, lr=1e-2, offload=offload,
                                           bucket_cap_mb=0.0005)
    fusedist.checkpoint.load(directory, model, opt)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        x, y = models.MLP.batch(gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt


def test_offload_checkpoint_interchange(offload_run, monkeypatch):
    world_size, directory, per_rank = offload_run
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "cpu_ext")
    assert per_rank[0]["consolidated_diff"] < TOL
    assert per_rank[0]["consolidated_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    saved_plain = os.path.join(directory, "offload-None")
    saved_off = os.path.join(directory, "offload-cpu")
    ref, _ = _load_and_train(saved_plain, None)
    for saved, offload in ((saved_plain, "cpu"), (saved_off, None), (saved_off, "cpu")):
        got, opt = _load_and_train(saved, offload)
        diff = (ref - got).abs().max().item()
        assert diff < TOL, \
            f"saved {os.path.basename(saved)} at world size {world_size}, loaded with offload={offload}: {diff}"
        assert {float(s["step"]) for s in opt.inner.state.values()} == {7.0}


def test_offload_rejects_unsupported_configurations():
    import fusedist

    model = models.MLP()
    with pytest.raises(TypeError, match=r"SGD is not supported.*FusedAdamW.*torch\.optim\.adamw\.AdamW"):
        fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1e-2, offload="cpu")
    with pytest.raises(ValueError, match="offload must be None or 'cpu'"):
        fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, offload="nvme")
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, amsgrad=True, offload="cpu")
    with pytest.raises(TypeError, match="parameter 0 has dtype torch.float64"):
        fusedist.ZeroRedundancyOptimizer(models.MLP().double().parameters(), torch.optim.AdamW, offload="cpu")


def _cuda_pair(dtype):
    import fusedist
    from fusedist.optim import FusedAdamW

    torch.manual_seed(0)
    base = models.MLP().cuda().to(dtype)
    results = []
    for offload in (None, "cpu"):
        model = copy.deepcopy(base)
        opt = fusedist.ZeroRedundancyOptimizer(_groups(model), FusedAdamW, lr=1e-2, offload=offload,
                                               bucket_cap_mb=0.0005)
        scaler = fusedist.amp.GradScaler("cuda", init_scale=2.0**10)
        gen = torch.Generator().manual_seed(0)
        for step in range(10):
            x, y = (t.cuda() for t in models.MLP.batch(gen))
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
            if step == 3:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            opt.clip_grad_norm_(0.05)
            scaler.step(opt)
            scaler.update()
        torch.cuda.synchronize()
        results.append((torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]), opt))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offload_cuda_pinned_streams_match_device_optimizer(dtype):
    """CUDA parameters: pinned host masters, D2H/H2D on side streams, GradScaler skip and clip;
    equals the on-device FusedAdamW (Triton kernel vs C++ kernel: a few fp32 ulp, so 1e-5)."""
    (a, _), (b, opt) = _cuda_pair(dtype)
    assert all(t.is_pinned() for t in opt._offload.masters.values())
    assert all(t.is_pinned() for t in opt._offload.host_grads.values())
    stats = opt.memory_stats()
    assert stats["host_bytes"] > stats["device_bytes"] > 0
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding step may differ
    assert (a - b).abs().max().item() < tol


def test_offload_follows_lr_scheduler(monkeypatch):
    """Hyperparameters are read from the param groups at every step (an LR schedule changes
    them); one process, stage 1 without DDP."""
    import fusedist
    from fusedist.optim import FusedAdamW

    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "cpu_ext")
    torch.manual_seed(3)
    base = models.MLP()
    finals = []
    for offload in (None, "cpu"):
        model = copy.deepcopy(base)
        opt = fusedist.ZeroRedundancyOptimizer(_groups(model), FusedAdamW, lr=1e-2, offload=offload,
                                               bucket_cap_mb=0.0005)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        gen = torch.Generator().manual_seed(5)
        for _ in range(6):
            x, y = models.MLP.batch(gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
        finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert (finals[0] - finals[1]).abs().max().item() < TOL
    assert not torch.equal(finals[1], torch.cat([p.detach().reshape(-1) for p in base.parameters()]))
