"""A process whose collectives were given up ends soon after its error, with the status the
interpreter would use, after every exit handler ran (Note [ending after given-up collectives] in
fusedist/comm/given_up_exit.py); a clean run, and a program that catches the error and goes on,
exit as the interpreter makes them.

The ranks here are real top-level programs (as torchrun starts them): an uncaught exception, the
exit handlers and the interpreter's shutdown are what is tested, and the multi-rank harness
catches a rank's exception itself."""

from __future__ import annotations

import os
import signal
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest
from script_runs import EXIT_MARKERS, run_at_once, run_ended_at_once

# One rank of a two-rank DDP job. argv: rank, rendezvous file, scenario.
#   skip:   rank 1 computes a loss and skips its backward, every rank calls check_consistency();
#           nothing catches the error (the divergence probe raises a StallError on every rank)
#   caught: the same; rank 1 catches the error, checks the group refuses collectives, computes on
#           and ends by ``raise SystemExit(0)`` (rank 0 leaves the error uncaught); ``sys.exit(n)``
#           instead ends at once (tests/test_given_up_exit_status.py)
#   clean:  every rank runs its backward; the check passes and the program destroys the default group (the
#           model at module scope) and ends normally
_RANK = EXIT_MARKERS + r'''
import datetime

import torch
import torch.distributed as dist
from torch import nn

rank, init, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
import torch.distributed.nn  # (before the group: Note [binding torch.distributed.nn early] in fusedist/distributed.py)
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
import fusedist

torch.manual_seed(0)
model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(5, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
loss = model(torch.randn(5, 8)).square().mean()
try:
    if scenario == "clean" or rank == 0:
        loss.backward()
        opt.step()
    model.check_consistency()
except Exception as exc:
    print(f"ERROR AT {time.time():.3f}: {type(exc).__name__}", flush=True)
    log = open(f"{init}.{rank}.log", "w")  # (never closed nor flushed: the exit flushes it)
    log.write(f"rank {rank} logged {type(exc).__name__}\n")
    if scenario == "caught" and rank == 1:
        try:
            model.comm.all_reduce(torch.ones(1), tag="after")
        except Exception as refused:
            print(f"REFUSED: {type(refused).__name__}: {refused}", flush=True)
        print(f"WENT ON: {float(torch.ones(3).sum()):g}", flush=True)
        raise SystemExit(0)  # (not sys.exit: nothing notes its status, the interpreter ends it)
    raise
print("NO ERROR", flush=True)
import gc, weakref
world = weakref.ref(dist.group.WORLD)
held = model.process_group is world()
gc.disable()  # (freed by the destroy itself, not by a collection)
dist.destroy_process_group()
print(f"DEFAULT GROUP: the model's {held}, freed at the destroy {world() is None}, "
      f"the model's now {model.process_group}", flush=True)
gc.enable()
'''

_ENV = {"FUSEDIST_TIMEOUT_S": "60", "FUSEDIST_DIVERGENCE_PROBE_S": "0.3", "FUSEDIST_STALL_REPORT_S": "0.5"}


@pytest.fixture(scope="module")
def runs(stand_in_runs) -> dict:
    """Every scenario's two ranks, all started at once: (scenario, rank) -> (exit status, output,
    ``time.time()`` at its end, what it wrote to its log file or None). (The stand-in programs,
    ``stand_in_runs``, start first and run beside them: their start-ups overlap.)"""
    with tempfile.TemporaryDirectory(prefix="fusedist-given-up-") as folder:
        inits = {scenario: os.path.join(folder, f"{scenario}.rdzv") for scenario in ("skip", "caught", "clean")}
        ran = run_ended_at_once({(scenario, rank): (_RANK, (str(rank), init, scenario), _ENV)
                                 for scenario, init in inits.items() for rank in (0, 1)}, timeout=150)
        return {key: (*run, _read(f"{inits[key[0]]}.{key[1]}.log")) for key, run in ran.items()}


def _read(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def _error_at(text: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith("ERROR AT "))
    return float(line.split()[2].rstrip(":"))


def test_ranks_that_diverged_end_non_zero_with_the_report_soon_after_the_error(runs):
    # rank 1 skipped its backward; the probe's verdict (about a second after 0.3 s) is uncaught on
    # both ranks. Before, each waited for its pending collectives at exit (the drain, up to 30 s, the
    # step check's read, 5 s): it ended about 33 s after its error.
    for rank in (0, 1):
        status, text, ended, log = runs["skip", rank]
        assert ended is not None, (rank, "still running after 150 s", text)
        assert status == 1, (rank, status, text)
        # (the report; the rank whose probe got there second may instead see the first one's
        # exit close its connection: its report still names the divergence, from the store)
        assert "StallError" in text and "Stall report" in text, (rank, text)
        assert "ranks [1] are behind by 1 backward(s); ranks [1] wait in check_consistency()" in text, (rank, text)
        assert "LAST EXIT HANDLER RAN" in text, (rank, "the exit handlers were cut short", text)
        assert ended - _error_at(text) < 15.0, (rank, f"ended {ended - _error_at(text):.1f} s after its error", text)
        assert log == f"rank {rank} logged StallError\n", (rank, log)
    assert any("found by the divergence probe" in runs["skip", rank][1] for rank in (0, 1)), runs


def test_a_rank_that_catches_the_error_goes_on_and_exits_as_the_interpreter_makes_it(runs):
    status, text, ended, _ = runs["caught", 1]
    assert status == 0, (status, text)
    # The refusal goes through the monitor, as the probe's verdict did: a StallError with the report
    # (a bare CollectiveError before), naming the refused collective without a number of its own
    assert "REFUSED: StallError: fusedist: refused on rank 1 of 2: all_reduce [after] was not launched" in text, text
    # (its own probe's verdict, or -- when rank 0 got its verdict first and ended -- the closed connection)
    assert "found by the divergence probe" in text or "Connection closed by peer" in text, text
    assert "Stall report" in text and "WENT ON: 3" in text, text
    assert "LAST EXIT HANDLER RAN" in text and "INTERPRETER SHUTDOWN RAN" in text, text
    # (it ends once rank 0 has ended, which closes their connections: its exit waited for its helper)
    assert ended - _error_at(text) < 20.0, (f"ended {ended - _error_at(text):.1f} s after its error", text)
    status, text, ended, _ = runs["caught", 0]
    assert status == 1 and "StallError" in text and ended - _error_at(text) < 15.0, (status, text)


def test_a_clean_run_exits_through_the_interpreters_shutdown(runs):
    for rank in (0, 1):
        status, text, _, _ = runs["clean", rank]
        assert status == 0, (rank, status, text)
        assert "NO ERROR" in text and "ERROR AT" not in text, (rank, text)
        assert "LAST EXIT HANDLER RAN" in text and "INTERPRETER SHUTDOWN RAN" in text, (rank, text)
        # (the model at module scope holds its communicator into the interpreter's shutdown: nothing of the
        # destroyed group may abort it there -- Note [a released communicator that outlives the exit hooks])
        assert "terminate called" not in text and "Aborted" not in text, (rank, text)
        # nor does the model hold the group itself (Note [the process group, held weakly] in
        # fusedist/ddp/torch_surface.py): freed at the destroy, as when no model outlives it
        assert "DEFAULT GROUP: the model's True, freed at the destroy True, the model's now None" in text, (rank, text)


# One process with a communicator that gave up (a stand-in in the cache, as the probe leaves a real
# one) and fusedist's excepthook in place, as get_communicator() installs it. argv: scenario.
#   by-hand:   the program passes a caught error to sys.excepthook itself (to log it) and goes on
#   interrupt: a KeyboardInterrupt reaches the top
_STAND_IN = EXIT_MARKERS + r'''
from fusedist import comm
from fusedist._process_hooks import chain_excepthook

class GaveUp:
    aborted = True

comm._cache[("stand-in", "torch")] = (object(), GaveUp())
chain_excepthook("end a process whose collectives were given up", comm.given_up_exit.on_uncaught)
if sys.argv[1] == "by-hand":
    try:
        raise RuntimeError("logged, not fatal")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())
    print("WENT ON", flush=True)
else:
    raise KeyboardInterrupt
'''


def _run_stand_ins() -> dict:
    runs = run_at_once({case: (_STAND_IN, case) for case in ("by-hand", "interrupt")}, merge_stderr=True)
    return {case: (run.stdout, run.returncode) for case, run in runs.items()}


@pytest.fixture(scope="module")
def stand_in_runs():
    """Future of {case: (output, exit status)} of the stand-in programs, started on a thread of its own."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(_run_stand_ins)


def test_an_error_logged_through_the_excepthook_is_not_an_exit_and_an_interrupt_ends_by_sigint(stand_in_runs):
    text, status = stand_in_runs.result()["by-hand"]
    assert status == 0, (status, text)
    assert "logged, not fatal" in text and "WENT ON" in text, text
    assert "LAST EXIT HANDLER RAN" in text and "INTERPRETER SHUTDOWN RAN" in text, text
    # Python ends a process interrupted by an uncaught KeyboardInterrupt by SIGINT; so does the
    # early end, after every exit handler
    text, status = stand_in_runs.result()["interrupt"]
    assert status == -signal.SIGINT, (status, text)
    assert "KeyboardInterrupt" in text and "LAST EXIT HANDLER RAN" in text, text
