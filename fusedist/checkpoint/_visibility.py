"""Waiting for a checkpoint's files where a host shows them late, instead of taking them for lost.

Note [a checkpoint another rank does not see yet]
    Rank 0 picks the checkpoint to restore from its own view of the filesystem: a manifest and
    every file it lists, at the listed size. Another host may show the same directory later: a
    network filesystem caches lookups and attributes (NFS: up to ``acdirmax``, 60 s by
    default), so a file another host wrote can be missing or short there while rank 0 sees it
    whole, and a manifest can be seen before the rank files it lists. Read at once, such a
    file failed its size check like a truncated one, and ``restore`` went back to the previous
    checkpoint with a warning on rank 0 alone: the run silently lost the steps since. So before
    anything is read every rank checks that it sees what rank 0 saw -- the manifest's very
    bytes, every listed file at its size -- and the ranks wait for each other together, one
    exchange per try (no rank sits in a collective past its deadline while another polls), up
    to ``FUSEDIST_CHECKPOINT_VISIBLE_S`` seconds (default :data:`DEFAULT_WAIT_S`). A file still
    unseen then fails the restore on every rank, naming the ranks and files: it is not corrupt,
    and falling back to an older checkpoint would undo the steps since without a word. Where
    rank 0 itself no longer sees it (removed since it listed it), nothing is waited for: the
    ordinary checks report it and the previous checkpoint is tried, as for a corrupt file. A
    listed file a rank sees at another size and modified after the manifest is damaged, not
    late (a lagging view shows an older state of a file, never a newer one; the manifest is
    written after every file it lists): the checkpoint is corrupt, as when rank 0 sees it so,
    and the previous one is tried at once with a warning naming the rank and file.

    Rank 0's own view may lag too (a restarted job's rank 0 on another host, a checkpoint
    still being copied in): a manifest listing a file that is not there is never an
    interrupted save -- the manifest is written last -- so restore waits for that file the same
    way (:func:`await_listed`) and refuses rather than pass over the checkpoint. A save waits
    likewise where rank 0 does not yet see a file another rank wrote into the same directory
    (:func:`wait_seen`): failing the save lost a checkpoint its ranks had written whole.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from typing import Optional

from . import _files, layout
from ._files import CheckpointError

WAIT_ENV = "FUSEDIST_CHECKPOINT_VISIBLE_S"
DEFAULT_WAIT_S = 60.0  # NFS's default acdirmax: how stale a client's view of a directory may be
_POLL_S = 0.25


def wait_limit() -> float:
    """``FUSEDIST_CHECKPOINT_VISIBLE_S`` in seconds (0: do not wait), else :data:`DEFAULT_WAIT_S`."""
    raw = os.environ.get(WAIT_ENV)
    if raw is None:
        return DEFAULT_WAIT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{WAIT_ENV} must be a finite number of seconds >= 0, got {raw!r}")
    return seconds


def _expected(path: str) -> Optional[tuple]:
    """Rank 0: the digest of the manifest of ``path`` and ``{file name: bytes}`` of the files it
    lists, or None when it cannot be read (the ordinary checks then say why)."""
    try:
        manifest, digest = _files.read_manifest_and_digest(path)
        return digest, {info.get("file", name): info["bytes"] for name, info in manifest["files"].items()}
    except Exception:  # noqa: BLE001 - reported by the load that follows
        return None


def _unseen(path: str, digest: str, files: dict) -> tuple[list, list]:
    """What of rank 0's view of ``path`` this rank does not see, in words: ``(late, damaged)``,
    both [] when it sees it all. A listed file of another size changed after the manifest was
    written is damaged, not late (as ``layout`` and :func:`_own_view` tell them apart): no
    filesystem's lagging view makes a file newer than the manifest the save wrote after it."""
    late, damaged = [], []
    try:
        with open(os.path.join(path, _files.MANIFEST), "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != digest:
                late.append(f"{_files.MANIFEST} (another one than rank 0 read: of another save of the step)")
        written = os.stat(os.path.join(path, _files.MANIFEST)).st_mtime
    except OSError:
        late.append(f"{_files.MANIFEST} (not there)")
    if late:  # (the files of another save, or none: nothing to tell a damaged file by)
        written = math.inf
    for name, size in sorted(files.items()):
        try:
            found = os.stat(os.path.join(path, name))
        except OSError:
            late.append(f"{name} (not there)")
            continue
        if found.st_size == size:
            continue
        if found.st_mtime < written:
            late.append(f"{name} ({found.st_size} of its {size} bytes)")
        else:
            damaged.append(f"{name} ({found.st_size} bytes where the manifest says {size}, changed after it "
                           "was written)")
    return late, damaged


def await_visible(coord, path: str, step: int) -> Optional[str]:
    """Wait until every rank of ``coord`` sees the checkpoint in ``path`` as rank 0 does (Note [a
    checkpoint another rank does not see yet]). A collective; None once they do (or where rank 0
    itself no longer does). Why the checkpoint is damaged where a rank sees a listed file changed
    since the save (truncated, replaced): a corrupt checkpoint, at once, the same on every rank.
    Raises CheckpointError, on every rank, where a rank's view lags past the wait, or as soon as
    nothing can still be arriving (Note [a file that is not arriving])."""
    want = coord.broadcast(_expected(path) if coord.rank == 0 else None, "checkpoint rank 0 sees")
    if want is None:
        return None
    limit = wait_limit()
    started = time.monotonic()
    quiet = _Quiet(path, limit)
    while True:
        late, damaged = _unseen(path, *want)
        everyone = coord.all_gather((late, damaged, time.monotonic() - started >= limit, quiet.settled()),
                                    "checkpoint every rank sees")
        if everyone[0][0]:  # (rank 0 no longer sees it whole: the ordinary checks say why)
            return None
        broken = [(coord.ranks[i], seen) for i, (_, seen, _, _) in enumerate(everyone) if seen]
        if broken:
            return (f"{_lacking(broken, 'sees')}: damaged since the save, as that host shows {path} (rank 0 sees "
                    "it whole), not a file shown late, so it is not waited for")
        lagging = [(coord.ranks[i], seen) for i, (seen, _, _, _) in enumerate(everyone) if seen]
        if not lagging:
            return None
        if any(out for _, _, out, _ in everyone):
            break
        only_files = not any(s.startswith(_files.MANIFEST) for _, seen in lagging for s in seen)
        if only_files and all(settled for _, _, _, settled in everyone):
            raise CheckpointError(_not_arriving(_restore_subject(path, step), _lacking(lagging), limit,
                                                _RESTORE_NOTHING_OLDER))
        time.sleep(_POLL_S)
    raise CheckpointError(
        f"{_restore_subject(path, step)}: rank 0 sees it complete, but {_lacking(lagging)}, after waiting {limit:g} s "
        f"({WAIT_ENV}). The directory is not on a filesystem every rank sees alike, or another host's view of it "
        f"lags (a network filesystem's attribute cache): the files are not corrupt, so no older checkpoint was "
        f"restored in its place. Restore again once every host shows them (raise {WAIT_ENV} to wait longer), or "
        f"pass step= to restore an older one")


def _lacking(lagging: list, verb: str = "does not see") -> str:
    """``[(rank, [what, ...]), ...]`` in words, one clause per rank."""
    return "; ".join(f"rank {rank} {verb} {', '.join(seen)}" for rank, seen in lagging)


def _restore_subject(path: str, step: int) -> str:
    return f"fusedist.checkpoint.Checkpointer: cannot restore step {step} from {path}"


_RESTORE_NOTHING_OLDER = ("No older checkpoint was restored in its place, which would undo the steps since: copy the "
                          "missing files in, or pass step= to restore an older one")


def await_listed(coord, path: str, step: int, reason: str) -> Optional[str]:
    """For the checkpoint of ``step`` that rank 0 listed as incomplete for ``reason``: wait while
    it is incomplete only because a file its manifest lists is not there (Note [a checkpoint
    another rank does not see yet]). A collective. None once it is complete; why it is
    incomplete when that is something else (it is skipped, as before); a CheckpointError, on
    every rank, when the file has not shown after the wait."""
    limit = wait_limit()
    started = time.monotonic()
    quiet = _Quiet(path, limit) if coord.rank == 0 else None
    while True:
        state = None
        if coord.rank == 0:
            entry = layout.entry_at(path, step)
            state = ((False, False, "its directory is gone") if entry is None
                     else (entry.complete, entry.unseen, entry.reason))
            state += (time.monotonic() - started >= limit, quiet.settled())
        complete, unseen, now, out, settled = coord.broadcast(state, "checkpoint files rank 0 sees")
        if complete:
            return None
        if not unseen:
            return now or reason
        if settled and not out:
            raise CheckpointError(_not_arriving(_restore_subject(path, step), f"its manifest is whole but {now}",
                                                limit, _RESTORE_NOTHING_OLDER))
        if out:
            raise CheckpointError(
                f"fusedist.checkpoint.Checkpointer: cannot restore step {step} from {path}: "
                f"its manifest is whole but {now}, after waiting {limit:g} s ({WAIT_ENV}). The manifest is written "
                f"only after every file it lists, so the file is not lost in a save: rank 0's host does not see it "
                f"yet (a network filesystem's view of another host's files lags), or the directory is being copied "
                f"or was partly removed. No older checkpoint was restored in its place, which would undo the steps "
                f"since: restore again once the file shows (raise {WAIT_ENV} to wait longer), or pass step= to "
                f"restore an older one")
        time.sleep(_POLL_S)


def _not_arriving(subject: str, where: str, limit: float, then: str) -> str:
    """Why a restore or load stops before the wait limit (Note [a file that is not arriving])."""
    return (f"{subject}: {where}. Its manifest was written more than {limit:g} s ago ({WAIT_ENV}) and nothing in the "
            f"directory changed for {QUIET_S:g} s, so the files are not arriving (Note [a file that is not "
            f"arriving]): they were removed, cut short, or never copied in. {then}")


def wait_seen(directory: str, files: dict) -> list[str]:
    """Rank 0 before a manifest lists the rank files every rank wrote into ``directory`` (the
    same path on every rank): the names in ``files`` it does not see with their size, after
    waiting up to ``FUSEDIST_CHECKPOINT_VISIBLE_S`` for them to show ([] once they do). Why:
    another host's new files may show late here (Note [a checkpoint another rank does not see
    yet]), and failing the save for it lost a checkpoint the ranks had written whole. The other
    ranks wait meanwhile at the save's I/O barrier, which has no deadline while rank 0 lives."""
    limit = wait_limit()
    started = time.monotonic()
    while True:
        missing = _files.not_seen(directory, files)
        if not missing or time.monotonic() - started >= limit:
            return missing
        time.sleep(_POLL_S)


# Note [a plain load waits for lagging files]
#     ``load`` read every file at once: a file its host did not show yet (missing, or short
#     at its final name) failed the load as lost or truncated, where a Checkpointer's restore
#     waits for it (Note [a checkpoint another rank does not see yet]). So ``load`` too waits,
#     up to ``FUSEDIST_CHECKPOINT_VISIBLE_S``, until every rank reads the manifest rank 0 reads
#     and sees every file it lists at its size -- rank 0 included: the manifest is written
#     last, so a listed file it does not see is late, not lost. One exchange per try. A short
#     file not older than the manifest was changed after the save (truncated, overwritten): it
#     is damaged, not late, so it is not waited for and the load's checks name it (a
#     Checkpointer's rank 0 tells the two apart alike: ``layout.py``). Nothing is waited for
#     where rank 0 reads no manifest (torch's distributed checkpoint, or none: the load says
#     which), or where the ranks were given different directories (the load refuses that).
#
# Note [a file that is not arriving]
#     Waiting the whole ``FUSEDIST_CHECKPOINT_VISIBLE_S`` for a file that was removed (a partly
#     deleted or partly copied checkpoint, the wrong directory) kept the user a minute from the
#     error. The wait is cut short when nothing can still be arriving: (1) every rank's manifest
#     was put in place (its inode change time, which copying tools do not back-date as they do
#     the modification time) longer ago than the wait limit, so a file a save wrote before it
#     shows on every host whose view lags by at most the limit -- the bound the variable states
#     (NFS: ``acdirmax``); (2) what lags is only listed files, missing or short, each rank
#     reading rank 0's manifest; and (3) no entry of the directory appeared, vanished or changed
#     its size or time on any rank for :data:`QUIET_S` seconds (a copy still writing, under a
#     temporary name too). Assumes the hosts' clocks agree with the file server's to well
#     within the limit. Any other lag is waited for in full. A Checkpointer's restore cuts its
#     waits short alike (:func:`await_listed` on rank 0's view, :func:`await_visible` on every
#     rank's): it waited the whole limit for a file of its newest checkpoint removed long ago.
QUIET_S = 3.0


def await_loadable(world, directory: str) -> None:
    """Wait until every rank of ``world`` (``api._World``) sees the checkpoint in ``directory``
    whole, as rank 0's manifest lists it (Note [a plain load waits for lagging files]); raise
    CheckpointError, on every rank alike, if some rank does not after the wait, or as soon as
    nothing can still be arriving (Note [a file that is not arriving])."""
    limit = wait_limit()
    started = time.monotonic()
    quiet = _Quiet(directory, limit)
    while True:
        view = _own_view(directory)
        out = time.monotonic() - started >= limit
        everyone = world.all_gather((directory, view, out, quiet.settled()), "load: files seen")
        first = everyone[0][1]
        if first is None or any(d != everyone[0][0] for d, _, _, _ in everyone):
            return
        lagging = [(rank, _behind(v, first[0])) for rank, (_, v, _, _) in zip(world.ranks(), everyone)]
        lagging = [(rank, seen) for rank, seen in lagging if seen]
        if not lagging:
            return
        if any(out for _, _, out, _ in everyone):
            break
        if all(settled for _, _, _, settled in everyone) and all(v is not None and v[0] == first[0]
                                                                  for _, v, _, _ in everyone):
            raise CheckpointError(_not_arriving(f"fusedist.checkpoint: cannot load {directory}", _lacking(lagging),
                                                limit, "Nothing was loaded: check the directory, or copy the "
                                                       "missing files in"))
        time.sleep(_POLL_S)
    raise CheckpointError(
        f"fusedist.checkpoint: cannot load {directory}: {_lacking(lagging)}, after waiting {limit:g} s ({WAIT_ENV}). "
        f"Its manifest is written only after every file it lists, so the files are not lost in a save: a host's "
        f"view of the directory lags (a network filesystem's attribute cache), the directory is being copied, or "
        f"files were removed since. Nothing was loaded: load again once every host shows them (raise {WAIT_ENV} to "
        f"wait longer)")


def _wall_clock() -> float:
    return time.time()


class _Quiet:
    """Whether this rank sees nothing of ``directory`` still arriving (Note [a file that is not
    arriving]): its manifest older than the wait limit, its entries unchanged for QUIET_S."""

    def __init__(self, directory: str, limit: float):
        self.directory, self.limit = directory, limit
        self.seen, self.since = None, time.monotonic()

    def settled(self) -> bool:
        now, seen = time.monotonic(), self._entries()
        if seen != self.seen:
            self.seen, self.since = seen, now
        try:
            placed = os.stat(os.path.join(self.directory, _files.MANIFEST)).st_ctime
        except OSError:
            return False
        return seen is not None and now - self.since >= QUIET_S and _wall_clock() - placed >= self.limit

    def _entries(self) -> Optional[frozenset]:
        try:
            with os.scandir(self.directory) as it:
                return frozenset((e.name, e.stat(follow_symlinks=False).st_size,
                                  e.stat(follow_symlinks=False).st_mtime_ns) for e in it)
        except OSError:
            return None


def _own_view(directory: str) -> Optional[tuple]:
    """This rank's view of the checkpoint in ``directory``: the digest of the manifest it reads
    and what of the files listed there it does not see yet, in words; None without a manifest."""
    try:
        manifest, digest = _files.read_manifest_and_digest(directory)
        listed = {info.get("file", name): info["bytes"] for name, info in manifest["files"].items()}
        written = os.stat(os.path.join(directory, _files.MANIFEST)).st_mtime
    except Exception:  # noqa: BLE001 - the load's checks say why
        return None
    late = []
    for name, size in sorted(listed.items()):
        try:
            found = os.stat(os.path.join(directory, name))
        except OSError:
            late.append(f"{name} (missing)")
            continue
        if found.st_size != size and found.st_mtime < written:  # (changed since the manifest: damaged)
            late.append(f"{name} ({found.st_size} of its {size} bytes)")
    return digest, late


def _behind(view: Optional[tuple], digest: str) -> list[str]:
    """What a rank with ``view`` (:func:`_own_view`) lacks of the checkpoint rank 0 reads."""
    if view is None:
        return [f"{_files.MANIFEST} (not there, or unreadable)"]
    if view[0] != digest:
        return [f"{_files.MANIFEST} (another one than rank 0 reads: of another save)"]
    return view[1]
