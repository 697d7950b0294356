"""A communicator whose process group torch.distributed destroyed (or aborted): what it lets go of, what it says after.

Note [a released communicator lets go of its group]
    ``release()`` runs when torch destroys the communicator's group (Note [releasing destroyed groups] in
    __init__.py). Before, a released TorchCommunicator still held the group (its ``group``, the group object
    it asks "destroyed?" of, its gloo exchange's ``group``): a program that kept the communicator -- or an
    object holding it, such as a monitor, at module scope -- kept the destroyed gloo group alive into the
    interpreter's finalization, where freeing a gloo group joins worker threads that need the GIL, and the
    process can abort after the program finished ("terminate called without an active exception"). So the
    release drops every reference to the group, once its helper threads stopped, and keeps what the
    communicator still answers with: its rank, world size and whether it served the default group, for its
    messages, and a released flag, which every launch reads first -- a collective on it is refused naming the
    op, as before ("the process group ... was destroyed"), and never reaches a group it no longer has (an
    absent group would otherwise read as the default one). One thing still needs the group: a collective in
    flight across the destroy. Freed under it, the group's destructor waits for it -- until the group's own
    timeout, 30 minutes by default (torch's own ``destroy_process_group`` blocks that long) -- so the
    collective's handle keeps the group until its wait ends (``CommHandle._group``): the destroy returns at
    once, the wait fails at fusedist's deadline naming the destroy, the abandoned collective's connections
    close (Note [closing the connections of an abandoned collective] in torch_comm.py: the released
    communicator reaches the group by a weak reference, for that alone; one nobody holds any more closed its
    connections as it went) and the group goes with the handle's hold. (Never ``None`` for the default
    group: after a new ``init_process_group()``, that is another group.)

Note [a finished collective never waited for]
    A collective launched with ``async_op=True`` whose handle is waited for later -- DDP's step check, read at
    the next forward -- holds the group (Note [a released communicator lets go of its group]) until that wait.
    When the group was destroyed between the two, its collective had long completed, yet the handle kept the
    destroyed group alive until the next forward, or for good where none came (a program that destroys the
    group and keeps its model until it exits). The release therefore also lets go of the group in every handle
    of the communicator whose collective has completed: nothing is in flight that the group's destructor
    would wait for, and the handle's later wait reads its finished work as before. A handle whose collective
    is still running keeps the group, as above.

Note [a communicator built directly]
    ``fusedist.comm.TorchCommunicator`` is public: a program (or a framework) may build one for a group itself,
    next to the one ``get_communicator`` caches. Only the cached ones were released when torch destroyed their
    group: a communicator built directly kept the destroyed group alive while the program held it -- into the
    interpreter's finalization where it was held at module scope -- and its exchange's progress thread ran on,
    and at exit nothing drained it (Note [draining at exit] in __init__.py). So every TorchCommunicator is
    tracked here, weakly (tracking keeps none alive), and the release and the exit drain treat the ones built
    directly as they treat the cached ones.

Note [a refusal names the abort]
    A group torch's ``_abort_process_group`` took away reads, to the communicator, as one destroyed: torch no
    longer has it. The refusal of its next collective said the group "was destroyed
    (torch.distributed.destroy_process_group())" -- a call the program never made, sending its reader after the
    wrong one. The abort marks the communicator (``ended_by_abort``: Note [a communicator remembers its group's
    abort] in group_ends.py; kept after the release), so the refusal names the abort instead, and, where a
    collective of the group had failed before -- a peer that aborted or ended, which the failure names -- that
    failure too: it is why the program aborted the group.
"""

from __future__ import annotations

import weakref
from typing import Optional

from .. import _group_table
from .checks import _tag

#: Whether torch.distributed still has a group (not destroyed), asked of here by the comm and DDP modules; one
#: source with the question fusedist/distributed.py asks (Note [one wrapper of torch's group-unregister functions]).
is_alive = _group_table.is_alive


#: Every TorchCommunicator built, held weakly (Note [a communicator built directly]).
_built: "weakref.WeakSet" = weakref.WeakSet()


def track(comm) -> None:
    """``comm`` is released like a cached communicator once torch destroys its group (Note [a communicator built
    directly])."""
    _built.add(comm)
    from . import _watch_communicator_built_directly  # (the package: it has the release and the exit drain)

    _watch_communicator_built_directly()


def unreleased(besides) -> list:
    """The tracked communicators not released yet, other than those in ``besides`` (the cached ones)."""
    cached = {id(comm) for comm in besides}
    return [comm for comm in list(_built) if not comm.released and id(comm) not in cached]


def let_go(comm) -> None:
    """Drop ``comm``'s references to its process group and its exchange's (Note [a released communicator lets
    go of its group]); its helper threads have stopped."""
    if not comm.released:
        try:
            comm._released_group = weakref.ref(comm._group_obj)
        except TypeError:  # (not a process group object: nothing to close later)
            comm._released_group = None
    comm.released = True
    comm.group = comm._group_obj = None
    _let_finished_handles_go(comm)
    if comm.exchange is not None:
        comm.exchange.group = None  # (its finished works hold none: Note [work references] in exchange_progress.py)


def _let_finished_handles_go(comm) -> None:
    """The handles of ``comm``'s completed collectives drop the group (Note [a finished collective never waited
    for])."""
    for handle in list(getattr(comm, "_holding_group", ())):
        try:
            finished = handle._group is None or handle.is_completed()
        except Exception:  # noqa: BLE001 - a failed collective: its wait raises the error, with or without the group
            finished = True
        if finished:
            handle._group = None
            comm._holding_group.discard(handle)


def held_elsewhere(comm) -> Optional[object]:
    """The released ``comm``'s process group where something else still holds it (an in-flight collective's work),
    else None."""
    ref = getattr(comm, "_released_group", None)
    return ref() if ref is not None else None


def which_group(on_default_group: bool) -> str:
    """The group as messages name it."""
    return "default process group" if on_default_group else "process group"


def refused_error(op: str, tag: str, rank: int, world_size: int, on_default_group: bool,
                  aborted: Optional[str] = None, failed_before: Optional[str] = None) -> RuntimeError:
    """The error refusing ``op`` on a communicator whose group torch.distributed no longer has (as torch's own
    collectives refuse one): run there, it would pair with whatever a peer still holding the group issues.
    ``aborted``: why, where the group was aborted rather than destroyed (Note [a refusal names the abort]);
    ``failed_before``: the failure that gave the group up before (it names the peer, where one ended it)."""
    where = f"fusedist {op}{_tag(tag)} on rank {rank} of {world_size}: not launched"
    if aborted is None:
        return RuntimeError(
            f"{where}, the {which_group(on_default_group)} of this communicator was destroyed "
            "(torch.distributed.destroy_process_group()); get a communicator for a live group "
            "(fusedist.comm.get_communicator) and rebuild what holds the old one (DDP, ZeRO)")
    earlier = f", after an earlier collective of it failed ({failed_before})" if failed_before else ""
    return RuntimeError(
        f"{where}: the {which_group(on_default_group)} of this communicator can no longer run collectives: "
        f"{aborted}{earlier}. Re-create the process group on every rank (torch.distributed.destroy_process_group() "
        "+ init_process_group(), or a new torch.distributed.new_group()), get a communicator for it "
        "(fusedist.comm.get_communicator) and rebuild what holds the old one (DDP, ZeRO)")


def ended_under_collective(on_default_group: bool) -> str:
    """Why a collective in flight could not complete when its group was destroyed under it (from another thread:
    a signal handler, a watchdog that tears the job down); alone, its wait's end would read as a peer that never
    joined."""
    return (f"the {which_group(on_default_group)} was destroyed (torch.distributed.destroy_process_group()) while this "
            "collective was in flight, so it could not complete; destroy a group only once its collectives have "
            "finished")
