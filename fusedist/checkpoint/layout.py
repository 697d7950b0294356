"""Step-numbered checkpoint directories: naming, finding the latest complete one, retention.

A periodic job writes ``<root>/step-00000010``, ``<root>/step-00000020``, ... each a complete
:func:`fusedist.checkpoint.save`-format checkpoint once its manifest exists (Note [checkpoint
atomicity]). Nothing here needs a process group: rank 0 decides, the others are told.

A directory counts as *complete* when its manifest parses, names the same step, and every
file it lists exists with the listed size. That catches an interrupted save (no manifest)
and truncation without reading the data; checksums are verified when the checkpoint is
loaded. Anything else under ``root`` (marker files, other runs' directories) is left alone.

Note [a restore that rolls back]
    ``restore(step=N)`` below the newest complete checkpoint -- a run rolled back past a loss
    spike, say -- continues from N, and its saves are the run's history from there. The
    checkpoints above N belong to the abandoned branch: left in place, a later restart (a
    crash, ``torchrun`` restarting) picked the newest complete one, the abandoned step, and
    silently undid the rollback; retention, which never touches steps above the one just
    saved, kept them for ever. So the first save after such a restore renames them
    ``abandoned-step-N`` (rank 0, before anything is written): never restored, never pruned,
    still there to inspect or delete. A restore that only reads (an evaluation) moves nothing.

Note [checkpoints of a newer fusedist]
    A checkpoint whose manifest has a format version above the one this fusedist reads (a
    job downgraded, or an older install restarting a newer run's job) is whole, only not
    readable here. Counted as incomplete, it was skipped with a warning: ``restore`` went
    back silently to an older step (or to step 0), the next save of its step replaced it,
    and retention removed it once the run passed it -- a downgrade destroyed the newest
    checkpoints. Now such an entry is ``newer_format``: ``restore`` without a step refuses
    while one is newer than every checkpoint it can read (upgrade fusedist, or name the step
    to continue from); retention never removes one; a save of its step fails naming it; a
    restore that rolls back past one sets it aside with the complete ones above.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from typing import Optional

from . import _files
from ._files import CheckpointError

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One ``step-N`` directory under the root and whether it can be loaded."""

    step: int
    path: str
    complete: bool
    reason: str = ""  # why it is not complete
    # Files its manifest does not list: of a save of the same step killed or failed while it
    # replaced this one (Note [saving a step again] in ``_replace.py``). Never read; removed
    # by the next complete save.
    leftovers: tuple = ()
    # The manifest's format version when a newer fusedist wrote it (Note [checkpoints of a
    # newer fusedist]): not complete here, and never removed by this fusedist.
    newer_format: Optional[int] = None
    # Set where its manifest is whole but a file it lists is not there (or shorter, and not
    # changed since): not an interrupted save (the manifest is written last) but one this host
    # does not see yet, or a copy still under way (Note [a checkpoint another rank does not see
    # yet] in ``_visibility.py``).
    unseen: bool = False


def _check(step: int, path: str) -> Entry:
    try:
        manifest = _files.read_manifest(path)
    except _files.NewerFormatError as exc:
        return Entry(step, path, False, f"it was written by a newer fusedist (format version {exc.version}; this "
                                        f"one reads versions up to {_files.VERSION})", newer_format=exc.version)
    except CheckpointError as exc:
        reason = "no manifest (the save was interrupted)" if "does not exist" in str(exc) else str(exc)
        return Entry(step, path, False, reason)
    saved = manifest.get("checkpointer", {}).get("step", step)
    if saved != step:
        return Entry(step, path, False, f"its manifest is for step {saved}")
    listed = set()
    for name, info in manifest.get("files", {}).items():
        listed.add(info.get("file", name))
        file = os.path.join(path, info.get("file", name))
        if not os.path.isfile(file):
            return Entry(step, path, False, f"{name} listed in the manifest is missing", unseen=True)
        if os.path.getsize(file) != info.get("bytes"):
            # not changed since the manifest was written: shown short, not truncated (Note [a plain
            # load waits for lagging files] in _visibility.py); changed after it: damaged
            late = os.path.getmtime(file) < os.path.getmtime(os.path.join(path, _files.MANIFEST))
            return Entry(step, path, False, f"{name} has {os.path.getsize(file)} bytes, the manifest says "
                                            f"{info.get('bytes')} ({'shown short' if late else 'truncated'})",
                         unseen=late)
    try:
        leftovers = tuple(_files.unlisted(path, listed))
    except OSError:  # cannot list it: nothing to warn about or remove, the checkpoint loads or not
        leftovers = ()
    return Entry(step, path, True, leftovers=leftovers)


def entry(root: str, step: int) -> Optional[Entry]:
    """The ``step-N`` directory of ``step`` under ``root`` as :func:`scan` sees it, or None
    when there is no such directory."""
    return entry_at(step_dir(root, step), step)


def entry_at(path: str, step: int) -> Optional[Entry]:
    """:func:`entry` of the directory ``path`` holding ``step``'s checkpoint (as :func:`scan`
    named it), or None when it is gone."""
    return _check(step, path) if os.path.isdir(path) else None


def scan(root: str) -> list[Entry]:
    """Every ``step-N`` directory under ``root``, newest first ([] if ``root`` does not exist)."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isdir(path):
            found.append(_check(int(match.group(1)), path))
    return sorted(found, key=lambda e: e.step, reverse=True)


def latest_complete(root: str) -> Optional[Entry]:
    """The complete checkpoint with the highest step, or None."""
    return next((e for e in scan(root) if e.complete), None)


def remove(path: str) -> None:
    """Delete a checkpoint directory, manifest first: a crash half-way leaves an incomplete
    directory (skipped at the next start), never a complete-looking one with files missing."""
    _files.remove_manifest(path)
    shutil.rmtree(path, ignore_errors=True)


ABANDONED = "abandoned-"


def set_aside_above(root: str, step: int) -> list[str]:
    """Rename the complete checkpoints of steps above ``step`` to ``abandoned-step-N`` (Note
    [a restore that rolls back]), and those of a newer fusedist (Note [checkpoints of a newer
    fusedist]); returns the new names. Incomplete ones are left to :func:`retain` and to saves
    of their step, as always."""
    moved = []
    for entry in scan(root):
        if entry.step <= step or not (entry.complete or entry.newer_format):
            continue
        base = os.path.join(root, ABANDONED + os.path.basename(entry.path))
        target, n = base, 1
        while os.path.exists(target):  # an earlier rollback set one of that step aside
            target, n = f"{base}.{n}", n + 1
        os.rename(entry.path, target)
        moved.append(os.path.basename(target))
    if moved:
        _files._fsync_dir(root)
    return sorted(moved)


def retain(root: str, keep: Optional[int], newest: int, started: Optional[float] = None) -> list[int]:
    """Apply retention after the checkpoint of step ``newest`` completed: keep the ``keep``
    newest complete checkpoints (None keeps all) and drop incomplete directories older than
    ``newest`` (interrupted saves that a complete checkpoint has superseded). Directories of
    steps above ``newest``, and checkpoints of a newer fusedist, are never touched. With
    ``started`` (when that save began), the kept checkpoints' leftovers older than it -- a
    killed rewrite's files -- are removed too.
    Returns the removed steps."""
    removed = []
    complete = 0
    for entry in scan(root):
        if entry.step > newest or entry.newer_format:  # (Note [checkpoints of a newer fusedist])
            continue
        if entry.complete:
            complete += 1
            if keep is None or complete <= keep:
                if entry.leftovers and started is not None:
                    _files.remove_unlisted(entry.path, before=started)
                    _files.remove_stale_temporaries(entry.path, started)
                continue
        elif entry.step == newest:
            continue
        remove(entry.path)
        removed.append(entry.step)
    return sorted(removed)
