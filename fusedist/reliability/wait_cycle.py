"""Ranks blocked in collectives of different groups, each waiting for a rank blocked in another: a cycle.

Note [waits across groups in the divergence probe]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The probe of Note [divergence probe] (divergence.py) reads the entries of its own group only. Ranks
that enter two groups' collectives in different orders -- rank 0 a collective on group A then one on B,
rank 1 B then A -- each wait in a group where the other never arrives, and each probe saw a peer with no
entry in its group ("maybe computing") and waited out the collective timeout. So a probe that has
published its entry also writes, under the job's store and this process's global rank, where it is
blocked: the group, its collective, the group's members (global ranks) and, for every group this process
monitors, the last collective it launched there. A rank blocked in group G at collective ``c`` then waits
for each member of G that is blocked in another group and has not launched G's collective ``c`` (one
launched asynchronously before still completes, and is no edge). Following those edges from this rank,
read from the store, reaching a rank already on the path is a cycle: no rank on it can go on, nor any
rank whose path leads into it, so the wait fails on every such rank with the probe's verdict, naming each
rank of the cycle, its group and collective. Only where a rank's own group entries give no verdict and
only past the probe's delay, as the probe itself; the same evidence must hold a quarter of the delay
(divergence.py). A rank that reached the verdict keeps its record, marked with the waits of the cycle it
found, as its failure entry stays: its peers, still probing that cycle, read it again -- and only they (the
process goes on; a record left as it was could close a cycle that is not there). It goes when the process
launches its next collective.
"""

from __future__ import annotations

import json
from typing import Optional

from ..comm.store_reads import read_json_now
from . import stall_report


def _key(global_rank: int) -> str:
    return f"{stall_report.KEY_PREFIX}/blocked/{global_rank}"


def group_id(name: str, generation: int) -> str:
    """How records name a group: its name and the monitor's generation."""
    return f"{name}#{generation}"


def record(monitor, waiting_on: dict) -> Optional[dict]:
    """Where this process is blocked (``waiting_on``, in ``monitor``'s group), for its peers' probes."""
    from ..comm.group_ranks import global_ranks
    from .monitor import _monitors

    me = stall_report._global_rank()
    if me is None:
        return None
    comm = monitor.comm
    launched = {group_id(m.group_name, m.generation): m.comm.last_seq for m in list(_monitors)}
    return {"rank": me, "group": group_id(monitor.group_name, monitor.generation),
            "members": global_ranks(comm) or list(range(comm.world_size)), "position": comm.rank,
            "op": waiting_on.get("op"), "tag": waiting_on.get("tag"), "seq": waiting_on.get("seq"),
            "launched": launched}


def publish(store, entry: dict) -> bool:
    """Write this process's record without touching the store's timeout (training may be healthy)."""
    try:
        store.set(_key(entry["rank"]), json.dumps(entry))
        return True
    except Exception:  # noqa: BLE001 - a probe never fails a wait because the store is odd
        return False


def withdraw(store, global_rank: int) -> None:
    """Remove this process's record: its wait ended."""
    try:
        store.delete_key(_key(global_rank))
    except Exception:  # noqa: BLE001
        pass


#: (store, global rank) of a record kept after a verdict, until this process launches its next collective.
kept: Optional[tuple] = None

#: The key of :func:`drop_kept` among the monitors' next-launch actions.
KEPT_KEY = "wait cycle: the record kept after a verdict"


def keep(store, entry: dict, waits: list) -> None:
    """Leave the record of a wait that ended in a verdict on the cycle of ``waits`` ([rank, group, seq] each),
    for the peers still probing it -- only for them: the process is no longer blocked. It goes when the process
    launches a collective again, in any group (Note [work at a monitor's next launch] in monitor.py)."""
    global kept
    from .monitor import _monitors

    if publish(store, dict(entry, gave_up=waits)):
        kept = (store, entry["rank"])
        for monitor in list(_monitors):
            monitor.before_next_launch(KEPT_KEY, drop_kept)


def drop_kept() -> None:
    """Withdraw the record :func:`keep` left: at the process's first launch after it, in any group (each monitor
    runs this once; the later ones find nothing left), or where a new probe's record replaces it."""
    global kept
    if kept is not None:
        store, global_rank = kept
        kept = None
        withdraw(store, global_rank)


def _read(store, global_rank: int) -> Optional[dict]:
    return read_json_now(store, _key(global_rank))  # (never waits: Note [reading a key without waiting])


def _waits_for(blocked: dict, peer: Optional[dict]) -> bool:
    """Whether ``blocked``'s collective cannot complete before ``peer`` (a member of its group) moves on:
    the peer is blocked in another group and has not launched this collective."""
    if peer is None or peer["group"] == blocked["group"]:
        return False  # (not blocked past the delay, or in this group: the group's own probe compares)
    if "gave_up" in peer:  # (a record kept after a verdict: only for the waits of the cycle it found)
        return [blocked["rank"], blocked["group"], blocked["seq"]] in peer["gave_up"]
    return peer.get("launched", {}).get(blocked["group"], -1) < blocked["seq"]


def find(store, mine: dict) -> Optional[tuple]:
    """(the verdict, the records it rests on, the waits it names) where ``mine`` waits on a cycle of ranks
    blocked in collectives of different groups, else None. One store read per rank reached, none waiting for
    a key."""
    records = {mine["rank"]: mine}
    path, on_path, done = [], set(), set()

    def visit(rank: int) -> Optional[list]:
        path.append(rank)
        on_path.add(rank)
        current = records[rank]
        for peer in current["members"]:
            if peer == rank or peer in done:
                continue
            if peer not in records:
                records[peer] = _read(store, peer)
            if not _waits_for(current, records[peer]):
                continue
            if peer in on_path:
                return path[path.index(peer):]
            found = visit(peer)
            if found is not None:
                return found
        path.pop()
        on_path.discard(rank)
        done.add(rank)
        return None

    try:
        cycle = visit(mine["rank"])
    except Exception:  # noqa: BLE001 - a store that cannot be read gives no verdict
        return None
    if cycle is None:
        return None
    steps = []
    for i, rank in enumerate(cycle):
        r, nxt = records[rank], cycle[(i + 1) % len(cycle)]
        steps.append(f"rank {rank} waits in {r['op']} (tag {r['tag']!r}, collective #{r['seq']}) of group "
                     f"{r['group']} for rank {nxt}")
    lead = "" if cycle[0] == mine["rank"] else f"rank {mine['rank']} waits on ranks blocked in a cycle: "
    verdict = (f"{lead}{'; '.join(steps)}, which has not launched that collective: each rank waits in a "
               "collective of a group whose other member is blocked in another group's, so none can go on "
               "(the groups' collectives were issued in different orders on different ranks; issue them in one "
               "order on every rank)")
    evidence = tuple(json.dumps({k: v for k, v in records[r].items() if k != "gave_up"}, sort_keys=True)
                     for r in sorted(cycle))
    return verdict, evidence, [[r, records[r]["group"], records[r]["seq"]] for r in path]
