"""A whole training recipe, run with fusedist's one-import swaps and with plain torch side by
side on 2 gloo ranks, compared step by step: losses, gradient norms, weights (BatchNorm
statistics included), optimizer state, GradScaler and LR-scheduler state.

The recipe is what a real script does: an embedding, a (Sync)BatchNorm layer, dropout with
seeded masks, bf16 autocast on CPU with a GradScaler, gradient accumulation over 2
micro-batches (``no_sync`` on the first), clip at 1.0 (returned norms compared), two parameter
groups (no weight decay for biases and norms), an LR scheduler, an evaluation forward after
every step, and one step whose loss is inf on rank 1 only (every rank skips it, both scalers
back off alike). Then the run is checkpointed at step K and resumed
in fresh processes -- at the same world size (bit for bit, generators included) and at world
sizes 1 and 3 (ZeRO's optimizer state resharded, ElasticDistributedSampler re-splitting the
epoch). Two focused tests pin the torch.compile fixes the recipe needed.

Torch references where torch cannot run the same thing on CPU/gloo:

* torch's ``nn.SyncBatchNorm`` refuses CPU tensors: the reference normalizes over the gathered
  global batch with ``F.batch_norm`` (:class:`_GatheredBatchNorm`), which is what SyncBatchNorm
  computes;
* ZeRO stage 2 has no torch counterpart: the reference is torch's ZeroRedundancyOptimizer
  (stage 1; same arithmetic as an unsharded AdamW).
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fusedist.testing import run_distributed

VOCAB, DIM, HIDDEN, CLASSES = 40, 16, 32, 5
GLOBAL_MICRO = 12         # samples per micro-batch over all ranks (1, 2 or 3 of them)
MICRO_STEPS = 2           # micro-batches accumulated per optimizer step
STEPS, RESUME_AT = 6, 3
INF_STEP = 1              # the step whose loss is inf on rank 1 only
DATASET = 160


# ----------------------------------------------------------------------------- the model
class Net(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        # The norm sits on the embedding's fp32 output: under bf16 autocast both sides then
        # normalize fp32 values, and the bf16 matmuls come after it.
        return self.fc2(self.drop(F.relu(self.fc1(self.norm(self.emb(x))))))


class _GatherRows(torch.autograd.Function):
    """Every rank's rows, concatenated; backward sums the global-batch gradient over the ranks
    (each rank's loss reaches every rank's rows through the statistics) and keeps this
    rank's rows -- what SyncBatchNorm's backward all-reduce amounts to."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.rows = x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        rank = dist.get_rank()
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows]


class _GatheredBatchNorm(nn.BatchNorm1d):
    """torch's SyncBatchNorm arithmetic on CPU: batch norm over the gathered global batch."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        full = _GatherRows.apply(x)
        out = F.batch_norm(full, self.running_mean, self.running_var, self.weight, self.bias, True,
                           self.momentum, self.eps)
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        rank = dist.get_rank()
        return out[rank * x.shape[0]:(rank + 1) * x.shape[0]]


def _reference_sync_bn(model: nn.Module) -> nn.Module:
    bn = model.norm
    ref = _GatheredBatchNorm(bn.num_features, bn.eps, bn.momentum)
    ref.load_state_dict(bn.state_dict())
    model.norm = ref
    return model


def _dataset():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (DATASET,), generator=g)
    return x, (x * 3 + torch.randint(0, 2, (DATASET,), generator=g)) % CLASSES


def _groups(module: nn.Module, weight_decay: float = 0.1) -> list:
    """The usual recipe: decay matrices, not biases and norm weights."""
    decay = [p for _, p in module.named_parameters() if p.dim() >= 2]
    rest = [p for _, p in module.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


# ----------------------------------------------------------------------------- one side
def _build(side: str, cfg: dict, world: int):
    """(model to call, bare module, optimizer, scaler, scheduler, clip) for ``side``."""
    import fusedist

    torch.manual_seed(0)
    bare = Net(cfg.get("dropout", 0.0))
    ours = side == "fusedist"
    if cfg.get("sync_bn"):
        bare = fusedist.nn.SyncBatchNorm.convert_sync_batchnorm(bare) if ours else _reference_sync_bn(bare)
    ddp_cls = fusedist.DistributedDataParallel if ours else nn.parallel.DistributedDataParallel
    compile_how = cfg.get("compile")
    inner = torch.compile(bare, backend="aot_eager") if compile_how == "inner" else bare
    model = ddp_cls(inner)
    if compile_how == "outer":
        model = torch.compile(model, backend="aot_eager")
    lr = cfg.get("lr", 0.02)
    stage = cfg.get("zero")
    if stage and ours:
        inner_cls = fusedist.optim.FusedAdamW if cfg.get("fused") else torch.optim.AdamW
        opt = fusedist.ZeroRedundancyOptimizer(_groups(bare), inner_cls, stage=stage, lr=lr)
    elif stage:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # betas given: torch's param_groups hold only the keywords passed, and OneCycleLR
        # refuses groups without betas to cycle (fusedist's hold the inner optimizer's defaults).
        opt = ZeroRedundancyOptimizer(_groups(bare), torch.optim.AdamW, lr=lr, betas=(0.9, 0.999))
    elif ours and cfg.get("fused"):
        opt = fusedist.optim.FusedAdamW(_groups(bare), lr=lr)
    else:
        opt = torch.optim.AdamW(_groups(bare), lr=lr)
    if cfg.get("sched") == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=STEPS + 2)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler_cls = fusedist.amp.GradScaler if ours else torch.amp.GradScaler
    scaler = scaler_cls("cpu", init_scale=2.0 ** 10, growth_interval=2)
    if not ours:
        clip = lambda: nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
    elif stage == 2:
        clip = lambda: opt.clip_grad_norm_(1.0)  # noqa: E731
    else:
        clip = lambda: fusedist.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
    return model, bare, opt, scaler, sched, clip


def _sampler(side: str, rank: int, world: int):
    from torch.utils.data import DistributedSampler

    from fusedist.checkpoint import ElasticDistributedSampler

    cls = ElasticDistributedSampler if side == "fusedist" else DistributedSampler
    return cls(range(DATASET), num_replicas=world, rank=rank, shuffle=True, seed=3)


def _train_steps(rank, world, side, cfg, model, opt, scaler, sched, clip, sampler, start, stop, log,
                 after_step=None):
    """Steps ``start`` .. ``stop - 1`` of the recipe; appends losses and norms to ``log``."""
    xs, ys = _dataset()
    local = GLOBAL_MICRO // world
    order = iter(list(sampler))
    for step in range(start, stop):
        for micro in range(MICRO_STEPS):
            idx = torch.tensor([next(order) for _ in range(local)])
            sync = contextlib.nullcontext() if micro == MICRO_STEPS - 1 else model.no_sync()
            if step == 0 and micro == 0:
                # Each rank its own dropout masks, the same on both sides; a resumed run
                # continues the generator its checkpoint saved.
                torch.manual_seed(100 + rank)
            with sync:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.get("bf16", True)):
                    # Summed over the samples: gradient norms of 2-4, so the clip at 1.0 bites.
                    # Scaled by world / 2 so the averaged gradients, and so the whole run, are
                    # the same at world size 1 (a resume at another world size).
                    loss = F.cross_entropy(model(xs[idx]), ys[idx], reduction="sum") * world / (2 * MICRO_STEPS)
                if step == INF_STEP and rank == 1 and micro == MICRO_STEPS - 1:
                    loss = loss * math.inf
                scaler.scale(loss).backward()
            log["loss"].append(loss.item())
            if hasattr(sampler, "advance"):
                sampler.advance(local)
        scaler.unscale_(opt)
        log["norm"].append(float(clip()))
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
        log["scale"].append(scaler.get_scale())
        log["eval"].append(_evaluate(model, xs))
        log["lr"].append([g["lr"] for g in opt.param_groups])
        if after_step is not None:
            after_step(step + 1)


def _evaluate(model, xs) -> float:
    """An evaluation forward between steps, as a script's validation does: every rank, running
    statistics (rank 0's, broadcast by the training forward before it, Note [when buffers are
    broadcast])."""
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(xs[:6]).float().sum().item()
    model.train()
    return out


def _full_opt_state(opt) -> dict:
    """The whole optimizer state on rank 0 (consolidated for ZeRO), as {param index: {key: t}}."""
    if hasattr(opt, "consolidate_state_dict"):
        opt.consolidate_state_dict(to=0)
        if dist.get_rank() != 0:
            return {}
    sd = opt.state_dict()
    return {i: {k: (v.float() if torch.is_tensor(v) else float(v)) for k, v in s.items()}
            for i, s in sd["state"].items()}


def _result(bare, opt, scaler, sched, log) -> dict:
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()
    sd = bare.state_dict()
    weights = {k.replace("_orig_mod.", ""): v.detach().clone() for k, v in sd.items()}
    return dict(log, weights=weights, opt=_full_opt_state(opt), scaler=scaler.state_dict(), rng=torch.get_rng_state(),
                sched={k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"})


def _side_by_side_worker(rank, world, cfg):
    out = {}
    for side in ("torch", "fusedist"):
        model, bare, opt, scaler, sched, clip = _build(side, cfg, world)
        log = {"loss": [], "norm": [], "scale": [], "lr": [], "eval": []}
        _train_steps(rank, world, side, cfg, model, opt, scaler, sched, clip, _sampler(side, rank, world),
                     0, STEPS, log)
        out[side] = _result(bare, opt, scaler, sched, log)
    return out


def _compiled_sync_bn_worker(rank, world):
    """fusedist's SyncBatchNorm inside a compiled module, against the same module eager."""
    import fusedist

    out = []
    for compiled in (False, True):
        torch.manual_seed(0)
        net = fusedist.nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)))
        model = torch.compile(net, backend="aot_eager") if compiled else net
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
        model(x).square().sum().backward()
        net.eval()
        with torch.no_grad():
            evaluated = model(x)
        out.append(([t.detach().clone() for t in (*net.parameters(), *(p.grad for p in net.parameters()),
                                                   *net.buffers())], evaluated))
    (trained, evaluated), (compiled_trained, compiled_evaluated) = out
    # training synchronizes eagerly: bit for bit; a compiled eval is torch's batch_norm in the
    # graph (as torch.nn.SyncBatchNorm's), fp32 within a few ulps of the eager kernel
    return (all(torch.equal(a, b) for a, b in zip(trained, compiled_trained))
            and torch.allclose(evaluated, compiled_evaluated, rtol=1e-6, atol=1e-6))


def test_sync_batch_norm_in_a_compiled_module_synchronizes_as_eager(shared_launch):
    """The layer runs outside the compiled graph (Note [SyncBatchNorm under torch.compile]):
    dynamo used to trace into the communicator and fail on every rank at the first training
    forward, and into the kernel launch of an eval forward under the Triton interpreter (where it
    does not synchronize, a compiled forward is torch's, in the graph)."""
    assert _outcome(shared_launch, "compiled SyncBN") == [True, True]


def _compiled_wrapper_frames_worker(rank, world):
    """Frames dynamo compiled after 2 and after 6 steps of a compiled fusedist DDP wrapper whose
    forward broadcasts BatchNorm buffers."""
    import fusedist
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model = torch.compile(fusedist.DistributedDataParallel(net), backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    frames = []
    for step in range(6):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step in (1, 5):
            frames.append(counters["frames"]["total"])
    return frames


def test_compiled_wrapper_compiles_once_not_every_step(shared_launch):
    """The wrapper's pre-forward bookkeeping runs outside the graph (Note [bookkeeping outside
    compiled graphs]): dynamo used to trace into the communicator's buffer broadcast and
    recompile its frames at every step (guards on the collective's tag and sequence number)
    until its recompile limit -- 38 frames in 6 steps, against 2."""
    for early, late in _outcome(shared_launch, "compiled wrapper frames"):
        assert late == early, (early, late)


# ----------------------------------------------------------------------------- comparisons
def _close(a, b, tol: float) -> bool:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return False
    same_nonfinite = torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
    fin = a.isfinite() & b.isfinite()
    return same_nonfinite and bool(torch.equal(a[~fin].nan_to_num(), b[~fin].nan_to_num())) and (
        not fin.any() or (a[fin] - b[fin]).abs().max().item() <= tol)


def _compare(ours: dict, ref: dict, tol: float, what: str, opt_keys=("exp_avg", "exp_avg_sq", "step")) -> None:
    for key in ("loss", "norm", "scale", "lr", "eval"):
        assert _close(ours[key], ref[key], tol), f"{what}: {key} differ:\n ours  {ours[key]}\n torch {ref[key]}"
    for name, ref_t in ref["weights"].items():
        assert _close(ours["weights"][name], ref_t, tol), (
            f"{what}: {name} differs by {(ours['weights'][name].double() - ref_t.double()).abs().max()}")
    assert ours["opt"].keys() == ref["opt"].keys(), what
    for i, state in ref["opt"].items():
        for k in opt_keys:
            assert _close(ours["opt"][i][k], state[k], tol), f"{what}: optimizer state {i}.{k} differs"
    for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
        assert ours["scaler"][k] == ref["scaler"][k], f"{what}: scaler {k}: {ours['scaler']} vs {ref['scaler']}"
    assert ours["sched"]["last_epoch"] == ref["sched"]["last_epoch"], what
    if "rng" in ref:
        assert torch.equal(ours["rng"], ref["rng"]), f"{what}: the generator's states differ"
    assert _close(ours["sched"]["_last_lr"], ref["sched"]["_last_lr"], 1e-12), what


# Bit for bit where the arithmetic is the same (torch's AdamW and BatchNorm on both sides; losses
# are bit for bit in every case). Elsewhere the arithmetic differs in order, not in substance,
# by an ulp or so: FusedAdamW's C++ CPU Adam and its global norm taken in the unscale pass;
# ZeRO's norm summed from its shards (a parameter cut between ranks is summed in two pieces),
# which reaches every update through the clip: 1e-5 on values of order 1. SyncBatchNorm's
# Welford statistics and fused backward against the reference's two-pass F.batch_norm differ
# by an ulp too (1.2e-7 in fp32), but the bf16 matmul after the norm rounds a few of its
# outputs to the neighbouring bf16 value (2^-8 apart), which moves those AdamW updates by up to
# 0.2% of a step: 3e-5 measured, 1e-4 allowed. A missed scale, clip or skipped step changes
# weights by 1e-3 or more.
CASES = {
    "ddp(compile(model)), SyncBN": (dict(compile="inner", sync_bn=True, dropout=0.25), 1e-4),
    "compile(ddp(model)), SyncBN": (dict(compile="outer", sync_bn=True, dropout=0.25), 1e-4),
    "ddp, FusedAdamW, BatchNorm": (dict(fused=True, dropout=0.25), 1e-5),
    "zero1, AdamW, OneCycleLR": (dict(zero=1, sched="onecycle", dropout=0.25), 1e-5),
    "zero2, AdamW, LambdaLR": (dict(zero=2, dropout=0.25), 1e-5),
    "zero1, FusedAdamW, ddp(compile(model))": (dict(zero=1, fused=True, compile="inner", dropout=0.25), 1e-5),
    "zero2, FusedAdamW, OneCycleLR, SyncBN": (dict(zero=2, fused=True, sched="onecycle", sync_bn=True), 1e-4),
}


# One launch of 2 ranks runs the side-by-side work of the recipe cases and of the compile checks
# above that pytest runs, and the uninterrupted runs the resume tests below continue (a shorter
# suite: each launch costs a process group, and dynamo's first compile in a process costs more
# than the next), each job after torch._dynamo.reset().
_FOCUSED = {"compiled SyncBN": ("test_sync_batch_norm_in_a_compiled_module_synchronizes_as_eager",
                                _compiled_sync_bn_worker),
            "compiled wrapper frames": ("test_compiled_wrapper_compiles_once_not_every_step",
                                        _compiled_wrapper_frames_worker)}


_UNINTERRUPTED = "uninterrupted runs"
_RESUME_TESTS = ("test_resume_in_fresh_processes_continues_the_uninterrupted_run",
                 "test_resume_at_another_world_size_reshards_zero_and_the_sampler")


def _jobs_worker(rank, world, jobs, runs):
    """Each job in turn (a recipe case, a focused check, or the uninterrupted ``runs``), dynamo's
    caches reset before each; a job that raises gives its traceback, and the next one runs."""
    import traceback

    out = {}
    for job in jobs:
        torch._dynamo.reset()
        try:
            if job in CASES:
                out[job] = _side_by_side_worker(rank, world, CASES[job][0])
            elif job == _UNINTERRUPTED:
                out[job] = _uninterrupted_runs_worker(rank, world, runs)
            else:
                out[job] = _FOCUSED[job][1](rank, world)
        except Exception:  # noqa: BLE001 - reported by the job's test
            out[job] = traceback.format_exc()
    return out


def _job_of(item):
    """The shared launch's job of a collected test of this file, or None."""
    if getattr(item, "originalname", None) == "test_recipe_matches_torch":
        return item.callspec.params["case"]
    if item.name in _RESUME_TESTS:
        return _UNINTERRUPTED
    return next((job for job, (test, _) in _FOCUSED.items() if item.name == test), None)


@pytest.fixture(scope="module")
def shared_launch(request, tmp_path_factory):
    """{job: per-rank results} for the jobs of the tests of this file that pytest runs, and
    {"resume" / "elastic": (periodic checkpoints, saved step RESUME_AT, config)} of the
    uninterrupted runs under ``"runs"``."""
    jobs = [_job_of(item) for item in request.session.items if item.module is request.module]
    jobs = list(dict.fromkeys(job for job in jobs if job is not None))
    runs = {}
    for name, cfg in (("resume", RESUME_CFG), ("elastic", ELASTIC_CFG)):
        root = tmp_path_factory.mktemp(name)
        runs[name] = (str(root / "periodic"), str(root / "saved"), cfg)
    per_rank = run_distributed(_jobs_worker, 2, jobs, list(runs.values()), timeout=900)
    return dict({job: [results[job] for results in per_rank] for job in jobs}, runs=runs)


def _outcome(shared: dict, job: str) -> list:
    """The per-rank results of ``job``; a rank that raised fails the test with its traceback."""
    for rank, res in enumerate(shared[job]):
        assert not isinstance(res, str), f"{job}, rank {rank} raised:\n{res}"
    return shared[job]


@pytest.mark.parametrize("case", list(CASES))
def test_recipe_matches_torch(case, shared_launch):
    cfg, tol = CASES[case]
    for rank, res in enumerate(_outcome(shared_launch, case)):
        assert math.isinf(res["torch"]["loss"][2 * INF_STEP + 1]) == (rank == 1)
        assert res["torch"]["scale"][INF_STEP] == res["torch"]["scale"][INF_STEP - 1] / 2  # backed off
        _compare(res["fusedist"], res["torch"], tol, f"{case}, rank {rank}")


# ----------------------------------------------------------------------------- checkpoint, resume
# In fp32: across world sizes the bf16 matmuls round partial sums over other row counts, and
# AdamW turns that into whole steps on near-zero gradients (0.04 on an embedding row at world
# size 3); in fp32 the resharded continuation agrees to 2.4e-7. bf16 is checked above.
# Not compiled: a graph dynamo compiles in the resumed process (at step K) is not the one the
# uninterrupted run compiled at step 0 and reuses, and under bf16 autocast their gradients
# differ by a few ulps -- torch's own DDP run changes the same way, to the bit, after
# torch._dynamo.reset() at that step.
RESUME_CFG = dict(zero=2, fused=True, sched="onecycle", sync_bn=True, bf16=False, dropout=0.25)
# No dropout across world sizes: each rank's masks come from its own generator.
ELASTIC_CFG = dict(RESUME_CFG, dropout=0.0)


def _resumable_sampler(rank: int, world: int):
    from fusedist.checkpoint.resume import ResumableDistributedSampler

    return ResumableDistributedSampler(range(DATASET), num_replicas=world, rank=rank, shuffle=True, seed=3)


def _uninterrupted_worker(rank, world, ckpt_dir, save_dir, cfg):
    """STEPS steps; the periodic Checkpointer (asynchronous) saves every RESUME_AT steps, and
    fusedist.checkpoint.save writes step RESUME_AT with the scheduler in ``extra`` and, per
    rank, the RNG states and a ResumableDistributedSampler's position (it yields the same
    indices as the ElasticDistributedSampler the loop reads)."""
    import fusedist
    from fusedist.checkpoint import resume

    model, bare, opt, scaler, sched, clip = _build("fusedist", cfg, world)
    sampler, shadow = _sampler("fusedist", rank, world), _resumable_sampler(rank, world)
    ckpt = fusedist.checkpoint.Checkpointer(ckpt_dir, every_steps=RESUME_AT, keep=None)
    assert ckpt.restore(model, opt, scaler, lr_scheduler=sched, sampler=sampler) == 0

    def after_step(done):
        shadow.advance(MICRO_STEPS * GLOBAL_MICRO // world)
        ckpt.maybe_save(done)
        if done == RESUME_AT:
            fusedist.checkpoint.save(save_dir, model, opt, scaler, extra={"sched": sched.state_dict()},
                                     per_rank=resume.resume_state(shadow))

    log = {"loss": [], "norm": [], "scale": [], "lr": [], "eval": []}
    _train_steps(rank, world, "fusedist", cfg, model, opt, scaler, sched, clip, sampler, 0, STEPS, log,
                 after_step)
    ckpt.close()
    return _result(bare, opt, scaler, sched, log)


def _resumed_worker(rank, world, how, directory, cfg):
    """A fresh process: restore step RESUME_AT (``how``: the Checkpointer, or checkpoint.load with
    the scheduler, sampler and RNG states put back by hand) and train to STEPS."""
    import fusedist
    from fusedist.checkpoint import resume

    model, bare, opt, scaler, sched, clip = _build("fusedist", cfg, world)
    sampler = _sampler("fusedist", rank, world) if how == "checkpointer" else _resumable_sampler(rank, world)
    if how == "checkpointer":
        ckpt = fusedist.checkpoint.Checkpointer(directory, every_steps=None)
        start = ckpt.restore(model, opt, scaler, lr_scheduler=sched, sampler=sampler, step=RESUME_AT)
        ckpt.close()
    else:
        extra = fusedist.checkpoint.load(directory, model, opt, scaler)
        sched.load_state_dict(extra["sched"])
        assert resume.restore(fusedist.checkpoint.load_per_rank(directory), sampler)
        start = RESUME_AT
    assert start == RESUME_AT
    log = {"loss": [], "norm": [], "scale": [], "lr": [], "eval": []}
    _train_steps(rank, world, "fusedist", cfg, model, opt, scaler, sched, clip, sampler, start, STEPS, log)
    return _result(bare, opt, scaler, sched, log)


def _resumed_runs_worker(rank, world, hows, cfg):
    """:func:`_resumed_worker` for each ``(how, directory)`` in turn, in the same processes (one
    launch: a shorter suite); each restores all it uses, generators included, from its checkpoint."""
    return [_resumed_worker(rank, world, how, directory, cfg) for how, directory in hows]


def _tail(run: dict) -> dict:
    """The uninterrupted run as a resumed one logs it: the steps from RESUME_AT on."""
    micro = RESUME_AT * MICRO_STEPS
    return dict(run, loss=run["loss"][micro:], **{k: run[k][RESUME_AT:] for k in ("norm", "scale", "lr", "eval")})


def _uninterrupted_runs_worker(rank, world, runs):
    """:func:`_uninterrupted_worker` for each ``(ckpt_dir, save_dir, cfg)`` in turn, in the same
    processes (one launch: a shorter suite); each run builds and seeds what it uses."""
    return [_uninterrupted_worker(rank, world, *run) for run in runs]


@pytest.fixture(scope="module")
def uninterrupted(shared_launch):
    """{"resume" / "elastic": (per-rank results, periodic checkpoints, saved step RESUME_AT)} of
    the uninterrupted runs of RESUME_CFG and ELASTIC_CFG at world size 2 (in the shared launch:
    the resumes below start fresh processes of their own)."""
    per_rank, runs = _outcome(shared_launch, _UNINTERRUPTED), shared_launch["runs"]
    return {name: ([results[i] for results in per_rank], *runs[name][:2]) for i, name in enumerate(runs)}


#: {test: the resumed launches it reads}; ``resumed_launches`` starts the selected tests' at once
_RESUMED_LAUNCHES = {
    "test_resume_in_fresh_processes_continues_the_uninterrupted_run": ("same world size",),
    "test_resume_at_another_world_size_reshards_zero_and_the_sampler": ("world size 1", "world size 3"),
}


@pytest.fixture(scope="module")
def resumed_launches(request, uninterrupted):
    """{launch: future of its per-rank results} of the selected tests' resumes, all started at once
    on their own threads: the world-size-1 launch leaves a core idle and each launch waits on its
    ranks' start and rendezvous, which then overlap instead of adding up. Each is fresh processes
    of its own, started from the uninterrupted runs' checkpoints."""
    wanted = {getattr(item, "originalname", item.name) for item in request.session.items
              if item.module is request.module}
    names = [name for test, launches in _RESUMED_LAUNCHES.items() if test in wanted for name in launches]
    _, resume_ckpt, resume_save = uninterrupted["resume"]
    elastic_ckpt = uninterrupted["elastic"][1]
    calls = {"same world size": (_resumed_runs_worker, 2, (("checkpointer", resume_ckpt), ("load", resume_save)),
                                 RESUME_CFG),
             **{f"world size {world}": (_resumed_worker, world, "checkpointer", elastic_ckpt, ELASTIC_CFG)
                for world in (1, 3)}}
    with ThreadPoolExecutor(max(len(names), 1)) as pool:
        # (300 s: the launches share the cores; only a hang comes near it)
        yield {name: pool.submit(run_distributed, *calls[name], timeout=300) for name in names}


def test_resume_in_fresh_processes_continues_the_uninterrupted_run(uninterrupted, resumed_launches):
    """Same world size, bit for bit (dropout masks from the restored generators included),
    through the periodic Checkpointer's asynchronous save and through checkpoint.save/load
    with a ResumableDistributedSampler."""
    full = uninterrupted["resume"][0]
    assert math.isinf(full[1]["loss"][2 * INF_STEP + 1])
    per_rank = resumed_launches["same world size"].result()
    for i, how in enumerate(("checkpointer", "load")):
        for rank in range(2):
            _compare(per_rank[rank][i], _tail(full[rank]), 0.0, f"resumed with {how}, rank {rank}")


def test_resume_at_another_world_size_reshards_zero_and_the_sampler(uninterrupted, resumed_launches):
    """World sizes 1 and 3 from a checkpoint of 2: ZeRO's state resharded and the
    ElasticDistributedSampler's position re-split (the same global batches); gradient sums over
    12 or 4 rows per rank instead of 6, so 1e-5. The generators belong to the old ranks and are
    left as the script seeded them (README), so they are not compared."""
    full = uninterrupted["elastic"][0]
    for world in (1, 3):
        elastic = resumed_launches[f"world size {world}"].result()
        expected = _tail(full[0])
        expected.pop("rng")
        # Each rank's loss weighs its samples by world / 2, so the mean over the ranks (what
        # the averaged gradients descend) is the same at every world size.
        expected["loss"] = [(a + b) / 2 for a, b in zip(expected["loss"], _tail(full[1])["loss"])]
        mean = [sum(r["loss"][i] for r in elastic) / world for i in range(len(expected["loss"]))]
        for rank, res in enumerate(elastic):
            ours = dict(res, loss=mean)  # the consolidated optimizer state is on rank 0 only
            _compare(ours, dict(expected, opt=expected["opt"] if rank == 0 else {}), 1e-5,
                     f"resumed at world size {world}, rank {rank}")
