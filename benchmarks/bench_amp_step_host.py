"""Benchmark: host time of the fused AMP step's GPU code path, measured on a CPU.

On a GPU the fused AMP step (``scaler.unscale_``, ``fusedist.clip_grad_norm_``,
``scaler.step``, ``scaler.update``) is bound by the host from small models down: the kernels
take microseconds, the Python that issues them takes hundreds (the GPT-like 196-tensor rows of
``bench_optimizer.py`` on an H200 spent 2.1-2.5 ms of host time a step). That Python is the
same on a CPU when the Triton path is taken, so this script runs it on tiny CPU tensors with
``TRITON_INTERPRET=1`` and ``FUSEDIST_KERNEL_BACKEND=triton``, **with the kernel launches
replaced by no-ops**: what is left is the host path, measurable without a GPU and repeatable
from one commit to the next. torch's multi-tensor ops (``_foreach_add_`` on the step counts)
are replaced by no-ops too, by default: on a CPU they loop over the tensors one by one, on a GPU
each is one launch (``--keep-foreach`` keeps them).

Not included: the launches themselves (per launch, 17-41 us through Triton's JIT on the H200
host: ``benchmarks/gpu/profile_launch_bound.py``) and the device ops' own host cost on a GPU
(each aten op on CUDA costs a few microseconds more than on a CPU). So the numbers rank host
paths against each other -- this commit against an earlier one, one tensor count against
another -- and are no GPU step time.

Rows: tensor count x parameter dtype (fp32; bf16 with FP32 masters) x unscale (``eager``, the
default; ``lazy`` = ``GradScaler(lazy_unscale=True)``); columns: the median host microseconds
of each phase and of the whole step, and per tensor (the whole step over the tensor count).

    python benchmarks/bench_amp_step_host.py [--counts 4 196] [--repeats 15] [--steps 20] [--quick] [--no-write]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # (before triton is imported: the kernels' module is read on CPU)
os.environ["FUSEDIST_KERNEL_BACKEND"] = "triton"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_run_options, record_results  # noqa: E402

import fusedist  # noqa: E402
from fusedist.triton_kernels import multi_tensor  # noqa: E402

MODES = ("fp32", "bf16+master")
PHASES = ("unscale_", "clip", "step", "update")
NUMEL = 64  # elements per tensor: the arithmetic stays negligible next to the host path


class _NoLaunch:
    """Stands for a compiled kernel: ``kernel[grid](*args)`` returns at once (and is counted,
    so a run that did not take the Triton path says so instead of timing another one)."""

    launches = 0

    def __getitem__(self, grid):
        return self._launch

    @classmethod
    def _launch(cls, *args, **kwargs) -> None:
        cls.launches += 1


def _without_launches(keep_foreach: bool) -> None:
    multi_tensor.cached = lambda kernel: _NoLaunch()
    if not keep_foreach:
        torch._foreach_add_ = lambda *args, **kwargs: None


def _phases(count: int, mode: str, lazy: bool):
    import bench_optimizer  # (builds the step exactly as the GPU benchmark does)

    _, (params, opt, scaler) = bench_optimizer.fusedist_step([(NUMEL,)] * count, torch.device("cpu"), mode,
                                                             lazy_unscale=lazy)
    return {"unscale_": lambda: scaler.unscale_(opt), "clip": lambda: fusedist.clip_grad_norm_(params, 1.0),
            "step": lambda: scaler.step(opt), "update": scaler.update}


def measure(count: int, mode: str, lazy: bool, repeats: int, steps: int) -> dict:
    """Median host microseconds of each phase over ``repeats`` timings of ``steps`` steps."""
    phases = _phases(count, mode, lazy)
    launched = _NoLaunch.launches
    for _ in range(3):  # warm up: states, chunk tables, first-call costs
        for run in phases.values():
            run()
    if _NoLaunch.launches < launched + 3 * 2:  # (the check pass and the update, each step)
        raise RuntimeError("the fused step did not take the Triton path: its host path is not what this measures")
    samples = {name: [] for name in phases}
    clock = time.perf_counter
    for _ in range(repeats):
        spent = dict.fromkeys(phases, 0.0)
        for _ in range(steps):
            for name, run in phases.items():
                start = clock()
                run()
                spent[name] += clock() - start
        for name in phases:
            samples[name].append(spent[name] / steps * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def rows_of(counts, repeats: int, steps: int) -> list[dict]:
    rows = []
    for count in counts:
        for mode in MODES:
            for lazy in (False, True):
                us = measure(count, mode, lazy, repeats, steps)
                total = sum(us.values())
                rows.append({"tensors": count, "mode": mode, "unscale": "lazy" if lazy else "eager",
                             **{f"{name}_us": round(us[name], 1) for name in PHASES},
                             "total_us": round(total, 1), "us_per_tensor": round(total / count, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[4, 196], help="tensor counts")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="steps per timing")
    parser.add_argument("--keep-foreach", action="store_true", help="run torch's foreach ops (per tensor on CPU)")
    add_run_options(parser)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps = 3, 3
    torch.set_num_threads(1)
    _without_launches(args.keep_foreach)
    rows = rows_of(args.counts, args.repeats, args.steps)
    print(f"fused AMP step, host us (median of {args.repeats} x {args.steps} steps; kernels not launched)")
    for row in rows:
        print(f"{row['tensors']:5d} {row['mode']:12s} {row['unscale']:5s} "
              + " ".join(f"{name} {row[name + '_us']:7.1f}" for name in PHASES)
              + f"  total {row['total_us']:7.1f}  per tensor {row['us_per_tensor']:6.2f}")
    record_results("amp_step_host_cpu", rows, (
        f"Host microseconds of the fused AMP step's GPU code path on CPU tensors of {NUMEL} elements, Triton "
        "launches replaced by no-ops" + ("" if args.keep_foreach else " and so are torch's _foreach_add_ ops")
        + f"; median over {args.repeats} timings of {args.steps} steps, one torch thread. Ranks host paths "
        "against each other; not a GPU step time (see the script's docstring)."), args)


if __name__ == "__main__":
    main()
