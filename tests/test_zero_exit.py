"""A ZeRO script may end right after its last ``step()``: its processes exit cleanly.

The last step's parameter all-gathers are still in flight when such a script returns. Before
Note [draining at exit] (fusedist/comm/__init__.py) every rank then aborted at interpreter
shutdown ("terminate called without an active exception", exit code -6) on every run, with
or without ``destroy_process_group()``. Launched under torchrun, as users run it.
"""

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "fault_scripts", "zero_exit.py")


def _launch(stage, ending):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           SCRIPT, str(stage), ending]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_script_ending_right_after_step_exits_cleanly():
    cases = [(2, "keep"), (2, "destroy"), (1, "keep")]
    procs = {case: _launch(*case) for case in cases}  # concurrently: keeps the suite short
    for case, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            raise AssertionError(f"{case}: torchrun did not finish within 180 s:\n{out[-3000:]}")
        assert proc.returncode == 0, f"{case}: exit code {proc.returncode}\n{out[-3000:]}"
        assert "terminate called" not in out, f"{case}:\n{out[-3000:]}"
        assert "rank 0 finished" in out and "rank 1 finished" in out
