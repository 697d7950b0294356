"""A program that catches a given-up collective's error and ends by ``sys.exit(n)`` ends soon after,
with status ``n`` -- what Python gives ``sys.exit(n)`` -- after every exit handler ran (Note [ending
after given-up collectives] in fusedist/comm/given_up_exit.py). Before, each of two such ranks
waited at exit for its given-up communicator's helpers, which end only when the peer exits: both
waited out the drain's bound (30 s). The same after a failed gloo exchange, where the launch that
waited for the failed exchange is refused naming that failure.

The ranks are real top-level programs (as torchrun starts them): the exit path is what is tested."""

from __future__ import annotations

import os
import tempfile

import pytest
from script_runs import EXIT_MARKERS, run_at_once, run_ended_at_once

# One rank of a two-rank DDP job; rank 1 skips a backward, both call check_consistency(), which the
# divergence probe fails on both; each catches the error, logs it and calls sys.exit(status).
# argv: rank, rendezvous file, status ("none" for sys.exit(None), "text" for sys.exit("message")).
_RANK = EXIT_MARKERS + r'''
os.environ.update(FUSEDIST_TIMEOUT_S="60", FUSEDIST_DIVERGENCE_PROBE_S="0.3", FUSEDIST_STALL_REPORT_S="0.5")

import datetime
import torch
import torch.distributed as dist
from torch import nn

rank, init, status = int(sys.argv[1]), sys.argv[2], sys.argv[3]
status = {"none": None, "text": "leaving: the job diverged"}.get(status, status)
status = int(status) if isinstance(status, str) and status.lstrip("-").isdigit() else status
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
import fusedist

torch.manual_seed(0)
model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
loss = model(torch.randn(5, 8)).square().mean()
try:
    if rank == 0:
        loss.backward()
    model.check_consistency()
except Exception as exc:
    print(f"ERROR AT {time.time():.3f}: {type(exc).__name__}", flush=True)
    log = open(f"{init}.{rank}.log", "w")  # (never closed nor flushed: the exit flushes it)
    log.write(f"rank {rank} logged {type(exc).__name__}\n")
    sys.exit(status)
print("NO ERROR", flush=True)
'''


# One rank of a two-rank job on fusedist's gloo exchange whose ranks are out of step: rank 0
# all-reduces 4 values, rank 1 5, so their messages never pair and the exchange fails on both at
# fusedist's timeout (3 s); a second all-reduce of the same tensor, launched meanwhile, waited for it.
# Each catches the error, logs it and calls sys.exit(status). argv as above.
_EXCHANGE_RANK = EXIT_MARKERS + r'''
os.environ.update(FUSEDIST_TIMEOUT_S="3")

import datetime
import torch
import torch.distributed as dist
from fusedist.comm import get_communicator

rank, init, status = int(sys.argv[1]), sys.argv[2], sys.argv[3]
status = None if status == "none" else int(status)
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
comm = get_communicator()
paired = torch.full((3,), rank + 1.0)
comm.all_reduce(paired)  # (the exchange works while the ranks are in step)
print(f"PAIRED {paired.tolist()}", flush=True)
values = torch.ones(4 + rank)
try:
    first = comm.all_reduce(values, async_op=True)
    comm.all_reduce(values)  # (on the same tensor: its launch waits for the first)
except Exception as exc:
    print(f"ERROR AT {time.time():.3f}: {type(exc).__name__}: {exc}", flush=True)
    log = open(f"{init}.{rank}.log", "w")  # (never closed nor flushed: the exit flushes it)
    log.write(f"rank {rank} logged {type(exc).__name__}\n")
    sys.exit(status)
print("NO ERROR", flush=True)
'''

# (scenario, rank) -> (script, its sys.exit argument)
_SCENARIOS = {("probe", 0): (_RANK, "3"), ("probe", 1): (_RANK, "text"),
              ("exchange", 0): (_EXCHANGE_RANK, "5"), ("exchange", 1): (_EXCHANGE_RANK, "none")}


@pytest.fixture(scope="module")
def runs() -> dict:
    """(scenario, rank) -> (exit status, output, log file text or None); every process started at once."""
    with tempfile.TemporaryDirectory(prefix="fusedist-given-up-status-") as folder:
        inits = {key: os.path.join(folder, f"{key[0]}.rdzv") for key in _SCENARIOS}
        ran = run_ended_at_once({key: (script, (str(key[1]), inits[key], status), None)
                                 for key, (script, status) in _SCENARIOS.items()}, timeout=150)
        return {key: (run.status, run.output, _read(f"{inits[key]}.{key[1]}.log")) for key, run in ran.items()}


def _read(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def _seconds_from_error_to_last_handler(text: str) -> float:
    lines = text.splitlines()
    error = next(float(line.split()[2].rstrip(":")) for line in lines if line.startswith("ERROR AT "))
    last = next(float(line.split()[-1]) for line in lines if line.startswith("LAST EXIT HANDLER RAN AT "))
    return last - error


def test_ranks_that_catch_the_error_and_call_sys_exit_end_at_once_with_that_status(runs):
    probe = {rank: runs["probe", rank] for rank in (0, 1)}
    for rank, (status, text, log) in probe.items():
        assert "ERROR AT" in text and "StallError" in text, (rank, text)
        assert "LAST EXIT HANDLER RAN AT" in text, (rank, "the exit handlers were cut short", text)
        # (before: about 30 s, the drain's bound, on both ranks, each waiting for the other's exit)
        waited = _seconds_from_error_to_last_handler(text)
        assert waited < 12.0, (rank, f"the exit handlers ended {waited:.1f} s after the error", text)
        assert log == f"rank {rank} logged StallError\n", (rank, log)
    # the reference: the status Python gives sys.exit(n), and sys.exit(message) after printing it
    assert probe[0][0] == 3, probe[0]
    assert probe[1][0] == 1 and "leaving: the job diverged" in probe[1][1], probe[1]


def test_ranks_whose_gloo_exchange_failed_and_call_sys_exit_end_after_the_exit_handlers_with_that_status(runs):
    # A failed exchange leaves the group refusing collectives, as the probe's verdict does; the
    # process ends as its uncaught error would: every exit handler, the files flushed, then the status
    # sys.exit asked for, without the interpreter's shutdown (1.5-4 s more here, with the failed
    # group's gloo threads still live). Before, it went through that shutdown.
    for rank, expected in ((0, 5), (1, 0)):  # what Python gives sys.exit(5) and sys.exit(None)
        status, text, log = runs["exchange", rank]
        assert "PAIRED [3.0, 3.0, 3.0]" in text, (rank, text)  # (rank 0's 1 + rank 1's 2)
        assert "ERROR AT" in text and "CollectiveError" in text, (rank, text)
        assert status == expected, (rank, status, text)
        assert "LAST EXIT HANDLER RAN AT" in text, (rank, "the exit handlers were cut short", text)
        assert "INTERPRETER SHUTDOWN RAN" not in text, (rank, "ended through the interpreter's shutdown", text)
        waited = _seconds_from_error_to_last_handler(text)
        assert waited < 12.0, (rank, f"the exit handlers ended {waited:.1f} s after the error", text)
        assert log == f"rank {rank} logged CollectiveError\n", (rank, log)


def test_a_launch_that_waited_for_a_failed_exchange_is_refused_naming_that_failure(runs):
    # Note [one buffer, issue order] in fusedist/comm/gloo_exchange.py: the second all-reduce of a
    # tensor waits for the first, which fails. Before, it then posted its messages on the connection
    # gloo had closed and failed with gloo's bare "Application timeout caused pair closure", naming
    # neither the failure nor what to do (Note [no collectives after a failed exchange]).
    for rank in (0, 1):
        _, text, _ = runs["exchange", rank]
        error = next(line for line in text.splitlines() if line.startswith("ERROR AT "))
        assert (f"CollectiveError: fusedist: launching all_reduce (collective #2) failed on rank {rank} of 2: this "
                "process group can no longer run collectives: an earlier exchange of it failed "
                f"(all_reduce [{4 + rank} x torch.float32 per rank] exchange: receiving chunk 0 from rank {1 - rank} "
                "did not complete") in error, (rank, text)
        assert "Destroy and re-create the process group on every rank" in error, (rank, text)


_PLAIN_EXIT = "import sys; s = sys.argv[1]; sys.exit(None if s == 'none' else int(s) if s.lstrip('-').isdigit() else s)"


def test_the_status_of_an_early_end_is_the_one_python_gives_sys_exit():
    from fusedist._exit_codes import status_of_exit as _exit_status

    cases = {"none": None, "0": 0, "7": 7, "-1": -1, "256": 256, "text": "text"}
    runs = run_at_once({key: (_PLAIN_EXIT, key) for key in cases})
    for key, status in cases.items():
        assert _exit_status(status) == runs[key].returncode, (key, runs[key])


def test_sys_exit_is_pythons_own_until_a_communicator_gives_up_and_again_after_uninstall():
    import sys

    from fusedist import _process_hooks
    from fusedist.comm import given_up_exit

    original = sys.exit
    assert given_up_exit._exit_request is None
    given_up_exit.watch_exit_requests()
    try:
        assert sys.exit is not original
        with pytest.raises(SystemExit) as raised:  # no communicator gave up: nothing is noted
            sys.exit(5)
        assert raised.value.code == 5 and given_up_exit._exit_request is None
    finally:
        _process_hooks.uninstall()
    assert sys.exit is original
