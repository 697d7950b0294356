"""Per-step fixed cost of fusedist DDP against torch DDP on a tiny model (CPU, gloo, 2 ranks).

    python benchmarks/bench_ddp_step_overhead.py              # ms/step of each, same run, rotating order
    python benchmarks/bench_ddp_step_overhead.py --profile    # and cProfile of fusedist's steps on rank 0
    python benchmarks/bench_ddp_step_overhead.py --phases     # and where the per-step check's time goes
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

``--phases`` splits the check's cost on rank 0 (Note [step check] in
fusedist/reliability/step_check.py): per step, the wall and training-thread CPU time of
assembling its vector (and of writing it into the last bucket's message), of reading
the verdict at the next forward (the wait for the all-reduce included), and of the parameter
digest (once every ``FUSEDIST_PARAM_CHECK_EVERY`` steps: per call and per step);
then, for each contender, the CPU time per step of every thread of the process (training
thread, the gloo exchange's progress thread, gloo's own threads; Linux only). The wall time of
a step is the critical path of two processes on a shared machine: on a loaded one it is the
waits for threads to be scheduled, which the CPU columns do not show, so compare contenders
within one run.
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


def _worker(rank, world, rounds, steps, profile, stack=0, phases=False):
    import fusedist

    torch.set_num_threads(1)
    models = {"torch": nn.parallel.DistributedDataParallel(_model(stack)),
              "fusedist": fusedist.DistributedDataParallel(_model(stack))}
    # The check through its own small all-reduce, as before it rode on the last bucket (Note [the
    # check carried by the last bucket] in fusedist/reliability/carried_check.py; identical where
    # the last bucket cannot carry it).
    own = models["fusedist, check's own all-reduce"] = fusedist.DistributedDataParallel(_model(stack))
    own.reducer.check_carrier = None
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
    if phases:
        report = _phases(rank, models, opts, x, y, max(steps * rounds // 2, 200))
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        _block(models["fusedist"], opts["fusedist"], x, y, 50)
        prof.disable()
        if rank == 0:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
            report = "\n".join(filter(None, (report, out.getvalue())))
    return {n: tuple(statistics.median(v) for v in zip(*t)) for n, t in times.items()}, report


def _phases(rank, models, opts, x, y, steps: int) -> str:
    """The per-step check's parts on the default model, timed around the methods that do them,
    then each contender's CPU time per thread (see the module's docstring)."""
    from fusedist.reliability import engine_watch, param_check, step_check

    model = models["fusedist"]
    spent: dict = {}  # label -> [wall s, training-thread CPU s, calls]

    def timed(owner, name, label, when=lambda *a, **k: True):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if not when(*args, **kwargs):
                return original(*args, **kwargs)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                row = spent.setdefault(label, [0.0, 0.0, 0])
                row[0] += time.perf_counter() - t0
                row[1] += time.thread_time() - c0
                row[2] += 1
        setattr(owner, name, wrapper)
        return original

    comm = model.watch.step_check.comm
    order = ["assemble the vector + launch the all-reduce", "  of which the all-reduce's launch",
             "assemble the vector (carried by the last bucket)", "  the tail's copy into the bucket's message",
             "read the verdict (next forward)", "parameter digest (when due)"]
    patched = [(engine_watch.StepWatch, "launch_check",
                timed(engine_watch.StepWatch, "launch_check", order[0])),
               (engine_watch.StepWatch, "prepare_carry",
                timed(engine_watch.StepWatch, "prepare_carry", order[2])),
               (engine_watch.StepWatch, "carry_tail",
                timed(engine_watch.StepWatch, "carry_tail", order[3])),
               (step_check.StepCheck, "settle",
                timed(step_check.StepCheck, "settle", order[4])),
               (param_check.ParamDigest, "compute",
                timed(param_check.ParamDigest, "compute", order[5]))]
    timed(comm, "all_reduce", order[1],
          when=lambda *a, **k: k.get("tag") == model.watch.step_check.tag)
    try:
        _block(model, opts["fusedist"], x, y, steps)
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
        del comm.all_reduce  # (the instance's wrapper: the class's method again)
    lines = [f"Where the per-step check's time goes (rank {rank}, fusedist default, {steps} steps; "
             "us per step, wall / training-thread CPU):"]
    for label, (wall, cpu, calls) in sorted(spent.items(), key=lambda kv: order.index(kv[0])):
        per_call = f"; {wall / calls * 1e6:7.1f} / {cpu / calls * 1e6:7.1f} per call, {calls} calls" \
            if calls < steps else ""
        lines.append(f"  {label:46s} {wall / steps * 1e6:7.1f} / {cpu / steps * 1e6:7.1f}{per_call}")
    lines.append("CPU time per step by thread (ms; Linux /proc):")
    for name in models:
        before = _thread_cpu()
        _block(models[name], opts[name], x, y, steps)
        after = _thread_cpu()
        by_thread: dict = {}
        for tid, (label, ticks) in after.items():
            by_thread[label] = by_thread.get(label, 0.0) + (ticks - before.get(tid, (label, 0))[1])
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        lines.append(f"  {name:34s} " + "  ".join(f"{label} {t / tick / steps * 1e3:.3f}"
                                                   for label, t in sorted(by_thread.items()) if t))
    return "\n".join(lines)


def _thread_cpu() -> dict:
    """tid -> (name, user + system clock ticks) of this process's threads (empty off Linux);
    Python threads by their Python names, the training thread as "training"."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "training"
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        out[tid] = (names.get(int(tid), comm), int(fields[11]) + int(fields[12]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--phases", action="store_true", help="where the per-step check's time goes")
    parser.add_argument("--stack", type=int, default=0, help="N >= 2 tiny linear layers instead of the MLP")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from fusedist.testing import run_distributed

    results = run_distributed(_worker, 2, args.rounds, args.steps, args.profile, args.stack, args.phases, timeout=600)
    for rank, (ms, _) in enumerate(results):
        tw, tc = ms["torch"]
        for name, (wall, cpu) in ms.items():
            print(f"rank {rank}: {name:34s} wall {wall:5.2f} ms/step ({wall / tw:.2f}x torch), "
                  f"training-thread CPU {cpu:5.2f} ms/step ({cpu / tc:.2f}x)")
    if results[0][1]:
        print(results[0][1])


if __name__ == "__main__":
    main()
