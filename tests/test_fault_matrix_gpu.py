"""The fault matrix of tests/test_fault_matrix.py on NCCL: the same faults, two ranks under
torchrun, on GPUs (auto-skipped without room for two ranks).

On a machine with one GPU run it with ``FUSEDIST_TEST_RANKS_PER_GPU=2``: the launcher gives
each worker the settings for sharing the GPU (Note [several ranks on one GPU] in
fusedist/testing/shared_gpu.py), and fusedist.init_distributed picks NCCL. Every rank must
exit within timeout + report window + slack of the fault, with fusedist's report naming the
faulty rank and the collective (not only torch's watchdog).
"""

import pytest
import torch
from test_fault_matrix import SCRIPT, TIMEOUT_S, WINDOW_S, _finish
from torchrun_launch import launch

from fusedist.testing import rank_slots, ranks_per_gpu_setting

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        rank_slots(torch.cuda.device_count() if torch.cuda.is_available() else 0, ranks_per_gpu_setting()) < 2,
        reason="needs room for 2 ranks: 2 GPUs, or 1 with FUSEDIST_TEST_RANKS_PER_GPU=2"),
]

# NCCL init and a first CUDA context per rank come on top of the CPU run's slack.
SLACK_S = 45.0


def test_fault_matrix_on_nccl():
    env = dict(FUSEDIST_TIMEOUT_S=str(TIMEOUT_S), FUSEDIST_STALL_REPORT_S=str(WINDOW_S))
    procs = {fault: launch(SCRIPT, fault, env=env, monitor_interval=2)
             for fault in ("none", "raise_in_backward", "skip_step", "exit_early")}
    results = {fault: _finish(proc) for fault, proc in procs.items()}

    rc, out, _ = results["none"]  # the script itself runs on NCCL
    assert rc == 0 and "rank 0 finished 5 steps" in out and "rank 1 finished 5 steps" in out, out[-3000:]

    rc, out, reaction = results["raise_in_backward"]
    assert rc != 0, out[-3000:]
    assert reaction is not None and reaction < TIMEOUT_S + WINDOW_S + SLACK_S, (reaction, out[-3000:])
    assert "injected failure in backward" in out and "rank 1 on" in out, out[-3000:]
    assert "reached all_reduce [ddp bucket" in out, out[-3000:]

    rc, out, reaction = results["skip_step"]
    assert rc != 0, out[-3000:]
    assert reaction is not None and reaction < TIMEOUT_S + WINDOW_S + SLACK_S, (reaction, out[-3000:])
    assert "RankMismatchError: fusedist DDP: ranks diverged" in out, out[-3000:]

    rc, out, _ = results["exit_early"]
    assert rc != 0, out[-3000:]
    assert "EXITED without an error; at DDP step 4" in out, out[-3000:]
    assert "reached all_reduce [ddp bucket 0]" in out, out[-3000:]
