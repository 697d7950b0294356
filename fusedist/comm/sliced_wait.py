"""A collective's wait in slices, so that ranks stuck in collectives that never pair are told at
once (Note [divergence probe] in fusedist/reliability/divergence.py).

The communicator's observer (the reliability monitor) decides when a wait is long enough to probe
(``probe_delay_s``) and hands out the probe; the communicator decides which works can be waited
for in slices without disturbing them (``_sliced_waits``). A wait that ends before the delay is
one call, as without a probe.
"""

from __future__ import annotations

import datetime
import time

from .closed_connections import closed_by_peer


def wait_probed(handle, waited: datetime.timedelta) -> None:
    """Wait for ``handle``'s work up to ``waited``; past the observer's ``probe_delay_s``, in
    slices between which its probe compares where every rank waits and may end the wait: the
    communicator then refuses further collectives (``gave_up``) and this raises
    ``CollectiveError`` with the verdict -- also where a peer's probe gave it first and closed
    the connections (Note [the verdict before the closed connections] in
    fusedist/reliability/divergence.py)."""
    try:
        _wait_probed(handle, waited)
    except Exception as exc:  # noqa: BLE001 - the backend's error, unless a peer's verdict explains it
        told = _told_by_peer(handle, exc)
        if told is None:
            raise
        peer, verdict, text = told
        raise _given_up(handle, text, verdict, peer) from exc


def _told_by_peer(handle, exc: BaseException):
    """(the peer, the verdict its probe gave, what this rank says of it) where ``exc`` is a connection closed by a
    peer of a group whose probe gave a verdict; else None. Reads the store on such a failure only."""
    if getattr(exc, "verdict", None) is not None or not closed_by_peer(exc):
        return None
    comm = handle._comm
    read = getattr(comm.observer, "peer_verdict", None)
    told = read() if read is not None else None
    if told is None:
        return None
    peer, verdict = told
    return peer, verdict, (f"{verdict} (rank {peer}{comm._global_note([peer])} gave this verdict first and closed "
                           "the group's connections, which ended this rank's wait)")


def _wait_probed(handle, waited: datetime.timedelta) -> None:
    comm, work = handle._comm, handle._work
    delay = getattr(comm.observer, "probe_delay_s", 0.0)
    if not delay or waited.total_seconds() <= delay:
        comm._wait_work(work, waited)
        return
    if not comm._sliced_waits(work, handle.async_op):
        if comm._watched_waits(work):
            _wait_watched(handle, waited, delay)
        else:
            comm._wait_work(work, waited)
        return
    end, piece, probe = time.monotonic() + waited.total_seconds(), delay, None
    try:
        while True:
            left = end - time.monotonic()
            if left <= piece:
                comm._wait_work(work, datetime.timedelta(seconds=max(left, 1e-3)))
                return
            try:
                comm._wait_work(work, datetime.timedelta(seconds=piece))
                return
            except Exception as exc:  # noqa: BLE001 - a slice that ran out, unless the work failed
                from .base import _is_timeout  # (here: base imports this module)

                if _is_timeout(exc) and work.is_completed():  # Note [a slice that runs out as the work completes]
                    comm._wait_work(work, datetime.timedelta(seconds=max(end - time.monotonic(), 1e-3)))
                    return
                if not comm._wait_can_resume(work):
                    raise
            probe = probe or comm.observer.divergence_probe(handle.op, handle.tag, handle.seq, handle.part)
            verdict = probe.check()
            if verdict is not None:
                raise _given_up(handle, verdict)
            piece = probe.every_s
    finally:
        if probe is not None:
            probe.close()


# Note [a slice that runs out as the work completes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A slice's wait that runs out raises (an exchange's ``TimeoutError``, gloo's "Wait timeout"); the work
# may complete between that and the check whether the wait can go on. Asked then, a completed work
# "cannot resume", and the slice's timeout was raised as the collective's failure, on this rank alone
# (its peers had completed it): a StallError "timed out 0.0 s after its launch ... (still done)" on a
# loaded machine, once a wait outlasted the probe's delay. A work completed by then is waited for once
# more instead: that returns at once with its result, or raises its own error. Only a slice that timed
# out: a wait that raised the work's own error (a part mismatch found as it completed) raises that, as
# a second wait of a work whose error was raised once may return as if it had succeeded.
def _wait_watched(handle, waited: datetime.timedelta, delay: float) -> None:
    """Wait for ``handle``'s work in one call while the watcher thread probes it (Note [probing waits that
    cannot be sliced] in watched_wait.py); raise the probe's verdict where it ended the wait."""
    from .watched_wait import WatchedWait

    watched = WatchedWait(handle, delay)
    try:
        handle._comm._wait_work(handle._work, waited)
    except Exception as exc:  # noqa: BLE001 - the backend's error, unless the probe ended the wait
        if watched.verdict is None:
            raise
        raise _given_up(handle, watched.verdict) from exc
    finally:
        watched.close()
    if watched.verdict is not None:  # (it completed as the probe closed the connections: the group is gone anyway)
        raise _given_up(handle, watched.verdict)


def _given_up(handle, verdict: str, told=None, told_by=None):
    """Give the communicator up on the probe's ``verdict``: the error to raise. ``told``: the verdict as rank
    ``told_by`` gave it, where this rank only learnt it (``verdict`` says so)."""
    from . import given_up_exit
    from .base import CollectiveError
    from .checks import describe_collective

    comm = handle._comm
    comm.gave_up = f"{describe_collective(handle.op, handle.tag, handle.seq)}: {verdict}"
    # (a program that catches the error and ends by sys.exit(n) ends at once, with n)
    given_up_exit.watch_exit_requests()
    error = CollectiveError(
        f"fusedist: {handle.op} (tag {handle.tag!r}, collective #{handle.seq}) cannot complete on rank "
        f"{comm.rank} of {comm.world_size}{comm._global_note([comm.rank])}: {verdict}",
        op=handle.op, tag=handle.tag, rank=comm.rank, seq=handle.seq)
    # (the failure entry keeps them for the peers: Note [the verdict before the closed connections])
    error.verdict, error.verdict_of = (verdict, comm.rank) if told is None else (told, told_by)
    return error
