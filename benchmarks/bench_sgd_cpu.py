"""Benchmark: FusedSGD's step on CPU tensors against torch.optim.SGD(foreach=True), same run.

On CPU, FusedSGD runs torch's list operations in the order of torch's foreach SGD
(``fusedist/optim/_cpu_sgd.py``, the same bits); what differs is fusedist's per-step
bookkeeping (step counts, the bucketing of the parameters). The shapes where that shows: many
small parameters (a step is then dispatch-bound), and a few large ones (memory-bound, where
both should be equal). Momentum 0.9 and weight decay on both sides. Each repetition times both
contenders once, in alternating order; the ratio is the median of the paired ratios
(torch / fusedist, > 1: fusedist faster).

    python benchmarks/bench_sgd_cpu.py [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, write_results  # noqa: E402

from fusedist.optim import FusedSGD  # noqa: E402

CASES = {"2000 x 64": (2000, 64), "200 x 4096": (200, 4096), "8 x 1M": (8, 1 << 20)}
HYPER = dict(lr=0.01, momentum=0.9, weight_decay=1e-4)


def _contenders(count: int, numel: int):
    gen = torch.Generator().manual_seed(0)
    made = {}
    for name, cls, extra in (("fusedist", FusedSGD, {}), ("torch", torch.optim.SGD, {"foreach": True})):
        params = [torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn(numel, generator=gen) * 1e-3
        made[name] = cls(params, **HYPER, **extra)
    return made


def _time(opt) -> float:
    start = time.perf_counter()
    opt.step()
    return (time.perf_counter() - start) * 1e3


def run(repeats: int) -> list[dict]:
    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"  # the CPU path (not Triton's interpreter)
    rows = []
    for case, (count, numel) in CASES.items():
        opts = _contenders(count, numel)
        for opt in opts.values():
            for _ in range(3):
                opt.step()
        times = {name: [] for name in opts}
        ratios = []
        for r in range(repeats):
            order = list(opts) if r % 2 == 0 else list(reversed(opts))
            got = {name: _time(opts[name]) for name in order}
            for name, ms in got.items():
                times[name].append(ms)
            ratios.append(got["torch"] / got["fusedist"])
        rows.append({"case": case, "params": count, "elements_each": numel,
                     "fusedist_ms": statistics.median(times["fusedist"]), "torch_ms": statistics.median(times["torch"]),
                     "torch_over_fusedist": statistics.median(ratios)})
        print(", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
              flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write benchmarks/results/")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = run(3 if args.quick else 31)
    notes = ("FusedSGD vs torch.optim.SGD(foreach=True) on CPU, one thread, momentum 0.9, weight decay 1e-4; "
             "torch_over_fusedist: median of paired ratios (> 1: fusedist faster).")
    if not args.no_write:
        md, _ = write_results("sgd_cpu", rows, notes, environment())
        print(f"wrote {md}")


if __name__ == "__main__":
    main()
