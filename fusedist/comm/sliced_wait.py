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


def wait_probed(handle, waited: datetime.timedelta) -> None:
    """Wait for ``handle``'s work up to ``waited``; past the observer's ``probe_delay_s``, in
    slices between which its probe compares where every rank waits and may end the wait: the
    communicator then refuses further collectives (``gave_up``) and this raises
    ``CollectiveError`` with the verdict."""
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
            except Exception:  # noqa: BLE001 - a slice that ran out, unless the work failed
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


def _given_up(handle, verdict: str):
    """Give the communicator up on the probe's ``verdict``: the error to raise."""
    from . import given_up_exit
    from .base import CollectiveError
    from .checks import describe_collective

    comm = handle._comm
    comm.gave_up = f"{describe_collective(handle.op, handle.tag, handle.seq)}: {verdict}"
    # (a program that catches the error and ends by sys.exit(n) ends at once, with n)
    given_up_exit.watch_exit_requests()
    return CollectiveError(
        f"fusedist: {handle.op} (tag {handle.tag!r}, collective #{handle.seq}) cannot complete on rank "
        f"{comm.rank} of {comm.world_size}{comm._global_note([comm.rank])}: {verdict}",
        op=handle.op, tag=handle.tag, rank=comm.rank, seq=handle.seq)
