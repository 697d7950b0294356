"""A ZeRO script may end right after its last ``step()``: its processes exit cleanly.

The last step's parameter all-gathers are still in flight when such a script returns. Before
Note [draining at exit] (fusedist/comm/__init__.py) every rank then aborted at interpreter
shutdown ("terminate called without an active exception", exit code -6) on every run, with
or without ``destroy_process_group()``. Launched under torchrun, as users run it: one job with
``destroy_process_group()`` at the end and one without, each training a stage-1 and a stage-2
model side by side (two jobs of three processes, not one per stage).
"""

import os

from torchrun_launch import finish, launch

SCRIPT = os.path.join(os.path.dirname(__file__), "fault_scripts", "zero_exit.py")


def test_script_ending_right_after_step_exits_cleanly():
    cases = [("1,2", "keep"), ("1,2", "destroy")]
    procs = {case: launch(SCRIPT, *case) for case in cases}  # concurrently: a shorter suite
    for case, proc in procs.items():
        returncode, out = finish(proc, timeout=180)
        assert returncode == 0, f"{case}: exit code {returncode}\n{out[-3000:]}"
        assert "terminate called" not in out, f"{case}:\n{out[-3000:]}"
        assert "rank 0 finished" in out and "rank 1 finished" in out
