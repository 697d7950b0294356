"""Fault matrix under torchrun on CPU: each fault ends every rank, fast, with a useful message.

Each case launches ``torchrun --standalone --nproc_per_node=2 fault_scripts/train_fault.py
<fault>`` with a 3 s collective timeout and a 3 s report window, and checks that the job
exits non-zero within timeout + window + slack of the fault (slack covers process exit and
a loaded 2-core machine) and that the output names the faulty rank and what happened.
The three launches run concurrently to keep the suite short.

``--monitor-interval=2``: torchrun SIGTERMs the surviving workers once it notices a failed
one; checking every 2 s instead of 0.1 s lets the survivors print their stall report first
(a real job wants that too: the report is how the survivors learn who failed).

Pending items of the fault matrix (need features of other branches):
  3. NaN/inf gradients on one rank with GradScaler (needs the fused GradScaler);
  4.-7. checkpoint faults, exact resume and world-size change (need fusedist.checkpoint).
"""

import os
import re
import subprocess
import sys
import time

SCRIPT = os.path.join(os.path.dirname(__file__), "fault_scripts", "train_fault.py")
TIMEOUT_S, WINDOW_S, SLACK_S = 3.0, 3.0, 15.0


def _launch(fault):
    env = dict(os.environ, FUSEDIST_TIMEOUT_S=str(TIMEOUT_S), FUSEDIST_STALL_REPORT_S=str(WINDOW_S),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor-interval=2", SCRIPT, fault]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc):
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not finish within 120 s (a hang):\n{out[-4000:]}")
    ended = time.time()
    fault_at = re.search(r"FAULT_AT ([0-9.]+)", out)
    return proc.returncode, out, ended - float(fault_at.group(1)) if fault_at else None


def test_fault_matrix_under_torchrun():
    procs = {fault: _launch(fault) for fault in ("raise_in_backward", "skip_step", "exit_early")}
    results = {fault: _finish(proc) for fault, proc in procs.items()}

    # 1. One rank raises mid-backward: every rank exits non-zero, the output names rank 1.
    rc, out, reaction = results["raise_in_backward"]
    assert rc != 0, out[-3000:]
    assert reaction is not None and reaction < TIMEOUT_S + WINDOW_S + SLACK_S, (reaction, out[-3000:])
    assert "[rank1]: ValueError: injected failure in backward" in out
    assert "rank 1 on" in out and "CRASHED with ValueError: injected failure in backward" in out
    assert "ranks [0] reached all_reduce [ddp bucket" in out
    assert "finished" not in out  # no rank completed the run

    # 2. One rank skips a step: a mismatch naming ranks, step and buckets on every rank, no hang.
    rc, out, reaction = results["skip_step"]
    assert rc != 0, out[-3000:]
    assert reaction is not None and reaction < TIMEOUT_S + WINDOW_S + SLACK_S, (reaction, out[-3000:])
    for rank in (0, 1):
        assert f"[rank{rank}]: fusedist._consistency.RankMismatchError: fusedist DDP: ranks diverged" in out
        assert f"this is rank {rank}) at the end of synchronized backward #2, after buckets 0..0" in out
    assert "forward: ranks [0]: 3; ranks [1]: 4" in out

    # 2b. One rank runs one iteration fewer: the waiting rank's report says it exited early.
    rc, out, reaction = results["exit_early"]
    assert rc != 0, out[-3000:]
    assert "rank 1 finished 3 steps" in out and "rank 0 finished" not in out
    assert "rank 1 on" in out and "EXITED without an error; at DDP step 3" in out
    assert "ranks [0] reached all_reduce [ddp bucket 0]" in out
