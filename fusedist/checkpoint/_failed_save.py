"""What a failed save leaves: nothing new. Shared by ``save`` (plain and pipelined, ``api.py``)
and the ``Checkpointer``'s background save (``_persist.py``).

Note [a failed save leaves nothing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A save that raises on some rank (a full disk, a value that cannot be pickled, a user's
``state_dict`` hook raising, a rank killed mid-write) raises on every rank, and the directory
must be as it was before the save: a complete checkpoint there stays the one it holds (Note
[checkpoint atomicity] in ``_files.py``), and what the failed save made goes. The files no
manifest lists were removed already, but the directory a save made for itself stayed:
empty after ``save``, and after a ``Checkpointer`` save a ``step-N`` holding the files of
the ranks that succeeded, which every later ``restore`` skipped with a warning until a
later save removed it; a killed writer's temporary stayed too. So:

* a failure in a rank's preparation, before the first exchange (a ``state_dict`` pre-hook
  raising while the model keys are read), is carried to the other ranks by that exchange:
  raised on that rank alone, it left the others waiting in the exchange for the collective
  timeout, which named the missing rank but not the cause, and broke the gloo group;
* once every rank is done writing (the failure was agreed over an exchange, or the failing
  peer is dead: its beat stopped, so it writes nothing more), rank 0 removes the
  temporaries of the save's writers -- a save beside a complete checkpoint names its files,
  and so their temporaries, with its own save id -- and the directory it made for the save
  (a ``step-N`` whole, unless its manifest was written; a ``save`` directory if nothing
  else is in it); after an agreed failure the ranks leave the save together once that is
  done (one more exchange, on a failure only). A save given up on a peer that is alive but
  slow removes nothing here: that peer may still be writing (Note [a plain save given up
  on] in ``_given_up.py`` cleans up once it is done).
"""

from __future__ import annotations

import os

from . import _files, layout


def preparation_failure(rank: int, exc: BaseException) -> str:
    """The words every rank raises for ``exc``, raised by ``rank`` before the first exchange."""
    return f"rank {rank} failed before writing anything (reading its model's state_dict): {type(exc).__name__}: {exc}"


def peers_done(exc: BaseException) -> bool:
    """Whether every rank is done writing once ``exc`` ends a save: an agreed failure, or a peer
    that is gone (its beat stopped); not a barrier given up on a live, slow peer."""
    return not getattr(exc, "given_up", False)


def agreed(error: BaseException) -> BaseException:
    """Mark ``error`` as raised by every rank after an exchange (every rank is alive and
    reachable, so they can wait for rank 0's cleanup together)."""
    error.agreed = True
    return error


def leave_together(exchange) -> None:
    """After a failure every rank raises, once rank 0 removed what the save left: ``exchange()``,
    so that no rank returns from the save before the directory is back as it was (the other
    ranks returned at once, and a rank looking into it found the failed save's files, or a
    directory being removed). Never raises: the save's own error is on its way."""
    try:
        exchange()
    except Exception:  # noqa: BLE001 - a peer lost now: the cleanup is done all the same
        pass


def remove_temporaries(directory: str, save_id: str = "") -> None:
    """Rank 0, after a failed save: remove the temporaries its writers left (a killed rank's) in
    ``directory``: those of the files named with ``save_id`` (only that save wrote them), or,
    without one, every checkpoint temporary (the save made the directory). Never raises."""
    try:
        for name in os.listdir(directory):
            match = _files._TEMPORARY.match(name)
            target = match.group(1) if match is not None else ""
            if not (_files._SAVED_FILE.match(target) or target == _files.MANIFEST):
                continue
            if not save_id or target.endswith(f".{save_id}.pt"):
                os.unlink(os.path.join(directory, name))
    except OSError:
        pass  # gone meanwhile: nothing to remove


def remove_made_directory(directory: str) -> None:
    """Rank 0, after a failed save that made ``directory``: remove its writers' temporaries,
    then the directory if it is empty. Never raises: a leftover only takes space, and is not a
    checkpoint (no manifest)."""
    remove_temporaries(directory)
    try:
        os.rmdir(directory)
    except OSError:
        pass  # gone, or holding something else (a user's file, a complete checkpoint): leave it


def remove_step_directory(path: str, save_id: str) -> None:
    """Rank 0, after a failed ``Checkpointer`` save of ``step-N``: the temporaries of a rewrite
    (``save_id``) beside a complete checkpoint; else the whole ``step-N`` it made, unless its
    manifest was written (a peer lost after it: the checkpoint is whole). Never raises."""
    if save_id:
        remove_temporaries(path, save_id)
        return
    try:
        if not os.path.exists(os.path.join(path, _files.MANIFEST)):
            layout.remove(path)
    except OSError:
        pass
