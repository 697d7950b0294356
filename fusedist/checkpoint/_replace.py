"""A ``Checkpointer`` save of a step the root already holds: written beside the old one.

Note [saving a step again]
    ``save(N)`` after ``maybe_save(N)``, or a restarted run saving the step it restored,
    writes ``step-N`` once more. The complete ``step-N`` was removed before the new one was
    written, so a save failing or killed during the rewrite (a full disk, a lost node) left
    no ``step-N`` at all: the run's newest checkpoint was gone and a restart went back a
    whole interval, or -- with ``keep=1`` -- to nothing.

    Now a complete ``step-N`` stays complete until its replacement is: the new files take
    names of their own (``rank-00000.<save id>.pt``, ``common.<save id>.pt``; format version
    2, as :func:`fusedist.checkpoint.save` over a complete checkpoint, Note [checkpoint
    atomicity] in ``_files.py``) beside the old ones, and the new manifest replaces the old
    one in one atomic rename, once every rank's file is written -- the swap. At every instant
    the directory holds a complete checkpoint of step N, the old one or the new one; there is
    no moment without one, as a swap of two directories (two renames) would have. After the
    swap rank 0 removes the old files; after a failed rewrite, the new ones (the old
    checkpoint is kept, and the error says so).

    A rewrite killed before the swap leaves its files (and temporaries) unlisted in
    ``step-N``: ``restore`` loads the old checkpoint, warning that they are there, and the
    next complete save removes them (the kept checkpoints' unlisted files older than that
    save: ``layout.retain``). A ``step-N`` that is incomplete (a save killed before its first
    manifest) holds nothing to keep and is removed before the new one is written, as before.
    A ``step-N`` that is not a directory (a file of the user's) is never touched: the save
    fails, naming it.
"""

from __future__ import annotations

import os
import uuid
import warnings
from typing import Optional

from . import _files, _owner, layout


def prepare(root: str, step: int) -> tuple[str, Optional[str]]:
    """Rank 0, before any rank writes: make ``step-N`` ready for this save. Returns (save
    id, None) -- the id is '' for a fresh directory, else the names the new files take beside
    a complete checkpoint of ``step`` -- or ('', why nothing may be written)."""
    path = layout.step_dir(root, step)
    if os.path.lexists(path) and not os.path.isdir(path):
        return "", (f"{path} exists and is not a directory (not a checkpoint this Checkpointer wrote); it is left "
                    "as it is. Move it away, or give the Checkpointer a directory of its own")
    found = layout.entry(root, step)
    if found is not None and found.newer_format:  # Note [checkpoints of a newer fusedist] in layout.py
        return "", (f"{path} holds a checkpoint that {found.reason}; it is left as it is. Upgrade fusedist to "
                    "continue that run, or move it away")
    if found is not None and found.complete:
        return uuid.uuid4().hex[:12], None  # Note [saving a step again]
    if found is not None:  # left by a save killed before a restart: nothing complete to keep
        layout.remove(path)
    os.makedirs(path, exist_ok=True)
    return "", None


def finish(path: str, save_id: str, completed_since: Optional[float]) -> None:
    """Rank 0, once no rank writes into ``path`` any more: remove the files its manifest
    does not list: the replaced checkpoint's after a complete save (started at
    ``completed_since``; abandoned temporaries too), the failed rewrite's own otherwise. A
    failed save into a fresh directory is removed whole by the caller (Note [a failed save
    leaves nothing] in ``_failed_save.py``). Never raises: the leftovers only take space."""
    if completed_since is None and not save_id:
        return
    try:
        _files.remove_unlisted(path)
        if completed_since is not None:
            _files.remove_stale_temporaries(path, completed_since)
    except OSError as exc:
        warnings.warn(f"fusedist.checkpoint.Checkpointer: could not remove the replaced or failed files from "
                      f"{path}: {type(exc).__name__}: {exc}; they are removed by a later save")


def still_held(root: str, lease: Optional[dict]) -> bool:
    """Whether ``lease`` is still the root's: cleanup removes files no manifest lists, which
    may be another job's once it took the root over (Note [one job per checkpoint root])."""
    try:
        return lease is not None and _owner.lost(root, lease) is None
    except Exception:  # noqa: BLE001 - cannot tell: remove nothing
        return False
