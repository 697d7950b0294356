"""Train a small GPT-style character model with fusedist, on CPU (gloo) or GPUs (NCCL).

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py            # CPU, 2 ranks
    torchrun --standalone --nproc_per_node=8 examples/train_gpt.py --steps 2000 --dim 512

Everything fusedist offers is switchable, so the same script shows each piece at work:
DistributedDataParallel, the fused AdamW with FP32 master weights, the fused GradScaler,
ZeRO stage 1/2 (``--zero 1|2``) and ZeRO-3 (``--zero 3``: ``fusedist.fully_shard`` on every
block and the root instead of DistributedDataParallel, the FSDP2 way).

A job that survives failures: checkpoints every N steps (asynchronous), and after a restart
by ``torchrun --max-restarts`` (or a relaunch at another rank count) it resumes from the
latest complete one by itself:

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 examples/train_gpt.py \
        --checkpoint-dir ckpt --checkpoint-every 50
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import math
import statistics
import sys
import time

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fusedist  # noqa: E402
from gpt import GPT, CharDataset, CharWindows, generate_corpus  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from fusedist.checkpoint import Checkpointer, ElasticDistributedSampler  # noqa: E402
from fusedist.checkpoint.resume import resume_state, restore_rng_state  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, help="peak learning rate (default 3e-3); with --resume or "
                   "--checkpoint-dir, given explicitly, it replaces the LR saved with the checkpoint")
    p.add_argument("--optimizer", choices=["fused", "torch"], default="fused",
                   help="fusedist.optim.FusedAdamW (default) or torch.optim.AdamW")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=2,
                   help="ZeRO stage (0: off; 3: fusedist.fully_shard per block, no DistributedDataParallel)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="auto (default): bf16 where the device computes it fast (probed), fp16 on GPUs "
                        "without bf16, else fp32. bf16/fp16: low-precision weights with FP32 master weights "
                        "in the optimizer (fp16 adds the fused GradScaler)")
    p.add_argument("--plot", metavar="PNG", help="write loss, tokens/s and exposed communication per step "
                                                 "(needs matplotlib)")
    p.add_argument("--save", metavar="DIR", help="write a fusedist checkpoint here at the end")
    p.add_argument("--resume", metavar="DIR", help="load a fusedist checkpoint (any world size) first")
    p.add_argument("--bucket-cap-mb", type=float, help="DistributedDataParallel's gradient buckets (default 1 MiB)")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="ZeRO: let step() return before the parameter all-gathers land (the next forward waits)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                   help="cosine: linear warmup over 10%% of --steps, then cosine decay to 10%% of --lr; a run "
                        "resumed by --resume continues the schedule saved with the checkpoint (past its end: 10%% "
                        "of --lr), one resumed from --checkpoint-dir spans --steps, the job's total")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save step-numbered checkpoints here and resume from the latest complete one "
                        "(--steps is then the run's total step count)")
    p.add_argument("--checkpoint-every", type=int, metavar="N", help="steps between checkpoints (default 100)")
    p.add_argument("--checkpoint-keep", type=int, metavar="K", help="complete checkpoints kept (default 3)")
    p.add_argument("--sync-checkpoint", action="store_true", help="save in the training thread (default: async)")
    p.add_argument("--fail-at-step", type=int, metavar="K",
                   help="testing: rank 1 exits hard after step K, once (a marker file in --checkpoint-dir "
                        "keeps it from failing again after the restart)")
    args = p.parse_args(argv)
    if args.fail_at_step is not None and not args.checkpoint_dir:
        p.error("--fail-at-step needs --checkpoint-dir (its marker file lives there)")
    # Options that cannot apply are refused, not ignored (their defaults are filled in after).
    stray = [f"--{n.replace('_', '-')}" for n in ("checkpoint_every", "checkpoint_keep", "sync_checkpoint")
             if getattr(args, n) not in (None, False)]
    if stray and not args.checkpoint_dir:
        p.error(f"{', '.join(stray)}: only with --checkpoint-dir (nothing else saves periodically)")
    if args.bucket_cap_mb is not None and args.zero == 3:
        p.error("--bucket-cap-mb sizes DistributedDataParallel's buckets: --zero 3 has none (use --zero 0, 1 or 2)")
    args.lr_given = args.lr is not None
    for name, default in (("checkpoint_every", 100), ("checkpoint_keep", 3), ("bucket_cap_mb", 1.0), ("lr", 3e-3)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    # Refused here, before any rank starts: otherwise a negative --steps saved a checkpoint
    # labelled with a step behind its weights, --resume was ignored next to --checkpoint-dir,
    # sizes failed deep inside the model, and --plot failed only after the whole run.
    for name in ("steps", "layers", "batch", "context", "dim", "heads", "checkpoint_every", "checkpoint_keep"):
        least = 0 if name in ("steps", "layers") else 1
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    for name in ("lr", "bucket_cap_mb"):  # (NaN fails the comparison too)
        if not 0 <= getattr(args, name) < math.inf:
            p.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {getattr(args, name)}")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if args.resume and args.checkpoint_dir:
        p.error("--resume and --checkpoint-dir are two ways to resume: pass one (--checkpoint-dir resumes from "
                "its latest complete checkpoint)")
    if args.overlap_param_gather and args.zero not in (1, 2):
        p.error("--overlap-param-gather applies to --zero 1 or 2")
    if args.optimizer == "torch" and args.zero == 0 and args.precision in ("bf16", "fp16"):
        p.error(f"--precision {args.precision} needs FP32 master weights: use --optimizer fused, --zero 1/2/3 "
                "or --precision fp32")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib (pip install matplotlib)")
    return args


class Progress:
    """A one-line progress bar on a terminal, periodic lines otherwise (logs, CI)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.tty = sys.stdout.isatty()
        self.every = max(total // 10, 1)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        done = int(30 * step / self.total)
        bar = f"[{'#' * done}{'.' * (30 - done)}]"
        line = f"{bar} step {step:>5}/{self.total}  loss {loss:6.3f}  {tokens_per_s:9.0f} tok/s"
        if self.tty:
            print("\r" + line, end="", flush=True)
            if step == self.total:
                print()
        elif step % self.every == 0 or step == self.total:
            print(line, flush=True)


def build_optimizer(args, model, ddp):
    params = model.parameters()
    kwargs = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    if args.zero == 3:  # the sharded parameters are FP32 (mp_policy computes in low precision)
        if args.optimizer == "fused":
            return fusedist.optim.FusedAdamW(params, **kwargs)
        return torch.optim.AdamW(params, **kwargs)
    if args.zero:  # ZeRO keeps FP32 masters itself: its inner optimizer steps FP32 shards (any class)
        inner = fusedist.optim.FusedAdamW if args.optimizer == "fused" else torch.optim.AdamW
        return fusedist.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=inner, stage=args.zero,
                                                overlap_param_gather=args.overlap_param_gather, **kwargs)
    if args.optimizer == "fused":
        return fusedist.optim.FusedAdamW(params, master_weights=args.low_precision, **kwargs)
    if args.low_precision:
        raise SystemExit(f"--precision {args.precision} needs FP32 master weights: use --optimizer fused "
                         "(or --precision fp32)")
    return torch.optim.AdamW(params, **kwargs)


class WarmupCosine:
    """--lr-schedule cosine: the LR factor at a step, over a run of ``steps`` steps.

    An object, not a function, so that the scheduler's state_dict carries ``steps`` and
    ``warmup`` and a run resumed by ``--resume`` continues the schedule it saved: there
    ``--steps`` counts the steps still to train, and a schedule rebuilt from it took the
    saved step index into another schedule -- the LR jumped at the resume and the decay
    depended on how the training was split into runs. (With ``--checkpoint-dir``, ``--steps``
    is the job's total, and the schedule spans it.)
    """

    def __init__(self, steps: int):
        self.steps = steps
        self.warmup = max(1, steps // 10)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def lr_schedule(args, opt):
    if args.lr_schedule == "constant":
        return None
    return torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(args.steps))


def replace_saved_lr(lr: float, opt, sched, announce: bool) -> None:
    """An explicit --lr wins over the checkpoint's: the optimizer's load_state_dict restores
    the LR it saved (torch's rule), and a resumed run ignored the --lr it was given. With a
    schedule the base LR is replaced and the schedule's factor at the restored step kept."""
    factor = 1.0 if sched is None else sched.lr_lambdas[0](sched.last_epoch)
    saved = opt.param_groups[0].get("initial_lr", opt.param_groups[0]["lr"])
    for group in opt.param_groups:
        group["lr"] = lr * factor
        if sched is not None:
            group["initial_lr"] = lr
    if sched is not None:
        sched.base_lrs = [lr for _ in sched.base_lrs]
    if announce and saved != lr:
        print(f"lr: --lr {lr:g} replaces the checkpoint's {saved:g}", flush=True)


def fail_once(args, rank: int, step: int) -> None:
    """--fail-at-step: rank 1 dies as a bad host would (no cleanup, no exception)."""
    if args.fail_at_step != step or rank != 1:
        return
    marker = os.path.join(args.checkpoint_dir, f"failed-at-step-{step}")
    if os.path.exists(marker):
        return
    with open(marker, "w") as f:
        f.write("rank 1 exited here once (--fail-at-step)\n")
    print(f"rank 1: failing at step {step} (--fail-at-step)", flush=True)
    os._exit(1)


def parameter_digest(state: dict) -> str:
    digest = hashlib.sha256()
    for name, t in sorted(state.items()):
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def main(argv=None):
    args = parse_args(argv)
    info = fusedist.init_distributed()
    rank, world = info.rank, info.world_size
    device = info.device
    precision = fusedist.amp.choose_precision(device, choice=None if args.precision == "auto" else args.precision)
    args.low_precision = precision.name != "fp32"
    torch.manual_seed(args.seed)
    data = CharDataset(generate_corpus())
    model = GPT(data.vocab_size, args.dim, args.layers, args.heads, args.context).to(device)
    n_params = sum(p.numel() for p in model.parameters())  # (before sharding: the whole model)
    if args.zero == 3:
        # ZeRO-3: parameters stored (and stepped) in FP32, gathered and computed in the chosen
        # precision, gradients reduced in FP32. The model itself is what gets called.
        mp = fusedist.MixedPrecisionPolicy(param_dtype=precision.dtype if args.low_precision else None,
                                           reduce_dtype=torch.float32)
        for block in model.blocks:
            fusedist.fully_shard(block, mp_policy=mp)
        ddp = fusedist.fully_shard(model, mp_policy=mp)
    else:
        model = model.to(precision.dtype)
        ddp = fusedist.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb, first_bucket_cap_mb=0.25)
    opt = build_optimizer(args, model, ddp)
    scaler = fusedist.amp.GradScaler(device.type, init_scale=2.0**12) if precision.needs_scaler else None
    sched = lr_schedule(args, opt)
    # Epochs of non-overlapping windows split over the ranks; the sampler's position is saved
    # independently of the world size, so a resume at another rank count re-splits the epoch.
    windows = CharWindows(data.data, args.context)
    sampler = ElasticDistributedSampler(windows, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    if sampler.num_samples < args.batch:  # (every rank alike) an epoch of no batch: a bare StopIteration later
        raise SystemExit(f"--batch {args.batch} is more than a rank's share of an epoch: {len(windows)} windows of "
                         f"--context {args.context} over {world} rank(s) are {sampler.num_samples} per rank")
    # Its own generator: every iter() draws a seed from it, and a resumed run calls iter()
    # where the uninterrupted one did not (Note in fusedist/checkpoint/resume.py).
    loader = DataLoader(windows, batch_size=args.batch, sampler=sampler, drop_last=True, generator=torch.Generator())
    start_step, ckpt = 0, None
    if args.checkpoint_dir:
        ckpt = Checkpointer(args.checkpoint_dir, every_steps=args.checkpoint_every, keep=args.checkpoint_keep,
                            async_save=not args.sync_checkpoint)
        start_step = ckpt.restore(ddp, opt, scaler, lr_scheduler=sched, sampler=sampler)
        if sched is not None:  # --steps is the job's total here: the schedule spans it, whatever was saved
            sched.lr_lambdas[0] = WarmupCosine(args.steps)
        if start_step and rank == 0:
            moved = ckpt.restored_world_size != world
            where = (f" (saved at world size {ckpt.restored_world_size}, now {world}: optimizer resharded, data "
                     f"re-split at epoch {sampler.epoch}, sample {sampler.consumed} of {len(windows)})")
            print(f"resumed from step {start_step}" + (where if moved else ""), flush=True)
    elif args.resume:
        extra = fusedist.checkpoint.load(args.resume, ddp, opt, scaler)
        start_step = extra["step"]
        if extra.get("sampler") is not None:
            sampler.load_state_dict(extra["sampler"])
        if extra.get("lr_scheduler") is not None and sched is not None:
            sched.load_state_dict(extra["lr_scheduler"])
        mine = fusedist.checkpoint.load_per_rank(args.resume)
        if mine is not None:  # same world size: this rank's generators continue exactly
            restore_rng_state(mine["rng"])
    if args.lr_given and start_step:
        replace_saved_lr(args.lr, opt, sched, announce=rank == 0)
    end_step = args.steps if args.checkpoint_dir else start_step + args.steps
    batches = iter(loader)

    def next_batch():
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:
            sampler.set_epoch(sampler.epoch + 1)
            batches = iter(loader)
            return next(batches)
    if rank == 0:
        print(f"fusedist demo: GPT {n_params / 1e6:.2f}M params, {world} rank(s) on {device.type} ({info.backend}), "
              f"optimizer={type(opt).__name__}{' (ZeRO-%d)' % args.zero if args.zero else ''}, "
              f"{_describe(precision)} ({args.precision}: {precision.reason})", flush=True)
        _say_what_the_run_does(args, start_step, end_step, sched)

    progress = Progress(max(end_step - start_step, 1), rank == 0)
    losses, step_times, hidden = [], [], []
    tokens_per_step = args.batch * args.context * world
    for step in range(start_step + 1, end_step + 1):
        t0 = time.perf_counter()
        x, y = next_batch()
        x, y = x.to(device), y.to(device)
        logits = ddp(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if sched is not None:
            sched.step()
        sampler.advance(len(x))
        loss_value = loss.item()  # the one host sync per step, for the progress bar
        step_times.append(time.perf_counter() - t0)
        losses.append(loss_value)
        if args.zero != 3:
            hidden.append(ddp.comm_stats().get("hidden_fraction", 0.0))
        progress.update(step - start_step, loss_value, tokens_per_step / step_times[-1])
        if ckpt is not None:
            ckpt.maybe_save(step)
            fail_once(args, rank, step)

    if ckpt is not None:
        ckpt.close()  # the save in flight completes before the process group goes away
    if args.save:
        fusedist.checkpoint.save(args.save, ddp, opt, scaler, per_rank=resume_state(), extra={
            "step": end_step, "sampler": sampler.state_dict(),
            "lr_scheduler": sched.state_dict() if sched is not None else None})
        if rank == 0:
            print(f"checkpoint written to {args.save} (step {end_step})")
    if losses:
        last = torch.tensor([losses[-1]], dtype=torch.float64)
        torch.distributed.all_reduce(last)
        # (stage 3: every rank gathers the whole parameters, a collective)
        state = fusedist.fsdp.full_state_dict(model) if args.zero == 3 else model.state_dict()
        digest = parameter_digest(state) if rank == 0 else ""
        if rank == 0:
            print(f"final loss {last.item() / world:.6f}")
            print(f"final parameters sha256 {digest}")

    if rank == 0 and losses:
        warm = step_times[min(10, len(step_times) - 1):]
        k = min(10, len(losses))
        med = statistics.median(warm)
        print("\nsummary")
        print(f"  steps                 {len(losses)}  ({tokens_per_step * len(losses) / 1e6:.2f}M tokens)")
        print(f"  loss                  {statistics.mean(losses[:k]):.3f} -> {statistics.mean(losses[-k:]):.3f}"
              f"  (mean of first / last {k} steps)")
        print(f"  step time (median)    {med * 1e3:.1f} ms   ({tokens_per_step / med:,.0f} tokens/s)")
        if hidden:
            print(f"  comm hidden behind backward (median over steps): {100 * statistics.median(hidden):.0f}%"
                  f"  ({len(ddp.buckets)} buckets)")
        print(f"  precision             {_describe(precision)}  ({args.precision}: {precision.reason})")
        if scaler is not None:
            print(f"  loss scale            {scaler.get_scale():g}")
        if args.plot:
            plot(args.plot, range(start_step + 1, start_step + 1 + len(losses)), losses,
                 [tokens_per_step / t for t in step_times], [1.0 - h for h in hidden], _describe(precision))
            print(f"  plot                  {args.plot}")
    torch.distributed.destroy_process_group()


def _say_what_the_run_does(args, start_step: int, end_step: int, sched) -> None:
    """A run with no step to train said nothing about it: it printed its header and ended.
    And a resumed cosine schedule past its end trains at its floor: say so too."""
    if end_step <= start_step:
        why = ("--steps 0" if args.steps == 0 else f"the checkpoint is at step {start_step}, and with "
               f"--checkpoint-dir --steps {args.steps} is the total step count of the run")
        print(f"nothing to train: {why}", flush=True)
    elif sched is not None and sched.last_epoch >= sched.lr_lambdas[0].steps:  # (restored: the saved step)
        print(f"lr schedule: the cosine schedule saved with the checkpoint ended at step {sched.lr_lambdas[0].steps}; "
              f"steps {start_step + 1}-{end_step} train at its final LR (10% of --lr)", flush=True)


def _describe(precision) -> str:
    return {"fp32": "fp32", "bf16": "bf16 + FP32 master weights",
            "fp16": "fp16 + FP32 master weights + GradScaler"}[precision.name]


def plot(path: str, steps, losses, tokens_per_s, exposed, title: str) -> None:
    """Loss, throughput and the fraction of gradient communication not hidden behind backward."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(steps)
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    axes[0].plot(steps, losses)
    axes[0].set_ylabel("loss")
    axes[1].plot(steps, tokens_per_s)
    axes[1].set_ylabel("tokens/s")
    if exposed:  # (DDP's measure; none with --zero 3)
        axes[2].plot(steps, [100 * e for e in exposed])
    axes[2].set_ylabel("exposed comm %")
    axes[2].set_xlabel("step")
    fig.suptitle(f"fusedist demo: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
