"""The ranks of a shared launch agree after each scenario whether every rank passed it, and
start the next one on a fresh process group when one did not (Note [a scenario that fails on
some ranks]).

Note [a scenario that fails on some ranks]
    A scenario that raises on one rank leaves the others where they were: in a collective the
    failed rank will never join, or on their way to the next scenario, whose first collective
    would pair with a collective of the failed one (silently, where the shapes match). So
    after each scenario the ranks agree on its outcome through a store of the launch, not
    through a collective, which could pair with one still pending: each publishes passed or
    failed and reads the others'. A rank that failed waits a moment (``SETTLE_S``) for the
    others to publish theirs, then aborts its process groups, which fails at once the
    collective a peer waits in (gloo sees the closed connection) instead of at the group's
    timeout; once any rank failed, every rank aborts its groups and starts the next scenario on
    a fresh default group (its rendezvous under a prefix of its own in the first group's store,
    with that group's timeout). A rank whose failure followed a peer's abort says so in its
    traceback's first line (``AFTER_ABORT``), so the test can report the failure that caused
    it first.

    What the abort does not end early: a wait in a store (a barrier, a new group's
    rendezvous): it waits out its timeout, the process group's (30 s by default), and the
    next scenario still runs on a fresh group. (gloo's abort closes no connection by itself;
    fusedist closes those of the groups its exchanges use: Note [aborting a group closes its
    connections] in fusedist/comm/aborted_groups.py.)

    The store is a TCP store served by rank 0 on a port the system picks (told to the others
    through the group's own store): its waits are answered when the key is set, where the
    file store the harness rendezvouses through polls (~10 ms per scenario, seconds per
    suite); an agreement costs about a millisecond.
"""

from __future__ import annotations

import datetime

#: seconds a rank whose scenario failed waits for the others to finish theirs before it aborts
#: the groups under them
SETTLE_S = 1.0
#: how the first line of a rank's failure that followed another's abort goes on after "rank N, "
AFTER_ABORT = "after rank(s)"
_PREFIX = "fusedist-scenario"


class ScenarioAgreement:
    """One rank's side of the agreements of a launch (:meth:`start` makes it)."""

    def __init__(self, rank: int, world: int, store, group_store, backend: str):
        self.rank, self.world, self.store = rank, world, store
        # the first group's store, with its timeout, and its backend: what a fresh group is made of
        self.group_store, self.backend = group_store, backend

    @classmethod
    def start(cls, rank: int, world: int, wait_s: float):
        """None where the launch has no process group (the scenarios make their own). ``wait_s``:
        the longest a rank waits for the others to finish a scenario."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        first = dist.distributed_c10d._get_default_store()
        timeout = datetime.timedelta(seconds=wait_s)
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
            first.set(f"{_PREFIX}/port", str(store.port))
        else:
            store = dist.TCPStore("127.0.0.1", int(first.get(f"{_PREFIX}/port")), world, is_master=False,
                                  timeout=timeout)
        return cls(rank, world, store, first, dist.get_backend())

    def failure_text(self, index: int, trace: str) -> str:
        """``trace`` headed by the rank, and by the ranks that had failed scenario ``index`` and
        aborted their groups before (that abort may be what ended this rank's collective)."""
        earlier = [r for r in self._others() if self.store.check([self._key(index, "aborted", r)])]
        if earlier:
            return (f"rank {self.rank}, {AFTER_ABORT} {earlier} failed this scenario and aborted its process "
                    f"groups (their failure is the cause where this is a closed connection):\n{trace}")
        return f"rank {self.rank}:\n{trace}"

    def settle(self, index: int, passed: bool) -> None:
        """Publish this rank's outcome of scenario ``index``, learn the others'; if any rank
        failed, start the next scenario on a fresh default group."""
        store = self.store
        store.set(self._key(index, "outcome", self.rank), b"passed" if passed else b"failed")
        others = [self._key(index, "outcome", r) for r in self._others()]
        if not passed:
            try:
                store.wait(others, datetime.timedelta(seconds=SETTLE_S))
            except Exception:  # noqa: BLE001 - a peer still running: the abort below ends its collective
                pass
            store.set(self._key(index, "aborted", self.rank), b"")
            _abort_groups()
        try:
            outcomes = store.multi_get(others)  # (waits for them, up to the store's timeout)
        except Exception as exc:
            missing = [r for r in self._others() if not store.check([self._key(index, "outcome", r)])]
            raise RuntimeError(f"rank {self.rank}: ranks {missing} did not finish scenario {index} of the launch "
                               f"within {store.timeout}; the launch cannot go on") from exc
        if passed and all(outcome == b"passed" for outcome in outcomes):
            return
        _abort_groups()
        self._fresh_default_group(index)

    def close(self) -> None:
        """Rank 0 serves the store: it returns (and ends the server) once the others are done."""
        self.store.set(self._key("end", "done", self.rank), b"")
        if self.rank == 0:
            self.store.wait([self._key("end", "done", r) for r in self._others()])

    def _fresh_default_group(self, index: int) -> None:
        import torch.distributed as dist

        dist.init_process_group(self.backend, store=dist.PrefixStore(f"{_PREFIX}/{index}/group/", self.group_store),
                                rank=self.rank, world_size=self.world, timeout=self.group_store.timeout)

    def _others(self) -> list:
        return [r for r in range(self.world) if r != self.rank]

    @staticmethod
    def _key(index, what: str, rank: int) -> str:
        return f"{_PREFIX}/{index}/{what}/{rank}"


def _abort_groups() -> None:
    """Abort every process group of this rank (the default one and its subgroups): a peer's
    collective on them fails at once."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()
