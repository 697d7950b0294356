"""The benchmark scripts that only run for real on a GPU still run, on CPU, in CI: a script that
first meets Python when the GPU is lent wastes the GPU's time.

Only the scripts' output is checked, never their figures, so the selected tests' scripts all
start at once (``script_runs``) and each test reads its own: their interpreter starts, rank
launches and single-threaded loops overlap instead of adding up on a 2-core machine.
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: {test: the benchmark script's command line (after the interpreter)}
_SCRIPTS = {
    # (width 16, not the CPU default 64, and no untimed round: the rows are all this checks, not
    # their figures -- the one round then carries the first steps' one-time costs; two blocks
    # still gather in turn)
    "test_gpt_step_benchmark_runs_on_cpu": ("bench_gpt_step.py", "--device", "cpu", "--repeats", "1", "--no-write",
                                            "--width", "16", "--warmup", "0"),
    # (--quick's sizes but a narrower MLP and a shorter stack, given explicitly: they win over
    # --quick; each contender is still launched alone)
    "test_ddp_benchmark_runs_both_rows": ("bench_ddp.py", "--no-write", "--quick", "--width", "256",
                                          "--stack-layers", "200"),
    "test_cpu_sgd_benchmark_runs": ("bench_sgd_cpu.py", "--quick", "--no-write"),
    "test_pipeline_benchmark_runs": ("bench_pipeline.py", "--quick", "--no-write", "--microbatches", "4"),
    "test_amp_step_host_benchmark_runs": ("bench_amp_step_host.py", "--quick", "--no-write", "--counts", "4"),
}


def _finish(proc) -> subprocess.CompletedProcess:
    # 600 s: five scripts share the cores (each took under 300 s alone); only a hang comes near it
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def script_runs(request):
    """{test: future of its script's CompletedProcess}; each script's output is read on its own
    thread, so that none blocks on a full pipe while another is waited for."""
    wanted = {getattr(item, "originalname", item.name) for item in request.session.items
              if item.module is request.module}
    procs = {test: subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for test, (script, *args) in _SCRIPTS.items() if test in wanted}
    with ThreadPoolExecutor(max(len(procs), 1)) as pool:
        yield {test: pool.submit(_finish, proc) for test, proc in procs.items()}


def _output(script_runs, test) -> str:
    out = script_runs[test].result()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_gpt_step_benchmark_runs_on_cpu(script_runs):
    stdout = _output(script_runs, "test_gpt_step_benchmark_runs_on_cpu")
    for row in ("'row': 'ddp'", "'row': 'zero2'", "'row': 'zero2, gathers inside step'", "'row': 'zero3'",
                "worst ratio against torch"):
        assert row in stdout, stdout


def test_ddp_benchmark_runs_both_rows(script_runs):
    """bench_ddp's rows (the MLP with every contender launched alone, and many-params) at
    smoke-test sizes: the script that reports fusedist DDP's step-time ratio keeps working."""
    stdout = _output(script_runs, "test_ddp_benchmark_runs_both_rows")
    # (the sizes given with --quick, and --quick's for the rest)
    for line in ("fusedist / torch step time", "launched alone", "fusedist / torch: **",
                 "Model: 4x Linear(256,256) MLP", "2 rounds x 2 steps", "Model: 200x (Linear(16,16) + Tanh)"):
        assert line in stdout, stdout


def test_cpu_sgd_benchmark_runs(script_runs):
    stdout = _output(script_runs, "test_cpu_sgd_benchmark_runs")
    assert stdout.count("torch_over_fusedist=") == 3, stdout


def test_pipeline_benchmark_runs(script_runs):
    """bench_pipeline's three contenders at --quick size (4 ranks): fusedist's stage issues one
    reduce-scatter per unit and step, torch's stage one per micro-batch."""
    stdout = _output(script_runs, "test_pipeline_benchmark_runs")
    assert "fusedist stage / torch FSDP2 stage:" in stdout, stdout
    assert "'reduce_scatters_per_step': 2}" in stdout and "'reduce_scatters_per_step': 8}" in stdout, stdout


def test_amp_step_host_benchmark_runs(script_runs):
    """bench_amp_step_host at --quick size: it times the Triton path's host code (it refuses to
    time another path), one row per dtype and unscale mode."""
    stdout = _output(script_runs, "test_amp_step_host_benchmark_runs")
    assert stdout.count(" total ") == 4, stdout


def test_reliability_benchmark_explicit_options_win_over_quick():
    """bench_reliability's ``--quick`` stands in for the defaults only, as bench_ddp's does: an
    option given with it keeps its value, before or after ``--quick`` (it overwrote them)."""
    import importlib

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        bench = importlib.import_module("bench_reliability")
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    for argv in (["--quick", "--width", "256", "--steps", "7"], ["--width", "256", "--steps", "7", "--quick"]):
        args = bench.parse_options(argv)
        assert (args.width, args.steps, args.layers, args.rounds) == (256, 7, 4, 3), (argv, args)
    args = bench.parse_options(["--quick"])
    assert (args.width, args.layers, args.rounds, args.steps) == (512, 4, 3, 3), args
    args = bench.parse_options([])
    assert (args.width, args.layers, args.rounds, args.steps) == (1536, 8, 12, 2), args
