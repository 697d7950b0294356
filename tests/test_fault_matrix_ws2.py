"""Two more faults of the fault matrix under torchrun, on gloo (``cpu``) and on NCCL (``cuda``):
mismatched models and a collective timeout (fault_scripts/mismatch_and_stall.py).

The ``cuda`` variant needs room for two ranks (two GPUs, or one shared through
``FUSEDIST_TEST_RANKS_PER_GPU=2``: the launcher gives each worker the settings for sharing,
Note [several ranks on one GPU] in fusedist/testing/shared_gpu.py). The two launches run
concurrently. Every rank must exit non-zero within collective timeout + report window + slack
of the fault (slack: process exit on a loaded 2-core machine, and on a GPU a CUDA context and
NCCL init per rank; under 60 s in all), with an error naming the problem. (The ``cpu`` launches
run with test_fault_matrix.py's, all at once: ``cpu_fault_runs``.)

* ``mismatched_model``: rank 1 builds a hidden layer of 33 instead of 32. Wrapping the model
  fails on *every* rank with the first differing parameter, both shapes and the odd rank.
* ``stall``: rank 1 sleeps outside any collective at step 2 (far longer than the timeout).
  Rank 0's gradient all-reduce times out; its error is fusedist's stall report (the op and
  bucket, rank 1 not reporting), not only the backend's timeout; torchrun then ends rank 1.
"""

import pytest
from conftest import requires_rank_slots
from test_fault_matrix import SLACK_S as CPU_SLACK_S
from test_fault_matrix import TIMEOUT_S, WINDOW_S, WS2_SCRIPT, _finish_all, _launch, cpu_fault_runs

# cpu: 12.4 s fault to job end measured alone at a load average of 8.9, up to 25 s launched with
# the other CPU faults (test_fault_matrix.py)
SLACK_S = {"cpu": CPU_SLACK_S, "cuda": 45.0}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_rank_slots(2)])])
def test_mismatched_models_and_collective_timeout(device):
    if device == "cpu":
        results = cpu_fault_runs()  # (launched with the other CPU faults; each timed on its own)
    else:
        results = _finish_all({fault: _launch(fault, WS2_SCRIPT, device) for fault in ("mismatched_model", "stall")})
    bound = TIMEOUT_S + WINDOW_S + SLACK_S[device]

    rc, out, reaction = results["mismatched_model"]
    assert rc != 0, out[-3000:]
    assert reaction is not None and reaction < bound, (reaction, out[-3000:])
    for rank in (0, 1):
        assert (f"[rank{rank}]: fusedist._consistency.RankMismatchError: fusedist: the model (parameters and "
                f"buffers) differs across ranks (this is rank {rank})") in out, out[-3000:]
    assert "ranks [0]: param '0.weight' shape (32, 16)" in out and "ranks [1]: param '0.weight' shape (33, 16)" in out
    assert "finished" not in out

    rc, out, reaction = results["stall"]
    assert rc != 0, out[-3000:]
    assert reaction is not None and reaction < bound, (reaction, out[-3000:])
    assert ("[rank0]: fusedist.reliability.monitor.StallError: fusedist: all_reduce (tag 'ddp bucket 0', "
            "collective #") in out and "failed on rank 0 of 2" in out, out[-3000:]
    assert "[rank0]:   rank 1: did not report" in out, out[-3000:]
    assert "[rank0]:   ranks [0] reached all_reduce [ddp bucket 0]" in out, out[-3000:]
    # On NCCL, wait() is stream-ordered (Note [stream-ordered waits and the watchdog]): the
    # failure surfaces at the rank's next collective, which may already be the next step's --
    # or, when the host is blocked behind the collective by then (reading the step check's
    # verdict), the watchdog reports it and ends the process; both print through
    # sys.excepthook, so the lines carry the rank prefix either way.
    steps = ("at DDP step 2",) if device == "cpu" else ("at DDP step 2", "at DDP step 3")
    assert any(s in out for s in steps), out[-3000:]
    assert "finished" not in out
