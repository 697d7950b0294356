"""What a failed or shortened wait of a :class:`~fusedist.comm.base.CommHandle` says.

Kept apart from the handle: the wording reads the handle's state (its launch, timeout,
communicator) but decides nothing about the collective's outcome.
"""

from __future__ import annotations

import datetime
import re
import time
from typing import Optional

from .closed_connections import PeerClosedConnection


def why_failed(handle, exc: Exception, wait_timeout: Optional[datetime.timedelta]) -> str:
    """The backend's error, preceded for a timeout by what the backend's own message may
    not say (gloo's reads "Operation timed out!"): how long the collective had been
    running, which timeout ended it and the peers it involves (Note [one deadline per
    collective] in base.py)."""
    elapsed = time.monotonic() - handle._launched
    ended = handle._comm._ended_under_collective()
    if ended:  # (whatever the backend says: a timeout, a closed connection)
        return f"{ended}; it ended {elapsed:.1f} s after its launch: {exc}"
    if not is_timeout(exc):
        return str(exc)
    comm, limit = handle._comm, handle._timeout.total_seconds()
    group_limit = comm._transport_timeout(handle._work) if handle._work is not None else None
    if wait_timeout is not None:
        cause = f"the timeout of this wait, {wait_timeout.total_seconds():g} s"
    elif group_limit is not None and group_limit < limit and elapsed < limit:
        cause = (f"the process group's own timeout, {group_limit:g} s, which ends gloo's collectives before "
                 f"fusedist's collective timeout ({limit:g} s, FUSEDIST_TIMEOUT_S) would; give the process "
                 "group a timeout at least as long")
    else:
        cause = f"fusedist's collective timeout, {limit:g} s"
    peers = [r for r in range(comm.world_size) if r != comm.rank]
    return (f"timed out {elapsed:.1f} s after its launch ({cause}); some rank of {peers}"
            f"{comm._global_note(peers)} did not join it, or joined another collective: {exc}")


def still_running_message(handle, timeout: datetime.timedelta, exc: Exception) -> str:
    """A wait shorter than the collective's timeout ran out and the collective goes on: as
    with a torch gloo work, the error is not recorded (a later ``wait`` returns the result)
    nor reported as a failure."""
    return (f"fusedist: {handle.op} (tag {handle.tag!r}, collective #{handle.seq}) on rank {handle._comm.rank} of "
            f"{handle._comm.world_size}, waited for with a shorter timeout ({timeout.total_seconds():g} s) than the "
            f"communicator's ({handle._timeout.total_seconds():g} s): {exc}. "
            "The collective goes on: wait() again for its result")


def is_timeout(exc: BaseException) -> bool:
    """Whether a backend's error is a timeout (gloo: "Timed out waiting 2000ms for recv
    operation", "Operation timed out!"; the exchange's TimeoutError). A connection a peer closed is
    not, even where the peer's error it quotes was (Note [connections a peer closed])."""
    if isinstance(exc, PeerClosedConnection):
        return False
    return isinstance(exc, TimeoutError) or re.search(r"timed out", str(exc), re.IGNORECASE) is not None
