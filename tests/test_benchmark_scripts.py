"""The benchmark scripts that only run for real on a GPU still run, on CPU, in CI: a script that
first meets Python when the GPU is lent wastes the GPU's time."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpt_step_benchmark_runs_on_cpu():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpt_step.py"), "--device", "cpu",
         "--repeats", "1", "--no-write"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    for row in ("'row': 'ddp'", "'row': 'zero2'", "'row': 'zero2, gathers inside step'", "'row': 'zero3'",
                "worst ratio against torch"):
        assert row in out.stdout, out.stdout


def test_ddp_benchmark_runs_both_rows():
    """bench_ddp's rows (the MLP with every contender launched alone, and many-params) at
    their --quick sizes: the script that reports fusedist DDP's step-time ratio keeps working."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_ddp.py"), "--quick", "--no-write"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    for line in ("fusedist / torch step time", "launched alone", "fusedist / torch: **"):
        assert line in out.stdout, out.stdout


def test_cpu_sgd_benchmark_runs():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_sgd_cpu.py"), "--quick", "--no-write"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("torch_over_fusedist=") == 3, out.stdout


def test_pipeline_benchmark_runs():
    """bench_pipeline's three contenders at --quick size (4 ranks): fusedist's stage issues one
    reduce-scatter per unit and step, torch's stage one per micro-batch."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_pipeline.py"), "--quick", "--no-write",
         "--microbatches", "4"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "fusedist stage / torch FSDP2 stage:" in out.stdout, out.stdout
    assert "'reduce_scatters_per_step': 2}" in out.stdout and "'reduce_scatters_per_step': 8}" in out.stdout, out.stdout


def test_amp_step_host_benchmark_runs():
    """bench_amp_step_host at --quick size: it times the Triton path's host code (it refuses to
    time another path), one row per dtype and unscale mode."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_amp_step_host.py"), "--quick", "--no-write",
         "--counts", "4"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count(" total ") == 4, out.stdout
