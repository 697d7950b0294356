"""A save called on some ranks only, and a save that fails at exit.

The two-rank scenario runs in the shared launch of test_checkpoint_optimizer_lists.py (its test is
there); this file holds it and the single-process tests.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

#: the scenario's collective timeout: the ranks' collectives never pair, and end at it
SAVE_ALONE_ENV = {"FUSEDIST_TIMEOUT_S": "2"}


def rank_0_saves_alone(rank: int, world: int, directory: str) -> dict:
    """Rank 0 saves (the torch.save habit, ``if rank == 0``), by ``save`` then by a Checkpointer,
    each over a group of its own (given up by it); rank 1 goes on to an all-reduce. Then rank 0
    saves a DDP model while rank 1 runs its next training step. The text of each rank's error, and
    how long it took to come, by the save's kind."""
    import traceback

    import torch.distributed as dist

    import fusedist.checkpoint as ckpt
    from fusedist.comm import get_communicator

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = {}
    for kind in ("save", "Checkpointer.save", "save of a DDP model"):
        group = dist.new_group(list(range(world)))
        checkpointer = None
        if kind == "Checkpointer.save":
            checkpointer = ckpt.Checkpointer(os.path.join(directory, "periodic"), async_save=False,
                                             process_group=group)
            checkpointer.restore(model, opt)
        if kind == "save of a DDP model":
            ddp, ddp_opt = _trained_ddp(group)
        started = time.monotonic()
        try:
            if kind == "save of a DDP model":
                if rank == 1:  # its next step: the backward's bucket is its next collective
                    # (a second later than rank 0's check: rank 0's entry, published as its wait times
                    # out, is in the store when rank 1's own report is written, however loaded the host)
                    time.sleep(1.0)
                    ddp(torch.ones(2, 4)).sum().backward()
                else:
                    ckpt.save(os.path.join(directory, "ddp"), ddp, ddp_opt)
            elif rank == 1:
                get_communicator(group).all_reduce(torch.ones(3))
            elif checkpointer is None:
                ckpt.save(os.path.join(directory, "plain"), model, opt, process_group=group)
            else:
                checkpointer.save(1)
            errors[kind] = None
        except Exception:  # noqa: BLE001 - the test reads it
            errors[kind] = traceback.format_exc()
        errors[f"{kind} took"] = time.monotonic() - started
    return errors


def _trained_ddp(group):
    """A fusedist DDP model over ``group`` and its optimizer, after one step on every rank."""
    from fusedist.ddp import DistributedDataParallel

    ddp = DistributedDataParallel(nn.Linear(4, 4), process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return ddp, opt


def check_rank_0_saves_alone(errors: list) -> None:
    """Rank 0's error (still the failed collective's type) says that rank 1 did not join and that every
    rank must call the save, then the collective's own error; rank 1's all-reduce fails too (no hang)."""
    for kind, first_tag in (("save", "fusedist.checkpoint.save: start"),
                            ("Checkpointer.save", "fusedist.checkpoint.Checkpointer")):
        text0, text1 = errors[0][kind], errors[1][kind]
        assert text0 is not None and text1 is not None, (kind, errors)
        opening = f"fusedist.checkpoint.{kind}: rank 0's save could not start"
        said = [line for line in text0.splitlines() if opening in line]
        assert said and said[-1].startswith((f"fusedist.comm.base.CollectiveError: {opening}: rank(s) [1] did not "
                                             "join it.", f"fusedist.reliability.monitor.StallError: {opening}: "
                                             "rank(s) [1] did not join it.")), (kind, text0)
        assert "every rank of the group must call it" in said[-1] and "if rank == 0:" in said[-1], (kind, text0)
        assert first_tag in said[-1], (kind, text0)
        assert "CollectiveError" in text1.strip().splitlines()[-1], (kind, text1)
    check_rank_1_reads_that_rank_0_saves(errors)


def check_rank_1_reads_that_rank_0_saves(errors: list) -> None:
    """Rank 0 saved a DDP model, whose step check is the save's first collective; rank 1 went on to
    its next backward. Both fail at the collective timeout (no hang), rank 0 saying that rank 1 did
    not join; rank 1's own error -- its bucket's -- says, in its stall report, that rank 0 is inside
    fusedist.checkpoint.save (it showed rank 0 at a bare "ddp step check", inside check_consistency()),
    and that rank 0 is behind for being inside the save (it blamed rank 0 for a skipped backward)."""
    kind = "save of a DDP model"
    text0, text1 = errors[0][kind], errors[1][kind]
    assert text0 is not None and text1 is not None, errors
    last0, last1 = text0.strip().splitlines(), text1.strip().splitlines()
    assert any(line.startswith("fusedist.reliability.monitor.StallError: fusedist.checkpoint.save: rank 0's save "
                               "could not start: rank(s) [1] did not join it.") for line in last0), text0
    assert any(line.startswith("fusedist.reliability.monitor.StallError: fusedist: all_reduce (tag 'ddp bucket 0'")
               for line in last1), text1
    reached = "  ranks [0] reached all_reduce [fusedist.checkpoint.save: ddp step check]"
    assert any(line.startswith(reached) for line in last0), text0  # rank 0's own report
    # what rank 1 is told of rank 0: its failed collective's tag, or -- where rank 1 reads rank 0's entry
    # before rank 0's own failure replaced it (rank 0 closes the connections first) -- its position
    told = [line for line in last1 if line.startswith("  rank 0 ")]
    assert told and ("fusedist.checkpoint.save: ddp step check" in told[0]
                     or "inside fusedist.checkpoint.save" in told[0]), text1
    # rank 0's fewer backwards are its save's, not a skipped backward (Note [peers inside a save] in stall_report.py)
    saving = ("  ranks [0] are inside fusedist.checkpoint.save (waiting in its first collective) and ranks [1] are "
              "not: a save is a collective, every rank of the group must call it")
    assert any(line.startswith(saving) for line in last1), text1
    assert not any("behind by" in line for line in last0 + last1), (text0, text1)
    timeout = float(SAVE_ALONE_ENV["FUSEDIST_TIMEOUT_S"])
    for rank_errors in errors:  # the timeout, then at most the stall report's window (2 s here)
        assert rank_errors[f"{kind} took"] < timeout + 2 + 4, rank_errors


_SAVE_FAILING_AT_EXIT = """
import atexit, sys, time
atexit.register(lambda: print("an earlier exit handler ran", flush=True))
from fusedist.checkpoint._writer import BackgroundWriter

def save_whose_peer_died():
    time.sleep(0.3)
    raise RuntimeError("rank 1 closed the connection")

BackgroundWriter("fusedist.checkpoint.Checkpointer").submit(save_whose_peer_died)
atexit.register(lambda: print("a later exit handler ran", flush=True))
print("the program ended", flush=True)
"""


@pytest.mark.parametrize("ending, status, said", [
    ("", 1, "the process ends with status 1, not 0: the checkpoint was lost"),
    ("sys.exit(3)", 3, "the process ends with status 3, the program's own")])
def test_a_save_that_fails_at_exit_ends_the_process_with_a_nonzero_status(ending, status, said):
    """The checkpoint being written at exit is lost: the status says so, after the message and
    after the other exit handlers ran -- 1 where the program ended with 0, and the program's own
    status where it chose one (``sys.exit(3)`` ended with 1 too)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SAVE_FAILING_AT_EXIT + ending], capture_output=True, text=True,
                          timeout=120)
    out = done.stdout
    assert done.returncode == status, (done.returncode, out, done.stderr)
    assert "the program ended" in out and "an earlier exit handler ran" in out, out
    lost = out.index("fusedist.checkpoint.Checkpointer: the checkpoint being written at exit was not completed: "
                     "RuntimeError: rank 1 closed the connection")
    assert lost < out.index("an earlier exit handler ran"), out
    assert said in out[lost:].splitlines()[0], out
    # every exit handler runs once: one registered after the writer too (it ran twice when the
    # failed save's handler, run in the middle of the others, ran them all again)
    assert out.count("a later exit handler ran") == 1 and out.count("an earlier exit handler ran") == 1, out


def test_sys_exit_is_pythons_own_once_no_save_is_in_flight():
    """``sys.exit`` notes the program's status only while a save is in flight (Note [the status of a
    save lost at exit]): a clean run's is Python's own once its saves were waited for."""
    import sys

    from fusedist.checkpoint import _exit_status
    from fusedist.checkpoint._writer import BackgroundWriter

    original = sys.exit
    writer = BackgroundWriter("a writer")
    writer.submit(lambda: None)
    assert sys.exit is not original
    writer.wait()
    assert sys.exit is original
    assert _exit_status.status_after_a_lost_save(0) == 1 and _exit_status.status_after_a_lost_save(3) == 3


def test_a_peer_still_checking_inside_a_save_is_reported_inside_it():
    """Rank 1 may read rank 0's ``checking`` entry -- written as the save's step check began, before its
    collective existed -- instead of its failure entry: that entry's position names the save too (Note [a
    step check inside a save] in fusedist/reliability/step_check.py), so the report says rank 0 is inside
    fusedist.checkpoint.save rather than behind by a skipped backward."""
    from fusedist.reliability import stall_report
    from fusedist.reliability.step_check import inside_call, with_call

    with inside_call("fusedist.checkpoint.save"):
        saving = with_call({"ddp_step": 1, "ddp_backward": 1, "ddp_forwards": 1, "optimizer_steps": 1,
                            "in_check": True})
    assert with_call({"ddp_step": 1}) == {"ddp_step": 1}  # (outside the save: nothing added)
    entries = {0: {"kind": "checking", "context": saving},
               1: {"kind": "failure", "context": {"ddp_step": 1, "ddp_backward": 1, "ddp_forwards": 2,
                                                  "optimizer_steps": 1, "in_backward": True},
                   "waiting_on": {"tag": "ddp bucket 0"}}}
    lines = stall_report.behind(entries)
    assert any(line.startswith("  ranks [0] are inside fusedist.checkpoint.save") for line in lines), lines
    assert not any("behind by" in line for line in lines), lines
