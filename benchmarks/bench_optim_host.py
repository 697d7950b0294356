"""Benchmark: host (Python) time per parameter of an AdamW step on many tiny CPU tensors.

With hundreds of small parameters the arithmetic of a step is negligible and what bounds it on
a GPU is the host: the Python around the kernel launches. The same host code runs on CPU, so
stepping tiny CPU tensors (200 of 16 elements by default) measures it without a GPU. Contenders,
each on its own copy of the same parameters and gradients:

* ``fusedist (torch)``: FusedAdamW with ``FUSEDIST_KERNEL_BACKEND=torch`` (torch's foreach ops);
* ``fusedist (default)``: FusedAdamW as shipped (the C++ CPU Adam when it is built);
* ``torch foreach`` and ``torch fused``: torch.optim.AdamW(foreach=True) and (fused=True).

Each repetition times every contender for ``--steps`` steps, in rotating order, so a drifting
load hits all alike; the table gives the median microseconds per parameter and step, and the
ratios fusedist / torch (< 1: fusedist's host time is shorter). One torch thread, so the
numbers measure the Python and dispatch path, not the thread pool.

    python benchmarks/bench_optim_host.py [--count 200] [--numel 16] [--quick] [--no-write] [--note TEXT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_run_options, record_results  # noqa: E402

from fusedist.optim import FusedAdamW  # noqa: E402

# name -> (optimizer factory, FUSEDIST_KERNEL_BACKEND while it steps; None: as set outside)
CONTENDERS = {
    "fusedist (torch)": (lambda ps: FusedAdamW(ps, lr=1e-3), "torch"),
    "fusedist (default)": (lambda ps: FusedAdamW(ps, lr=1e-3), None),
    "torch foreach": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), None),
    "torch fused": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), None),
}


def _optimizers(count: int, numel: int) -> dict:
    """Every contender on its own copy of the same parameters and gradients."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(numel, generator=gen) for _ in range(count)]
    grads = [torch.randn(numel, generator=gen) * 1e-3 for _ in range(count)]
    made = {}
    for name, (factory, _) in CONTENDERS.items():
        params = [torch.nn.Parameter(v.clone()) for v in values]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        made[name] = factory(params)
    return made


def _with_backend(backend):
    """Set FUSEDIST_KERNEL_BACKEND for one contender's timing (read at every step)."""
    if backend is None:
        os.environ.pop("FUSEDIST_KERNEL_BACKEND", None)
    else:
        os.environ["FUSEDIST_KERNEL_BACKEND"] = backend


def _time_steps(opt, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return time.perf_counter() - start


def run(count: int, numel: int, repeats: int, steps: int) -> dict:
    """Median microseconds per parameter and step, by contender."""
    outside = os.environ.get("FUSEDIST_KERNEL_BACKEND")
    opts = _optimizers(count, numel)
    names = list(opts)
    samples = {name: [] for name in names}
    try:
        for name in names:  # warm up (state creation, first-call costs)
            _with_backend(CONTENDERS[name][1])
            _time_steps(opts[name], 3)
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                _with_backend(CONTENDERS[name][1])
                samples[name].append(_time_steps(opts[name], steps) / steps / count * 1e6)
    finally:
        _with_backend(outside)
    return {name: statistics.median(s) for name, s in samples.items()}


def rows_of(us: dict) -> list[dict]:
    rows = []
    for name in ("fusedist (torch)", "fusedist (default)"):
        rows.append({
            "fusedist": name, "fusedist_us_per_param": round(us[name], 3),
            "torch_foreach_us_per_param": round(us["torch foreach"], 3),
            "torch_fused_us_per_param": round(us["torch fused"], 3),
            "ratio_vs_foreach": round(us[name] / us["torch foreach"], 3),
            "ratio_vs_fused": round(us[name] / us["torch fused"], 3),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200, help="number of parameters")
    parser.add_argument("--numel", type=int, default=16, help="elements per parameter")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--steps", type=int, default=50, help="steps per timing")
    add_run_options(parser)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps = 3, 5
    torch.set_num_threads(1)
    us = run(args.count, args.numel, args.repeats, args.steps)
    rows = rows_of(us)
    print(f"{args.count} parameters x {args.numel} elements, AdamW, host us per parameter and step (median)")
    for row in rows:
        print(f"{row['fusedist']:20s} {row['fusedist_us_per_param']:8.3f}   torch foreach "
              f"{row['torch_foreach_us_per_param']:8.3f} (ratio {row['ratio_vs_foreach']:.3f})   torch fused "
              f"{row['torch_fused_us_per_param']:8.3f} (ratio {row['ratio_vs_fused']:.3f})")
    record_results("optim_host_cpu", rows, (
        f"AdamW step on {args.count} CPU parameters of {args.numel} elements, one torch thread; median over "
        f"{args.repeats} repetitions of {args.steps} steps, contenders in rotating order. "
        "Ratio = fusedist / torch (< 1: less host time)."), args)


if __name__ == "__main__":
    main()
