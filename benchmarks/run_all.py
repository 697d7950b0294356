"""Run every CPU benchmark once, quick where the script has a quick mode, and print a table.

    python benchmarks/run_all.py            # (`make bench`)
    python benchmarks/run_all.py --full     # the full sizes (tens of minutes on 2 cores)

Each script writes its own results under benchmarks/results/ (a quick run replaces a
recorded run of the same name; `git diff` shows what changed); this prints the last line of
each and its exit status. The GPU benchmarks run from benchmarks/gpu/run_checks.sh instead.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (script, extra arguments): the CPU benchmarks in the order a newcomer would read them.
BENCHMARKS = [
    ("bench_optimizer.py", ["--device", "cpu"]),
    ("bench_amp_step_host.py", []),
    ("bench_cpu_adam.py", []),
    ("bench_ddp.py", []),
    ("bench_zero.py", []),
    ("bench_syncbn.py", ["--skip-cuda"]),
    ("bench_reliability.py", []),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="full sizes instead of --quick")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark")
    args = parser.parse_args()
    rows, failed = [], False
    for script, extra in BENCHMARKS:
        path = os.path.join(HERE, script)
        with open(path) as f:
            quick = not args.full and "--quick" in f.read()
        cmd = [sys.executable, path, *extra] + (["--quick"] if quick else [])
        print("$ python", os.path.relpath(path), *cmd[2:], flush=True)
        start = time.monotonic()
        # Its own process group: a benchmark that runs past the limit is stopped with the
        # rank processes it spawned, not just its main process.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=args.timeout)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            lines = [line for line in output.splitlines() if line.strip()]
            last = lines[-1][:110] if lines else ""
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            status, last = f"timed out after {args.timeout:.0f} s", ""
        failed |= status != "ok"
        rows.append((script, status, time.monotonic() - start, last))
    print("\n| benchmark | status | s | last line |\n|---|---|---|---|")
    for script, status, took, last in rows:
        print(f"| {script} | {status} | {took:.0f} | {last.replace('|', '/')} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
