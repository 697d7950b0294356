"""Which checkpoint ``load`` reads in a directory holding both fusedist's and torch's."""

from __future__ import annotations

import os
import time

from ._files import MANIFEST, CheckpointError
from ._from_dcp import METADATA, is_dcp


def reads_dcp(directory: str) -> bool:
    """Whether ``load`` reads ``directory`` as torch's distributed checkpoint rather than as
    fusedist's (whose manifest is written last, as DCP's ``.metadata``). Where both are
    there, another job saved into the directory: the one written last is the checkpoint, and
    a fusedist manifest older than the metadata would load the state torch's save replaced,
    silently: refused (Note [two checkpoints in one directory])."""
    if not is_dcp(directory):
        return False
    listed = os.path.join(directory, MANIFEST)
    if not os.path.exists(listed):
        return True
    ours, theirs = os.stat(listed).st_mtime_ns, os.stat(os.path.join(directory, METADATA)).st_mtime_ns
    if theirs > ours:
        raise CheckpointError(
            f"fusedist.checkpoint: {directory} holds two checkpoints: torch's distributed checkpoint ({METADATA}, "
            f"written {_when(theirs)}) and, older, fusedist's ({MANIFEST}, written {_when(ours)}): torch's "
            "dcp.save wrote into a directory of fusedist's files, which fusedist's manifest still lists, so they "
            "would load as the checkpoint, not the state saved last. Move fusedist's files (the manifest, "
            "common*.pt, rank-*.pt) out of it to load torch's, or save each checkpoint into a directory of its "
            "own; nothing was loaded")
    return False


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


# Note [two checkpoints in one directory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's dcp.save into a directory holding a fusedist checkpoint leaves fusedist's files and
# manifest beside its own (it removes nothing), and load took the manifest: a job resumed from
# the state torch's save had replaced, silently. Each format writes its index file last (DCP
# its .metadata, fusedist its manifest), so the later of the two is the checkpoint the
# directory was last given: a fusedist save into a directory of torch's checkpoint loads as
# fusedist's (its manifest is newer, and torch's files are not read), and the other way round
# is refused, naming both and their times: which one the user meant is theirs to make plain
# (by moving the other's files away), not a guess from file times alone.
