"""What a ``Checkpointer`` checks of its root in the save call itself, before the snapshot.

Note [one saving Checkpointer per root in a process]
    Two Checkpointers of one program given the same root (a copy-pasted setup, a second one
    made for a later phase while the first is still open) are one run, so the root's lease
    (Note [one job per checkpoint root] in ``_owner.py``) let the later one take the root:
    the earlier one's next save then failed -- from the background thread, one save later --
    blaming "a restarted instance of this same run", while meanwhile each had replaced the
    other's steps and pruned the root by its own ``keep``. Lightning refuses two
    ``ModelCheckpoint`` callbacks of one configuration likewise. Now a Checkpointer's first
    save takes the root for itself in this process, and the save of another Checkpointer
    given the same root (by any path to it) is refused at once, in the save call, on every
    rank, before anything is written; the first goes on undisturbed. (Checkpointers given
    different ``run_id``s are two jobs: the lease refuses the later one, naming the other.) Its ``close()`` -- or its
    being garbage collected -- frees the root. Restoring from such a root (reading) is fine.

Note [a root that cannot be written]
    A root under a file, or in a directory this process may not write, failed the first
    save in the background thread: the error came at the next save or ``close()``, a whole
    save interval of training later. Rank 0 now looks at the root (or its nearest existing
    parent) in the save call and every rank raises there, naming it. Only what can be seen
    without writing is checked (a full disk or a read-only mount still fail in the
    background, on every rank, at the next save or ``close()``).
"""

from __future__ import annotations

import os
import weakref
from typing import Optional

_SAVING: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


def _key(root: str) -> str:
    return os.path.realpath(root)


def claim(root: str, owner) -> Optional[str]:
    """Take ``root`` for ``owner``'s saves in this process (Note [one saving Checkpointer per
    root in a process]); why not, or None."""
    key = _key(root)
    holder = _SAVING.get(key)
    if holder is None:
        _SAVING[key] = owner
        return None
    if holder is owner or getattr(holder, "_run", None) != getattr(owner, "_run", None):
        return None  # another run: the root's lease decides, naming that job
    where = root if key == os.path.abspath(root) else f"{root} ({key})"
    return (f"another Checkpointer of this process saves to {where} (its last save: step "
            f"{getattr(holder, 'last_saved_step', None)}). Two Checkpointers writing "
            "one root replace and prune each other's checkpoints: use one per root (any number may restore "
            "from it), or close() the other first")


def release(root: str, owner) -> None:
    """At ``close()``: the root is free for another Checkpointer of this process."""
    key = _key(root)
    if _SAVING.get(key) is owner:
        del _SAVING[key]


def unwritable(root: str) -> Optional[str]:
    """Why a save cannot write ``root``, as far as can be seen without writing (Note [a root
    that cannot be written]), or None."""
    path = os.path.abspath(root)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not os.path.isdir(path):
        if path == os.path.abspath(root):
            return f"the checkpoint root {root} is a file, not a directory"
        return f"the checkpoint root {root} lies under {path}, which is a file, not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"this process may not write the checkpoint root {root} ({path} is not writable)"
    return None
