"""ZeroRedundancyOptimizer where its shards alias the parameters and DDP's buckets (Note
[shards aliasing the parameters and gradients] in fusedist/zero/shard_store.py), in the
combinations the aliasing could break: fp32 (aliased) next to bf16 (copied) parameters in one
optimizer, gradients replaced or modified by hand before the step, gradient views off,
parameters written between steps, loads into a fresh optimizer.

The oracle is an unsharded optimizer over a fusedist DDP copy of the same model fed the same
per-rank batches: torch.optim.AdamW for fp32 models, fusedist.optim.FusedAdamW with FP32
master weights for models with bf16 parameters (ZeRO's masters are FP32 too). lr 1e-2 moves
each weight by ~1e-2 per step, far above the tolerances (fp32 1e-5; bf16 one rounding).
"""

import copy
import os

import pytest
import torch
from torch import nn

import models

from shared_rank_launch import launch_for_selected, results_of

STEPS = 4
TOL = 1e-5


def _batch(step, rank, world_size):
    return models.rank_slice_of_global_batch(step, rank, world_size, seed=500, n=12, shape=(8,))


class Mixed(nn.Module):
    """fp32 -> bf16 -> fp32 layers: one optimizer holds aliased (fp32) and copied (bf16) shards."""

    def __init__(self, bf16=True, fp64=False):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 2)
        if bf16:
            self.b.to(torch.bfloat16)
        if fp64:
            self.c.to(torch.float64)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h.to(self.b.weight.dtype)))
        return self.c(h.to(self.c.weight.dtype)).float()


def _close(a, b, p, tol=TOL):
    if p.dtype == torch.bfloat16:
        return torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-3)
    return (a - b).abs().max().item() <= tol


def _compare(model, ref, tol=TOL):
    bad = []
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if not _close(p.detach(), q.detach(), p, tol):
            bad.append((n, (p.detach().float() - q.detach().float()).abs().max().item()))
    return bad


def _zero(params, inner, stage, **kw):
    """The probes' ZeroRedundancyOptimizer: the oracle's AdamW hyperparameters around ``inner``."""
    import fusedist

    return fusedist.ZeroRedundancyOptimizer(params, inner, stage=stage, lr=1e-2, weight_decay=0.1, **kw)


def _zero_variants():
    """(stage, inner optimizer) pairs every probe runs: both stages, torch's and fusedist's AdamW."""
    import fusedist

    return [(stage, inner) for stage in (1, 2) for inner in (torch.optim.AdamW, fusedist.optim.FusedAdamW)]


def _assert_no_mismatch(results, ignore=None):
    """Every rank's probes found nothing (entries whose key contains ``ignore`` are reports)."""
    for r in results:
        bad = {k: v for k, v in r.items() if v and not (ignore and ignore in k)}
        assert not bad, bad


def _ddp(model, **kw):
    import fusedist

    return fusedist.DistributedDataParallel(model, bucket_cap_mb=0.0015, first_bucket_cap_mb=0.0005, **kw)


def _train(rank, world_size, ddp, opt, scaler=None, clip=None, between=None, steps=STEPS, start=0):
    """``clip``: None, "opt" (opt.clip_grad_norm_) or "global" (fusedist.clip_grad_norm_).
    ``between(step, model)``: runs after backward, before the step (gradient edits), and the
    return of ``between`` is ignored."""
    import fusedist

    for step in range(start, start + steps):
        x, y = _batch(step, rank, world_size)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if between is not None:
            between(step, ddp.module)
        if scaler is not None and clip is not None:
            scaler.unscale_(opt)
        if clip == "opt":
            opt.clip_grad_norm_(0.05)
        elif clip == "global":
            fusedist.clip_grad_norm_(list(ddp.module.parameters()), 0.05)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()


def _mixed_worker(rank, world_size, bf16=True):
    """bf16 + fp32 in one ZeRO optimizer; stages 1/2; torch and fused inner optimizers;
    GradScaler with both clips; against unsharded FusedAdamW with FP32 masters."""
    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}
    for clip in (None, "opt", "global"):
        for use_scaler in (False, True, "lazy"):
            ref = Mixed(bf16)
            rddp = _ddp(ref)
            ropt = fusedist.optim.FusedAdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
            rscaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 8) if use_scaler else None  # (eager)
            _train(rank, world_size, rddp, ropt, rscaler, "global" if clip else None)
            for stage, inner in _zero_variants():
                model = Mixed(bf16)
                ddp = _ddp(model)
                opt = _zero(ddp.parameters(), inner, stage)
                scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 8,
                                                 lazy_unscale=use_scaler == "lazy") if use_scaler else None
                _train(rank, world_size, ddp, opt, scaler, clip)
                # The oracle's clip measures bf16 gradients in bf16, ZeRO in fp32 (~2e-5 apart).
                tol = 1e-4 if clip and not use_scaler else TOL
                out[f"clip={clip} scaler={use_scaler} stage={stage} {inner.__name__}"] = _compare(model, ref, tol)
    return out


def test_mixed_dtypes_scaler_clip(launched2):
    _assert_no_mismatch(results_of(launched2, "mixed"))


def _half_grad(step, model):
    model.a.weight.grad = model.a.weight.grad * 0.5  # replaced by hand
    model.c.bias.grad.mul_(3.0)  # modified in place


def _outside(step, model, opt):
    """Writes between steps: two weights in place, then the whole state dict. ZeRO and the
    oracle's FusedAdamW each refresh only the masters of the written parameters."""
    if step == 1:
        with torch.no_grad():
            model.a.weight.mul_(0.5)
            model.b.weight.mul_(0.5)
    if step == 2:
        sd = {k: v * 0.9 for k, v in model.state_dict().items()}
        model.load_state_dict(sd)


def _edits_worker(rank, world_size):
    """Stage 1 fp32 (and mixed): gradients replaced / scaled in place by hand, gradient views
    off, zero_grad(set_to_none=False), parameters written between steps."""
    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}
    cases = {
        "hand grads": dict(between=_half_grad),
        "hand grads, views off": dict(between=_half_grad, ddp=dict(gradient_as_bucket_view=False)),
        "outside writes": dict(outside=_outside),
        "zero_grad(set_to_none=False)": dict(keep=True, between=_half_grad),
    }
    for bf16 in (False, True):
        for name, case in cases.items():
            def run(make_opt):
                model = Mixed(bf16)
                ddp = _ddp(model, **case.get("ddp", {}))
                opt = make_opt(model, ddp)
                for step in range(STEPS):
                    if case.get("outside"):
                        case["outside"](step, model, opt)
                    x, y = _batch(step, rank, world_size)
                    opt.zero_grad(set_to_none=not case.get("keep"))
                    nn.functional.mse_loss(ddp(x), y).backward()
                    if case.get("between"):
                        case["between"](step, model)
                    opt.step()
                return model

            if bf16:
                ref = run(lambda m, d: fusedist.optim.FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1,
                                                                 master_weights=True))
            else:
                ref = run(lambda m, d: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))
            for stage, inner in _zero_variants():
                if stage == 2 and case.get("between"):
                    continue  # stage 2 has no p.grad to edit
                model = run(lambda m, d: _zero(d.parameters(), inner, stage))
                out[f"{name} bf16={bf16} stage={stage} {inner.__name__}"] = _compare(model, ref)
    return out


def test_gradient_and_parameter_edits(launched2):
    _assert_no_mismatch(results_of(launched2, "edits"))


def _reference(steps, bf16=False):
    """Unsharded AdamW (or FusedAdamW with masters) on the global batch, one process."""
    import fusedist

    model = Mixed(bf16)
    if bf16:
        opt = fusedist.optim.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        x, y = _batch(step, None, 1)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def _save_worker(rank, world_size, directory, stage):
    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    model = Mixed(False)
    ddp = _ddp(model)
    opt = _zero(ddp.parameters(), torch.optim.AdamW, stage)
    _train(rank, world_size, ddp, opt, steps=2)
    fusedist.checkpoint.save(directory, model, opt)


def _resume_worker(rank, world_size, directory, stage):
    """Load into a fresh optimizer (no step yet) at another world size, then train on."""
    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}
    ref = _reference(4)
    for to_stage in (1, 2):
        model = Mixed(False)
        ddp = _ddp(model)
        opt = _zero(ddp.parameters(), fusedist.optim.FusedAdamW, to_stage)
        fusedist.checkpoint.load(directory, model, opt)
        stats = opt.memory_stats()
        out[f"stage {to_stage} master_bytes"] = stats["master_bytes"]
        out[f"stage {to_stage} grad shard bytes"] = stats["gradient_shard_bytes"]
        _train(rank, world_size, ddp, opt, steps=2, start=2)
        out[f"stage {to_stage}"] = _compare(model, ref)
    return out


def test_checkpoint_resume_other_world_size(launched2, launched3):
    for stage in (1, 2):
        results_of(launched2, f"save {stage}")  # saved by 2 ranks, resumed by 3
        for r in results_of(launched3, f"resume {stage}"):
            assert r["stage 1 master_bytes"] == 0 and r["stage 2 master_bytes"] == 0, r
            assert r["stage 1 grad shard bytes"] == 0, r
            _assert_no_mismatch([r], ignore="bytes")


def _unfreeze_worker(rank, world_size):
    """A frozen layer (bf16: copied shards; fp32: aliased) joins after two steps (Note [growing
    the partition]); non-fused and fused inner optimizers, GradScaler and clip, overlapped
    gathers; against the oracle with the same schedule."""
    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}

    def run(layer, make_opt, scaler, clip, steps=5):
        model = Mixed(True)
        getattr(model, layer).requires_grad_(False)
        ddp = _ddp(model)
        opt = make_opt(model, ddp)
        sc = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
        _train(rank, world_size, ddp, opt, sc, clip, steps=2)
        getattr(model, layer).requires_grad_(True)
        _train(rank, world_size, ddp, opt, sc, clip, steps=steps - 2, start=2)
        if hasattr(opt, "wait_for_params"):
            opt.wait_for_params()  # (overlapped gathers)
        return model

    for layer in ("b", "c"):
        for scaler, clip in ((False, None), (True, "opt")):
            ref = run(layer, lambda m, d: fusedist.optim.FusedAdamW(
                m.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True), scaler, "global" if clip else None)
            for inner in (torch.optim.AdamW, fusedist.optim.FusedAdamW):
                for overlap in (False, True):
                    model = run(layer, lambda m, d: _zero(d.parameters(), inner, 1, overlap_param_gather=overlap),
                                scaler, clip)
                    tol = 1e-4 if clip else TOL  # (the oracle's clip measures bf16 gradients in bf16)
                    out[f"unfreeze {layer} scaler={scaler} {inner.__name__} overlap={overlap}"] = _compare(
                        model, ref, tol)
    return out


def test_unfreeze_stage1_mixed(launched2):
    _assert_no_mismatch(results_of(launched2, "unfreeze"))


def _roundtrip_worker(rank, world_size, path):
    """Mid-training state dicts (consolidated, and every rank's shards) loaded into a fresh
    optimizer before its first step, on a fresh model: training continues exactly as without
    the interruption. bf16 + fp32 parameters; stages 1 and 2; with and without offload."""
    import torch.distributed as dist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}

    def fresh(stage, offload, sd=None):
        model = Mixed(True)
        if sd is not None:
            model.load_state_dict(sd)
        ddp = _ddp(model)
        opt = _zero(ddp.parameters(), torch.optim.AdamW, stage, offload=offload)
        return model, ddp, opt

    for stage in (1, 2):
        for offload in (None, "cpu"):
            model, ddp, opt = fresh(stage, offload)
            _train(rank, world_size, ddp, opt, steps=4)
            ref = model
            for how in ("consolidated", "shards"):
                model, ddp, opt = fresh(stage, offload)
                _train(rank, world_size, ddp, opt, steps=2)
                stats = opt.memory_stats()
                if how == "consolidated":
                    full = opt.consolidate_state_dict(0)
                    if rank == 0:
                        torch.save(full, path)
                    dist.barrier()
                    sd = torch.load(path, weights_only=False)
                else:
                    sd = [None] * world_size
                    dist.all_gather_object(sd, opt.shard_state_dict())
                model, ddp, opt = fresh(stage, offload, model.state_dict())
                opt.load_state_dict(sd)
                _train(rank, world_size, ddp, opt, steps=2, start=2)
                key = f"stage={stage} offload={offload} {how}"
                out[key] = _compare(model, ref)
                out[key + " master bytes"] = stats["master_bytes"]
                dist.barrier()
    return out


def test_state_dict_roundtrip_fresh_optimizer(launched2):
    for r in results_of(launched2, "roundtrip"):
        _assert_no_mismatch([r], ignore="bytes")
        # Masters: copies for bf16 always, for fp32 only when offloaded (aliased otherwise).
        on_device = r["stage=1 offload=None shards master bytes"]
        offloaded = r["stage=1 offload=cpu shards master bytes"]
        assert 0 < on_device < offloaded, r


def _fp64_worker(rank, world_size):
    """fp64 parameters (their masters alias the parameters, in fp64) next to fp32 ones, against
    torch.optim.AdamW; GradScaler and clip."""
    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}
    for use_scaler, clip in ((False, None), (True, "opt"), (False, "global")):
        def run(make_opt, clip):
            model = Mixed(False, fp64=True)
            ddp = _ddp(model)
            opt = make_opt(ddp)
            sc = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 8) if use_scaler else None
            _train(rank, world_size, ddp, opt, sc, clip)
            return model

        ref = run(lambda d: torch.optim.AdamW(d.parameters(), lr=1e-2, weight_decay=0.1), "global" if clip else None)
        for stage, inner in _zero_variants():
            model = run(lambda d: _zero(d.parameters(), inner, stage), clip)
            out[f"scaler={use_scaler} clip={clip} stage={stage} {inner.__name__}"] = _compare(model, ref)
    return out


def test_fp64_next_to_fp32(launched3):
    _assert_no_mismatch(results_of(launched3, "fp64"))


def _optimizer_only_load_worker(rank, world_size):
    """A shard state dict from an earlier step loaded while the model holds later values
    (the optimizer alone is rolled back): the parameters stay identical on every rank and keep
    their values, as a torch optimizer's load leaves the parameters (Note [loaded masters that
    do not match the parameters] in fusedist/zero/sharded_state.py: the stale masters are not
    written back); training on equals the unsharded oracle doing the same."""
    import torch.distributed as dist

    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}
    for stage in (1, 2):
        for bf16 in (False, True):
            model, ref = Mixed(bf16), Mixed(bf16)
            ddp, rddp = _ddp(model), _ddp(ref)
            opt = _zero(ddp.parameters(), torch.optim.AdamW, stage)
            ropt = fusedist.optim.FusedAdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
            for m, o in ((ddp, opt), (rddp, ropt)):
                _train(rank, world_size, m, o, steps=2)
            sd = [None] * world_size
            dist.all_gather_object(sd, opt.shard_state_dict())
            rsd = copy.deepcopy(ropt.state_dict())  # (torch's holds the live state tensors)
            for m, o in ((ddp, opt), (rddp, ropt)):
                _train(rank, world_size, m, o, steps=1, start=2)
            before = [p.detach().clone() for p in model.parameters()]
            opt.load_state_dict(sd)
            ropt.load_state_dict(rsd)
            flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
            every = [torch.empty_like(flat) for _ in range(world_size)]
            dist.all_gather(every, flat)
            out[f"stage={stage} bf16={bf16}"] = max((t - flat).abs().max().item() for t in every)
            out[f"stage={stage} bf16={bf16} load moved"] = max(
                (a.float() - p.detach().float()).abs().max().item() for a, p in zip(before, model.parameters()))
            for m, o in ((ddp, opt), (rddp, ropt)):
                _train(rank, world_size, m, o, steps=1, start=2)
            out[f"stage={stage} bf16={bf16} continued"] = _compare(model, ref)
    return out


def test_optimizer_only_load_keeps_ranks_identical(launched2):
    """Defect: loaded fp32 masters were written into this rank's slices of the parameters
    only (they alias them), so the ranks' parameters differed until the next step; and stale
    loaded masters rolled the parameters back to the optimizer's step."""
    for r in results_of(launched2, "optimizer only load"):
        assert all(not v for v in r.values()), r


# The probes share two launches (every worker builds its own models and optimizers and selects
# the same kernel backend): one of 2 ranks, then one of 3 that resumes the 2-rank checkpoints.
@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("aliasing")


@pytest.fixture(scope="module")
def launched2(request, ckpt_root):
    return launch_for_selected(request, {
        "test_mixed_dtypes_scaler_clip": {"mixed": (_mixed_worker, ())},
        "test_gradient_and_parameter_edits": {"edits": (_edits_worker, ())},
        "test_checkpoint_resume_other_world_size": {
            f"save {stage}": (_save_worker, (str(ckpt_root / f"ckpt{stage}"), stage)) for stage in (1, 2)},
        "test_unfreeze_stage1_mixed": {"unfreeze": (_unfreeze_worker, ())},
        "test_state_dict_roundtrip_fresh_optimizer": {
            "roundtrip": (_roundtrip_worker, (str(ckpt_root / "full.pt"),))},
        "test_optimizer_only_load_keeps_ranks_identical": {
            "optimizer only load": (_optimizer_only_load_worker, ())},
    }, 2, timeout=600)


@pytest.fixture(scope="module")
def launched3(request, ckpt_root, launched2):
    return launch_for_selected(request, {
        "test_checkpoint_resume_other_world_size": {
            f"resume {stage}": (_resume_worker, (str(ckpt_root / f"ckpt{stage}"), stage)) for stage in (1, 2)},
        "test_fp64_next_to_fp32": {"fp64": (_fp64_worker, ())},
    }, 3, timeout=300)
