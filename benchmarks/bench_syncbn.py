"""Benchmark: fusedist SyncBatchNorm, kernels on CUDA and the synchronized layer on CPU.

CUDA (runs when a GPU is visible): the Triton kernels against the CUDA kernels that
torch.nn.SyncBatchNorm uses, on the BatchNorm shapes of ResNet-50 (per-GPU batch 32 and 64),
NCHW and NHWC (channels_last), fp32, fp16 and bf16:

* statistics: ``welford_stats`` (per-channel count/mean/M2) vs ``torch.batch_norm_stats``;
* backward reduce: ``backward_reduce`` (sum dy, sum dy*x̂) vs ``torch.batch_norm_backward_reduce``;
* normalize: ``channel_affine`` vs ``torch.batch_norm_elemt``;
* elementwise backward: ``input_grad`` (from the all-reduced sums) vs ``torch.batch_norm_backward_elemt``.

Median µs from ``triton.testing.do_bench``, GB/s at the bytes each op must move (stats: read
x; backward reduce: read dy and x; normalize: read x, write y; elementwise backward: read dy
and x, write dx), the fraction of a same-run read bandwidth (``torch.sum`` over a 1 GiB fp32
buffer), and the ratio torch / fusedist (> 1: fusedist is faster). The last line is the
verdict: the lowest ratio over every row (target >= 1.0) and the lowest bandwidth fraction
over the rows whose input is at least 100 MB (target >= 0.85). ``fusedist_host_us`` /
``torch_host_us``: the host's time to issue one call (50 calls, no synchronization between
them); where it is most of the measured time the call is bound by its launch, not by its
kernels, and the verdict counts those rows among the slower ones. ``launch_cache_*``: the
same call with the Triton launch cache switched on (``FUSEDIST_TRITON_LAUNCH_CACHE=1``, off by
default: Note [the launch cache is opt-in] in triton_kernels/launch_cache.py).

CPU (always): two ranks on gloo, each normalizing its own batch: fusedist SyncBatchNorm
forward+backward against plain ``nn.BatchNorm`` on the same per-rank batch in the same
process -- the cost of being synchronized (two small collectives, the combine and the
pure-PyTorch statistics path). Contenders are timed round-robin so background load hits
both alike; median and min of the repetitions are reported.

    python benchmarks/bench_syncbn.py            # CPU part (+ CUDA part if a GPU is visible)
    python benchmarks/bench_syncbn.py --skip-cpu # CUDA part only

Results go to benchmarks/results/syncbn_cpu.{md,csv} and syncbn_cuda_batch<batches>.{md,csv}.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import graph_ms_per_call, host_ms_per_call, launch_cache_on  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")

# (C, H, W) of every distinct BatchNorm input in ResNet-50 at 224x224.
RESNET50_BN = [
    (64, 112, 112), (64, 56, 56), (256, 56, 56), (128, 56, 56), (128, 28, 28), (512, 28, 28),
    (256, 28, 28), (256, 14, 14), (1024, 14, 14), (512, 14, 14), (512, 7, 7), (2048, 7, 7),
]

# Per-rank CPU shapes: (N, C, H, W) or (N, C).
CPU_SHAPES = [(16, 64, 28, 28), (16, 256, 14, 14), (32, 512, 7, 7), (256, 1024)]


# ----------------------------------------------------------------------------- environment


def hardware() -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - the CPU part does not need triton
        info["triton"] = "not installed"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                           if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        info["cpu"] = platform.processor() or "unknown"
    info["cores"] = os.cpu_count()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_results(name: str, rows: list[dict], header: str) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    cols = list(rows[0])
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[c]) for c in cols) + " |")
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


# ----------------------------------------------------------------------------- CUDA kernels

# Note [call time and device time]
# ``fusedist_us`` / ``torch_us`` time one call as a training step issues it: do_bench records
# an event, makes the call and records another, one call at a time behind a cache flush. When
# the host needs longer to issue the call than the flush keeps the GPU busy, that time is the
# host's (Python, the launch calls), and small shapes are measured by their launches. The
# ``_device_us`` columns replay the same call from a CUDA graph (20 calls per graph, no cache
# flush between them: an input that fits in L2 stays there, as a layer's output just written
# often does): the kernels alone, what the call costs a step whose host runs ahead of the GPU
# (a large model's). The target is on the call time; the device columns say which of the two a
# slow row needs.


def bench_cuda(batches: list[int], dtypes: list[torch.dtype]) -> list[dict]:
    import triton.testing

    from fusedist.nn._layout import ncs_layout
    from fusedist.triton_kernels import syncbn as kernels

    def median_us(fn) -> float:
        # ~40 ms of repetitions: hundreds of launches even for the largest shapes, and the
        # whole matrix (2 batches x 3 dtypes x 2 layouts x 12 shapes x 4 ops x 2) in ~1-2 min.
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3

    def device_us(fn) -> float:
        """The kernels' time alone: ``fn`` captured in a CUDA graph and replayed, so no host
        work (Python, launch calls) sits between the events (Note [call time and device
        time])."""
        try:
            return graph_ms_per_call(fn) * 1e3
        except RuntimeError:
            return float("nan")

    def host_us(fn) -> float:
        try:
            return host_ms_per_call(fn, calls=50) * 1e3
        except RuntimeError:  # (a dtype a torch kernel lacks: its row says so)
            return float("nan")

    def timed(fn) -> tuple[float, str]:
        """(median µs, "") or (nan, the error): one op that fails (a dtype a torch kernel lacks)
        must not cost the rest of a GPU run's rows."""
        try:
            return median_us(fn), ""
        except RuntimeError as exc:
            return float("nan"), f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"

    big = torch.empty(256 * 2**20, device="cuda", dtype=torch.float32).uniform_()
    read_gbs = big.numel() * 4 / (median_us(big.sum) * 1e-6) / 1e9
    del big
    print(f"same-run read bandwidth (torch.sum, 1 GiB fp32): {read_gbs:.0f} GB/s")

    rows = []
    for batch, dtype, memory_format, (C, H, W) in itertools.product(batches, dtypes, ("NCHW", "NHWC"), RESNET50_BN):
        x = torch.randn(batch, C, H, W, device="cuda", dtype=dtype) * 2 + 1
        dy = torch.randn_like(x)
        if memory_format == "NHWC":
            x = x.contiguous(memory_format=torch.channels_last)
            dy = dy.contiguous(memory_format=torch.channels_last)
        layout = ncs_layout(x)
        assert layout is not None
        f32 = dict(device="cuda", dtype=torch.float32)
        weight, bias = torch.ones(C, **f32), torch.zeros(C, **f32)
        mean_out, m2_out = torch.empty(C, **f32), torch.empty(C, **f32)
        count_out = torch.empty(1, **f32)
        mean, invstd = torch.batch_norm_stats(x, 1e-5)
        y = torch.empty_like(x)
        # the elementwise backward's inputs: the all-reduced sums and the global count (both
        # sides make the per-channel factors from them: Note [the backward's factors in the
        # kernel] in fusedist/nn/_function.py)
        count = torch.full((1,), x.numel() // C, device="cuda", dtype=torch.int32)
        sum_dy, sum_dy_xmu = torch.randn(C, **f32), torch.randn(C, **f32)
        sums = torch.stack([sum_dy, sum_dy_xmu * invstd])  # [sum(dy), sum(dy * xhat)]
        nbytes = x.numel() * x.element_size()
        ops = {
            "stats": (lambda: kernels.welford_stats(x, layout, mean_out, m2_out, count_out),
                      lambda: torch.batch_norm_stats(x, 1e-5), nbytes),
            "backward_reduce": (
                lambda: kernels.backward_reduce(dy, x, layout, mean, invstd),
                lambda: torch.batch_norm_backward_reduce(dy, x, mean, invstd, weight, True, True, True),
                2 * nbytes),
            "normalize": (
                lambda: kernels.channel_affine(y, x, layout, mean, invstd, b=bias),
                lambda: torch.batch_norm_elemt(x, weight, bias, mean, invstd, 1e-5),
                2 * nbytes),
            "backward_elemt": (
                lambda: kernels.input_grad(y, dy, x, layout, sums, mean, invstd, weight, x.numel() // C),
                lambda: torch.batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count),
                3 * nbytes),
        }
        for op, (ours, theirs, moved) in ops.items():
            (t_ours, err_ours), (t_torch, err_torch) = timed(ours), timed(theirs)
            with launch_cache_on() as on:  # the same launchers, repeats past the JIT's per-call work
                t_cached, h_cached = (timed(ours)[0], host_us(ours)) if on else (float("nan"), float("nan"))
            gbs = moved / (t_ours * 1e-6) / 1e9
            path = ("per-channel" if op in ("stats", "backward_reduce") and kernels._channel_path(layout) is not None
                    else "row-split" if op in ("stats", "backward_reduce") else "tiles")
            rows.append({
                "op": op, "dtype": str(dtype).replace("torch.", ""), "layout": memory_format, "path": path,
                "shape": f"{batch}x{C}x{H}x{W}", "input_MB": nbytes / 1e6,
                "fusedist_us": t_ours, "torch_us": t_torch,
                "fusedist_GBps": gbs, "torch_GBps": moved / (t_torch * 1e-6) / 1e9,
                "frac_read_bw": gbs / read_gbs, "speedup_vs_torch": t_torch / t_ours,
                "fusedist_host_us": host_us(ours), "torch_host_us": host_us(theirs),
                "fusedist_device_us": (d_ours := device_us(ours)), "torch_device_us": (d_torch := device_us(theirs)),
                "device_speedup": d_torch / d_ours,
                "launch_cache_us": t_cached, "launch_cache_host_us": h_cached,
                "launch_cache_speedup": t_torch / t_cached,
                "error": "; ".join(e for e in (err_ours and f"fusedist: {err_ours}",
                                               err_torch and f"torch: {err_torch}") if e),
            })
            print(rows[-1])
    return rows


def _lowest_clause(rows: list[dict], key: str, label: str) -> str:
    """"; <label>: lowest ratio ..., k of n rows below 1.0" over the rows where ``key`` was
    measured (not nan), or "" when none was."""
    timed = [r for r in rows if r.get(key) == r.get(key)]
    if not timed:
        return ""
    low = min(timed, key=lambda r: r[key])
    return (f"; {label}: lowest ratio {low[key]:.3f}x ({low['op']} {low['dtype']} {low['layout']} {low['shape']}), "
            f"{sum(r[key] < 1.0 for r in timed)} of {len(timed)} rows below 1.0")


def verdict(rows: list[dict]) -> str:
    """One line: the lowest ratio against torch, and the lowest bandwidth fraction of the rows
    whose input is at least 100 MB."""
    failed = [r for r in rows if r["error"]]
    rows = [r for r in rows if not r["error"]]
    if not rows:
        return f"verdict: every row failed; first: {failed[0]['error']}"
    worst = min(rows, key=lambda r: r["speedup_vs_torch"])
    text = (f"verdict: lowest ratio against torch {worst['speedup_vs_torch']:.3f}x ({worst['op']} "
            f"{worst['dtype']} {worst['layout']} {worst['shape']}; target >= 1.0)")
    if failed:
        text += f"; {len(failed)} row(s) failed (see their error column), first: {failed[0]['error']}"
    slower = [r for r in rows if r["speedup_vs_torch"] < 1.0]
    if slower and "fusedist_host_us" in slower[0]:
        launch_bound = [r for r in slower if r["fusedist_host_us"] >= 0.8 * r["fusedist_us"]]
        text += f"; {len(launch_bound)} of the {len(slower)} slower rows are launch-bound (host >= 80% of the time)"
    text += _lowest_clause(rows, "device_speedup", "device time alone (graph replay)")
    text += _lowest_clause(rows, "launch_cache_speedup", "with FUSEDIST_TRITON_LAUNCH_CACHE=1")
    large = [r for r in rows if r["input_MB"] >= 100]
    if large:
        low = min(large, key=lambda r: r["frac_read_bw"])
        text += (f"; lowest read-bandwidth fraction on inputs >= 100 MB {low['frac_read_bw']:.2f} "
                 f"({low['op']} {low['dtype']} {low['layout']} {low['shape']}; target >= 0.85)")
    return text


# ----------------------------------------------------------------------------- CPU, 2 ranks


def _time_round_robin(fns: dict, reps: int) -> dict:
    for fn in fns.values():  # warm-up
        fn()
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: (statistics.median(s), min(s)) for name, s in samples.items()}


def _cpu_rank(rank, world_size, shapes, reps):
    import torch.distributed as dist
    import torch.nn as nn

    from fusedist.nn import SyncBatchNorm

    # a group of one rank per rank: the same layer and math with nobody to talk to, which
    # separates the cost of the statistics path from the cost of the collectives
    solo_groups = [dist.new_group([r]) for r in range(world_size)]
    out = []
    for shape in shapes:
        for memory_format in (("NCHW", "NHWC") if len(shape) == 4 else ("NC",)):
            torch.manual_seed(rank)
            x = torch.randn(shape)
            if memory_format == "NHWC":
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_(True)
            dy = torch.randn_like(x)
            C = shape[1]
            plain = (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(C)
            synced = SyncBatchNorm(C)
            solo = SyncBatchNorm(C, process_group=solo_groups[rank])

            def step(module):
                def run():
                    x.grad = None
                    module(x).backward(dy)
                return run

            dist.barrier()
            timings = _time_round_robin({"bn": step(plain), "solo": step(solo), "sync": step(synced)}, reps)
            row = {"shape": "x".join(map(str, shape)), "layout": memory_format}
            for name, (median, best) in timings.items():
                row[f"{name}_ms"], row[f"{name}_min_ms"] = median * 1e3, best * 1e3
            out.append(row)
    return out


def bench_cpu(reps: int) -> list[dict]:
    from fusedist.testing import run_distributed

    per_rank = run_distributed(_cpu_rank, 2, CPU_SHAPES, reps, timeout=1800,
                               env={"TRITON_INTERPRET": "0"})
    rows = []
    for i, row in enumerate(per_rank[0]):
        # a synchronized step ends together on both ranks: report the slower rank's median
        worst = {k: max(r[i][f"{k}_ms"] for r in per_rank) for k in ("bn", "solo", "sync")}
        best = {k: min(r[i][f"{k}_min_ms"] for r in per_rank) for k in ("bn", "solo", "sync")}
        rows.append({"shape (per rank)": row["shape"], "layout": row["layout"],
                     "BatchNorm_ms": worst["bn"], "SyncBN_1rank_ms": worst["solo"],
                     "SyncBN_2ranks_ms": worst["sync"],
                     "BatchNorm_min_ms": best["bn"], "SyncBN_1rank_min_ms": best["solo"],
                     "SyncBN_2ranks_min_ms": best["sync"],
                     "ratio_1rank": worst["solo"] / worst["bn"],
                     "ratio_2ranks": worst["sync"] / worst["bn"],
                     "ratio_2ranks_min": best["sync"] / best["bn"]})
    return rows


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-cuda", action="store_true")
    parser.add_argument("--reps", type=int, default=30, help="CPU repetitions per contender")
    parser.add_argument("--batch", default="32,64", help="per-GPU batches for the ResNet-50 shapes (comma-separated)")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16", help="CUDA dtypes (comma-separated)")
    parser.add_argument("--note", default="", help="a sentence about the run's conditions, added to the report")
    args = parser.parse_args()
    info = hardware()
    if os.name == "posix":
        info["load avg (1 min, at start)"] = f"{os.getloadavg()[0]:.1f}"
    env_line = ", ".join(f"{k} {v}" for k, v in info.items())
    if args.note:
        env_line += f". {args.note.rstrip('.')}"
    if not args.skip_cpu:
        rows = bench_cpu(args.reps)
        write_results("syncbn_cpu", rows, "\n".join([
            "# SyncBatchNorm on CPU: fusedist SyncBatchNorm vs nn.BatchNorm, forward+backward",
            "",
            f"{env_line}. Two ranks on gloo, one torch thread each, the same per-rank batch for "
            "every contender, timed round-robin; `_ms`: median of the slower rank, `_min_ms`: "
            "least disturbed repetition. `SyncBN_1rank`: fusedist SyncBatchNorm over a group of "
            "one (same math, no collective); `SyncBN_2ranks`: synchronized over both ranks (one "
            "all-gather forward, one all-reduce backward). Ratios are against nn.BatchNorm on the "
            "same batch: the cost of the pure-PyTorch statistics path and of being synchronized.",
        ]))
    if not args.skip_cuda and torch.cuda.is_available():
        batches = [int(b) for b in args.batch.split(",")]
        rows = bench_cuda(batches, [getattr(torch, d) for d in args.dtypes.split(",")])
        line = verdict(rows)
        # one file per batch list, so that run_checks.sh can time the batches in separate runs
        write_results(f"syncbn_cuda_batch{'-'.join(map(str, batches))}", rows, "\n".join([
            "# SyncBatchNorm kernels on CUDA: fusedist (Triton) vs torch's SyncBatchNorm kernels",
            "",
            f"{env_line}. ResNet-50 BatchNorm shapes, per-GPU batch {args.batch}; median µs "
            "(triton.testing.do_bench); `frac_read_bw` = achieved GB/s over a same-run torch.sum "
            "read bandwidth; `speedup_vs_torch` = torch time / fusedist time. `_host_us`: the "
            "host's time to issue one call; `_device_us`: the call replayed from a CUDA graph, the "
            "kernels alone (20 calls per graph, inputs warm in L2), `device_speedup` their ratio "
            "(Note [call time and device time] in the benchmark). `path`: the kernels' choice (per-channel: "
            "Note [one program per channel] in triton_kernels/syncbn_reduce.py). `launch_cache_*`: the same "
            "call with FUSEDIST_TRITON_LAUNCH_CACHE=1 (Note [the launch cache is opt-in]).",
            "",
            line,
        ]))
        print(line)
    elif not args.skip_cuda:
        print("no CUDA device: CUDA kernel benchmark skipped")


if __name__ == "__main__":
    main()
