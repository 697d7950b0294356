"""A rank that failed outside its groups' collectives tells the peers blocked on it, through the store.

Note [a failure outside the group's collectives]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A rank can fail somewhere no monitored collective sees -- a pipeline stage's loss, whose failure its
pipeline learns of in an exchange at the step's end -- and then wait there, alive, while the peers of its
other groups (the stage's data-parallel group) wait in a reduction it will never issue. Its connections
stay open, so nothing on the wire ends their wait before the collective timeout, and the pipeline's
exchange in turn waits on them. While such a rank waits to tell its failure, it publishes a ``failure``
entry in each of its monitored groups (the store key the divergence probe reads, Note [divergence probe] in
divergence.py), saying it waits in no collective of the group, with the failure's message. A peer whose
wait has blocked past ``FUSEDIST_DIVERGENCE_PROBE_S`` then reads that entry and fails its wait at once, its
error saying which rank failed elsewhere and why (Note [a peer that failed elsewhere, in the divergence probe]
in divergence.py), and whoever handles that error can read the message (:func:`failure_told`) and raise
that. The entry is withdrawn once the rank's failure has been told, so a group used again later is probed
as before. A rank whose group already holds its entry of a real collective failure keeps that one (Note
[one entry per rank] in monitor.py). Costs nothing until a failure; store calls only then.

Note [a failure entry withdrawn at the next launch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Where nothing waits for the peers to read the entry (a pipeline's first-step failure, told along the pipeline
by notices: Note [a first-step failure told to the data-parallel peers] in fusedist/pipelining/step_status.py),
it was kept for good: after a caught failure the rank trained on, and any later wait of a peer blocked past
the probe's delay (a rank saving a checkpoint, a slow data loader) was told of the old failure and gave the
group up. What the entry says -- this rank waits in no collective of the group from collective ``seq`` on --
stays true exactly until the rank launches its next collective there; so that launch withdraws it, in that
group alone, before the rank waits. A peer still waiting for this rank is told as long as this rank issues
nothing there; once it does, the peer's wait pairs with it (or, where the two cannot pair, the probe names
both as diverged). The launch reads this rank's entry first and withdraws only the failure it published (an
entry written since, a real failure's, a check's, stays). Costs one store read and delete at the first
launch after a published failure; nothing otherwise.
"""

from __future__ import annotations

import functools
from typing import Optional

from . import monitor as _monitor
from . import stall_report

#: What the entry says the failed rank waits in (the probe names it beside its peers' collectives).
WAITS_IN = "no collective of this group (it failed elsewhere and is telling its failure)"


def publish(message: str) -> list:
    """Publish ``message`` as this rank's failure in each of its monitored groups, each withdrawn at this rank's
    next launch there (Note [a failure entry withdrawn at the next launch]); the monitors written to (for
    :func:`withdraw`). Never raises."""
    written = []
    for monitor in list(_monitor._monitors):
        if monitor.store is None or monitor.reports:
            continue
        try:
            entry = {"kind": "failure", "error": _monitor._short(RuntimeError(message)), "context": monitor.context(),
                     "recent": list(monitor.history), "failed_elsewhere": message,
                     "waiting_on": {"op": WAITS_IN, "tag": "", "seq": getattr(monitor.comm, "last_seq", -1) + 1}}
            if stall_report.publish(monitor.store, monitor.group_name, monitor.generation, monitor.comm.rank, entry):
                written.append(monitor)
                # Note [a failure entry withdrawn at the next launch]
                monitor.before_next_launch(_KEY, functools.partial(_withdraw_at_launch, monitor, message))
        except Exception:  # noqa: BLE001 - telling the peers is best effort; the failure itself is raised anyway
            continue
    return written


def withdraw(written: list) -> None:
    """Remove the entries :func:`publish` wrote (unless a real failure of the group replaced one since)."""
    for monitor in written:
        monitor.cancel_before_next_launch(_KEY)
        if not monitor.reports:
            stall_report.withdraw(monitor.store, monitor.group_name, monitor.generation, monitor.comm.rank)


#: The key of :func:`_withdraw_at_launch` among a monitor's next-launch actions (Note [work at a monitor's next
#: launch] in monitor.py).
_KEY = "failed elsewhere: this rank's failure entry"


def _withdraw_at_launch(monitor, message: str) -> None:
    """At the rank's next launch in ``monitor``'s group: withdraw the failure entry that told ``message``, and
    no other (Note [a failure entry withdrawn at the next launch])."""
    if not monitor.reports and monitor.store is not None:
        rank = monitor.comm.rank
        mine = (stall_report.read_entries(monitor.store, monitor.group_name, monitor.generation, [rank])
                or {}).get(rank) or {}
        if mine.get("kind") == "failure" and mine.get("failed_elsewhere") == message:
            stall_report.withdraw(monitor.store, monitor.group_name, monitor.generation, rank)


def failure_told(error: BaseException) -> Optional[str]:
    """The message a peer published (:func:`publish`) where ``error`` is, or was caused by, a fusedist
    collective's failure in a group of this rank; else None. Reads the store only after such an error."""
    from ..comm.base import CollectiveError

    seen, cause = set(), error
    while cause is not None and id(cause) not in seen and not isinstance(cause, CollectiveError):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, CollectiveError):
        return None
    for monitor in list(_monitor._monitors):
        if monitor.store is None:
            continue
        peers = [rank for rank in range(monitor.comm.world_size) if rank != monitor.comm.rank]
        entries = stall_report.read_entries(monitor.store, monitor.group_name, monitor.generation, peers) or {}
        for entry in entries.values():
            told = (entry or {}).get("failed_elsewhere")
            if told:
                return told
    return None
