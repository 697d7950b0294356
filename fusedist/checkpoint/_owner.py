"""Which job writes a ``Checkpointer`` root: the root's lease (Note [one job per checkpoint root]).

Note [one job per checkpoint root]
    A Checkpointer writes ``<root>/step-N`` directories, replaces a ``step-N`` it finds
    incomplete (left by a save killed before a restart) and prunes old steps. Two jobs given
    the same root -- a second experiment launched with the first's output directory, a job
    submitted twice -- would each restore the other's checkpoints, overwrite each other's
    steps and prune each other's history, silently.

    *What a job is.* Not its processes: ``torchrun --max-restarts`` (and an elastic
    membership change) replaces every process of a job, which must then resume from the
    root. A job is its *run*: ``Checkpointer(..., run_id=...)`` when given (a scheduler's job
    id that survives requeueing, say); else torchrun's ``TORCHELASTIC_RUN_ID`` -- its
    rendezvous id, the same for every restart of one launch and for every node of it --
    except torchrun's default ``"none"``, which every launch without ``--rdzv-id`` shares;
    else the launch itself (rank 0's process, so a Checkpointer made again in the same
    program is the same job).

    *The lease.* A job's first save writes, on rank 0, ``<root>/.fusedist-checkpointer.json``
    (run, a random token, host, process id, time), atomically. It may take the root when there
    is no lease, when the lease is of the same run (a restart: its predecessor is gone, or
    will stop at its next save, below), or when the holder is known to have ended: released
    by ``close()``, held by a process of this host that no longer exists (a job without a
    run id, started again by hand after a crash), or no longer renewed by its holder's
    heartbeat (on any host: Note [lease heartbeat] in ``_heartbeat.py``). A lease of another
    run whose holder may still run -- its process on this host is alive, its heartbeat goes
    on, or it is on another host and has none -- is refused on every rank, naming that job; ``restore`` checks the same
    first, so such a job stops before it trains, having read and written nothing. The
    message says what to do: another directory, or, when that job is known to be over, its
    run id (``run_id=``) or the lease file removed. ``restore`` itself writes nothing, so a
    Checkpointer of the same run that only restores (an evaluation in the training program)
    does not disturb the one that saves.

    *While it runs.* Every later save checks, on rank 0, that the lease is still its own
    before it creates or replaces the step directory, before it writes the manifest, and
    before retention removes anything. A lease taken over -- by a restarted instance of the
    same run started while this one still runs, or by another job after this one's lease was
    removed -- fails that save on every rank with the new holder named: nothing is written,
    replaced or pruned. A lease found missing is written again.

    Two Checkpointers of one process are one run; the second to save to a root is refused
    in the process itself (Note [one saving Checkpointer per root in a process] in
    ``_root_checks.py``).

    Not covered: two jobs reading the lease at the same instant (both may take the root), and
    a process id reused on the same host (a dead holder then looks alive: refused, and the
    message says what to do).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Optional

from . import _files

LEASE = ".fusedist-checkpointer.json"

# The run of a launch without a run id: one per process (only rank 0's is used).
_LAUNCH_RUN = f"launch-{uuid.uuid4().hex[:12]}"


def run_identity(run_id: Optional[str]) -> tuple[str, str]:
    """The job's run id and where it came from (Note [one job per checkpoint root])."""
    if run_id is not None:
        return str(run_id), "run_id"
    env = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if env and env != "none":
        return env, "TORCHELASTIC_RUN_ID"
    return _LAUNCH_RUN, "this launch"


def _path(root: str) -> str:
    return os.path.join(root, LEASE)


def read(root: str) -> Optional[dict]:
    """The root's lease, or None (none, or unreadable: a lease is written atomically, so an
    unreadable one was not written by a Checkpointer)."""
    try:
        with open(_path(root), "rb") as f:
            lease = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return lease if isinstance(lease, dict) and "token" in lease else None


def describe(lease: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease.get("started_unix", 0)))
    return (f"run {lease.get('run')!r} (from {lease.get('run_source')}), rank 0 process {lease.get('pid')} "
            f"on host {lease.get('host')}, since {started}")


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, ValueError, TypeError):
        return True  # exists (another user's) or cannot tell: assume it runs
    return True


def _holder_ended(lease: dict) -> bool:
    return lease.get("host") == socket.gethostname() and not _pid_alive(lease.get("pid"))


def write(root: str, lease: dict) -> None:
    data = json.dumps(lease).encode()
    _files.atomic_write(_path(root), lambda f: f.write(data))


def remove_stale_temporaries(root: str, started: float) -> list:
    """Remove the lease's temporaries that processes killed while writing it left in ``root``,
    by the rule of a checkpoint directory's (Note [abandoned temporaries] in ``_files.py``): those
    last modified before ``started``, when the save that just completed began. Only the lease
    holder calls it, so a temporary of another job's lease being written now is newer and kept."""
    removed = []
    for name in sorted(os.listdir(root)):
        match = _files._TEMPORARY.match(name)
        if match is None or match.group(1) != LEASE:
            continue
        try:
            if os.path.getmtime(os.path.join(root, name)) < started:
                os.unlink(os.path.join(root, name))
                removed.append(name)
        except OSError:
            pass  # gone meanwhile: the next save looks again
    return removed


def refusal(root: str, run: str, source: str, timeout: Optional[float] = None) -> Optional[str]:
    """Why a job of ``run`` may not write ``root`` (another run's lease, holder maybe alive),
    or None. With ``timeout``, a lease with a heartbeat is waited on until it is renewed or
    goes stale (Note [lease heartbeat] in ``_heartbeat.py``)."""
    current = read(root)
    if current is None or current.get("run") == run or _holder_ended(current):
        return None
    if timeout is not None:
        from ._heartbeat import stale_for, wait_until_stale_or_renewed

        # A holder on this host whose process lives runs (no need to wait for its next beat),
        # unless its lease is stale already (its process id reused by another program).
        here = current.get("host") == socket.gethostname()
        stale_or_elsewhere = stale_for(current, timeout) is not None or not here
        if stale_or_elsewhere and wait_until_stale_or_renewed(root, current, timeout):
            return None
        current = read(root) or current
    return (
        f"fusedist.checkpoint.Checkpointer: {root} is the checkpoint root of another job: "
        f"{describe(current)} (lease {_path(root)}); this job is run {run!r} (from {source}). Two jobs "
        "writing one root overwrite and prune each other's checkpoints, so this one reads and writes nothing "
        "there. Give this job its own directory; or, if that job has ended without close() (killed) and this "
        f"one continues it, pass run_id={current.get('run')!r} to the Checkpointer (or delete the lease file). "
        "To only read that job's checkpoints, use fusedist.checkpoint.load on a step directory"
        + (". Its holder renews the lease (Note [lease heartbeat]): it runs" if current.get("beat_unix") else "")
    )


def acquire(root: str, run: str, source: str, held: Optional[dict],
            timeout: Optional[float] = None) -> tuple[Optional[dict], Optional[str]]:
    """Rank 0 before a save writes or removes anything: (the lease it holds, None), or (None,
    why this save may not write). ``held``: the lease taken by an earlier save of this
    Checkpointer, or None (taken now, Note [one job per checkpoint root]). ``timeout``: the
    heartbeat's (Note [lease heartbeat] in ``_heartbeat.py``)."""
    if held is not None:
        other = lost(root, held)
        return (None, other) if other is not None else (held, None)
    why = refusal(root, run, source, timeout)
    if why is not None:
        return None, why
    now = time.time()
    lease = {"run": run, "run_source": source, "token": uuid.uuid4().hex, "host": socket.gethostname(),
             "pid": os.getpid(), "started_unix": now}
    if timeout is not None:
        lease.update(beat_unix=now, beat_s=timeout / 4.0)
    os.makedirs(root, exist_ok=True)
    write(root, lease)
    return lease, None


def lost(root: str, lease: dict) -> Optional[str]:
    """Rank 0 before a save writes or removes anything: None while ``lease`` is the root's
    (written again if it is missing); else who holds the root now, in words."""
    current = read(root)
    if current is None:
        try:
            write(root, lease)
        except OSError:
            pass  # the save's own writes report an unwritable root
        return None
    if current.get("token") == lease["token"]:
        return None
    same = current.get("run") == lease["run"]
    return (f"{describe(current)} took over {root} (lease {_path(root)}) since this job's last save; "
            + ("a restarted instance of this same run: the later one continues, this one stops"
               if same else "two jobs writing one root overwrite and prune each other's checkpoints"))


def release(root: str, lease: dict) -> None:
    """At ``close()``: give the root up, unless another holds it now."""
    current = read(root)
    if current is not None and current.get("token") == lease["token"]:
        try:
            os.unlink(_path(root))
        except OSError:
            pass
