"""Soak: many steps of the demo GPT with DDP + FusedAdamW + GradScaler; memory must not grow.

    python benchmarks/soak_ddp.py                 # 2 ranks, 2,000 steps, writes benchmarks/results/
    python benchmarks/soak_ddp.py --steps 300     # shorter

After a warm-up, each rank samples its process RSS (``/proc/self/statm``) and the number of
live tensors (``gc.get_objects()``, after ``gc.collect()``) at regular intervals, each taken
after ``check_consistency()`` so that no collective is in flight. A leak shows
as growth between the first sample after warm-up and the last; allocator noise shows as a
small, non-monotonic wobble. The fp16 variant keeps fp16 weights with FP32 master weights in
the optimizer and the fused GradScaler (the full mixed-precision path).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some deprecated torch aliases warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def soak_worker(rank, world_size, steps, warmup, samples, dim=64, layers=2, batch=4, context=32):
    """Train ``steps`` steps; return [(step, rss MiB, live tensors)] sampled after ``warmup``."""
    import fusedist
    from gpt import GPT, CharDataset, generate_corpus

    torch.manual_seed(0)
    data = CharDataset(generate_corpus(2000))
    model = fusedist.DistributedDataParallel(GPT(data.vocab_size, dim=dim, layers=layers, heads=4, context=context))
    opt = fusedist.optim.FusedAdamW(model.parameters(), lr=1e-3)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0**12)
    gen = torch.Generator().manual_seed(rank)
    every = max((steps - warmup) // max(samples - 1, 1), 1)
    trace, losses = [], []
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = data.batch(gen, batch, context)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        fusedist.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if step >= warmup and ((step - warmup) % every == 0 or step == steps - 1):
            # The per-step consistency check's tiny all-reduce stays in flight until the next
            # forward (by design), holding a few small tensors until the exchange's progress
            # thread has run it; settle it so every sample is taken at the same quiet point.
            model.check_consistency()
            trace.append((step, rss_mib(), live_tensors()))
            losses.append(loss.item())
    return {"trace": trace, "seconds": time.perf_counter() - t0, "loss_first": losses[0], "loss_last": losses[-1]}


def _optimizer_backend() -> str:
    from fusedist import _extension
    from fusedist.backend import select_backend

    return select_backend("adam", torch.device("cpu"), has_cpu_ext=_extension.is_available("_cpu_ops"))


def growth(trace) -> tuple[float, int]:
    """(RSS growth MiB, live-tensor growth) from the first post-warm-up sample to the last."""
    return trace[-1][1] - trace[0][1], trace[-1][2] - trace[0][2]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--samples", type=int, default=9)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    from fusedist.testing import run_distributed
    from _common import write_results

    results = run_distributed(soak_worker, args.world_size, args.steps, args.warmup, args.samples,
                              timeout=3600, pg_timeout=600)
    lines = [
        f"Demo GPT (dim 64, 2 layers, context 32, batch 4 per rank), {args.world_size} ranks, gloo; "
        f"fusedist DDP + FusedAdamW + GradScaler (unscale_ + clip_grad_norm_ every step); "
        f"{args.steps} steps, samples after a {args.warmup}-step warm-up. Optimizer kernel backend: "
        f"{_optimizer_backend()}.",
        "",
        "| rank | seconds | loss first -> last | RSS MiB (first -> last sample) | live tensors (first -> last) | "
        "RSS growth MiB | tensor growth |",
        "|---|---|---|---|---|---|---|",
    ]
    for rank, r in enumerate(results):
        tr = r["trace"]
        d_rss, d_t = growth(tr)
        lines.append(f"| {rank} | {r['seconds']:.0f} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} | "
                     f"{tr[0][1]:.1f} -> {tr[-1][1]:.1f} | {tr[0][2]} -> {tr[-1][2]} | {d_rss:+.2f} | {d_t:+d} |")
    lines += ["", "Samples (rank 0): " + ", ".join(f"step {s}: {m:.1f} MiB / {n} tensors"
                                                   for s, m, n in results[0]["trace"])]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        md, _ = write_results("soak", [], "Soak: DDP + FusedAdamW + GradScaler (CPU, gloo)\n\n" + text)
        print("written:", md)


if __name__ == "__main__":
    main()
