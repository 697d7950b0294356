"""Which rank closed a connection of the gloo exchange, and why (Note [connections a peer closed]).

Note [connections a peer closed]
    gloo closes a rank's connections to its peers when a transfer of that rank fails (its wait
    timed out). A peer still waiting on that connection then fails at once with gloo's
    "Connection closed by peer [address]", which named neither the rank that closed it nor why:
    read alone, it looked like a crash, where the usual cause is a collective the two ranks
    never paired, found out first by the rank whose timeout ran out first. So a rank whose
    exchange failed leaves its error in the store (on the failure path only: nothing on the
    common path), and a rank that finds a connection closed by a peer reads that peer's entry,
    waiting for it a short while (the peer writes it right after it closed the connection), and
    names the peer and its error. Where the peer left no entry (its process ended, or it could
    not reach the store) the error says that this peer ended the connection and that its process
    may have ended. Entries are keyed by the group's name and the rank's global rank: a group
    gives up at its first failed exchange (Note [no collectives after a failed exchange] in
    gloo_exchange.py), so each rank writes at most one per group. A rank that aborts its process
    groups writes that it did before it closes their connections (Note [aborting a group closes its
    connections] in aborted_groups.py), and that entry stays: the abort fails its own pending
    exchanges next, whose errors are not the cause. The entries go once every rank has left the group
    (Note [the last rank to leave a group clears its entries] in reliability/group_left.py).
"""

from __future__ import annotations

import datetime
import weakref
from typing import Optional

from . import aborted_groups

#: How long a rank that found a connection closed waits for the peer's entry.
WAIT_S = 2.0
_PREFIX = "fusedist/exchange_failed"


def _default_store():
    """The default process group's store, or None (never raises)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: errors just say less
        return None


def entry_keys(group_name: str, global_ranks: list) -> list:
    """The keys the ranks ``global_ranks`` of the group named ``group_name`` may have written (Note [the last rank
    to leave a group clears its entries] in reliability/group_left.py)."""
    return [f"{_PREFIX}/{group_name}/{rank}" for rank in global_ranks]


class PeerClosedConnection(RuntimeError):
    """An exchange failed because a peer closed its connection: no timeout of this rank's, even when
    the peer's own error, which it quotes, was one."""


def closed_by_peer(exc: BaseException) -> bool:
    """Whether gloo's error says the peer closed (or reset) the connection."""
    text = str(exc).lower()
    return "closed by peer" in text or "reset by peer" in text


class ClosedConnections:
    """Publishes this rank's exchange failure for one group and reads a peer's."""

    def __init__(self, group, global_rank: int):
        self.store = _default_store()  # held now: the group may be destroyed when a failure is written
        try:
            self.group_name = str(group.group_name)
        except Exception:  # noqa: BLE001 - no name to key on: nothing is published
            self.store = None
            self.group_name = ""
        self.global_rank = global_rank
        self._final = False  # (an abort's entry was written: it stays)
        try:  # (weakly: the group closes its connections when its last holder drops it)
            self.group = weakref.ref(group)
        except TypeError:  # (not a process group: nothing to close on an abort)
            self.group = lambda: None
        # Note [aborting a group closes its connections] in aborted_groups.py
        aborted_groups.watch(self)

    def _key(self, global_rank: int) -> str:
        return entry_keys(self.group_name, [global_rank])[0]

    def publish(self, reason: str, final: bool = False) -> None:
        """Leave this rank's failure for its peers; never raises. After a ``final`` one (an abort, which fails
        this rank's own pending exchanges next), the others are not written."""
        if self.store is None or self._final:
            return
        self._final = final
        try:
            self.store.set(self._key(self.global_rank), reason.encode())
        except Exception:  # noqa: BLE001 - the store is gone too: the peers say less
            pass

    def left_by(self, global_peer: int, wait_s: float) -> Optional[str]:
        """The failure ``global_peer`` left, waited for up to ``wait_s`` (0: read now), or None."""
        if self.store is None:
            return None
        key = self._key(global_peer)
        try:
            if wait_s > 0:
                self.store.wait([key], datetime.timedelta(seconds=wait_s))
            elif not self.store.check([key]):
                return None
            return self.store.get(key).decode()
        except Exception:  # noqa: BLE001 - no entry within the wait
            return None

    def explain(self, peer_where: str, global_peer: int, wait_s: float = WAIT_S) -> str:
        """What to say of a connection ``global_peer`` (``peer_where``: how errors name it) closed, its entry
        waited for up to ``wait_s``."""
        failure = self.left_by(global_peer, wait_s)
        if failure is not None and failure.startswith(aborted_groups.aborted_reason(f"rank {global_peer}")):
            return f"{peer_where} closed the connection: it {failure.split(' ', 2)[2]}"
        if failure is not None:
            return (f"{peer_where} closed the connection because its side of a collective failed first "
                    f"({failure})")
        return (f"{peer_where} closed the connection and left no error: its process may have ended (look at "
                "its log), or it failed without reaching the store")


def explained(closing: Optional[ClosedConnections], exc: BaseException, peer_where: str,
              global_peer: int) -> Optional[str]:
    """The explanation for ``exc`` where it is a connection the peer closed (gloo's own words cut to
    their first sentence: the rest guesses at a crash), else None."""
    if closing is None or not closed_by_peer(exc):
        return None
    gloo = str(exc).split(". ")[0]
    return f"{closing.explain(peer_where, global_peer)} (gloo: {gloo})"
