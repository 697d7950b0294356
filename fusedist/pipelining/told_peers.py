"""A rank that published a caught failure to its data-parallel peers lets them read it before its next step.

Note [the next step waits until the peers were told]
    A failure published for the data-parallel peers (Note [a first-step failure told to the data-parallel
    peers], Note [a one-rank pipeline's failure told to its data-parallel peers] in step_status.py)
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
    go on together, at once.

    How long: in the groups the stage's gradients are reduced over (its fusedist DDP engine's, its
    ``fully_shard`` units' shard and replicate groups), until then, up to the group's collective timeout
    (``FUSEDIST_TIMEOUT_S``). A peer still computing the failed step reaches its reduction later, blocks there
    (this rank launched nothing yet) and its probe reads the entry. The wait once ended at the probe's delay and
    ``MARGIN_S``: a peer later than that (on pp=2 x dp=2, pipeline 1's loss a second slower) paired its
    reductions of the failed step with the retried step's, both steps returned, every rank applied the offset
    optimizer step and the next forward's step check named it by a count of forwards. Nothing the reductions
    carry can refuse that pairing at no cost: the check's verdict is read at the next forward, behind the
    optimizer step (Note [step check] in fusedist/reliability/step_check.py); waiting costs no collective and
    only time the retried step's reductions would have waited for that peer anyway. A peer of such a group
    still neither at the timeout (it reached no collective of the group) fails the step, raised here naming
    the peers, the group and both steps, rather than letting its reductions pair with theirs later. Other
    groups the failure was published to (another model's, an earlier phase's whose peers moved on) are waited
    for up to the probe's delay and ``MARGIN_S`` only, and the step goes on. A peer that failed the same step
    without publishing it -- told at the step's end by its pipeline's status exchange (Note [a failure told at
    the step's end] in step_status.py), it reaches no reduction and so is never told -- counts that
    failed step as a published one (once a step), so the wait ends for it at once.

    Costs nothing on a step after one that published nothing; after one: a store count per group at the
    publish (or at a failure told at the step's end), and a read of the peers' entries every ``POLL_S`` while
    waiting (``SLOW_POLL_S`` past the probe's delay and ``MARGIN_S``). Not waited where the probe is off
    (``FUSEDIST_DIVERGENCE_PROBE_S=0``, ``FUSEDIST_CHECKS=0``): no peer reads the entries, and a late peer's
    reductions still pair with the retried step's; with the step check on, that step raises at its end on
    every rank, before any optimizer step, naming each data-parallel rank's step (Note [a retried step paired
    with a late peer's] in step_verdict.py).
"""

from __future__ import annotations

import time
from typing import Optional

from .._rank import this_rank
from ..comm.store_reads import read_count
from ..reliability import group_left, stall_report

#: How long past the probe's delay a group the stage's gradients are not reduced over is waited for (the probe
#: reads every 0.25 s past it).
MARGIN_S = 1.0
#: How often the peers' entries are read while waiting: until the probe's delay and ``MARGIN_S``, and after.
POLL_S = 0.05
SLOW_POLL_S = 0.25
#: Store keys counting the failures each rank published to a group (kept: a peer may read them after the
#: entry went).
COUNT_PREFIX = "fusedist_pipeline_failures_published"


def count_published(monitors: list, stage=None) -> None:
    """After ``failed_elsewhere.publish`` wrote to ``monitors``: one more failure this rank published to
    each of those groups -- once a step of ``stage``'s schedule, where given. Never raises."""
    if stage is not None and not _first_count_of_the_step(stage):
        return
    for monitor in monitors:
        try:
            monitor.store.add(_count_key(monitor, monitor.comm.rank), 1)
        except Exception:  # noqa: BLE001 - best effort, as the publishing itself
            continue


def count_failed_step(stage) -> None:
    """The stage's step failed on every rank of its pipeline (its status exchange told a failure): counted
    as a published one in each group a failure is published to, once a step, so that a data-parallel peer
    whose pipeline published its failure of this step does not wait for this rank, which failed alike
    without publishing (Note [the next step waits until the peers were told]). Never raises."""
    from ..reliability import monitor as _monitor

    count_published([m for m in list(_monitor._monitors) if m.store is not None and not m.reports], stage)


def step_began(stage) -> None:
    """At a scheduled step's beginning: its number (the first is 1), and nothing counted in it yet."""
    stage._steps_begun = getattr(stage, "_steps_begun", 0) + 1
    _step_owner(stage).__dict__["_fusedist_failure_counted"] = False


def wait_until_told(stage, monitors: list) -> Optional[str]:
    """At the next step's beginning (Note [the next step waits until the peers were told]): wait until every
    peer of each group in ``monitors`` still holding this rank's entry has been told of it or failed alike --
    in the groups the stage's gradients are reduced over, up to their collective timeout, elsewhere up to the
    probe's delay and ``MARGIN_S``. The failure told where a peer gave its group up on reading it (this step's
    reductions there then fail), else None. Raises where a peer of a reducing group is neither by then."""
    from ..reliability.config import checks_enabled, divergence_probe_s

    try:
        delay = divergence_probe_s() if checks_enabled() else 0.0
    except Exception:  # noqa: BLE001 - a malformed setting is raised where the probe reads it
        return None
    if delay <= 0:
        return None
    began, gave_up = time.monotonic(), None
    try:
        reducing = reduction_comms(stage.submod)
    except Exception:  # noqa: BLE001 - a module not read as expected: every group waited for as another's
        reducing = []
    waiting = {id(m): (m, _reduced_over(m, reducing)) for m in monitors}
    while waiting:
        now = time.monotonic()
        for key, (monitor, reduced) in list(waiting.items()):
            untold, message = _untold(monitor)
            gave_up = gave_up or message
            deadline = began + (_timeout_s(monitor) if reduced else delay + MARGIN_S)
            if not untold or now >= deadline:
                del waiting[key]
            if untold and now >= deadline and reduced:  # its peers' reductions would pair with this step's
                raise RuntimeError(_not_told(stage, monitor, untold, now - began))
        if waiting:
            time.sleep(POLL_S if now < began + delay + MARGIN_S else SLOW_POLL_S)
    return gave_up


def reduction_comms(module) -> list:
    """The communicators a stage module's gradients are reduced over: its fusedist DDP (or replicate) engine's,
    its ``fully_shard`` units' (shard and replicate groups)."""
    from .sync_switch import ddp_engine_of
    from ..fsdp import FullyShardedModule
    from ..fsdp.state import state_of

    engine = ddp_engine_of(module)
    comms = [engine.comm] if engine is not None else []
    for sub in module.modules():
        unit = getattr(state_of(sub), "unit", None) if isinstance(sub, FullyShardedModule) else None
        comms += [c for c in (getattr(unit, "comm", None), getattr(unit, "replicate_comm", None)) if c is not None]
    return comms


def _reduced_over(monitor, reducing: list) -> bool:
    """Whether the stage's gradients are reduced over the monitor's group: its reductions there would pair
    with the peers' reductions of the failed step."""
    group = getattr(monitor.comm, "group", monitor.comm)
    return any(c is monitor.comm or getattr(c, "group", c) is group for c in reducing)


def with_the_failure_told_before(stage, message: str) -> str:
    """``message`` of a failure in a step whose data-parallel peers gave their groups up when told of the
    rank's failure in the step before (:func:`wait_until_told`): that failure named too, and both steps."""
    before = getattr(stage, "_peers_gave_up_on", None)
    if not before:
        return message
    step = getattr(stage, "_steps_begun", 0)
    return (f"{message} -- this rank's data-parallel peers had given their group up when told of its failure in "
            f"the step before (step #{step - 1}; this is step #{step}, refused before any of its reductions "
            f"could pair with theirs of step #{step - 1}): {before}. Fix what raised and restart every rank from the "
            "last checkpoint")


def _not_told(stage, monitor, untold: list, waited: float) -> str:
    """The error of a step whose peers were neither told of the rank's failure in the step before nor failed."""
    from ..comm.base import global_ranks

    step = getattr(stage, "_steps_begun", 0)
    try:
        named = global_ranks(monitor.comm)
    except Exception:  # noqa: BLE001 - positions in the group, then
        named = None
    peers = [named[r] if named else r for r in untold]
    return (f"fusedist.pipelining.PipelineStage: stage {stage.stage_index} (global rank {this_rank()}): step "
            f"#{step} refused: its data-parallel peers (global ranks {peers} of group {monitor.group_name!r}) neither "
            f"learned of this rank's failure in step #{step - 1} nor failed in that step within {waited:.0f} s (the "
            "collective timeout, FUSEDIST_TIMEOUT_S): they reached no collective of the group, and this step's "
            f"reductions would pair with theirs of step #{step - 1}, averaging the gradients of different steps. Fix "
            f"what raised in step #{step - 1} and restart every rank from the last checkpoint")


def _untold(monitor) -> tuple:
    """(the group positions of the peers not yet told of this rank's entry nor failed in the same step -- none
    where the entry no longer stands, launched past or replaced by a failure of the group's own, or the store
    cannot answer; the entry's message where a peer's probe gave its verdict on it, else None)."""
    if monitor.reports or monitor.store is None:
        return [], None
    rank = monitor.comm.rank
    entries = stall_report.read_entries(monitor.store, monitor.group_name, monitor.generation,
                                        list(range(monitor.comm.world_size)))
    message = (entries or {}).pop(rank, None) or {}
    message = message.get("failed_elsewhere")
    if entries is None or not message:
        return [], None
    gave_up = message if any((e or {}).get("verdict") for e in entries.values()) else None
    try:
        mine = _published(monitor, rank)
        return [peer for peer in sorted(entries) if (entries.get(peer) or {}).get("kind") not in (
            "failure", "crash", "exit") and _published(monitor, peer) < mine], gave_up
    except Exception:  # noqa: BLE001 - a store that cannot count: nothing to wait on
        return [], gave_up


def _published(monitor, rank: int) -> int:
    """How many failures ``rank`` published to the monitor's group (0 where none)."""
    return read_count(monitor.store, _count_key(monitor, rank))


def _count_key(monitor, rank: int) -> str:
    return f"{COUNT_PREFIX}/{monitor.group_name}/{monitor.generation}/{rank}"


def _timeout_s(monitor) -> float:
    """The group's collective timeout, in seconds."""
    timeout = getattr(monitor.comm, "timeout", None)
    return timeout.total_seconds() if timeout is not None else 600.0


def _first_count_of_the_step(stage) -> bool:
    """Whether nothing was counted yet in this step of the stage's schedule (every stage a rank runs: one
    count a step), marking it counted."""
    owner = _step_owner(stage).__dict__
    if owner.get("_fusedist_failure_counted", False):
        return False
    owner["_fusedist_failure_counted"] = True
    return True


def _step_owner(stage):
    """What one step of the rank is counted on: the stage's schedule, or the stage driven by hand."""
    from .step_failures import last_schedule

    return last_schedule(stage) or stage


# The counts go with the group's other entries once every rank has left it (Note [the last rank to leave a group
# clears its entries] in fusedist/reliability/group_left.py): one key per rank and failed group, left for good before.
group_left.delete_with_group(lambda monitor: [_count_key(monitor, r) for r in range(monitor.comm.world_size)])
