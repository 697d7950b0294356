"""Saves given up on (a rank's storage hung): what the next ``save`` or ``load`` waits for first."""

from __future__ import annotations

from typing import Callable

# Note [a plain save given up on]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A save whose barrier was given up on (a rank's storage hangs: Note [a save given up on] in
# ``_writer.py``) raises on every rank, while the slow rank may still be writing. A
# Checkpointer's next save first waits for it (``settle``); ``save`` did not: the next save
# (or load) started its first collective at once, which timed out on the rank still writing
# after FUSEDIST_TIMEOUT_S -- and a gloo group whose collective failed is broken for good,
# training included. Its claim on the directory and its rank files were left behind too. So
# each rank keeps the barrier of a save given up on, and its next ``save`` or ``load`` first
# waits at one more phase of it, beating, for as long as the slow ranks show they are alive
# (up to IO_LIMIT_S again: a wait given up on leaves it for the next call); once every rank
# is there, rank 0 removes what the given-up save left (its claim, its unlisted files, and the
# directory it made for the save, left empty: the save created it, and nothing there is the user's).
_pending: list = []  # (the IOBarrier of a save given up on, its cleanup), oldest first


def settle() -> None:
    """Before a save's or load's first exchange: wait until every rank has left the saves
    given up on before it, and clean up after them (Note [a plain save given up on])."""
    while _pending:
        barrier, cleanup = _pending[0]
        barrier.wait_beating("the save given up on before this call")
        del _pending[0]
        barrier.forget(barrier.phase - 1)  # (every rank left those; a slower one may still read this phase's keys)
        cleanup()


def remember(barrier, cleanup: Callable[[], None]) -> None:
    """Keep the barrier of a save given up on, and what to remove once every rank has left it."""
    _pending.append((barrier, cleanup))
