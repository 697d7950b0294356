"""fusedist.ZeroRedundancyOptimizer against unsharded AdamW under DDP (gloo, world sizes 2, 3).

Tolerance: both sides run the same fp32 AdamW elementwise math on the same averaged
gradients; differences come only from summation order (reduce-scatter vs all-reduce, the
global norm summed over shards instead of over parameters). 1e-5 absolute after 10 steps is
~100 ulps of the parameter magnitudes involved, far below what one wrong element or a missed
step would cause (lr 1e-2 per step).
"""

import copy
import warnings

import pytest
import torch
from torch import nn

import models
from conftest import requires_rank_slots
from fusedist.testing import device_for_rank, run_distributed

TINY_BUCKETS = dict(bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)  # several buckets


def _inner_class():
    """FusedAdamW when fusedist.optim is present on this branch, else torch.optim.AdamW."""
    try:
        from fusedist.optim import FusedAdamW
        return FusedAdamW
    except ImportError:
        return torch.optim.AdamW


def _groups(model, lr=1e-2):
    """Two groups with different hyperparameters: weights decay, biases do not."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [dict(params=weights, weight_decay=0.1), dict(params=biases, weight_decay=0.0, lr=lr / 2)]


class ProtocolScaler:
    """The fused-optimizer side of fusedist.amp.GradScaler (Note [scaler protocol]), for
    branches where fusedist.amp is not present: unscale_ = one check-and-norm pass recording
    inv_scale and the global sum of squares; step hands found_inf to the optimizer; update is
    torch's scale update kernel. Same constants as torch.amp.GradScaler."""

    def __init__(self, init_scale, growth_interval):
        self.scale = torch.full((1,), float(init_scale))
        self.tracker = torch.zeros(1, dtype=torch.int32)
        self.growth_interval = growth_interval
        self.found = None

    def scale_loss(self, loss):
        return loss * self.scale

    def unscale_(self, opt):
        inv = self.scale.double().reciprocal().float()
        self.found, sumsq = opt._fusedist_check_and_norm(inv)
        opt.step_context.inv_scale, opt.step_context.grad_sumsq = inv, sumsq

    def step(self, opt):
        if self.found is None:
            self.found, _ = opt._fusedist_check_and_norm(None)
            opt.grad_scale = self.scale
        opt.found_inf = self.found
        opt.step()

    def update(self):
        torch._amp_update_scale_(self.scale, self.tracker, self.found.clone(), 2.0, 0.5, self.growth_interval)
        self.found = None


def _make_scaler(kind):
    if kind is None:
        return None
    if kind == "torch":
        return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    try:
        from fusedist.amp import GradScaler
        return GradScaler("cpu", init_scale=2.0**10, growth_interval=3, lazy_unscale=kind == "fused lazy")
    except ImportError:
        return ProtocolScaler(2.0**10, 3)


def _scaled(scaler, loss):
    if scaler is None:
        return loss
    return scaler.scale_loss(loss) if isinstance(scaler, ProtocolScaler) else scaler.scale(loss)


def _train(rank, model, opt, *, zero, steps, scaler_kind=None, clip=None, inject_at=None, micro=1,
           large_batch=False):
    """``steps`` optimizer steps on rank-dependent data; returns the final flat parameters.
    ``micro`` micro-batches per step (all but the last under no_sync), or with ``large_batch``
    the same samples in one batch."""
    scaler = _make_scaler(scaler_kind)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        opt.zero_grad()
        xs, ys = models.MLP.batch(gen, n=8 * micro)
        if large_batch:
            nn.functional.mse_loss(model(xs), ys).backward()
        for m in range(0 if large_batch else micro):
            x, y = xs[m * 8:(m + 1) * 8], ys[m * 8:(m + 1) * 8]
            ctx = model.no_sync() if m < micro - 1 else _Null()
            with ctx:
                loss = nn.functional.mse_loss(model(x), y) / micro
                hook = None
                if step == inject_at and rank == 1:
                    # One inf gradient element on one rank: after the reduce-scatter only the
                    # rank owning that element sees it; the others learn it from the all-reduce.
                    hook = model.module.layers[0].weight.register_hook(_poison)
                _scaled(scaler, loss).backward()
                if hook is not None:
                    hook.remove()
        if scaler is not None and clip is not None:
            scaler.unscale_(opt)
        if clip is not None:
            if zero == "fusedist.clip_grad_norm_":
                import fusedist
                fusedist.clip_grad_norm_(model.parameters(), clip)
            elif zero == "torch.nn.utils.clip_grad_norm_":
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            elif zero:
                opt.clip_grad_norm_(clip)
            else:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    if zero:
        opt.wait_for_params()  # the last step's all-gathers are waited for by the next forward
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _poison(grad):
    grad = grad.clone()
    grad[0, 0] = float("inf")
    return grad


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _pair(rank, *, stage, ddp_kwargs, steps=10, scaler=None, clip=None, inject_at=None, groups=True, micro=1,
          model_kwargs=None, kernels="torch", clip_api="optimizer", zero_kwargs=None, inner=None):
    """Train unsharded AdamW and ZeRO(FusedAdamW) copies of one model; max |difference|.

    ``kernels="torch"`` runs FusedAdamW's pure-PyTorch path (its Triton kernels are tested
    against it elsewhere; under the CPU interpreter they cost ~0.5 s per step here)."""
    import os

    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = kernels

    torch.manual_seed(1234)
    base = models.MLP(**(model_kwargs or {}))
    ref = fusedist.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    ref_params = _groups(ref.module) if groups else ref.parameters()
    our_params = _groups(ours.module) if groups else ours.parameters()
    opt_ref = torch.optim.AdamW(ref_params, lr=1e-2)
    opt = fusedist.ZeroRedundancyOptimizer(our_params, inner or _inner_class(), stage=stage, lr=1e-2,
                                           **(zero_kwargs or {}))
    a = _train(rank, ref, opt_ref, zero=False, steps=steps, scaler_kind="torch" if scaler else None,
               clip=clip, inject_at=inject_at, micro=micro)
    b = _train(rank, ours, opt, zero=True if clip_api == "optimizer" else clip_api, steps=steps,
               scaler_kind=scaler, clip=clip,
               inject_at=inject_at, micro=micro)
    return (a - b).abs().max().item(), b, opt


def _parity_worker(rank, world_size):
    out = {}
    for stage in (1, 2):
        for name, kw in (("tiny buckets", TINY_BUCKETS), ("one bucket", dict(bucket_cap_mb=100.0))):
            diff, flat, opt = _pair(rank, stage=stage, ddp_kwargs=kw)
            out[(stage, name)] = (diff, flat)
        diff, flat, _ = _pair(rank, stage=stage, ddp_kwargs=TINY_BUCKETS, clip=0.05)
        out[(stage, "clip")] = (diff, flat)
        diff, flat, _ = _pair(rank, stage=stage, ddp_kwargs=TINY_BUCKETS, scaler="fused", clip=0.05, inject_at=3)
        out[(stage, "scaler+overflow+clip")] = (diff, flat)
        # Stage 1: p.grad holds full gradients and fusedist.clip_grad_norm_ takes its fast path;
        # stage 2: p.grad is None and it dispatches to the optimizer owning the shards.
        diff, flat, _ = _pair(rank, stage=stage, ddp_kwargs=TINY_BUCKETS, scaler="fused", clip=0.05,
                              inject_at=3, clip_api="fusedist.clip_grad_norm_")
        out[(stage, "scaler+overflow+fusedist.clip_grad_norm_")] = (diff, flat)
        if stage == 2 and world_size == 2:  # once with the Triton kernels (interpreted on CPU)
            diff, flat, _ = _pair(rank, stage=stage, ddp_kwargs=TINY_BUCKETS, scaler="fused", clip=0.05,
                                  inject_at=3, kernels="auto", steps=5)
            out[(stage, "scaler+overflow+clip, triton kernels")] = (diff, flat)
        diff, flat, _ = _pair(rank, stage=stage, ddp_kwargs=TINY_BUCKETS, scaler="fused", inject_at=5, groups=False)
        out[(stage, "scaler, no unscale_")] = (diff, flat)
        # The parameter gathers waited for by the next forward's pre-hooks (Note [overlapped
        # parameter gathers]); every other case completes them inside step().
        overlap = dict(overlap_param_gather=True)
        diff, flat, _ = _pair(rank, stage=stage, ddp_kwargs=TINY_BUCKETS, zero_kwargs=overlap)
        out[(stage, "overlap_param_gather=True")] = (diff, flat)
        diff, flat, _ = _pair(rank, stage=stage, ddp_kwargs=TINY_BUCKETS, scaler="fused", clip=0.05, inject_at=3,
                              zero_kwargs=overlap)
        out[(stage, "overlap_param_gather=True, scaler+overflow+clip")] = (diff, flat)
    # Stage 1 keeps full gradients in p.grad, so torch's own GradScaler and clip_grad_norm_
    # work on it unchanged (stage 2 refuses them: test_misuse_is_reported).
    diff, flat, _ = _pair(rank, stage=1, ddp_kwargs=TINY_BUCKETS, scaler="torch", clip=0.05, inject_at=3,
                          clip_api="torch.nn.utils.clip_grad_norm_")
    out[(1, "torch's GradScaler+overflow+clip_grad_norm_")] = (diff, flat)
    # fusedist's scaler unscales stage 1's p.grad in place, so torch's clip works on it too
    # (Note [lazy unscale]); lazy_unscale=True leaves them scaled for fusedist's clip.
    diff, flat, _ = _pair(rank, stage=1, ddp_kwargs=TINY_BUCKETS, scaler="fused", clip=0.05, inject_at=3,
                          clip_api="torch.nn.utils.clip_grad_norm_")
    out[(1, "GradScaler+overflow+torch's clip_grad_norm_")] = (diff, flat)
    for stage in (1, 2):
        diff, flat, _ = _pair(rank, stage=stage, ddp_kwargs=TINY_BUCKETS, scaler="fused lazy", clip=0.05, inject_at=3)
        out[(stage, "GradScaler(lazy_unscale=True)+overflow+clip")] = (diff, flat)
    return out


def _zero_worker(rank, world_size):
    """Every multi-rank ZeRO check of one world size in one spawn (each spawn costs seconds)."""
    return {"parity": _parity_worker(rank, world_size), "no_sync_memory": _no_sync_and_memory_worker(rank, world_size),
            "consolidate": _consolidate_worker(rank, world_size), "misuse": _misuse_worker(rank, world_size),
            "read_after_step": _read_after_step_worker(rank, world_size),
            "stage1_aliasing": _stage1_aliasing_worker(rank, world_size),
            "schedulers": _scheduler_worker(rank, world_size),
            "lifetime": _lifetime_and_destination_worker(rank, world_size)}


def _lifetime_and_destination_worker(rank, world_size):
    """A dropped optimizer is freed at once, as torch's optimizers are (no cyclic collection:
    until one, a DDP model's layout changes would still grow it); consolidate_state_dict's
    ``to`` is checked before the gather."""
    import gc
    import weakref

    import fusedist

    out = {}
    gen = torch.Generator().manual_seed(rank)
    gc.collect()
    gc.disable()
    try:
        for stage, name in ((1, "fusedist"), (2, "fusedist"), (1, "torch")):
            model = fusedist.DistributedDataParallel(models.MLP(), **TINY_BUCKETS)
            if name == "torch":
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            else:
                opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2)
            x, y = models.MLP.batch(gen)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if name == "fusedist":
                opt.consolidate_state_dict(to=0)
            dropped = weakref.ref(opt)
            del opt
            if stage == 2:  # the model's reduce-scatter holds it until a newer optimizer takes over
                out["stage 2 kept by its model"] = dropped() is not None
                newer = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
            out[f"{name} stage {stage} freed"] = dropped() is None
    finally:
        gc.enable()
    del newer
    model = fusedist.DistributedDataParallel(models.MLP(), **TINY_BUCKETS)
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    x, y = models.MLP.batch(gen)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    for to in (world_size, -1, "0"):
        out[f"to={to!r}"] = models.error_text(lambda: opt.consolidate_state_dict(to=to))
    full = opt.consolidate_state_dict(to=world_size - 1)  # the ranks still agree after the refusals
    out["last rank got the state"] = full is not None and len(full["state"]) == len(list(model.parameters()))
    return out


def _stage1_aliasing_worker(rank, world_size):
    """Note [shards aliasing the parameters and gradients]: stage 1 on fp32 parameters holds no
    master copy and no gradient shard; it matches unsharded AdamW with gradient views on and off
    and with a non-fused inner optimizer (handed scaled copies of the aliased gradients); and
    its step leaves p.grad as backward, unscale_ and clip left it."""
    import fusedist

    out = {}
    for views in (True, False):
        kw = dict(TINY_BUCKETS, gradient_as_bucket_view=views)
        diff, _, opt = _pair(rank, stage=1, ddp_kwargs=kw, scaler="fused lazy", clip=0.05, inject_at=3,
                             inner=torch.optim.AdamW)
        stats = opt.memory_stats()
        out[views] = (diff, stats["master_bytes"], stats["gradient_shard_bytes"])
    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(models.MLP(), **TINY_BUCKETS)
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=1e-2)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0**10, lazy_unscale=True)
    x, y = models.MLP.batch(torch.Generator().manual_seed(rank))
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    opt.clip_grad_norm_(1e-3)
    before = [p.grad.clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    out["grads_kept"] = all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    return out


def _scheduler_worker(rank, world_size):
    """LR schedulers that also cycle momentum (OneCycleLR: AdamW's beta1, SGD's momentum)
    find it in ``optimizer.defaults`` and change it in every group; ZeRO against the
    unsharded optimizer under the same schedule."""
    import fusedist

    def sgd(params, **kw):
        return torch.optim.SGD(params, momentum=0.9, **kw)

    out = {}
    for stage in (1, 2):
        for name, inner in (("AdamW", torch.optim.AdamW), ("SGD momentum", sgd)):
            torch.manual_seed(5)
            base = models.MLP()
            ref = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
            ours = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
            opt_ref = inner(_groups(ref.module), lr=1e-2)
            opt = fusedist.ZeroRedundancyOptimizer(_groups(ours.module), inner, stage=stage, lr=1e-2)
            scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.05, 0.02], total_steps=8)
                      for o in (opt_ref, opt)]
            gen = torch.Generator().manual_seed(rank)
            for _ in range(6):
                x, y = models.MLP.batch(gen)
                for model, o, sched in ((ref, opt_ref, scheds[0]), (ours, opt, scheds[1])):
                    o.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    o.step()
                    sched.step()
            out[(stage, name)] = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))
    return out


def test_momentum_cycling_schedulers(zero_run):
    _, per_rank = zero_run
    for rank, r in enumerate(per_rank):
        for key, diff in r["schedulers"].items():
            assert diff < 1e-5, f"rank {rank}, OneCycleLR with {key}: max |unsharded - ZeRO| = {diff}"


def _read_after_step_worker(rank, world_size):
    """Parameters read right after ``step()`` -- as an EMA or ``AveragedModel`` update reads
    them, with no forward in between -- against unsharded AdamW after the same steps."""
    import fusedist

    out = {}
    for stage in (1, 2):
        torch.manual_seed(7)
        base = models.MLP()
        ref = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
        ours = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2)
        ema = torch.optim.swa_utils.AveragedModel(ours.module,
                                                  multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        ema_ref = torch.optim.swa_utils.AveragedModel(ref.module,
                                                      multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        gen = torch.Generator().manual_seed(rank)
        worst = 0.0
        for _ in range(8):
            x, y = models.MLP.batch(gen)
            for model, o, avg in ((ref, opt_ref, ema_ref), (ours, opt, ema)):
                o.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                o.step()
                copies = [p.detach().clone() for p in model.parameters()]  # before anything else runs
                avg.update_parameters(model.module)
                if model is ours:
                    worst = max(worst, max((a - b).abs().max().item() for a, b in zip(ref.parameters(), copies)))
        out[f"params {stage}"] = worst
        out[f"ema {stage}"] = max((a - b).abs().max().item() for a, b in zip(ema_ref.parameters(), ema.parameters()))
    return out


def test_parameters_are_final_when_step_returns(zero_run):
    """The default returns final parameters (Note [overlapped parameter gathers]): read before
    their all-gathers landed, some would hold the previous step's values from other ranks."""
    _, per_rank = zero_run
    for rank, r in enumerate(per_rank):
        for key, diff in r["read_after_step"].items():
            assert diff < 1e-5, f"rank {rank}, {key}: max |AdamW - ZeRO| read right after step() = {diff}"


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def zero_run(request):
    return request.param, run_distributed(_zero_worker, request.param, timeout=400)


def test_zero_matches_unsharded_adamw(zero_run):
    world_size, per_rank = zero_run
    for key, (diff, flat0) in per_rank[0]["parity"].items():
        assert diff < 1e-5, f"{key}: max |AdamW - ZeRO| = {diff}"
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank]["parity"][key][1], flat0), f"{key}: rank {rank} diverged from rank 0"


def _no_sync_and_memory_worker(rank, world_size):
    import fusedist

    out = {}
    # no_sync: 4 micro-batches accumulated locally, reduce-scattered on the last one, equal
    # one step on the 4x batch (unsharded AdamW under DDP).
    torch.manual_seed(1234)
    base = models.MLP()
    ref = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), _inner_class(), stage=2, lr=1e-2)
    a = _train(rank, ref, opt_ref, zero=False, steps=4, micro=4, large_batch=True)
    b = _train(rank, ours, opt, zero=True, steps=4, micro=4)
    out["no_sync_diff"] = (a - b).abs().max().item()
    # Stage 2 keeps only the gradient shard: p.grad is None after a synchronized backward.
    x, y = models.MLP.batch(torch.Generator().manual_seed(rank))
    opt.zero_grad()
    nn.functional.mse_loss(ours(x), y).backward()
    out["grads_none"] = all(p.grad is None for p in ours.parameters())
    layout = ours.reducer.layout
    out["grad_buffers_freed"] = layout.allocated_bytes == 0 and all(b.data is None for b in layout.buckets)
    shard = torch.cat(list(opt.gradient_shards().values()))
    out["shard_numel"] = shard.numel()
    # A step after a no_sync-only backward is refused (its gradients were never reduced).
    opt.zero_grad()
    with ours.no_sync():
        nn.functional.mse_loss(ours(x), y).backward()
    out["no_sync_step_error"] = models.error_text(opt.step, RuntimeError)
    nn.functional.mse_loss(ours(x), y).backward()  # the synchronized backward makes it valid
    opt.step()

    # Memory per rank: a model with an odd parameter count, AdamW (2 moments; fp32 parameters
    # are their own masters).
    torch.manual_seed(0)
    big = fusedist.DistributedDataParallel(models.MLP(d_in=16, hidden=97, layers=4), **TINY_BUCKETS)
    opt = fusedist.ZeroRedundancyOptimizer(big.parameters(), torch.optim.AdamW, stage=1, lr=1e-3)
    nn.functional.mse_loss(big(x), y).backward()
    opt.step()
    # What the inner optimizer steps is this rank's slice of the parameters' own storage.
    buffers = list(opt._flat_params.buffers.values())
    out["pieces_in_params"] = all(
        any(b.data_ptr() <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size()
            <= b.data_ptr() + b.numel() * b.element_size() for b in buffers)
        and any(p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for p in big.parameters())
        for t in opt._pieces)
    out["psi"] = sum(p.numel() for p in big.parameters())
    out["stats"] = opt.memory_stats()
    out["buckets"] = len(big.buckets)
    out["pieces"] = len(opt._pieces)
    return out


def test_stage1_shares_the_parameters_and_gradients(zero_run):
    _, per_rank = zero_run
    for out in (r["stage1_aliasing"] for r in per_rank):
        for views in (True, False):
            diff, master_bytes, grad_bytes = out[views]
            assert diff < 1e-5, (views, diff)
            assert master_bytes == 0 and grad_bytes == 0, (views, master_bytes, grad_bytes)
        assert out["grads_kept"]


def test_no_sync_stage2_and_memory(zero_run):
    world_size, per_rank = zero_run
    per_rank = [r["no_sync_memory"] for r in per_rank]
    for out in per_rank:
        assert out["no_sync_diff"] < 1e-5, out["no_sync_diff"]
        assert out["grads_none"] and out["grad_buffers_freed"]
        assert out["no_sync_step_error"] and "no_sync" in out["no_sync_step_error"]
        stats, psi = out["stats"], out["psi"]
        # Each rank holds 1/N of the padded flat space: at most SHARD_ALIGN (16) padding
        # elements per bucket beyond psi/N.
        assert psi / world_size <= stats["shard_elements"] <= psi / world_size + 16 * out["buckets"]
        # AdamW on fp32 parameters: exp_avg (4 B) + exp_avg_sq (4 B) per element, plus one
        # 4-byte step counter per inner tensor; no master copy (Note [shards aliasing the
        # parameters and gradients]: the parameters' own slices are stepped).
        assert stats["master_bytes"] == 0 and out["pieces_in_params"], stats
        assert stats["total_bytes"] == 8 * stats["shard_elements"] + 4 * out["pieces"], stats
        assert abs(stats["total_bytes"] - 8 * psi / world_size) <= 8 * 16 * out["buckets"] + 4 * out["pieces"]
        # The stage-2 reduce-scatters above left landing buffers in the gloo exchange's pool:
        # none with 2 ranks (one peer's part lands in the output), some with 3.
        scratch = stats["communication_scratch_bytes"]
        assert scratch == 0 if world_size == 2 else 0 < scratch <= 256 << 20, (world_size, scratch)
    assert all(out["shard_numel"] > 0 for out in per_rank)


def _consolidate_worker(rank, world_size):
    """consolidate_state_dict(to=0) equals the state of an unsharded AdamW trained the same way,
    and an unsharded optimizer loads it; stage 1 on a torch DDP model (no fusedist DDP)."""
    import fusedist

    torch.manual_seed(1234)
    base = models.MLP()
    ref = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
    opt_ref = torch.optim.AdamW(_groups(ref.module), lr=1e-2)
    opt = fusedist.ZeroRedundancyOptimizer(_groups(ours.module), torch.optim.AdamW, stage=2, lr=1e-2)
    _train(rank, ref, opt_ref, zero=False, steps=3)
    _train(rank, ours, opt, zero=True, steps=3)
    full = opt.consolidate_state_dict(to=0)
    out = {"is_none": full is None}
    if rank == 0:
        expected = opt_ref.state_dict()
        diffs = []
        for index, st in expected["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                diffs.append((st[key] - full["state"][index][key]).abs().max().item())
            diffs.append(abs(float(st["step"]) - float(full["state"][index]["step"])))
        out["state_diff"] = max(diffs)
        fresh = torch.optim.AdamW(_groups(copy.deepcopy(ref.module)), lr=1e-2)
        fresh.load_state_dict(full)
        out["groups"] = [(g["lr"], g["weight_decay"]) for g in fresh.param_groups]

    # torch's recipe: after consolidate_state_dict(to=0), rank 0's state_dict() is the full
    # state (what it saves), which every rank then loads; other ranks' is their shard.
    import torch.distributed as dist

    sd = opt.state_dict()
    out["state_dict_is_full"] = "state" in sd and "fragments" not in sd
    box = [sd if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)

    def fresh_optimizer():
        model = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
        return fusedist.ZeroRedundancyOptimizer(_groups(model.module), torch.optim.AdamW, stage=2, lr=1e-2)

    again = fresh_optimizer()
    again.load_state_dict(box[0])
    reloaded = again.consolidate_state_dict(to=0)  # before its first step: the loaded state
    if rank == 0:
        out["recipe_diff"] = max((full["state"][i][k] - reloaded["state"][i][k]).abs().max().item()
                                 for i in full["state"] for k in ("exp_avg", "exp_avg_sq"))
    # One rank's shard loaded everywhere would leave the other ranks' parameters without state.
    shard0 = [opt.shard_state_dict() if rank == 0 else None]
    dist.broadcast_object_list(shard0, src=0)
    try:
        fresh_optimizer().load_state_dict(shard0[0])
        out["rank0_shard"] = "loaded"
    except Exception as exc:  # noqa: BLE001
        out["rank0_shard"] = f"{type(exc).__name__}: {exc}"
    _train(rank, ours, opt, zero=True, steps=1)
    out["after_step_is_shard"] = "fragments" in opt.state_dict()

    # Stage 1 without a fusedist DDP wrapper: torch DDP synchronizes the gradients.
    torch.manual_seed(1234)
    base = models.MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.AdamW, lr=1e-2, bucket_cap_mb=0.0005)
    a = _train(rank, ref, opt_ref, zero=False, steps=4)
    b = _train(rank, ours, opt, zero=True, steps=4)
    out["torch_ddp_diff"] = (a - b).abs().max().item()
    return out


def test_consolidate_state_dict(zero_run):
    world_size, per_rank = zero_run
    results = [r["consolidate"] for r in per_rank]
    assert not results[0]["is_none"] and all(r["is_none"] for r in results[1:])
    assert results[0]["state_diff"] < 1e-6
    assert results[0]["groups"] == [(1e-2, 0.1), (5e-3, 0.0)]
    assert results[0]["state_dict_is_full"] and not any(r["state_dict_is_full"] for r in results[1:])
    assert results[0]["recipe_diff"] == 0.0
    for r in results:
        assert "StateDictError" in r["rank0_shard"] and "shard(s) of ranks [0]" in r["rank0_shard"], r["rank0_shard"]
    assert all(r["after_step_is_shard"] for r in results)
    for r in results:
        assert r["torch_ddp_diff"] < 1e-5


def _misuse_worker(rank, world_size):
    import fusedist

    errors = {}
    model = fusedist.DistributedDataParallel(models.MLP())
    try:
        fusedist.ZeroRedundancyOptimizer(models.MLP().parameters(), torch.optim.AdamW, stage=2)
    except ValueError as exc:
        errors["stage2 without DDP"] = str(exc)
    try:
        # (stage 1 takes a subset, as torch's: tests/test_zero_subset_copies_and_state_refusals.py; stage 2
        # once add_param_group completes it: tests/test_sharded_optimizer_stage2_recipe_and_rank_checks.py)
        part = fusedist.ZeroRedundancyOptimizer(list(model.parameters())[:2], torch.optim.AdamW, stage=2)
        x, y = models.MLP.batch(torch.Generator().manual_seed(rank))
        nn.functional.mse_loss(model(x), y).backward()
        part.step()
    except RuntimeError as exc:
        errors["subset"] = str(exc)
    # A second stage-2 optimizer takes the model over; the first refuses to step.
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
    newer = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
    x, y = models.MLP.batch(torch.Generator().manual_seed(rank))
    nn.functional.mse_loss(model(x), y).backward()
    try:
        opt.step()
    except RuntimeError as exc:
        errors["two stage-2 optimizers"] = str(exc)
    del newer

    # torch's GradScaler on stage 2 (no p.grad to unscale or check): a clear error at step().
    torch_scaled = fusedist.DistributedDataParallel(models.MLP())
    opt = fusedist.ZeroRedundancyOptimizer(torch_scaled.parameters(), torch.optim.AdamW, stage=2)
    scaler = torch.amp.GradScaler("cpu")
    x, y = models.MLP.batch(torch.Generator().manual_seed(rank))
    scaler.scale(nn.functional.mse_loss(torch_scaled(x), y)).backward()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch announces its protocol change
            scaler.step(opt)
    except RuntimeError as exc:
        errors["torch scaler"] = str(exc)

    # Parameters changed between steps (Note [parameters changed outside the optimizer]) are
    # what the next step updates, as with torch: with lr=0 they stay as set. Loaded right after
    # a step -- with overlapped gathers, while they may still be landing.
    for stage, overlap in ((1, False), (2, False), (1, True), (2, True)):
        model = fusedist.DistributedDataParallel(models.MLP(), **TINY_BUCKETS)
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.0,
                                               overlap_param_gather=overlap)
        gen = torch.Generator().manual_seed(rank)

        def lr0_step():
            x, y = models.MLP.batch(gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        lr0_step()
        model.module.load_state_dict({k: torch.full_like(v, 0.5) for k, v in model.module.state_dict().items()})
        lr0_step()
        opt.wait_for_params()
        loaded = all(torch.all(p == 0.5) for p in model.parameters())
        with torch.no_grad():
            model.module.layers[0].weight.mul_(2.0)  # in place, between steps
        lr0_step()
        opt.wait_for_params()
        errors[f"params set between steps kept {stage}, overlap {overlap}"] = (
            loaded and bool(torch.all(model.module.layers[0].weight == 1.0)))

    # Parameters no rank uses are skipped, as torch skips grad=None (weight decay would move
    # them otherwise); tests/test_zero_no_grad.py compares this with torch in detail.
    for stage in (1, 2):
        model = fusedist.DistributedDataParallel(models.WithUnused(), find_unused_parameters=True)
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage)
        before = [p.detach().clone() for p in model.module.unused.parameters()]
        x, y = models.WithUnused.batch(torch.Generator().manual_seed(0))
        for _ in range(2):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.wait_for_params()
        errors[f"unused unchanged {stage}"] = all(
            torch.equal(b, p) for b, p in zip(before, model.module.unused.parameters()))

    # bf16 parameters: FP32 master shards; stage 1 (bf16 all-reduce) and stage 2 (bf16
    # reduce-scatter) agree to bf16 resolution, and the masters are FP32.
    finals = {}
    for stage in (1, 2):
        torch.manual_seed(3)
        model = fusedist.DistributedDataParallel(models.MLP().to(torch.bfloat16), **TINY_BUCKETS)
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x, y = models.MLP.batch(gen)
            model.zero_grad()
            nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
            opt.step()
        opt.wait_for_params()
        finals[stage] = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        errors[f"bf16 master bytes {stage}"] = (opt.memory_stats()["master_bytes"]
                                                == 4 * opt.memory_stats()["shard_elements"])
    errors["bf16 stage1 vs stage2"] = (finals[1] - finals[2]).abs().max().item()
    return errors


def test_misuse_is_reported(zero_run):
    _, per_rank = zero_run
    for r in per_rank:
        errors = r["misuse"]
        assert "DistributedDataParallel" in errors["stage2 without DDP"]
        assert "missing" in errors["subset"] and "layers." in errors["subset"]
        assert "a newer stage-2 optimizer was built for the same DDP model" in errors["two stage-2 optimizers"]
        assert "cannot be stepped by torch.amp.GradScaler" in errors["torch scaler"]
        for stage in (1, 2):
            for overlap in (False, True):
                assert errors[f"params set between steps kept {stage}, overlap {overlap}"]
        assert "fusedist.amp.GradScaler" in errors["torch scaler"]
        assert errors["bf16 master bytes 1"] and errors["bf16 master bytes 2"]
        for stage in (1, 2):
            assert errors[f"unused unchanged {stage}"]
        # bf16 has 8 mantissa bits: one rounding of a parameter near 0.5 is ~2e-3; the two
        # stages sum the bf16 gradients in different orders.
        assert errors["bf16 stage1 vs stage2"] < 2e-2


def test_dropped_optimizer_is_freed_at_once(zero_run):
    """As a torch optimizer: ``del opt`` frees it (and its masters) without a cyclic collection."""
    _, per_rank = zero_run
    for rank, r in enumerate(per_rank):
        out = r["lifetime"]
        assert out["torch stage 1 freed"], rank
        assert out["fusedist stage 1 freed"], rank
        assert out["stage 2 kept by its model"] and out["fusedist stage 2 freed"], (rank, out)


def test_consolidate_destination_outside_the_group_is_named(zero_run):
    """torch's optimizer takes any ``to`` and gathers nowhere (state_dict() fails later);
    here every rank refuses it at once, naming the argument and the valid ranks."""
    world_size, per_rank = zero_run
    for rank, r in enumerate(per_rank):
        out = r["lifetime"]
        for to in (world_size, -1, "0"):
            text = out[f"to={to!r}"]
            assert text is not None and f"rank {rank}" in text and f"to={to!r}" in text, text
            assert f"ranks are 0..{world_size - 1} (world size {world_size})" in text, text
        assert out["last rank got the state"] == (rank == world_size - 1)


def _cuda_worker(rank, world_size, stage):
    import fusedist

    device = device_for_rank(rank)  # several ranks may share it (FUSEDIST_TEST_RANKS_PER_GPU)
    torch.cuda.set_device(device)
    torch.manual_seed(1234)
    base = models.MLP().cuda()
    ref = fusedist.DistributedDataParallel(copy.deepcopy(base), device_ids=[device], **TINY_BUCKETS)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), device_ids=[device], **TINY_BUCKETS)
    opt_ref = torch.optim.AdamW(_groups(ref.module), lr=1e-2)
    opt = fusedist.ZeroRedundancyOptimizer(_groups(ours.module), _inner_class(), stage=stage, lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    scaler_ref = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    scaler = fusedist.amp.GradScaler("cuda", init_scale=2.0**10)
    for step in range(10):
        x, y = (t.cuda() for t in models.MLP.batch(gen))
        for model, o, sc, zero in ((ref, opt_ref, scaler_ref, False), (ours, opt, scaler, True)):
            o.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if step == 3 and rank == world_size - 1:
                loss = loss * float("inf")
            sc.scale(loss).backward()
            sc.unscale_(o)
            if zero:
                o.clip_grad_norm_(0.05)
            else:
                nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            sc.step(o)
            sc.update()
    opt.wait_for_params()
    return max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))


@pytest.mark.gpu
@requires_rank_slots(2)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_nccl_matches_unsharded_adamw(stage):
    for diff in run_distributed(_cuda_worker, 2, stage, backend="nccl", timeout=300):
        assert diff < 1e-5


@pytest.mark.gpu
def test_zero_single_gpu_without_process_group(tmp_path):
    """One process, no torch.distributed: ZeRO (world size 1) on CUDA equals AdamW, and a
    checkpoint round-trips."""
    import fusedist

    torch.manual_seed(0)
    base = models.MLP().cuda()
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    opt_ref = torch.optim.AdamW(_groups(ref), lr=1e-2)
    opt = fusedist.ZeroRedundancyOptimizer(_groups(ours), _inner_class(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        x, y = (t.cuda() for t in models.MLP.batch(gen))
        for model, o in ((ref, opt_ref), (ours, opt)):
            o.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert (a - b).abs().max().item() < 1e-5
    fusedist.checkpoint.save(str(tmp_path), ours, opt, extra={"k": 1})
    again = models.MLP().cuda()
    opt2 = fusedist.ZeroRedundancyOptimizer(_groups(again), _inner_class(), lr=1e-2)
    assert fusedist.checkpoint.load(str(tmp_path), again, opt2) == {"k": 1}
    for a, b in zip(again.parameters(), ours.parameters()):
        assert torch.equal(a, b)
