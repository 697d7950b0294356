"""A failed wait for one of gloo's own collectives (an all-reduce over SMALL_ALL_REDUCE_BYTES, as a DDP
bucket is) leaves the group refusing collectives naming that failure, and the process ends as one whose
collectives were given up: soon after its error, after every exit handler, without the interpreter's
shutdown (Note [no collectives after a failed builtin collective] in fusedist/comm/torch_comm.py, Note
[ending after given-up collectives] in fusedist/comm/given_up_exit.py). Before, nothing recorded it: the
next collective failed with gloo's bare error, and the process ended through the interpreter's shutdown.

The ranks are real top-level programs (as torchrun starts them): the exit path is what is tested."""

from __future__ import annotations

import os
import tempfile

import pytest
from script_runs import EXIT_MARKERS, run_ended_at_once

# One rank of a two-rank job, divergence probe off, 2 s timeouts (fusedist's and the group's). Both
# all-reduce a tensor over SMALL_ALL_REDUCE_BYTES in step (checked against torch's all_reduce); then
# rank 0 all-reduces another, which rank 1 skips: rank 0's wait fails at 2 s. Rank 0 tries one more
# all-reduce, then leaves an error uncaught. Rank 1 waits past rank 0's failure, all-reduces on the
# connection rank 0's gloo closed, catches that failure and ends by sys.exit(4). argv: rank, rendezvous file.
_RANK = EXIT_MARKERS + r'''
os.environ.update(FUSEDIST_TIMEOUT_S="2", FUSEDIST_DIVERGENCE_PROBE_S="0")

import datetime
import torch
import torch.distributed as dist
from fusedist.comm import get_communicator
from fusedist.comm.torch_comm import SMALL_ALL_REDUCE_BYTES

rank, init = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
comm = get_communicator(group)
numel = SMALL_ALL_REDUCE_BYTES // 4 + 7  # float32: gloo's own all-reduce, not the exchange
torch.manual_seed(rank)
values = torch.randn(numel)
reference = values.clone()
dist.all_reduce(reference)  # torch's, on the default group
comm.all_reduce(values)
print(f"IN STEP {torch.equal(values, reference)}", flush=True)
if rank == 0:
    try:
        comm.all_reduce(torch.randn(numel))  # rank 1 skips it
    except Exception as exc:
        print(f"ERROR AT {time.time():.3f}: {type(exc).__name__}: {exc}", flush=True)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.randn(numel), tag="after")
        print("NOT REFUSED", flush=True)
    except Exception as exc:
        print(f"REFUSED IN {time.monotonic() - start:.2f} s: {type(exc).__name__}: {exc}", flush=True)
    raise RuntimeError("left uncaught after the failed all-reduce")
time.sleep(3.5)  # (past rank 0's failure: its gloo closed their connection)
try:
    comm.all_reduce(torch.randn(numel))
except Exception as exc:
    print(f"ERROR AT {time.time():.3f}: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(4)
print("NO ERROR", flush=True)
'''


@pytest.fixture(scope="module")
def runs() -> dict:
    """rank -> (exit status, output, ``time.time()`` at its end); both started at once."""
    with tempfile.TemporaryDirectory(prefix="fusedist-given-up-builtin-") as folder:
        return run_ended_at_once({rank: (_RANK, (str(rank), os.path.join(folder, "rdzv")), None) for rank in (0, 1)},
                                 timeout=120)


def _stamp(text: str, prefix: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line[len(prefix):].split()[0].rstrip(":"))


def test_a_collective_after_a_failed_builtin_all_reduce_is_refused_naming_that_failure(runs):
    status, text, _ = runs[0]
    assert "IN STEP True" in text, text  # (the same sum as torch's all_reduce, bit for bit: gloo's own)
    assert "ERROR AT" in text and "CollectiveError" in text, text
    refused = next((line for line in text.splitlines() if line.startswith("REFUSED IN ")), None)
    assert refused is not None, ("the next all-reduce was not refused", text)
    # Before: gloo's bare "pair closure" error (or a wait to the deadline), naming neither the failure nor
    # what to do.
    # (no monitor watches this communicator: a CollectiveError, naming the refused all-reduce without a
    # number of its own -- "collective #2" before, one it never used)
    assert ("CollectiveError: fusedist: refused on rank 0 of 2: all_reduce [after] was not launched: this process "
            "group can no longer run collectives, because an earlier one failed (all_reduce (tag '', collective #1) "
            "failed on rank 0 of 2: timed out") in refused, text
    assert "collective #2" not in refused, text
    assert "Destroy and re-create the process group on every rank" in refused, text
    assert float(refused.split()[2]) < 1.0, ("the refusal waited", text)  # (refused at the launch)


def test_ranks_whose_builtin_all_reduce_failed_end_after_their_exit_handlers_without_the_interpreters_shutdown(runs):
    # The status Python gives an uncaught error (rank 0) and sys.exit(4) (rank 1), every exit handler
    # run, then the process ends at once. Before: it ended through the interpreter's shutdown.
    for rank, expected in ((0, 1), (1, 4)):
        status, text, ended = runs[rank]
        assert ended is not None, (rank, "still running after 120 s", text)
        assert status == expected, (rank, status, text)
        assert "ERROR AT" in text and "CollectiveError" in text, (rank, text)
        assert "LAST EXIT HANDLER RAN AT" in text, (rank, "the exit handlers were cut short", text)
        assert "INTERPRETER SHUTDOWN RAN" not in text, (rank, "ended through the interpreter's shutdown", text)
        last = _stamp(text, "LAST EXIT HANDLER RAN AT ")
        waited = last - _stamp(text, "ERROR AT ")
        assert waited < 10.0, (rank, f"the exit handlers ended {waited:.1f} s after the error", text)
        assert ended - last < 3.0, (rank, f"ended {ended - last:.1f} s after its last exit handler", text)
    assert "left uncaught after the failed all-reduce" in runs[0][1], runs[0][1]
