"""A save called on some ranks only, and a save that fails at exit.

The two-rank scenario runs in the shared launch of test_checkpoint_optimizer_lists.py (its test is
there); this file holds it and the single-process tests.
"""

from __future__ import annotations

import os


import torch
from torch import nn

#: the scenario's collective timeout: the ranks' collectives never pair, and end at it
SAVE_ALONE_ENV = {"FUSEDIST_TIMEOUT_S": "2"}


def rank_0_saves_alone(rank: int, world: int, directory: str) -> dict:
    """Rank 0 saves (the torch.save habit, ``if rank == 0``), by ``save`` then by a Checkpointer,
    each over a group of its own (given up by it); rank 1 goes on to an all-reduce. The text of
    each rank's error, by the save's kind."""
    import traceback

    import torch.distributed as dist

    import fusedist.checkpoint as ckpt
    from fusedist.comm import get_communicator

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = {}
    for kind in ("save", "Checkpointer.save"):
        group = dist.new_group(list(range(world)))
        checkpointer = None
        if kind == "Checkpointer.save":
            checkpointer = ckpt.Checkpointer(os.path.join(directory, "periodic"), async_save=False,
                                             process_group=group)
            checkpointer.restore(model, opt)
        try:
            if rank == 1:
                get_communicator(group).all_reduce(torch.ones(3))
            elif checkpointer is None:
                ckpt.save(os.path.join(directory, "plain"), model, opt, process_group=group)
            else:
                checkpointer.save(1)
            errors[kind] = None
        except Exception:  # noqa: BLE001 - the test reads it
            errors[kind] = traceback.format_exc()
    return errors


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


_SAVE_FAILING_AT_EXIT = """
import atexit, time
atexit.register(lambda: print("an earlier exit handler ran", flush=True))
from fusedist.checkpoint._writer import BackgroundWriter

def save_whose_peer_died():
    time.sleep(0.3)
    raise RuntimeError("rank 1 closed the connection")

BackgroundWriter("fusedist.checkpoint.Checkpointer").submit(save_whose_peer_died)
atexit.register(lambda: print("a later exit handler ran", flush=True))
print("the program ended", flush=True)
"""


def test_a_save_that_fails_at_exit_ends_the_process_with_a_nonzero_status():
    """The checkpoint being written at exit is lost: the status says so, after the message and
    after the other exit handlers ran."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SAVE_FAILING_AT_EXIT], capture_output=True, text=True, timeout=120)
    out = done.stdout
    assert done.returncode == 1, (done.returncode, out, done.stderr)
    assert "the program ended" in out and "an earlier exit handler ran" in out, out
    lost = out.index("fusedist.checkpoint.Checkpointer: the checkpoint being written at exit was not completed: "
                     "RuntimeError: rank 1 closed the connection")
    assert lost < out.index("an earlier exit handler ran"), out
    # every exit handler runs once: one registered after the writer too (it ran twice when the
    # failed save's handler, run in the middle of the others, ran them all again)
    assert out.count("a later exit handler ran") == 1 and out.count("an earlier exit handler ran") == 1, out
