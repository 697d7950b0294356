"""Train a small GPT-style character model with fusedist, on CPU (gloo) or GPUs (NCCL).

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py            # CPU, 2 ranks
    torchrun --standalone --nproc_per_node=8 examples/train_gpt.py --steps 2000 --dim 512

Everything fusedist offers is switchable, so the same script shows each piece at work:
DistributedDataParallel (always), the fused AdamW with FP32 master weights, the fused
GradScaler, and ZeRO stage 1/2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fusedist  # noqa: E402
from gpt import GPT, CharDataset, generate_corpus  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optimizer", choices=["fused", "torch"], default="fused",
                   help="fusedist.optim.FusedAdamW (default) or torch.optim.AdamW")
    p.add_argument("--zero", type=int, choices=[0, 1, 2], default=2, help="ZeRO stage (0: off)")
    p.add_argument("--precision", choices=["fp16", "fp32"], default="fp16",
                   help="fp16: fp16 weights, FP32 master weights in the optimizer, fused GradScaler")
    p.add_argument("--save", metavar="DIR", help="write a fusedist checkpoint here at the end")
    p.add_argument("--resume", metavar="DIR", help="load a fusedist checkpoint (any world size) first")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="ZeRO: let step() return before the parameter all-gathers land (the next forward waits)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.fp16 = args.precision == "fp16"
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
        line = f"[{'#' * done}{'.' * (30 - done)}] step {step:>5}/{self.total}  loss {loss:6.3f}  {tokens_per_s:9.0f} tok/s"
        if self.tty:
            print("\r" + line, end="", flush=True)
            if step == self.total:
                print()
        elif step % self.every == 0 or step == self.total:
            print(line, flush=True)


def build_optimizer(args, model, ddp):
    params = model.parameters()
    kwargs = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    if args.zero:
        inner = fusedist.optim.FusedAdamW if args.optimizer == "fused" else torch.optim.AdamW
        if args.fp16:
            kwargs["master_weights"] = True
        return fusedist.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=inner, stage=args.zero,
                                                overlap_param_gather=args.overlap_param_gather, **kwargs)
    if args.optimizer == "fused":
        return fusedist.optim.FusedAdamW(params, master_weights=args.fp16, **kwargs)
    if args.fp16:
        raise SystemExit("--precision fp16 needs FP32 master weights: use --optimizer fused")
    return torch.optim.AdamW(params, **kwargs)


def main(argv=None):
    args = parse_args(argv)
    info = fusedist.init_distributed()
    rank, world = info.rank, info.world_size
    device = info.device
    torch.manual_seed(args.seed)
    data = CharDataset(generate_corpus())
    model = GPT(data.vocab_size, args.dim, args.layers, args.heads, args.context).to(device)
    if args.fp16:
        model = model.half()
    ddp = fusedist.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb, first_bucket_cap_mb=0.25)
    opt = build_optimizer(args, model, ddp)
    scaler = fusedist.amp.GradScaler(device.type, init_scale=2.0**12) if args.fp16 else None
    gen = torch.Generator().manual_seed(1000 + rank)
    start_step = 0
    if args.resume:
        extra = fusedist.checkpoint.load(args.resume, ddp, opt, scaler)
        start_step = extra["step"]
        gen.set_state(extra["generators"][rank] if rank < len(extra["generators"]) else gen.get_state())
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"fusedist demo: GPT {n_params / 1e6:.2f}M params, {world} rank(s) on {device.type} ({info.backend}), "
              f"optimizer={type(opt).__name__}{' (ZeRO-%d)' % args.zero if args.zero else ''}, "
              f"{'fp16 + master weights + GradScaler' if args.fp16 else 'fp32'}", flush=True)

    progress = Progress(args.steps, rank == 0)
    losses, step_times, hidden = [], [], []
    tokens_per_step = args.batch * args.context * world
    for step in range(start_step + 1, start_step + args.steps + 1):
        t0 = time.perf_counter()
        x, y = data.batch(gen, args.batch, args.context)
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
        loss_value = loss.item()  # the one host sync per step, for the progress bar
        step_times.append(time.perf_counter() - t0)
        losses.append(loss_value)
        hidden.append(ddp.comm_stats().get("hidden_fraction", 0.0))
        progress.update(step - start_step, loss_value, tokens_per_step / step_times[-1])

    if args.save:
        generators = [None] * world
        torch.distributed.all_gather_object(generators, gen.get_state())
        fusedist.checkpoint.save(args.save, ddp, opt, scaler, extra={"step": start_step + args.steps,
                                                                     "generators": generators})
        if rank == 0:
            print(f"checkpoint written to {args.save} (step {start_step + args.steps})")

    if rank == 0:
        warm = step_times[min(10, len(step_times) - 1):]
        k = min(10, len(losses))
        med = statistics.median(warm)
        print("\nsummary")
        print(f"  steps                 {args.steps}  ({tokens_per_step * args.steps / 1e6:.2f}M tokens)")
        print(f"  loss                  {statistics.mean(losses[:k]):.3f} -> {statistics.mean(losses[-k:]):.3f}"
              f"  (mean of first / last {k} steps)")
        print(f"  step time (median)    {med * 1e3:.1f} ms   ({tokens_per_step / med:,.0f} tokens/s)")
        print(f"  comm hidden behind backward (median over steps): {100 * statistics.median(hidden):.0f}%"
              f"  ({len(ddp.buckets)} buckets)")
        if scaler is not None:
            print(f"  loss scale            {scaler.get_scale():g}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
