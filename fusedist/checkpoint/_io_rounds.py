"""The store barriers of a Checkpointer's saves, one round of them per save, and the keys they
leave (Note [waiting for a peer's I/O] in ``_writer.py``)."""

from __future__ import annotations

import uuid

from ._writer import Coordinator, io_barrier


class IOWaits:
    """The barriers of a :class:`Coordinator`'s saves, one :class:`IOBarrier` per save."""

    def __init__(self, coord: Coordinator):
        self.coord = coord
        # One name per Checkpointer of this run: a store kept across restarts holds the keys of
        # an earlier run's group of the same name, whose counts would end a barrier early.
        nonce = coord.broadcast(uuid.uuid4().hex[:12] if coord.rank == 0 else None, "checkpoint I/O keys")
        self.name = f"{getattr(coord.group, 'group_name', 'default')}-{nonce}"
        self.round, self.barrier, self.previous = 0, None, None
        self.unsettled = False  # the last save was given up on (Note [a save given up on])
        # every rank left the last round's barriers: its closing exchange completed here
        self.left_together = False

    def start(self) -> None:
        """Number this save's round and renew this rank's beat until :meth:`stop`."""
        self.round += 1
        self.left_together = False
        if self.previous is not None:  # every rank left the round before the last one: each ends at a barrier
            self.previous.forget(self.previous.phase)
        self.previous = self.barrier
        self.barrier = io_barrier(f"{self.name}/{self.round}", self.coord.rank, self.coord.ranks,
                                  silence=self.coord.silence)
        if self.barrier is not None:
            self.barrier.start_beat()

    def stop(self) -> None:
        if self.barrier is not None:
            self.barrier.stop_beat()

    def settle(self) -> None:
        """Wait, at one more barrier of the save given up on, beating as its rounds do, for the
        ranks still writing it; raised errors leave it unsettled, for the next save to retry."""
        if not self.unsettled or self.barrier is None:
            return
        self.barrier.wait_beating("the save given up on before this one")
        self.unsettled = False

    def wait(self, what: str) -> None:
        if self.barrier is not None:
            self.barrier.wait(what)

    def close(self) -> None:
        """Remove the keys of the rounds every rank has left (Note [the keys a Checkpointer leaves at close])."""
        if self.previous is not None:  # (as the next start would)
            self.previous.forget(self.previous.phase)
            self.previous = None
        if self.barrier is not None and self.left_together:
            self.barrier.forget(self.barrier.phase)
            self.barrier = None


# Note [the keys a Checkpointer leaves at close]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each save's round leaves two keys a phase in the job's store (Note [waiting for a peer's I/O]); a
# round's keys can go once no rank reads them any more. The next round's start removes the round
# before the last (each round ends at a barrier every rank reached, so every rank has left the one
# before it), and so does close(), which is no collective: it cannot wait for the others. The last
# round goes too where it ended with its closing exchange ("save finished"): an all-gather completes
# on a rank only once every rank has joined it, after leaving the round's last barrier, so no rank
# polls its keys any more. A round that failed, or was given up on, ended without that exchange: a
# peer may still wait at one of its barriers, and a key removed under it would be recreated at zero
# and waited on; its keys stay (a few keys for the life of the store).
