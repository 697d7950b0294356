"""Checkpoint stall: what a save costs the training loop, asynchronous vs synchronous, same run.

One process trains a ~50M-parameter MLP (12 x Linear(2048, 2048), torch AdamW: ~600 MB of
parameters and optimizer state per checkpoint) and saves every ``--every`` steps through
``fusedist.checkpoint.Checkpointer``, alternating a synchronous and an asynchronous
Checkpointer (separate directories) so both see the same machine state. Per save:

* ``stall_ms``: time the training thread spends inside ``maybe_save`` -- for the
  synchronous save the whole write; for the asynchronous one the wait for the previous save
  (if still in flight) plus the snapshot into host buffers;
* ``persist_ms``: the write itself (serialization, SHA-256, fsync, manifest);
* for asynchronous saves, ``slowdown_ms``: extra time of the training steps that ran while
  the write was in flight, against the median step without one (the background thread
  competes for the CPU with training on a CPU-only machine).

The first asynchronous save allocates the staging buffers (reported, left out of medians).

    python benchmarks/bench_checkpoint.py            # writes results/checkpoint_cpu_<date>.*
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import environment, write_results  # noqa: E402

from fusedist.checkpoint import Checkpointer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--every", type=int, default=20, help="steps between saves")
    p.add_argument("--saves", type=int, default=4, help="saves of each kind (after the warm-up one)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the training loop")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed after)")
    p.add_argument("--no-write", action="store_true", help="print only, write no result files")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh()) for _ in range(args.layers)])
    n_params = sum(q.numel() for q in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)
    root = args.dir or tempfile.mkdtemp(prefix="bench-ckpt-")
    ckpts = {"sync": Checkpointer(os.path.join(root, "sync"), every_steps=None, keep=1, async_save=False),
             "async": Checkpointer(os.path.join(root, "async"), every_steps=None, keep=1, async_save=True)}
    for c in ckpts.values():
        c.restore(model, opt)

    step_times, in_flight = [], []
    kinds = ["async"] + ["sync", "async"] * args.saves  # the first async save allocates the buffers
    stalls = {"sync": [], "async": []}
    step = 0
    for kind in kinds:
        for _ in range(args.every):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()
            step += 1
            step_times.append(time.perf_counter() - t0)
            in_flight.append(ckpts["async"]._writer.busy)
        t0 = time.perf_counter()
        ckpts[kind].save(step)
        stalls[kind].append((time.perf_counter() - t0, ckpts[kind].stats[-1]))
    for c in ckpts.values():
        c.close()
    nbytes = ckpts["sync"].stats[-1]["bytes"]
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)

    quiet = [t for t, busy in zip(step_times, in_flight) if not busy]
    busy = [t for t, b in zip(step_times, in_flight) if b]
    base = statistics.median(quiet)
    slowdown_per_save = (sum(busy) - base * len(busy)) / max(1, len(stalls["async"]))
    first, async_rest = stalls["async"][0], stalls["async"][1:]
    sync_ms = [1e3 * t for t, _ in stalls["sync"]]
    async_ms = [1e3 * t for t, _ in async_rest]
    rows = []
    for kind, items in (("sync", stalls["sync"]), ("async", async_rest)):
        for i, (t, rec) in enumerate(items):
            rows.append({"kind": kind, "save": i + 1, "stall_ms": 1e3 * t, "wait_ms": 1e3 * rec["wait_s"],
                         "persist_ms": 1e3 * rec.get("persist_s", float("nan")), "bytes_mb": rec["bytes"] / 2**20})
    ratio = statistics.median(async_ms) / statistics.median(sync_ms)
    notes = (
        f"Machine: {os.cpu_count()}-core {platform.machine()} CPU, no GPU; checkpoints on local disk.\n\n"
        f"Model: {args.layers} x Linear({args.width}, {args.width}) + Tanh, {n_params / 1e6:.1f}M parameters, torch "
        f"AdamW; {nbytes / 2**20:.0f} MiB staged per save; batch {args.batch}; {args.threads} torch thread(s); a save "
        f"every {args.every} steps, sync and async alternating in one run.\n\n"
        f"- synchronous save, stall (median of {len(sync_ms)}): {statistics.median(sync_ms):.0f} ms\n"
        f"- asynchronous save, stall (median of {len(async_ms)}): {statistics.median(async_ms):.0f} ms "
        f"= **{100 * ratio:.1f}%** of the synchronous stall\n"
        f"- first asynchronous save (allocates the staging buffers): {1e3 * first[0]:.0f} ms\n"
        f"- training step, median without a save in flight: {1e3 * base:.0f} ms; steps run during a background "
        f"write: {len(busy)}, their extra time per async save: {1e3 * slowdown_per_save:.0f} ms\n"
    )
    print(notes)
    for row in rows:
        print(row)
    if not args.no_write:
        env = environment()
        print(write_results("checkpoint_cpu", rows, notes, env))


if __name__ == "__main__":
    main()
