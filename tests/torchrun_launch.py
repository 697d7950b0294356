"""Launching a script under torchrun from a test, as users run jobs (CPU, gloo, 2 ranks)."""

import os
import subprocess
import sys


def launch(script: str, *args: str, env: dict | None = None, monitor_interval: float | None = None,
           nproc: int = 2, torchrun_args: tuple = ()):
    """Start ``torchrun --standalone --nproc_per_node=<nproc> <torchrun_args> script args...``;
    output merged."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args]
    if monitor_interval is not None:
        cmd.append(f"--monitor-interval={monitor_interval:g}")
    return subprocess.Popen(cmd + [script, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout: float) -> tuple[int, str]:
    """(exit code, output); a launch still running after ``timeout`` seconds is a hang: killed,
    and reported with its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not finish within {timeout:g} s (a hang):\n{out[-4000:]}")
    return proc.returncode, out
