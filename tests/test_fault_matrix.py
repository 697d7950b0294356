"""Fault matrix under torchrun on CPU: each fault ends every rank, fast, with a useful message.

Each case launches ``torchrun --standalone --nproc_per_node=2 fault_scripts/train_fault.py
<fault>`` with a 3 s collective timeout and a 3 s report window, and checks that the job
exits non-zero within timeout + window + slack of the fault (slack covers process exit and
a loaded 2-core machine) and that the output names the faulty rank and what happened.
The three launches run concurrently with the two CPU launches of test_fault_matrix_ws2.py
(``cpu_fault_runs``), to keep the suite short: five jobs share one wait for their timeouts.

``--monitor-interval=2``: torchrun SIGTERMs the surviving workers once it notices a failed
one; checking every 2 s instead of 0.1 s lets the survivors print their stall report first
(a real job wants that too: the report is how the survivors learn who failed).

Item 3 (inf/nan gradients on one rank) checks numbers, not process exits, so it runs on the
project's multi-process harness, which returns each rank's values.

Checkpoint items 4.-7. (killed mid-save, corrupted/truncated file, exact resume, world-size
change) are in tests/test_resume.py and tests/test_checkpoint.py.
"""

import functools
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torchrun_launch import finish, launch

SCRIPT = os.path.join(os.path.dirname(__file__), "fault_scripts", "train_fault.py")
WS2_SCRIPT = os.path.join(os.path.dirname(__file__), "fault_scripts", "mismatch_and_stall.py")
# Slack: after the timeout and the report window, the survivors print their reports and
# exit, torchrun notices (every 2 s) and ends the job. With three launches (six ranks and
# three agents) sharing 2 cores, fault to job end measured 10.6-11.5 s at a load average of 9.8,
# 5 s of slack used where 15 s was allowed. The five launches of ``cpu_fault_runs`` (ten ranks
# and five agents) measured 11-25 s at a load average of 15 (the slowest: ``mismatched_model``,
# whose fault is right after start-up, while the other jobs still import torch). 45 s keeps
# the bound (51 s) over that with room for a busier machine and far under what a fault without
# fusedist's timeout takes (the collective's default timeout, minutes; _finish calls a job
# still running at 120 s a hang).
TIMEOUT_S, WINDOW_S, SLACK_S = 3.0, 3.0, 45.0


def _launch(fault, script=SCRIPT, *args):
    env = dict(FUSEDIST_TIMEOUT_S=str(TIMEOUT_S), FUSEDIST_STALL_REPORT_S=str(WINDOW_S))
    return launch(script, fault, *args, env=env, monitor_interval=2)


def _finish(proc):
    returncode, out = finish(proc, timeout=120)
    ended = time.time()
    fault_at = re.search(r"FAULT_AT ([0-9.]+)", out)
    return returncode, out, ended - float(fault_at.group(1)) if fault_at else None


def _finish_all(procs: dict) -> dict:
    """``_finish`` of concurrent launches, each waited for on its own thread, so that each end
    time is its own: waited for one after the other, a launch that ended while the test still
    waited for an earlier one was timed at that one's end, its reaction grown by the delay."""
    with ThreadPoolExecutor(len(procs)) as pool:
        futures = {key: pool.submit(_finish, proc) for key, proc in procs.items()}
        return {key: future.result() for key, future in futures.items()}


@functools.lru_cache(maxsize=None)
def cpu_fault_runs() -> dict:
    """``_finish`` of every CPU launch of the fault matrix by fault: this file's three and
    test_fault_matrix_ws2.py's two (``mismatched_model``, ``stall``), started at once and run
    once per test process: the jobs spend most of their time waiting for their collective
    timeouts and report windows, which then overlap instead of adding up."""
    procs = {fault: _launch(fault) for fault in ("raise_in_backward", "skip_step", "exit_early")}
    procs.update({fault: _launch(fault, WS2_SCRIPT, "cpu") for fault in ("mismatched_model", "stall")})
    return _finish_all(procs)


@pytest.fixture(scope="module")
def inf_on_one_rank_run():
    """Future of item 3's launch, started by the first test that asks: it runs while the torchrun
    jobs of ``cpu_fault_runs`` wait for their timeouts, instead of after them."""
    from fusedist.testing import run_distributed

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run_distributed, _inf_on_one_rank_worker, 2, timeout=120)


def test_fault_matrix_under_torchrun(inf_on_one_rank_run):
    results = cpu_fault_runs()

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
        assert f"this is rank {rank}) in synchronized backward #2, whose buckets 0..0" in out
    assert "forward: ranks [0]: 3; ranks [1]: 4" in out

    # 2b. One rank runs one iteration fewer: the waiting rank's report says it exited early, as
    # fast (timed from rank 1's step 2, two steps before it leaves: a bound on the reaction).
    rc, out, reaction = results["exit_early"]
    assert rc != 0, out[-3000:]
    assert reaction is not None and reaction < TIMEOUT_S + WINDOW_S + SLACK_S, (reaction, out[-3000:])
    assert "rank 1 finished 4 steps" in out and "rank 0 finished" not in out
    assert "rank 1 on" in out and "EXITED without an error; at DDP step 4" in out
    assert "ranks [0] reached all_reduce [ddp bucket 0]" in out


# ---------------------------------------------------------------- 3. inf/nan on one rank
def _inf_on_one_rank_worker(rank, world_size, steps=5, bad_step=2):
    """fusedist DDP + FusedAdamW + fusedist GradScaler next to torch DDP + AdamW + torch's
    GradScaler, same data; at ``bad_step`` rank 1's loss is multiplied by inf, so only its
    local gradients are inf/nan (DDP's average then spreads them to every rank)."""
    import copy

    import torch
    from torch import nn

    import fusedist
    from fusedist.amp import GradScaler

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt_ours = fusedist.optim.FusedAdamW(ours.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sc_ours = GradScaler("cpu", init_scale=2.0**10)
    sc_ref = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    gen = torch.Generator().manual_seed(rank)
    skipped, scales = [], []
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        before = [p.detach().clone() for p in ours.parameters()]
        for model, opt, scaler in ((ours, opt_ours, sc_ours), (ref, opt_ref, sc_ref)):
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            if rank == 1 and step == bad_step:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        unchanged = all(torch.equal(a, b.detach()) for a, b in zip(before, ours.parameters()))
        skipped.append((sc_ours.last_step_skipped, unchanged))
        scales.append((sc_ours.get_scale(), sc_ref.get_scale()))
    flat_ours = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    flat_ref = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    return skipped, scales, flat_ours, flat_ref


def test_inf_gradients_on_one_rank_skip_the_step_on_every_rank(inf_on_one_rank_run):
    results = inf_on_one_rank_run.result()
    for skipped, scales, flat_ours, flat_ref in results:
        # Every rank skipped exactly the bad step, and only it, and left the parameters as they were.
        assert skipped == [(False, False), (False, False), (True, True), (False, False), (False, False)]
        # The scale backed off once, like torch's GradScaler on the same run.
        assert [s for s, _ in scales] == [r for _, r in scales] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
        # Same trajectory as torch AdamW: fp32 and a handful of steps, so only the fused
        # kernel's operation order differs (a few ulps per step); 1e-5 is ~100 ulps at |p|~0.5.
        assert (flat_ours - flat_ref).abs().max().item() < 1e-5
    # Parameters bitwise identical across ranks (same averaged gradients, same update).
    assert torch.equal(results[0][2], results[1][2])
