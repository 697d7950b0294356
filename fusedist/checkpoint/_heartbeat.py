"""The lease's heartbeat: how a job on another host learns that the root's holder has ended.

Note [lease heartbeat]
    A lease names its holder's host and process (Note [one job per checkpoint root] in
    ``_owner.py``). On the holder's own host a dead process shows; on another host nothing
    can be checked, so a job killed there (preempted, its node lost) kept its root refused to
    any other run until someone deleted the lease or passed the old run id: a resubmission
    without a stable run id (a ``torchrun --standalone`` job requeued on another node) failed
    at ``restore`` instead of continuing.

    So rank 0 renews the lease it holds: a daemon thread rewrites it with ``beat_unix`` (and
    the interval ``beat_s``) every ``timeout / 4`` seconds, from the save that took it until
    ``close()``, or until the lease is no longer its own. A lease whose ``beat_unix`` is more
    than ``timeout`` seconds old (``Checkpointer(lease_timeout_s=...)``, default 120) has a
    holder that stopped renewing it -- ended, or unable to write the root -- and another run
    takes it over with a warning. A lease renewed recently is waited on, up to the time it
    would go stale: renewed meanwhile, its holder runs and the job is refused as before;
    released or gone stale, the job continues. A resubmitted job therefore waits at most
    ``timeout`` at its first restore. Leases without ``beat_unix`` (written by earlier
    versions) are never taken to have ended.

    Safe against a holder that only paused (a stalled filesystem, a suspended process): its
    next save checks that the lease is still its own before writing anything (Note [one job
    per checkpoint root], *While it runs*), so after a takeover it stops, writing and
    pruning nothing. Clocks: ``beat_unix`` is the holder's clock, compared with the reader's;
    the default leaves two minutes, far above the skew of synchronized hosts.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Optional

from . import _owner

__all__ = ["DEFAULT_TIMEOUT_S", "Heartbeat", "stale_for", "wait_until_stale_or_renewed"]

DEFAULT_TIMEOUT_S = 120.0
_TAKEN_OVER: set = set()  # tokens of stale leases this process has taken over (warned once)


class Heartbeat:
    """Renews ``lease`` under ``root`` every ``timeout / 4`` seconds while it is the root's."""

    def __init__(self, root: str, lease: dict, timeout: float):
        self.root, self.lease, self.interval = root, lease, timeout / 4.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fusedist lease heartbeat {root}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            current = _owner.read(self.root)
            if current is not None and current.get("token") != self.lease["token"]:
                return  # taken over: the next save reports it (Note [one job per checkpoint root])
            self.lease["beat_unix"] = time.time()
            try:
                _owner.write(self.root, self.lease)
            except OSError:
                pass  # a root that cannot be written: the saves report it

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def stale_for(lease: dict, timeout: float) -> Optional[float]:
    """Seconds since ``lease`` was last renewed when that is more than ``timeout``, else None
    (also for a lease without a heartbeat)."""
    beat = lease.get("beat_unix")
    if not isinstance(beat, (int, float)):
        return None
    age = time.time() - beat
    return age if age > timeout else None


def wait_until_stale_or_renewed(root: str, lease: dict, timeout: float) -> bool:
    """Whether the holder of ``lease`` has ended: it goes stale (or is released) before it is
    renewed. Polls the lease file up to the moment it would go stale. Warns on a takeover."""
    beat = lease.get("beat_unix")
    if not isinstance(beat, (int, float)):
        return False
    while True:
        current = _owner.read(root)
        if current is None:
            return True  # released meanwhile
        if current.get("token") != lease.get("token") or current.get("beat_unix") != beat:
            return False  # renewed (or taken by a third job): its holder runs
        age = stale_for(current, timeout)
        if age is not None:
            if current.get("token") in _TAKEN_OVER:  # (said at this job's restore already)
                return True
            _TAKEN_OVER.add(current.get("token"))
            warnings.warn(f"fusedist.checkpoint.Checkpointer: the lease of {root} held by {_owner.describe(current)} "
                          f"was last renewed {age:.0f} s ago (lease_timeout_s={timeout:g}): that job has ended; "
                          "this one takes the root over (Note [lease heartbeat])", stacklevel=4)
            return True
        time.sleep(min(1.0, max(0.05, timeout / 20.0)))
