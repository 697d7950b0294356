"""A rank that aborts its process groups closes their gloo connections, so a peer's exchange fails at once.

Note [aborting a group closes its connections]
    ``torch.distributed.distributed_c10d._abort_process_group()`` forgets the groups; for gloo it ends
    nothing (a gloo group's ``abort`` does not close a connection). The connections close only when the
    last reference to the group goes. torch's own collectives hold none once they returned, so a peer
    waiting in gloo's all-reduce fails at once with "Connection closed by peer". fusedist's communicator
    cache, and a DDP model or ZeRO optimizer the program still holds, keep the group alive: a peer
    waiting in a fusedist exchange (a small all-reduce, a DDP bucket) waited out the group's timeout (30 s)
    and the stall report after it. So the first exchange on a group wraps ``_abort_process_group`` (once
    per process); after an abort, each group of a fusedist exchange that torch no longer has leaves the
    reason in the store (Note [connections a peer closed] in closed_connections.py) and then closes its
    connections the way a gloo receive that times out does (a receive no peer sends, waited for a
    millisecond). The peer's wait fails at once and names this rank and the abort. Nothing is held: the
    exchanges are known by weak references, the aborted groups only while the abort runs.

Note [an abort told to waits in the store]
    Closed connections end the waits of collectives; a wait in the store (a save's I/O barrier, which polls
    the store until every rank has arrived) sees none of them, and took the aborted rank, alive and
    silent, for a process that hangs -- once its silence ran out (10 s by default), not at once. So an
    abort of all of this process's groups (``_abort_process_group()``, or of the default group) also
    leaves a record in the job's store, keyed by the global rank: the reason and a count of such records.
    A store wait that polls anyway can ask :func:`aborted_peers` at each poll -- one store call while no
    rank aborted -- and fail at once naming the rank and the abort. The record is withdrawn when this process
    makes its next communicator (a new group after the abort: its peers' waits must not end on the old
    one). Nothing is written until an abort.

Note [one wrapper of torch's abort]
    One wrapper of ``distributed_c10d._abort_process_group`` serves fusedist, installed through
    ``_process_hooks.chain_module_function`` by the first communicator or exchange (so ``uninstall()`` restores
    torch's own): it counts how deep this thread is in an abort -- the groups torch forgets meanwhile were
    aborted, not destroyed, which group_ends.py asks by :func:`aborting` -- and, once this process has made a
    gloo exchange, closes the aborted groups' connections and leaves the record above. Before, group_ends.py
    and this module each wrapped it, the second copying the first's marker so that they chained in either
    order, and this module's stayed in place after ``uninstall()``.
"""

from __future__ import annotations

import threading
import weakref

from .._process_hooks import chain_module_function
from .store_reads import read_count, read_now

_ABORTED = "aborted its process groups (torch.distributed's _abort_process_group), which closed the group's connections"

#: The job-wide abort records (Note [an abort told to waits in the store]): ``{prefix}/{global rank}``,
#: ``{prefix}/count``.
_RECORDS = "fusedist/aborted_process"

_lock = threading.Lock()
_recorded: list = []  # (store, global rank) of this process's record, until its next communicator
_watched: "weakref.WeakSet" = weakref.WeakSet()  # the ClosedConnections of this process's exchanges
_exchange_made = False  # (once this process made its first gloo exchange)
_depth = threading.local()  # how deep this thread is in _abort_process_group

#: Note [one wrapper of torch's abort]
_HOOK_KEY = "abort process groups: close their connections, tell the store"


def watch(closing) -> None:
    """Close ``closing``'s group's connections when this process aborts it (Note [aborting a group
    closes its connections]); ``closing``: a ``ClosedConnections`` holding its group weakly."""
    global _exchange_made
    with _lock:
        _watched.add(closing)
        _exchange_made = True
    install()


def closing_of(group):
    """The ``ClosedConnections`` of this process's exchange on ``group``, or None."""
    with _lock:
        watched = list(_watched)
    return next((closing for closing in watched if closing.group() is group), None)


def aborted_reason(rank_text: str) -> str:
    """What an aborting rank leaves in the store for its peers."""
    return f"{rank_text} {_ABORTED}"


def install() -> None:
    """fusedist's one wrapper of ``_abort_process_group`` (Note [one wrapper of torch's abort]), once;
    ``_process_hooks.uninstall()`` removes it."""
    from torch.distributed import distributed_c10d

    chain_module_function(_HOOK_KEY, distributed_c10d, "_abort_process_group", _wrapped)
    with _lock:
        exchange_made = _exchange_made
    if exchange_made:
        from . import barrier_closed  # (here: it imports this module)

        barrier_closed.install()  # Note [a peer gone under torch's barrier] in barrier_closed.py


def aborting() -> bool:
    """Whether this thread is inside ``_abort_process_group`` (the groups torch forgets now are aborted)."""
    return getattr(_depth, "value", 0) > 0


def _wrapped(original):
    """torch's ``original`` abort, within this thread's abort depth, and with the aborted groups' connections
    closed and the record left once this process has made a gloo exchange (Note [one wrapper of torch's abort])."""
    from torch.distributed import distributed_c10d

    def _abort_process_group(group=None):
        _depth.value = getattr(_depth, "value", 0) + 1
        try:
            with _lock:
                told = _exchange_made  # (nothing to close or to tell before this process's first exchange)
            groups = _groups_aborted_by(group) if told else []
            whole = _whole_process(group) if told else None  # (read before the abort forgets the default group)
            try:
                return original(group)
            finally:
                _close_aborted(groups)
                del groups  # (held no longer than the abort)
                if whole is not None and distributed_c10d.GroupMember.WORLD is None:  # (the abort went through)
                    _record(*whole)
        finally:
            _depth.value -= 1

    _abort_process_group.__name__ = getattr(original, "__name__", _abort_process_group.__name__)
    _abort_process_group.__doc__ = getattr(original, "__doc__", None)
    _abort_process_group.__wrapped__ = original
    return _abort_process_group


def _groups_aborted_by(group) -> list:
    """The (group, its ClosedConnections) of the exchanges an abort of ``group`` (None: all) may end."""
    from torch.distributed import distributed_c10d

    with _lock:
        watched = list(_watched)
    world = distributed_c10d.GroupMember.WORLD
    aborted = []
    for closing in watched:
        target = closing.group()
        if target is not None and (group is None or group is world or target is group):
            aborted.append((target, closing))
    return aborted


def _close_aborted(groups: list) -> None:
    from torch.distributed import distributed_c10d

    pg_map = getattr(getattr(distributed_c10d, "_world", None), "pg_map", None)
    for group, closing in groups:
        if pg_map is not None and group in pg_map:
            continue  # (the abort failed or skipped it: torch still has it)
        closing.publish(aborted_reason(f"rank {closing.global_rank}"), final=True)
        _close_connections(group)


def _close_connections(group) -> None:
    """Close the aborted ``group``'s gloo connections as an abandoned collective's are closed."""
    from .torch_comm import close_connections  # (here: torch_comm imports what imports this module)

    try:
        rank, size = group.rank(), group.size()
    except Exception:  # noqa: BLE001 - nothing left to close
        return
    close_connections(group, rank, size)


def aborted_peers(store, ranks: list) -> dict:
    """``{global rank: what it left}`` for each of ``ranks`` (global) that aborted all its process groups
    (Note [an abort told to waits in the store]); one store call while none did. Never raises."""
    try:
        if read_count(store, f"{_RECORDS}/count") <= 0:
            return {}
        found = {}
        for rank in ranks:
            record = read_now(store, f"{_RECORDS}/{rank}")  # Note [reading a key without waiting] in store_reads.py
            if record is not None:
                found[rank] = record.decode()
        return found
    except Exception:  # noqa: BLE001 - a wait goes on as before where the store cannot say
        return {}


def withdraw_record() -> None:
    """Withdraw this process's abort record, if it left one (it makes a communicator again). Never raises."""
    with _lock:
        recorded, _recorded[:] = list(_recorded), []
    for store, rank in recorded:
        try:
            if store.delete_key(f"{_RECORDS}/{rank}"):
                store.add(f"{_RECORDS}/count", -1)
        except Exception:  # noqa: BLE001 - the store went with the old group: nothing left to withdraw
            pass


def _whole_process(group):
    """(the job's store, this process's global rank) where aborting ``group`` aborts every group of this
    process (None, or the default group), else None."""
    from torch.distributed import distributed_c10d

    if group is not None and group is not distributed_c10d.GroupMember.WORLD:
        return None
    try:
        return distributed_c10d._get_default_store(), distributed_c10d.get_rank()
    except Exception:  # noqa: BLE001 - no default group (nothing to abort), or no store: nothing to tell
        return None


def _record(store, global_rank: int) -> None:
    """Leave the record of this process's abort in ``store`` (Note [an abort told to waits in the store])."""
    try:
        store.set(f"{_RECORDS}/{global_rank}",
                  f"rank {global_rank} aborted all its process groups (torch.distributed's _abort_process_group)"
                  .encode())
        store.add(f"{_RECORDS}/count", 1)
    except Exception:  # noqa: BLE001 - the store is gone too: the waits end as before
        return
    with _lock:
        _recorded.append((store, global_rank))
