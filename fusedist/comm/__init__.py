"""Collectives behind one interface: torch.distributed or direct NCCL (CUDA extension)."""

from __future__ import annotations

import gc
import os
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .base import CollectiveError, CommHandle, Communicator
from . import released_group as _released_group
from .released_group import is_alive as _is_registered  # (torch still has the group: not destroyed)
from .torch_comm import TorchCommunicator
from .._process_hooks import at_exit, chain_excepthook
from . import given_up_exit, group_ends

__all__ = [
    "CollectiveError",
    "CommHandle",
    "Communicator",
    "TorchCommunicator",
    "get_communicator",
    "register_cuda_communicator",
    "release_destroyed_groups",
]

_cache: dict = {}
_cuda_factory: Optional[Callable] = None


def register_cuda_communicator(factory: Callable) -> None:
    """Install the factory ``factory(process_group, device) -> Communicator`` used for CUDA
    tensors when ``FUSEDIST_COMM`` is not ``torch`` (``device`` is a ``torch.device`` with its
    index resolved). fusedist registers its direct-NCCL factory at import, on every rank
    (Note [one decision on every rank])."""
    global _cuda_factory
    _cuda_factory = factory


def get_communicator(process_group=None, device: torch.device | str | None = None) -> Communicator:
    """The communicator for ``process_group`` and tensors on ``device`` (cached per group and,
    for the direct-NCCL path, per CUDA device).

    CUDA tensors use the direct-NCCL communicator when every rank of the group can run it
    (unless ``FUSEDIST_COMM=torch``); everything else uses ``torch.distributed``. Raises
    ``ValueError`` on a rank that is not a member of ``process_group``, and
    :class:`CollectiveError` once the group's communicator was aborted (Note [no recovery
    after an abort]).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    choice = communicator_choice()
    # Even FUSEDIST_COMM=torch goes through the factory for CUDA tensors: the choice is part
    # of its exchange (Note [one decision on every rank]).
    use_nccl = device.type == "cuda" and _cuda_factory is not None
    if choice == "nccl" and not use_nccl:
        raise RuntimeError(
            "FUSEDIST_COMM=nccl but the direct-NCCL communicator is unavailable for "
            f"{device.type} tensors (fusedist.cuda_ext_error() says why)"
        )
    _check_member(process_group)
    # Key on the group object itself (the default group resolved), so a destroyed and
    # re-created process group gets a fresh communicator. The cache holds the group alive
    # (which keeps its id from being reused) until torch.distributed destroys it (Note
    # [releasing destroyed groups]). A direct-NCCL communicator is bound to one device, so
    # the device is part of its key.
    release_destroyed_groups()
    group_obj = process_group if process_group is not None else dist.group.WORLD
    if use_nccl:
        device = _with_index(device)
        key = (id(group_obj), "nccl", device.index)
    else:
        key = (id(group_obj), "torch")
    entry = _cache.get(key)
    if entry is None or entry[0] is not group_obj:
        comm = _cuda_factory(process_group, device) if use_nccl else TorchCommunicator(process_group)
        entry = _cache[key] = (group_obj, comm)
    # (at every lookup: after _process_hooks.uninstall() a communicator already in use is
    # drained at exit, released at its group's destroy and closed at its abort again once it is
    # next used; each is one dictionary lookup once installed)
    group_ends.watch(_groups_forgotten)  # Note [when torch forgets a group] in group_ends.py
    _drain_at_exit_once()
    # Note [ending after given-up collectives] in given_up_exit.py
    chain_excepthook("end a process whose collectives were given up", given_up_exit.on_uncaught)
    comm = entry[1]
    if comm.aborted:
        raise _aborted_error(comm)
    return comm


def communicator_choice() -> str:
    """``FUSEDIST_COMM`` of this rank: ``auto`` (default), ``torch`` or ``nccl``."""
    choice = os.environ.get("FUSEDIST_COMM", "auto").strip().lower() or "auto"
    if choice not in ("auto", "torch", "nccl"):
        raise ValueError(f"FUSEDIST_COMM must be auto, torch or nccl, got {choice!r}")
    return choice


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` resolved to ``cuda:<current device>``: the device a communicator binds to is
    the one its tensors live on, never whatever is current at some later call."""
    if device.index is not None:
        return device
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return torch.device(device.type, index)


def _check_member(process_group) -> None:
    """Raise on a rank outside ``process_group``: torch gives such a rank rank -1 and world
    size -1, and every collective on it would fail somewhere less clear."""
    if process_group is None or not dist.is_initialized():
        return  # the default group has every rank; the constructors explain a missing one
    if dist.get_rank(process_group) < 0:
        raise ValueError(
            f"fusedist: rank {dist.get_rank()} is not a member of this process group, so it has "
            "no communicator for it; call collectives on that group only from its member ranks "
            "(torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER on the others)"
        )


# Note [no recovery after an abort]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A direct-NCCL communicator is aborted when a collective fails or times out; every later
# collective on it raises. It is not re-created behind the caller's back: creating one is a
# collective of every rank of the group, and after a failure the other ranks may be anywhere
# (still blocked in the collective that timed out here, in another one, or dead), so a
# re-creation on this rank alone would pair with whatever they call next. What works is what
# torch asks for too: rebuild the process group on every rank (a new group gets a new
# communicator, as the cache keys on the group object) or restart the job. The lookup keeps
# raising so that a caller that asks again learns that, rather than meeting the aborted
# communicator at its next collective.
def _aborted_error(comm: Communicator) -> CollectiveError:
    return CollectiveError(
        f"fusedist: the {comm.name} communicator of this process group (rank {comm.rank} of "
        f"{comm.world_size}) was aborted after an earlier failure ({comm.abort_reason or 'no reason recorded'}). "
        "fusedist does not re-create it on its own, because creating one is a collective of every "
        "rank and the others may be anywhere after that failure: destroy and re-create the "
        "process group on every rank (torch.distributed.destroy_process_group() + "
        "init_process_group(), or a new torch.distributed.new_group()) -- fusedist then creates a "
        "fresh communicator for it -- or restart the job (torchrun --max-restarts).",
        op="get_communicator", rank=comm.rank)


# Note [releasing destroyed groups]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Once ``destroy_process_group`` has run, the communicator cache must not keep the group
# alive. Why: torch frees a ProcessGroupGloo when its last reference goes, and its destructor
# joins gloo's worker threads, each of which drops its last finished work first. A group
# kept alive past that point is torch's to free at interpreter shutdown instead, and a worker
# that drops a finished work then -- its tensors need the GIL to release their Python
# objects -- is ended by pthread_exit inside a no-throw destructor: the process aborts with
# "terminate called without an active exception" after the program has finished (seen about
# once in 150 two-rank runs whose last collective was a gloo broadcast; the core showed a
# ProcessGroupGloo worker in ``~AsyncBroadcastWork`` -> ``decref_pyobject`` ->
# ``take_gil``). So the destroy itself (Note [when torch forgets a group] in group_ends.py), every
# lookup, and an atexit hook, drop the communicators of groups torch no longer has and stop their
# helper threads; a lookup collects the cycles that held them, the destroy and the exit only where
# one may (Note [no collection inside the destroy]). (A group never destroyed stays torch's
# business, as without fusedist: call ``destroy_process_group()`` before exiting.)


# Note [no collection inside the destroy]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The destroy's release ran one full collection whenever the released group was still alive after
# it, which it always was: torch's ``destroy_process_group`` frame holds the group in a local while it
# calls the hook that releases it (and a ZeroRedundancyOptimizer the program still holds keeps its
# ``process_group``). Neither is a reference cycle, so the collection freed nothing that held the
# group (only a communicator and its monitor, which refer to each other: the release unlinks them
# now), yet it cost every ``destroy_process_group()`` 0.3-0.7 s once torch's compiler stack was
# loaded (two-rank DDP + ZeroRedundancyOptimizer, gloo, 2-core CPU). So the destroy collects
# nothing: it remembers the released groups weakly, the torch frame lets go as the destroy returns,
# the program's references go as it drops its objects, and the exit hook collects only where a
# remembered group is still alive then (Note [a released communicator that outlives the exit
# hooks]) -- the one place where a cycle holding it would otherwise be freed too late.
def release_destroyed_groups(collect: bool = True) -> int:
    """Forget (and stop the helper threads of) the communicators whose process group
    ``torch.distributed`` has destroyed -- the cached ones and those built directly; returns how
    many. Runs when torch destroys a group (Note [when torch forgets a group] in group_ends.py), on
    every :func:`get_communicator` call and at interpreter exit; the first and the last with
    ``collect=False``: no collection here (Note [no collection inside the destroy]), the exit hook's
    own where a released group outlived it."""
    stale = [_cache.pop(key) for key, (group, _) in list(_cache.items()) if not _is_registered(group)]
    stale += [(comm._group_obj, comm) for comm in _released_group.unreleased(_cached())
              if not _is_registered(comm._group_obj)]  # Note [a communicator built directly] in released_group.py
    count = len(stale)
    while stale:
        # Note [draining at exit]: nothing left running behind the release. The direct-NCCL
        # communicator also destroys its NCCL communicator here (one per rebuilt group would
        # otherwise leak) and hands its comm stream back.
        group, comm = stale.pop(0)
        _release(comm)
        _remember_released(group)
        group = comm = None  # (no local name: it would hold a group through gc below)
    if count and collect:
        # A DDP model or ZeRO optimizer and its communicator may form reference cycles; collect
        # them now, while the interpreter runs, rather than at its shutdown.
        gc.collect()
    return count


def _cached() -> list:
    return [comm for _, comm in _cache.values()]


#: Weak references to the released groups that were alive at their release (Note [no collection
#: inside the destroy]); the exit hook collects if one still is.
_released_groups: list = []


def _remember_released(group) -> None:
    ref = _weak(group)
    _released_groups[:] = [r for r in _released_groups if r() is not None]
    if ref() is not None:
        _released_groups.append(ref)


def _collect_if_a_released_group_lives() -> bool:
    """One full collection where a released group is still alive (Note [a released communicator that
    outlives the exit hooks]); whether it ran."""
    if not any(ref() is not None for ref in _released_groups):
        _released_groups.clear()
        return False
    gc.collect()
    _released_groups[:] = [r for r in _released_groups if r() is not None]
    return True


def _watch_communicator_built_directly() -> None:
    """A communicator built outside :func:`get_communicator` is released when torch destroys its group and
    drained at exit, as a cached one is (Note [a communicator built directly] in released_group.py)."""
    group_ends.watch(_groups_forgotten)
    _drain_at_exit_once()


def _drain_at_exit_once() -> None:
    at_exit("drain in-flight exchanges", _drain_at_exit)  # Note [draining at exit]


def _groups_forgotten(aborted: bool) -> None:
    """torch destroyed or aborted process groups (Note [when torch forgets a group] in group_ends.py)."""
    if not aborted:
        release_destroyed_groups(collect=False)


def _weak(group):
    """A weak reference to ``group`` (the default group is cached as None: a reference to nothing)."""
    try:
        return weakref.ref(group)
    except TypeError:
        return lambda: None


# Note [a released communicator that outlives the exit hooks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The exit hook skipped the collection: the interpreter's finalization collects after the exit
# hooks anyway, and a full collection costs a large fraction of a second once torch's compiler
# stack is loaded. But that collection runs after the interpreter is marked finalizing, when a
# thread that takes the GIL exits on the spot: a gloo group freed there (a DDP engine and its
# step watch left in a reference cycle once the program's ``main`` returned hold its
# communicator, and so the group) joins workers that need the GIL to drop their last work, and
# the process aborts after the program finished ("terminate called without an active
# exception": once in a fresh-clone run of the demo's DDP job). So the exit hook collects where
# a released communicator's group is still alive -- released now, or by an earlier destroy (Note
# [no collection inside the destroy]): something still holds it -- and only there: a program
# whose groups went with their models pays nothing.


# Note [draining at exit]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A collective launched with ``async_op=True`` and never waited for -- typically the
# parameter all-gathers of ZeRO's last ``step()`` before the script ends -- is still being
# driven by its group's progress thread when the program returns. That thread waits inside
# gloo with the GIL released; if the wait returns after the interpreter has begun to
# finalize, taking the GIL back ends the thread with pthread_exit inside a no-throw C++
# frame and the process aborts ("terminate called without an active exception", exit code
# -6), every time, on every rank. So at exit every cached communicator first lets its helper
# threads finish the work already handed to them (milliseconds when the peers are healthy;
# at most DRAIN_TIMEOUT_S, so an exit never waits out the full collective timeout), and only
# then are destroyed groups released. A communicator that gave up is not waited for at all when
# the process ends by os._exit: what it left pending can never complete (Note [ending after
# given-up collectives] in given_up_exit.py); its helpers are told to stop and left behind.
DRAIN_TIMEOUT_S = 30.0


def _join_limit(comm: Communicator) -> float:
    """How long the exit or a release waits for ``comm``'s helper threads."""
    if given_up_exit.skips_waits(comm):
        return 0.0
    return min(DRAIN_TIMEOUT_S, comm.timeout.total_seconds())


def _release(comm: Communicator) -> None:
    comm.release(join_timeout=_join_limit(comm))
    left = getattr(comm.observer, "on_release", None)  # (the monitor: this rank left the group)
    if left is not None:
        try:
            left(comm)
        except Exception:  # noqa: BLE001 - what it says is for the peers' reports; the release goes on
            pass
    if not getattr(comm, "_holding_group", None):
        # Nothing in flight is left to observe (Note [a finished collective never waited for] in
        # released_group.py); the monitor refers back to its communicator, and that cycle was
        # freed only by a collection (Note [no collection inside the destroy]).
        comm.observer = None


def _drain(comm: Communicator) -> None:
    comm.stop_helpers(join_timeout=_join_limit(comm))


def _drain_at_exit() -> None:
    for comm in _cached() + _released_group.unreleased(_cached()):  # (those built directly too)
        if not given_up_exit.skips_waits(comm):
            comm.settle_at_exit(min(DRAIN_TIMEOUT_S, comm.timeout.total_seconds()))
        _drain(comm)
    comm = None  # (the loop's last one would hold its group through the release below)
    release_destroyed_groups(collect=False)
    _collect_if_a_released_group_lives()
    from .watched_wait import stop_watcher

    stop_watcher()  # (its thread sleeps until a wait is due: nothing is left for it to probe)


# Note [one decision on every rank]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Whether CUDA collectives go through fusedist's own NCCL communicator or torch.distributed
# must be decided the same way on every rank of a group: the NCCL communicator's construction
# is a collective (an all_gather_object that shares each rank's readiness and the unique id),
# and a rank that built a torch communicator instead would pair its next collective -- DDP's
# model check, say -- with that exchange: an unpickling error or a false rank mismatch, then
# misaligned collectives. So the factory is registered on every rank, also where the CUDA
# extension did not import (a mixed install, a broken build on one node): it reports that as
# this rank's problem in the exchange, and every rank falls back together. The same holds
# for ``FUSEDIST_COMM``, an environment variable set per process: a rank with ``torch`` that
# skipped the exchange would pair its next collective with the others' exchange. So each
# rank's setting travels in the exchange too; ranks that differ fail together, naming them.
def _register_direct_nccl() -> None:
    # Importing nccl_comm touches neither the extension nor a driver.
    from .nccl_comm import make_nccl_communicator

    register_cuda_communicator(make_nccl_communicator)


_register_direct_nccl()
