"""Shared helpers of the benchmark scripts: timing, hardware/version header, result files.

* :func:`bench_ms` times a callable: ``triton.testing.do_bench`` on CUDA (median and 20/80%
  quantiles over CUDA-event timings, with cache flushing between runs), a repeated
  ``perf_counter`` timer on CPU. Both return milliseconds.
* :func:`environment` describes the machine (date, CPU model, cores, GPU, versions).
* :func:`time_interleaved` times several contenders in turn within each repetition (ranks
  barrier-aligned), so a drifting load hits all alike; :func:`rank_device` binds a rank to its
  device, also when ranks share a GPU.
* :func:`write_results` writes ``benchmarks/results/<name>_<date>.md`` and ``.csv``: a table of
  the rows with the environment in the header, so a result file always says where it came from.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import os
import platform
import statistics
import subprocess
import time
from typing import Callable, Sequence

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional for CPU runs
        triton_version = "not installed"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton_version,
        "torch_threads": torch.get_num_threads(),
        # A busy shared machine skews CPU timings; the load says how busy it was.
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else "n/a",
    }


def time_cpu(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 20) -> dict:
    """Median and 20/80% quantiles (ms) of ``repeats`` timed calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    q = statistics.quantiles(samples, n=10) if len(samples) > 1 else samples * 9
    return {"median_ms": statistics.median(samples), "p20_ms": q[1], "p80_ms": q[7]}


def time_cuda(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> dict:
    import triton.testing

    median, p20, p80 = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return {"median_ms": median, "p20_ms": p20, "p80_ms": p80}


def host_ms_per_call(fn: Callable[[], object], calls: int = 20) -> float:
    """The host's time per call on CUDA, ``calls`` calls issued back to back (far fewer launches
    than the queue holds, so none waits for the GPU): about the device time when launches and
    Python bound the call, far less when its kernels do, the device time or more when it
    synchronizes the host."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return took


def graph_ms_per_call(fn: Callable[[], object], calls: int = 20, replays: int = 5) -> float:
    """The device's time per call with no host work between calls: ``calls`` calls captured in
    one CUDA graph, replayed ``replays`` times, the median per call. No cache flush between the
    calls (inputs that fit stay in L2, for every contender alike). ``fn`` must have run before
    (compiled, its allocations made) and be capturable."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(samples)


@contextlib.contextmanager
def launch_cache_on(launchers: dict | None = None):
    """Within the block, fusedist's Triton launches go through the launch cache (Note [the
    launch cache is opt-in] in triton_kernels/launch_cache.py), whatever the setting outside;
    yields whether this Triton supports it (False: the block runs the JIT path as usual).
    ``launchers``: a dict that keeps the block's launchers for the next block (see
    :func:`with_launchers`); a fresh one by default."""
    from fusedist.triton_kernels import launch_cache

    saved_env, saved_launchers = os.environ.get("FUSEDIST_TRITON_LAUNCH_CACHE"), launch_cache._LAUNCHERS
    os.environ["FUSEDIST_TRITON_LAUNCH_CACHE"] = "1"
    launch_cache._LAUNCHERS = {} if launchers is None else launchers
    try:
        yield launch_cache._enabled()
    finally:
        launch_cache._LAUNCHERS = saved_launchers
        if saved_env is None:
            os.environ.pop("FUSEDIST_TRITON_LAUNCH_CACHE", None)
        else:
            os.environ["FUSEDIST_TRITON_LAUNCH_CACHE"] = saved_env


def with_launchers(fn: Callable[[], object], launchers: dict) -> Callable[[], object]:
    """``fn`` run with the launchers a :func:`launch_cache_on` block made (call ``fn`` once in
    such a block first): each call swaps the module's table in and out, two assignments, so
    calls can be timed in turn with the default path's."""
    from fusedist.triton_kernels import launch_cache

    def run():
        saved, launch_cache._LAUNCHERS = launch_cache._LAUNCHERS, launchers
        try:
            return fn()
        finally:
            launch_cache._LAUNCHERS = saved

    return run


def bench_ms(fn: Callable[[], object], device: torch.device | str, **kwargs) -> dict:
    """Time ``fn`` on ``device`` with the right timer (see module docstring)."""
    if torch.device(device).type == "cuda":
        return time_cuda(fn, **kwargs)
    return time_cpu(fn, **kwargs)


def _markdown_table(rows: Sequence[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in rows:
        cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def add_run_options(parser) -> None:
    """``--quick``, ``--no-write`` and ``--note``: the options :func:`record_results` reads."""
    parser.add_argument("--quick", action="store_true", help="a few short repetitions (a smoke run)")
    parser.add_argument("--no-write", action="store_true", help="print only, write no result file")
    parser.add_argument("--note", default="", help="a line for the result file (the machine, the commit compared)")


def record_results(name: str, rows: list[dict], notes: str, args) -> None:
    """The result files of a script's run, unless it was given ``--no-write``; its ``--note``
    (a line about the machine or the commit compared) follows the notes."""
    if getattr(args, "no_write", False):
        return
    if getattr(args, "note", ""):
        notes += "\n\n" + args.note
    for path in write_results(name, rows, notes):
        print("wrote", path)


def write_results(name: str, rows: Sequence[dict], markdown: str = "", env: dict | None = None) -> tuple[str, str]:
    """Write ``results/<name>_<date>.md`` (environment, ``markdown`` notes, table) and
    ``.csv`` (one line per row, environment columns appended). Returns both paths."""
    env = env or environment()
    os.makedirs(RESULTS_DIR, exist_ok=True)
    base = os.path.join(RESULTS_DIR, f"{name}_{env['date']}")
    header = "\n".join(f"- {k}: {v}" for k, v in env.items())
    with open(base + ".md", "w", encoding="utf-8") as f:
        f.write(f"# {name} ({env['date']})\n\n{header}\n\n")
        if markdown:
            f.write(markdown.strip() + "\n\n")
        f.write(_markdown_table(rows))
    with open(base + ".csv", "w", newline="", encoding="utf-8") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) + list(env))
            writer.writeheader()
            for row in rows:
                writer.writerow({**row, **env})
    return base + ".md", base + ".csv"


def sync(device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(fns, device, comm, warmup, repeats):
    """Median and p20/p80 of each of ``fns``, timed in turn within every repetition, so a
    shared machine's load drifts alike for all of them and their ratios stay fair."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            comm.barrier()
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            samples[name].append((time.perf_counter() - start) * 1e3)
    out = {}
    for name, s in samples.items():
        q = statistics.quantiles(s, n=10) if len(s) > 1 else s * 9
        out[name] = (statistics.median(s), q[1], q[7])
    out["_samples"] = samples  # per repetition, aligned across fns (paired ratios)
    return out


def rank_device(device_type: str, rank: int) -> torch.device:
    """This rank's device, bound: ranks may share a GPU (FUSEDIST_TEST_RANKS_PER_GPU, Note
    [several ranks on one GPU] in fusedist/testing/shared_gpu.py)."""
    if device_type != "cuda":
        return torch.device("cpu")
    from fusedist.testing import device_for_rank

    index = device_for_rank(rank)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
