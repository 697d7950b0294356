"""Direct-NCCL communicator vs torch.distributed's NCCL, one GPU.

World size 1 (NCCL refuses two ranks on one GPU), so this measures what fusedist adds or saves
per collective -- Python and launch overhead, stream/event plumbing, host waiting -- not link
bandwidth. Both paths run in the same process on the same buffers; ratios are ours / torch's
(below 1 means fusedist is faster).

    python benchmarks/bench_nccl.py --device cuda [--iters 200]

Writes benchmarks/results/bench_nccl_<date>.md and .csv. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _per_call_us(fn, iters: int) -> float:
    """Median over 5 repeats of the wall time of ``iters`` calls (device synchronized)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return sorted(samples)[len(samples) // 2]


def bench_collectives(ours, theirs, iters: int) -> list[dict]:
    rows = []
    for nbytes in (4 << 10, 1 << 20, 64 << 20):
        x = torch.randn(nbytes // 4, device="cuda")
        torch_us = _per_call_us(lambda: theirs.all_reduce(x, async_op=True).wait(), iters)
        default = ours.blocking_wait
        for blocking in (True, False):
            ours.blocking_wait = blocking
            ours_us = _per_call_us(lambda: ours.all_reduce(x, async_op=True).wait(), iters)
            rows.append({
                "case": f"all_reduce {nbytes >> 10} KiB, launch+wait "
                        f"({'blocking' if blocking else 'stream-only'} wait)",
                "fusedist_us": ours_us, "torch_us": torch_us, "ratio": ours_us / torch_us,
            })
        ours.blocking_wait = default
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda"], help="only cuda is meaningful")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_nccl: skipped, no CUDA GPU visible (it compares NCCL paths on a GPU)")
        return
    import fusedist
    from fusedist.comm import TorchCommunicator
    from fusedist.comm.nccl_comm import NcclCommunicator

    if not fusedist.cuda_ext_available():
        raise SystemExit(f"bench_nccl: fusedist._C is not built: {fusedist.cuda_ext_error()}")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            ours, theirs = NcclCommunicator(), TorchCommunicator()
            rows = bench_collectives(ours, theirs, args.iters)
        finally:
            dist.destroy_process_group()

    import triton

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    header = (f"# bench_nccl, {stamp}\n\nGPU: {torch.cuda.get_device_name(0)}; CPU: {_cpu_model()}, "
              f"{os.cpu_count()} cores; torch {torch.__version__} (CUDA {torch.version.cuda}), "
              f"triton {triton.__version__}, NCCL {ours.nccl_version}. World size 1: overhead, "
              f"not bandwidth. Ratio = fusedist / torch (lower is better).\n")
    lines = [header, "| case | fusedist (us) | torch (us) | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['fusedist_us']:.1f} | {r['torch_us']:.1f} | {r['ratio']:.2f} |" for r in rows]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"bench_nccl_{stamp}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, f"bench_nccl_{stamp}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["date", "gpu", "case", "fusedist_us", "torch_us", "ratio"])
        writer.writeheader()
        for r in rows:
            writer.writerow({"date": stamp, "gpu": torch.cuda.get_device_name(0), **r})
    print("\n".join(lines))
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"bench_nccl: {len(rows)} cases, worst ratio {worst['ratio']:.2f} ({worst['case']})")


if __name__ == "__main__":
    main()
