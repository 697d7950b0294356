"""Launching a script under torchrun from a test, as users run jobs (CPU, gloo, 2 ranks).

With ``FUSEDIST_TEST_RANKS_PER_GPU`` set (in ``env`` or the test's environment), each worker
starts through ``fusedist.testing.run_rank``, which gives it the settings for sharing a GPU
with other ranks before the script runs (Note [several ranks on one GPU] in
``fusedist/testing/shared_gpu.py``).
"""

import os
import subprocess
import sys

from fusedist.testing import ranks_per_gpu_setting


def launch(script: str, *args: str, env: dict | None = None, monitor_interval: float | None = None,
           nproc: int = 2, torchrun_args: tuple = ()):
    """Start ``torchrun --standalone --nproc_per_node=<nproc> <torchrun_args> script args...``;
    output merged."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args]
    if monitor_interval is not None:
        cmd.append(f"--monitor-interval={monitor_interval:g}")
    if ranks_per_gpu_setting(env) is not None:  # raises on a malformed value, here, once
        cmd += ["-m", "fusedist.testing.run_rank"]
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
