"""A rank that published a caught failure to its data-parallel peers lets them read it before its next step.

Note [the next step waits until the peers were told]
    A failure published for the data-parallel peers (Note [a first-step failure told to the data-parallel
    peers], Note [a one-rank pipeline's failure told to its data-parallel peers] in _pipeline_step_status.py)
    stands until the rank's next launch in each group (Note [a failure entry withdrawn at the next launch] in
    fusedist/reliability/failed_elsewhere.py). A peer reads it only once its wait has blocked past
    ``FUSEDIST_DIVERGENCE_PROBE_S``. Where the failing rank caught its error and took its next step at once (a
    failed shape inference counts as ended, and a stage with no backward pass yet may step again), that step's
    data-parallel reductions withdrew the entry before the peers' probes read it and paired with the peers'
    reductions of the failed step: on pp=2 x dp=2, pipeline 1's first step returned, its gradients averaged
    with pipeline 0's second step's, every rank applied that offset optimizer step, and only the next forward's
    step check named it (by a count of forwards that differed, not the offset itself). So at the beginning of
    the step after one whose failure it published, the rank waits, in each group that still holds its entry,
    until every peer has been told or cannot pair: its entry is a failure of its own (a probe's verdict that
    read this one, its own failure told elsewhere, a crash) or it has published as many failures to the group
    as this rank (it failed in the same step and goes on too: counted in the store, since its entry goes at
    its own next launch -- waiting on for such a peer kept this rank's entry standing while the peer waited
    in its next reduction, and the peer's probe failed it on this rank's old failure). A told peer gives the
    group up, so this rank's next reductions there fail at once, its error naming the failure the peers were
    told as well as gloo's closed connection, and every rank raises the first failure; peers that failed alike
    go on together, at once. The wait is bounded by the probe's delay and ``MARGIN_S`` more -- a peer blocked in a
    reduction when the step began reads the entry within it; a peer that reaches its reduction later than
    that, or a group whose peers are in no collective at all, is not waited for further and the step goes on as
    before. Costs nothing on a step after one that published nothing; after one: a store count per group at
    the publish, and a read of the peers' entries every ``POLL_S`` while waiting. Not waited where the probe is
    off (``FUSEDIST_DIVERGENCE_PROBE_S=0``, ``FUSEDIST_CHECKS=0``): no peer reads the entries.
"""

from __future__ import annotations

import time
from typing import Optional

from .reliability import stall_report

#: How long past the probe's delay the next step waits at most (the probe reads every 0.25 s past it).
MARGIN_S = 1.0
#: How often the peers' entries are read while waiting.
POLL_S = 0.05
#: Store keys counting the failures each rank published to a group (kept: a peer may read them after the
#: entry went).
COUNT_PREFIX = "fusedist_pipeline_failures_published"


def count_published(monitors: list) -> None:
    """After ``failed_elsewhere.publish`` wrote to ``monitors``: one more failure this rank published to
    each of those groups. Never raises."""
    for monitor in monitors:
        try:
            monitor.store.add(_count_key(monitor, monitor.comm.rank), 1)
        except Exception:  # noqa: BLE001 - best effort, as the publishing itself
            continue


def wait_until_told(monitors: list) -> Optional[str]:
    """At the next step's beginning (Note [the next step waits until the peers were told]): wait until every
    peer of each group in ``monitors`` still holding this rank's entry has been told of it or failed alike,
    at most the probe's delay and ``MARGIN_S``. The failure told where a peer gave its group up on reading it
    (this step's reductions there then fail), else None. Never raises."""
    from .reliability.config import checks_enabled, divergence_probe_s

    try:
        delay = divergence_probe_s() if checks_enabled() else 0.0
    except Exception:  # noqa: BLE001 - a malformed setting is raised where the probe reads it
        return None
    if delay <= 0:
        return None
    deadline, gave_up = time.monotonic() + delay + MARGIN_S, None
    waiting = list(monitors)
    while waiting:
        still = []
        for monitor in waiting:
            told, message = _told(monitor)
            gave_up = gave_up or message
            if not told:
                still.append(monitor)
        waiting = still
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    return gave_up


def with_the_failure_told_before(stage, message: str) -> str:
    """``message`` of a failure in a step whose data-parallel peers gave their groups up when told of the
    rank's failure in the step before (:func:`wait_until_told`): that failure named too."""
    before = getattr(stage, "_peers_gave_up_on", None)
    if not before:
        return message
    return (f"{message} -- this rank's data-parallel peers had given their group up when told of its failure in "
            f"the step before: {before}. Fix what raised and restart every rank from the last checkpoint")


def _told(monitor) -> tuple:
    """(whether every peer of the group has been told of this rank's entry, or failed in the same step -- or the
    entry no longer stands, launched past or replaced by a failure of the group's own, or the store cannot
    answer; the entry's message where a peer's probe gave its verdict on it, else None)."""
    if monitor.reports or monitor.store is None:
        return True, None
    rank = monitor.comm.rank
    entries = stall_report.read_entries(monitor.store, monitor.group_name, monitor.generation,
                                        list(range(monitor.comm.world_size)))
    message = (entries or {}).pop(rank, None) or {}
    message = message.get("failed_elsewhere")
    if entries is None or not message:
        return True, None
    gave_up = message if any((e or {}).get("verdict") for e in entries.values()) else None
    try:
        mine = _published(monitor, rank)
        return all((entries.get(peer) or {}).get("kind") in ("failure", "crash", "exit")
                   or _published(monitor, peer) >= mine for peer in entries), gave_up
    except Exception:  # noqa: BLE001 - a store that cannot count: nothing to wait on
        return True, gave_up


def _published(monitor, rank: int) -> int:
    """How many failures ``rank`` published to the monitor's group (0 where none)."""
    return int(monitor.store.add(_count_key(monitor, rank), 0))


def _count_key(monitor, rank: int) -> str:
    return f"{COUNT_PREFIX}/{monitor.group_name}/{monitor.generation}/{rank}"
