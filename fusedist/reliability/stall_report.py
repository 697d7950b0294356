"""Stall reports exchanged through the ``torch.distributed`` store, not the stuck collective.

When a collective fails or times out, the collective itself cannot carry the diagnosis: the
peers it would reach are the ones that are gone or stuck. The key-value store the process
group was rendezvoused through is still there (under torchrun it lives in the launcher's
agent, so it even outlives crashed workers). Each rank that notices a failure publishes one
small JSON entry under ``fusedist/stall/<group>/<generation>/<rank>``: what it was waiting
on, its recent collective history and its training position. It then waits a bounded time
for the other ranks' entries and renders a report that says which ranks reached which
operation, which crashed (see :func:`publish_crash`) and which never reported -- dead, or
stuck outside fusedist collectives. Horovod's stall inspector is the model; unlike it, the
exchange happens only on failure, so the steady state pays nothing. A rank waiting in
``check_consistency()`` leaves an entry too, removed when the check returns, and the report
compares the ranks' training counters (Note [a rank behind at the check] in ``engine_watch.py``).
A group's entries are deleted once every rank has left it (Note [the last rank to leave a group clears its
entries] in ``group_left.py``).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
import weakref
from typing import Optional

from ..comm.base import global_note
from ..comm.store_reads import read_count
from ..comm.store_reads import read_json_now as _read  # never waits: Note [reading a key without waiting]

#: Keys live under this prefix in the process group's store.
KEY_PREFIX = "fusedist/stall"


#: The window when the failure says a peer's connection is gone (``peer_gone``).
PEER_GONE_WINDOW_S = 2.0

#: How backends word a peer process that has exited (gloo's TCP pairs; NCCL's proxy).
_PEER_GONE = ("connection reset by peer", "connection closed by peer", "remote process exited", "broken pipe")


def report_window_s(collective_timeout_s: float, peer_gone: bool = False) -> float:
    """How long a rank waits for the others' entries before rendering the report.

    ``FUSEDIST_STALL_REPORT_S`` overrides. Default: 5% of the collective timeout, clamped to
    [2 s, 15 s]: ranks that hit the same stuck collective time out within a few seconds of
    each other, and the report must not delay the error by much. When the failure is a
    peer's connection reset or closed (``peer_gone``: the peer process has exited -- a crash,
    an out-of-memory kill), ``PEER_GONE_WINDOW_S``: the ranks still alive meet closed
    connections at once, not at their timeouts, and the exited rank never writes an entry
    (one that crashed in Python has written its ``crash`` entry already), so the long window
    only delayed the error.
    """
    env = os.environ.get("FUSEDIST_STALL_REPORT_S")
    if env is not None:
        try:
            value = float(env)
        except ValueError:
            value = -1.0
        if not 0 <= value < float("inf"):  # an infinite window would hang the failing rank
            raise ValueError(f"FUSEDIST_STALL_REPORT_S must be a finite number of seconds >= 0, got {env!r}")
        return value
    window = min(15.0, max(2.0, 0.05 * collective_timeout_s))
    return min(window, PEER_GONE_WINDOW_S) if peer_gone else window


def peer_gone(error: BaseException) -> bool:
    """Whether ``error``'s text says a peer's connection was reset or closed."""
    text = str(error).lower()
    return any(words in text for words in _PEER_GONE)


def default_store():
    """The default process group's store, or None when there is none (never raises); its bounded client is made
    here (Note [a bound of its own on the store])."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not (dist.is_available() and dist.is_initialized()):
            return None
        store = distributed_c10d._get_default_store()
        _bounded(store)  # (its client made now, while the store answers: Note [a bound of its own on the store])
        return store
    except Exception:  # noqa: BLE001 - a report must never fail because the store is odd
        return None


def _key(group: str, generation: int, rank: int) -> str:
    return f"{KEY_PREFIX}/{group}/{generation}/{rank}"


# Note [a bound of its own on the store]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The report's store calls must not wait long on a store server that no longer answers (a failure is
# being reported). They were bounded by shortening the store's own timeout to 5 s while they ran, then
# giving it back; but the store is the process group's, shared with torch and the program, and a
# ``checking`` entry is written at every ``check_consistency()`` of healthy training: a ``store.get`` or
# ``store.wait`` another thread began meanwhile (a checkpoint's barrier, torch's group creation, the
# program's own) gave up after 5 s instead of its own timeout -- "wait timeout after 5000ms" while the key
# it waited for came at 5.8 s. So the report's calls go through a client of their own, a clone of the
# store (same server and keys, its own connection and timeout), made once per store: the store's timeout is
# never touched. :func:`default_store` makes it while the store answers, so that a report does not open
# a connection to a server that does not. A store that cannot be cloned, or whose clone is the store
# itself (a HashStore: in-process, nothing to wait on), is used as it is, unbounded.
_BOUND_S = 5.0
_clients_lock = threading.Lock()
_clients: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # store -> the client of its bounded calls


def _bounded(store):
    """The client whose blocking calls on ``store`` give up after ``_BOUND_S`` (or its own shorter timeout),
    leaving ``store``'s timeout alone (Note [a bound of its own on the store]); ``store`` itself where none
    can be made."""
    try:
        with _clients_lock:
            client = _clients.get(store)
    except TypeError:  # (not weakly referable: a store of the program's own)
        return store
    if client is None:
        client = _client_of(store)
        with _clients_lock:
            client = _clients.setdefault(store, client)
    return client


def bounded(store):
    """The client whose calls on ``store`` are bounded (Note [a bound of its own on the store]), for the modules
    that write the group's entries beside this one."""
    return _bounded(store)


def _client_of(store):
    """A clone of ``store`` with the bound for its timeout, or ``store`` itself."""
    import torch.distributed as dist

    base = getattr(store, "_underlying_non_prefix_store", store)
    if not isinstance(base, (dist.TCPStore, dist.FileStore)):  # (a HashStore's clone is itself)
        return store
    try:
        client = store.clone()
        own = store.timeout
        client.set_timeout(min(own, datetime.timedelta(seconds=_BOUND_S)) if own.total_seconds() > 0
                           else datetime.timedelta(seconds=_BOUND_S))
        return client
    except Exception:  # noqa: BLE001 - unbounded, as a store without a clone
        return store


def publish(store, group: str, generation: int, rank: int, entry: dict, bounded: bool = True) -> bool:
    """Write this rank's entry; False if the store is unreachable. ``bounded``: through the store's bounded
    client (Note [a bound of its own on the store]); ``False``: through the store itself."""
    entry = dict(entry, rank=rank, host=socket.gethostname(), pid=os.getpid(), time=time.time(),
                 global_rank=_global_rank())
    try:
        (_bounded(store) if bounded else store).set(_key(group, generation, rank), json.dumps(entry, default=str))
        return True
    except Exception:  # noqa: BLE001
        return False


def withdraw(store, group: str, generation: int, rank: int, bounded: bool = True) -> None:
    """Remove this rank's entry (a ``checking`` one whose check completed, a ``waiting`` one whose
    wait ended); never raises."""
    try:
        (_bounded(store) if bounded else store).delete_key(_key(group, generation, rank))
    except Exception:  # noqa: BLE001
        pass


def _crash_count_key(group: str, generation: int) -> str:
    return f"{KEY_PREFIX}/{group}/{generation}/crashed"


def group_keys(group: str, generation: int, world_size: int) -> list:
    """The keys this module writes for a group: each rank's entry and the crash counter."""
    return [_key(group, generation, rank) for rank in range(world_size)] + [_crash_count_key(group, generation)]


def count_crash(store, group: str, generation: int) -> None:
    """Bump the group's crash counter: what survivors poll (one call) instead of every entry
    (Note [a crashed peer, seen through the store] in comm/watchdog.py)."""
    try:
        _bounded(store).add(_crash_count_key(group, generation), 1)
    except Exception:  # noqa: BLE001
        pass


def crashed_peer(store, group: str, generation: int, rank: int, world_size: int) -> Optional[str]:
    """Which other rank of the group published a crash, as a phrase for an error (None: none
    did, or the store cannot say). One store call while none has, through the store itself; none of
    its calls waits for a key."""
    try:
        if read_count(store, _crash_count_key(group, generation)) == 0:
            return None
        for other in range(world_size):
            entry = _read(store, _key(group, generation, other)) if other != rank else None
            if entry is not None and entry.get("kind") == "crash":
                return (f"rank {other} on {entry.get('host')} pid {entry.get('pid')} crashed with "
                        f"{entry.get('error')}")
    except Exception:  # noqa: BLE001 - a report must never fail because the store is odd
        return None
    return None


def await_entries(store, group: str, generation: int, rank: int, world_size: int, window_s: float) -> bool:
    """Wait up to ``window_s`` until every other rank of the group has published an entry (a
    crashed rank lingering for the survivors' reports). True when all did."""
    others = [r for r in range(world_size) if r != rank]
    return len(collect(store, group, generation, others, window_s)) == len(others)


def _global_rank():
    """This process's rank in the default group (None outside one): a report over a subgroup
    (HSDP's replicate group, a ZeRO group) names its ranks within the group, and this says
    which processes they are."""
    import torch.distributed as dist

    try:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a destroyed default group
        return None


def read_entries(store, group: str, generation: int, ranks: list) -> Optional[dict]:
    """The entries of ``ranks`` (None for a rank without one), or None where the store could not be read; one
    store call or two per rank, none of which waits for a key (the store's timeout is left alone)."""
    found = {}
    try:
        for rank in ranks:
            found[rank] = _read(store, _key(group, generation, rank))
    except Exception:  # noqa: BLE001 - a probe or report never fails because the store is odd
        return None
    return found


def collect(store, group: str, generation: int, ranks: list[int], window_s: float) -> dict[int, dict]:
    """Poll for the entries of ``ranks`` until all are there or ``window_s`` has passed."""
    found: dict[int, dict] = {}
    deadline = time.monotonic() + window_s
    client = _bounded(store)
    while True:
        for rank in ranks:
            if rank in found:
                continue
            try:
                entry = _read(client, _key(group, generation, rank))
                if entry is not None:
                    found[rank] = entry
            except Exception:  # noqa: BLE001 - an unreachable store ends the wait
                return found
        if len(found) == len(ranks) or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def _describe_op(entry: dict) -> str:
    w = entry.get("waiting_on") or {}
    tag = f" [{w['tag']}]" if w.get("tag") else ""
    return f"{w.get('op', '?')}{tag} (collective #{w.get('seq', '?')})"


def _position(entry: dict) -> str:
    ctx = entry.get("context", {})
    labels = (("ddp_step", "DDP step {}"), ("ddp_forwards", "{} training forwards"), ("ddp_backward", "{} backwards"),
              ("fully_shard_step", "fully_shard step {}"), ("fully_shard_forwards", "{} training forwards"),
              ("fully_shard_backward", "{} backwards"),
              ("optimizer_steps", "{} optimizer steps"), ("buckets_launched", "buckets launched {}"))
    parts = [fmt.format(ctx[key]) for key, fmt in labels if key in ctx]
    if ctx.get("in_backward"):
        parts.append("inside backward")
    if ctx.get("in_check"):
        parts.append("inside check_consistency()")
    if ctx.get("inside_call"):  # Note [a step check inside a save] in step_check.py
        parts.append(f"inside {ctx['inside_call']}")
    text = ", ".join(parts)
    if ctx.get("models_on_group"):  # Note [several models on one communicator] in monitor.py
        text += f" (the position of {ctx.get('position_of')}, of {ctx['models_on_group']} models on this group)"
    return text


def _history(entry: dict, last: int = 4) -> str:
    recent = entry.get("recent") or []
    if not recent:
        return "no fusedist collective issued yet"
    items = [f"#{seq} {op}{(' [' + tag + ']') if tag else ''}" for seq, op, tag, _step in recent[-last:]]
    return "last issued: " + ", ".join(items)


def render(entries: dict[int, dict], world_size: int, window_s: float, reporter: int,
           named: Optional[list] = None) -> str:
    """A multi-line report: one line per rank, then who reached which operation. ``named``:
    each group position's global rank on a subgroup (``comm.base.global_ranks``), else None."""
    lines = [
        f"Stall report (rank {reporter}{global_note([reporter], named)}, through the torch.distributed store; "
        "waited up to "
        f"{window_s:.1f} s for {world_size} ranks):"
    ]
    reached: dict[str, list[int]] = {}
    silent = []
    for rank in range(world_size):
        entry = entries.get(rank)
        if entry is None:
            silent.append(rank)
            lines.append(
                f"  rank {rank}{global_note([rank], named)}: did not report (dead, or alive but stuck outside "
                "fusedist collectives, e.g. in data loading or a different code path)"
            )
            continue
        global_rank = entry.get("global_rank", named[rank] if named else None)
        where = f" (global rank {global_rank})" if global_rank is not None and global_rank != rank else ""
        where += f" on {entry.get('host')} pid {entry.get('pid')}"
        pos = _position(entry)
        pos = f"; at {pos}" if pos else ""
        if entry.get("kind") == "exit":
            lines.append(
                f"  rank {rank}{where}: EXITED without an error{pos}; {_history(entry)} -- it ran fewer "
                "iterations or collectives than the ranks still waiting"
            )
            continue
        if entry.get("kind") == "checking":  # Note [a rank behind at the check] in engine_watch.py
            lines.append(
                f"  rank {rank}{where}: waits in check_consistency() (its check's collective has not completed; no "
                f"failure of its own yet){pos}; {_history(entry)}"
            )
            continue
        if entry.get("kind") == "waiting":  # Note [divergence probe] in divergence.py
            op = _describe_op(entry)
            reached.setdefault(op, []).append(rank)
            lines.append(f"  rank {rank}{where}: waits in {op} (blocked past the divergence probe's delay; no failure "
                         f"of its own yet){pos}; {_history(entry)}")
            continue
        if entry.get("failed_elsewhere"):  # Note [a failure outside the group's collectives] (failed_elsewhere.py)
            lines.append(f"  rank {rank}{where}: FAILED outside this group's collectives and waits in none of them"
                         f"{pos}: {entry['failed_elsewhere']}; {_history(entry)}")
            continue
        if entry.get("kind") == "crash":
            error = str(entry.get("error"))
            where_from = ("a fusedist collective of another group failed" if error.startswith(_COLLECTIVE_ERRORS)
                          else "outside fusedist collectives")
            lines.append(f"  rank {rank}{where}: CRASHED with {error} ({where_from}){pos}; {_history(entry)}")
            continue
        op = _describe_op(entry)
        reached.setdefault(op, []).append(rank)
        waited = (entry.get("waiting_on") or {}).get("age_s")
        waited = f" after {waited:.1f} s" if isinstance(waited, (int, float)) else ""
        lines.append(
            f"  rank {rank}{where}: failed waiting on {op}{waited}{pos}: {entry.get('error')}; "
            f"{_history(entry)}"
        )
    for op, ranks in reached.items():
        lines.append(f"  ranks {ranks}{global_note(ranks, named)} reached {op}")
    if len(reached) > 1:
        # Note [ranks at different collectives]: none of them will ever complete.
        lines.append(
            "  the ranks wait in different collectives, which never pair: their programs diverged before "
            "this point (a step, backward or collective skipped or added on some ranks, rank-dependent "
            "control flow, or options that differ across ranks); compare the positions above"
        )
    if silent:
        lines.append(f"  ranks {silent}{global_note(silent, named)} did not report")
    lines.extend(behind(entries, named))
    return "\n".join(lines)


#: How a crash entry's error begins when a collective failure ended the rank (monitor._publish_uncaught).
_COLLECTIVE_ERRORS = ("StallError", "CollectiveError")

#: What ``behind`` compares: the name in the report, and the count from a position (``context``).
_COUNTERS = (
    ("backwards (the one in progress included)",
     lambda c: _first(c, "ddp_backward", "fully_shard_backward") + bool(c.get("in_backward"))),
    ("training forwards", lambda c: _first(c, "ddp_forwards", "fully_shard_forwards")),
    ("optimizer steps", lambda c: c["optimizer_steps"]),
)


def _first(ctx: dict, *keys: str) -> int:
    return next(int(ctx[k]) for k in keys if k in ctx)


def behind(entries: dict[int, dict], named: Optional[list] = None) -> list[str]:
    """The lines comparing the reporting ranks' training counters: each counter on which they differ,
    with the ranks at each value, then which ranks ran a forward without its backward and which are
    behind, by how many backwards or forwards (Note [a rank behind at the check] in engine_watch.py).
    Empty when they agree or fewer than two ranks said."""
    rows = {}
    for rank, entry in entries.items():
        if entry.get("kind") == "crash" or entry.get("failed_elsewhere"):
            continue  # (where a rank died or failed elsewhere says nothing of what it skipped)
        try:
            rows[rank] = [count(entry.get("context") or {}) for _, count in _COUNTERS]
        except (KeyError, StopIteration, TypeError, ValueError):
            continue  # no training position (an entry of another kind of collective)
    if len(rows) < 2:
        return []
    shown = {rank: (named[rank] if named else rank) for rank in rows}
    word = "global ranks" if named else "ranks"
    lines = []
    for column, (name, _) in enumerate(_COUNTERS):
        groups: dict = {}
        for rank, row in sorted(rows.items()):
            groups.setdefault(row[column], []).append(shown[rank])
        if len(groups) > 1:
            listing = "; ".join(f"{word} {ranks}: {value}" for value, ranks in sorted(groups.items()))
            lines.append(f"    {name}: {listing}")
    if not lines:
        return []
    out = ["  the ranks' training positions differ:"] + lines
    context = {rank: entries[rank].get("context") or {} for rank in rows}
    checking = sorted(shown[r] for r in rows if context[r].get("in_check"))
    where = f"; {word} {checking} wait in check_consistency()" if checking else ""
    # a forward not followed by its backward: more forwards than backwards begun, beyond the one a rank
    # may be running (none inside a backward or the check)
    unmatched = sorted(shown[r] for r, row in rows.items()
                       if row[1] - row[0] > (0 if context[r].get("in_backward") or context[r].get("in_check") else 1))
    if unmatched:
        out.append(f"  {word} {unmatched} ran a training forward without its backward (a loss computed, then the "
                   "backward skipped on these ranks only)")
    saving = sorted(shown[r] for r in rows if _inside_save(entries[r]))
    if saving and len(saving) < len(rows):  # Note [peers inside a save]
        others = sorted(shown[r] for r in rows if not _inside_save(entries[r]))
        out.append(f"  {word} {saving} are inside fusedist.checkpoint.save (waiting in its first collective) and "
                   f"{word} {others} are not: a save is a collective, every rank of the group must call it (not "
                   "under `if rank == 0:`), at the same point of training")
        return out
    for column, what in ((0, "backward(s)"), (1, "training forward(s)")):
        counts = {rank: row[column] for rank, row in rows.items()}
        low, high = min(counts.values()), max(counts.values())
        if low < high and not (column == 1 and unmatched):  # (then the forwards differ by that forward)
            late = sorted(shown[r] for r, v in counts.items() if v == low)
            out.append(
                f"  {word} {late} are behind by {high - low} {what}{where}: the others began what these did not -- "
                "skipped on these ranks (an empty batch, a loss skipped with `continue`, an exception caught around "
                "the step), an iteration fewer, or these wait earlier in the same step; every rank must run a "
                "forward and a backward in every iteration"
            )
            break
    return out


# Note [peers inside a save]
#     A fusedist.checkpoint.save of a DDP model begins with the model's step check, tagged as inside
#     the save (Note [a step check inside a save] in step_check.py). Where some ranks call the save and
#     others go on training, the savers' backward counts are lower, and the report blamed them for a
#     skipped backward; the tag says where they are: inside a save the others did not call.
_SAVE_TAG = "fusedist.checkpoint.save: "


def _inside_save(entry: dict) -> bool:
    """Whether the rank of ``entry`` waits in a collective of a fusedist.checkpoint.save: its tag says so, or,
    for a ``checking`` entry written before the collective existed, its position."""
    if str((entry.get("waiting_on") or {}).get("tag") or "").startswith(_SAVE_TAG):
        return True
    return str((entry.get("context") or {}).get("inside_call") or "").startswith(_SAVE_TAG.rstrip(": "))


def exchange(
    store,
    group: str,
    generation: int,
    rank: int,
    world_size: int,
    entry: dict,
    window_s: float,
    named: Optional[list] = None,
) -> Optional[str]:
    """Publish ``entry`` and return the rendered report (None if the store is unreachable).
    ``named``: the group positions' global ranks on a subgroup (``comm.base.global_ranks``)."""
    if store is None or not publish(store, group, generation, rank, entry):
        return None
    return read_report(store, group, generation, rank, world_size, window_s, named)


def read_report(store, group: str, generation: int, rank: int, world_size: int, window_s: float,
                named: Optional[list] = None) -> Optional[str]:
    """The report rendered from the entries the store holds (waiting up to ``window_s`` for the missing),
    publishing nothing: a rank's later failures keep its first entry (Note [one entry per rank] in
    monitor.py). None without a store."""
    if store is None:
        return None
    entries = collect(store, group, generation, list(range(world_size)), window_s)
    return render(entries, world_size, window_s, rank, named)
