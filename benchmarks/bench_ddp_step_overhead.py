"""Per-step fixed cost of fusedist DDP against torch DDP on a tiny model (CPU, gloo, 2 ranks).

    python benchmarks/bench_ddp_step_overhead.py              # ms/step of each, same run, rotating order
    python benchmarks/bench_ddp_step_overhead.py --profile    # and cProfile of fusedist's steps on rank 0
    python benchmarks/bench_ddp_step_overhead.py --stack 100  # 100 Linear(4, 4): 200 parameters

A 3-layer MLP of width 32 at batch 8: the arithmetic and the bytes are negligible, so the time
of ``zero_grad + forward + backward + SGD step`` is the wrapper's bookkeeping and the
collectives' latency. Contenders: torch DDP, fusedist DDP, and fusedist DDP built with
``FUSEDIST_CHECKS=0`` (without its per-step cross-rank check, which costs one more small
collective a step). Each round times a block of steps of each contender in turn (the order
rotating between rounds); the figures are the medians over rounds of each block's ms/step:
wall time, and the training thread's CPU time, which leaves out the waits for the other rank
and so shows the host's own work even on a loaded machine. ``--stack N`` replaces the MLP by
N tiny linear layers, where the per-parameter cost (gradient hooks, bucket bookkeeping) shows.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(stack: int = 0) -> nn.Module:
    torch.manual_seed(0)
    if stack:
        return nn.Sequential(nn.Linear(16, 4), *[nn.Linear(4, 4) for _ in range(stack - 2)], nn.Linear(4, 4))
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _block(model, opt, x, y, steps: int) -> tuple[float, float]:
    """Wall and training-thread CPU milliseconds per step (the CPU time leaves out the waits for
    the other rank, so it shows the host's own work even on a loaded machine)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - t0) * 1e3 / steps, (time.thread_time() - c0) * 1e3 / steps


def _worker(rank, world, rounds, steps, profile, stack=0):
    import fusedist

    torch.set_num_threads(1)
    models = {"torch": nn.parallel.DistributedDataParallel(_model(stack)),
              "fusedist": fusedist.DistributedDataParallel(_model(stack))}
    # The same without its per-step cross-rank check (read when a model is built; the collective
    # monitor and the optimizer-step guard, process-wide, stay on for all three).
    os.environ["FUSEDIST_CHECKS"] = "0"
    models["fusedist, FUSEDIST_CHECKS=0"] = fusedist.DistributedDataParallel(_model(stack))
    del os.environ["FUSEDIST_CHECKS"]
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    for n in models:
        _block(models[n], opts[n], x, y, 5)  # warm-up (the first backward rebuilds the buckets)
    times = {n: [] for n in models}
    for r in range(rounds):
        for n in list(models)[r % len(models):] + list(models)[:r % len(models)]:  # rotating order
            times[n].append(_block(models[n], opts[n], x, y, steps))
    report = None
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        _block(models["fusedist"], opts["fusedist"], x, y, 50)
        prof.disable()
        if rank == 0:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
            report = out.getvalue()
    return {n: tuple(statistics.median(v) for v in zip(*t)) for n, t in times.items()}, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--stack", type=int, default=0, help="N >= 2 tiny linear layers instead of the MLP")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from fusedist.testing import run_distributed

    results = run_distributed(_worker, 2, args.rounds, args.steps, args.profile, args.stack, timeout=600)
    for rank, (ms, _) in enumerate(results):
        tw, tc = ms["torch"]
        for name, (wall, cpu) in ms.items():
            print(f"rank {rank}: {name:28s} wall {wall:5.2f} ms/step ({wall / tw:.2f}x torch), "
                  f"training-thread CPU {cpu:5.2f} ms/step ({cpu / tc:.2f}x)")
    if results[0][1]:
        print(results[0][1])


if __name__ == "__main__":
    main()
