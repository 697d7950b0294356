"""Which peer closed the connection under one of gloo's own collectives, and why.

Note [a peer gone under gloo's own collective]
    gloo's own collectives (all-reduces over the exchange's size -- a DDP bucket --, the fingerprints
    agreed before them, every collective under ``FUSEDIST_GLOO_COLLECTIVES=builtin``) fail where a peer's
    process vanished (a SIGKILL, the out-of-memory killer) or aborted its groups with gloo's bare
    "Connection closed by peer [address]:port": no rank, no reason, only an address. The exchange names
    the peer it was receiving from (Note [connections a peer closed] in closed_connections.py); gloo's own
    collective does not say which of its pairs failed. But a pair that failed stays closed: posting a
    receive on it fails at once with the same words, while a live pair takes it. So on such a failure --
    the group's first, on the failure path only -- the communicator posts the receive that closes an
    abandoned collective's connections (Note [closing the connections of an abandoned collective] in
    torch_comm.py) to every peer: the peers whose post fails are the ones that closed theirs. It leaves
    a first word in the store for its live peers (which peers closed their connections), then closes the
    live connections -- a live peer still waiting in the collective, or launching the next one, fails at
    once and reads this rank's entry instead of waiting out its timeout -- and names each closed peer
    with what it left in the store: that it aborted its groups or its own failure, else what it published
    for the stall reports where a monitor watches the group (that it crashed, or left the group without
    an error), all written before its connections closed and read at once; else its entry waited for a
    moment (a transfer that timed out closes the connections before its rank writes), or nothing (its
    process may have ended).
    The communicator then leaves the whole error there in place of the first word, as it does for any
    first failure of gloo's own collectives (Note [no collectives after a failed builtin collective] in
    torch_comm.py); the group could no longer run collectives anyway. Where no post fails (the pair
    recovered, a transport that says nothing), gloo's error stays as it was.
"""

from __future__ import annotations

import re
import time
from typing import Callable, Optional

from .base import CollectiveError
from .closed_connections import WAIT_S, closed_by_peer
from .exchange_progress import _where
from .group_ranks import global_ranks

#: gloo's report of a closed pair: its source location, the words, the peer's address.
_GLOO_CLOSED = re.compile(r"(\[[^\]\s]*\]\s*)?connection (closed|reset) by peer( \[[^\]]*\](:\d+)?)?", re.IGNORECASE)

#: How long a closed peer's entry is waited for at least, once the others' wait used up ``WAIT_S``.
_LEAST_WAIT_S = 0.05


def explained(comm, handle, error: BaseException, close_connections: Callable) -> Optional[CollectiveError]:
    """``error`` (a failed wait of gloo's own collective on ``comm``) told again naming the peers that closed
    their connections, and why (Note [a peer gone under gloo's own collective]); None where it is no closed
    connection, or no peer's is closed. ``close_connections``: torch_comm's. Closes the group's connections."""
    closing = getattr(comm, "_closing", None)
    if (closing is None or not isinstance(error, CollectiveError) or getattr(error, "verdict", None) is not None
            or not closed_by_peer(error) or comm._ended_under_collective()):
        return None  # (a destroyed group's error says so instead)
    what = _described(handle)
    job_ranks = _global_ranks(comm)

    def publish_first(closed: list) -> None:
        # (before the live connections close: a live peer finding this rank's closed reads this at once)
        if closed:
            named = ", ".join(_where(p, job_ranks[p]) for p in closed)
            closing.publish(f"{_where(comm.rank, job_ranks[comm.rank])}: {what} lost its connection to {named}, "
                            "which closed it")

    closed = close_connections(comm.group, comm.rank, comm.world_size, publish_first)
    if not isinstance(closed, list) or not closed:
        return None
    deadline = time.monotonic() + WAIT_S  # (one wait for every closed peer's entry)
    why = "; ".join(_why_closed(comm, closing, p, job_ranks[p], max(deadline - time.monotonic(), _LEAST_WAIT_S))
                    for p in closed)
    gloo = _gloo_words(error)
    return CollectiveError(
        f"fusedist: {error.op} (tag {error.tag!r}, collective #{error.seq}) failed on rank {comm.rank} of "
        f"{comm.world_size}{comm._global_note([comm.rank])}: {what}: {why} (gloo: {gloo})",
        op=error.op, tag=error.tag, rank=error.rank, seq=error.seq)


def _why_closed(comm, closing, peer: int, global_peer: int, wait_s: float) -> str:
    """Why ``peer`` closed its connection: the failure or abort it left for its peers (written before it
    closed them), else what it left for the stall reports, else its entry waited for up to ``wait_s``
    (a transfer that timed out closes the connections before its rank writes)."""
    where = _where(peer, global_peer)
    if closing.left_by(global_peer, 0.0) is not None:
        return closing.explain(where, global_peer, 0.0)
    return _left_for_reports(comm, peer, where) or closing.explain(where, global_peer, wait_s)


def _left_for_reports(comm, peer: int, peer_where: str) -> Optional[str]:
    """What ``peer`` left for the stall reports before its connection closed -- that it crashed, or left the
    group without an error -- where a monitor watches ``comm`` (Note [a crashed peer, seen through the store]
    in watchdog.py), else None. Written before its process ended or its group went: nothing is waited for."""
    observer = comm.observer
    store = getattr(observer, "store", None)
    if store is None or not hasattr(observer, "group_name") or not hasattr(observer, "generation"):
        return None
    from ..reliability import stall_report

    entry = (stall_report.read_entries(store, observer.group_name, observer.generation, [peer]) or {}).get(peer)
    kind = (entry or {}).get("kind")
    if kind == "crash":
        return (f"{peer_where} closed the connection: its process crashed with {entry.get('error')} (on "
                f"{entry.get('host')}, pid {entry.get('pid')})")
    if kind == "exit":
        return (f"{peer_where} closed the connection: it left the group without an error (its program ended, or "
                "destroyed the group) while this rank still ran collectives there")
    return None


def _described(handle) -> str:
    """How the error names the collective: gloo's own, with this rank's part where it has one that says something."""
    part = handle.part
    if part is None or handle.op == "barrier":
        return f"gloo's own {handle.op}"
    return f"gloo's own {handle.op} [{part.numel()} x {part.dtype} per rank]"


def _gloo_words(error: BaseException) -> str:
    """gloo's own words cut to their first sentence (the rest guesses at a crash), without fusedist's lead-in."""
    found = _GLOO_CLOSED.search(str(error))
    return found.group(0) if found is not None else str(error)


def _global_ranks(comm) -> list:
    return global_ranks(comm) or list(range(comm.world_size))
