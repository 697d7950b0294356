"""Atomic, checksummed checkpoint files and the manifest that makes a checkpoint complete.

Note [checkpoint atomicity]
    Every file is written to a temporary name in the same directory, flushed and fsync'ed,
    then renamed over its final name (``os.replace`` is atomic on POSIX), and the directory is
    fsync'ed so the rename itself survives a crash. The manifest is written last, by rank 0,
    after every rank reported its file's size and SHA-256. So a directory either has a
    manifest describing files that were all completely written, or no manifest (an
    interrupted first save), never one that points at half-written or mixed-up files -- and a
    later corruption is caught by the size/checksum check at load.

    Saving over a complete checkpoint must not lose it when the save fails (a full disk, a
    rank killed): the new files then take names of their own (``rank-00000.<save id>.pt``,
    listed in the manifest under the usual key with a ``file`` entry, format version 2), the
    old manifest and files stay as they are, and the new manifest replaces the old one in one
    atomic rename -- the moment the new checkpoint becomes the one the directory holds. Only
    after that are the old files removed (:func:`remove_unlisted`), as are the new ones when
    the save failed.

Note [abandoned temporaries]
    A writer killed between creating its temporary and renaming it (SIGKILL, the OOM killer,
    a lost node) leaves ``.<name>.tmp-<pid>-<thread>`` behind: ``atomic_write`` removes its temporary
    only when it unwinds. No manifest lists one and a load reads only listed files, so they
    are harmless but for their size -- a whole rank file per kill. They are removed by rank 0
    once a later save into the same directory is complete (:func:`remove_stale_temporaries`),
    and only what it can tell is abandoned: a temporary of a checkpoint file or manifest
    (``_TEMPORARY``; a user's own files are never touched) last modified before that save
    started. Every rank of the completed save has renamed or removed its own temporaries by
    then, and a directory takes one save at a time (as removing unlisted files assumes), so
    an older temporary has no writer; one touched since the save started is left alone (a
    second writer there would be a mistake, but not one to lose data for). On a network
    filesystem the file times come from the server: a clock ahead of rank 0's keeps a stale
    temporary until a later save, one behind only matters for that second writer. A
    Checkpointer's root lease (``_owner.py``) is written the same way, and its abandoned
    temporaries in the root go by the same rule after each complete save.

Note [one save at a time]
    Two saves into one directory at once -- a job launched again while the old one still
    runs, two jobs given the same output directory -- would remove each other's files: each
    save ends by deleting the checkpoint files its manifest does not list, which include the
    other save's, written but not yet listed. No lock is taken (a lock left by a killed job
    would have to be judged stale, and across hosts it cannot be); instead rank 0 *claims*
    the directory when its save starts, writing a small file (``CLAIM``: a random token, its
    host, process id and start time) over whatever claim is there, and checks the claim is
    still its own before it writes the manifest and before it removes anything. A save that
    finds another's claim stops with an error naming the other writer, writes no manifest
    and removes nothing: the later save wins, the earlier one loses nothing that was complete
    (the directory keeps the checkpoint it held, or the other save's once that completes).
    A claim left by a killed save is simply overwritten by the next save. What remains is the
    instant between the check and the rename of the manifest (or the removal): two saves
    that start within it are not told apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import socket
import threading
import time
import uuid
from typing import Any, Callable, Optional

import torch

MANIFEST = "manifest.json"
COMMON = "common.pt"  # rank 0's file: the model, an unsharded optimizer, the scaler, extra
FORMAT = "fusedist.checkpoint"
VERSION = 5  # the newest format this fusedist reads and writes
# Version 2 adds files with names of their own (Note [checkpoint atomicity]), version 3 box
# fragments (Note [box fragments] in zero/box_fragments.py: fully_shard parameters sharded on
# a dim other than 0), version 4 region fragments (Note [region fragments] there: fully_shard
# over tensor-parallel parameters), version 5 pipelined checkpoints (Note [pipelined
# checkpoints] in pipeline.py: a file per stage beside common.pt). A manifest is written with
# the lowest version that reads it -- 1 without any of these, which older fusedist releases
# read too.
BASE_VERSION = 1
SAVE_ID_VERSION = 2
BOX_VERSION = 3
REGION_VERSION = 4
PIPELINE_VERSION = 5
_CHUNK = 1 << 20
# The files a save writes: rank-00000.pt / common.pt (/ common-stage-000.pt), or with a save id
# before ".pt".
_SAVED_FILE = re.compile(r"^(rank-\d{5}|common|common-stage-\d{3,})(\.[0-9a-f]{12})?\.pt$")
# What atomic_write writes first: "." + the final name + ".tmp-" + the writer's process id and
# thread id (two threads of one process may write one file: two Checkpointers' background saves
# of the same root's lease); temporaries of older versions carry the process id alone.
_TEMPORARY = re.compile(r"^\.(.+)\.tmp-\d+(?:-\d+)?$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded (missing, truncated, corrupt or mismatched); nothing was
    changed in the model, optimizer or scaler."""


class NewerFormatError(CheckpointError):
    """The checkpoint was written by a newer fusedist: whole, but unreadable here (Note
    [checkpoints of a newer fusedist] in layout.py)."""

    def __init__(self, message: str, version):
        super().__init__(message)
        self.version = version


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[Any], None]) -> dict:
    """Write ``path`` atomically (Note [checkpoint atomicity]); return its size and SHA-256."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{threading.get_native_id()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        info = file_info(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(directory)
    return info


def atomic_torch_save(path: str, obj: Any) -> dict:
    return atomic_write(path, lambda f: torch.save(obj, f))


def file_info(path: str) -> dict:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def write_manifest(directory: str, manifest: dict) -> None:
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    atomic_write(os.path.join(directory, MANIFEST), lambda f: f.write(data))


def file_name(name: str, save_id: str) -> str:
    """Where a save with ``save_id`` ('' when the directory held no checkpoint) writes the file
    the manifest lists as ``name``."""
    return name if not save_id else f"{name[:-len('.pt')]}.{save_id}.pt"


def _listed(directory: str) -> set:
    """The file names the manifest of ``directory`` lists (none without a readable one)."""
    try:
        return {info.get("file", name) for name, info in read_manifest(directory)["files"].items()}
    except CheckpointError:
        return set()


def unlisted(directory: str, listed: Optional[set] = None) -> list:
    """The checkpoint files (``_SAVED_FILE``) and checkpoint temporaries (``_TEMPORARY``) in
    ``directory`` that its manifest does not list: what a save killed or failed there left.
    ``listed``: the manifest's file names, when the caller has read them already."""
    listed = _listed(directory) if listed is None else listed
    found = []
    for name in sorted(os.listdir(directory)):
        temporary = _TEMPORARY.match(name)
        if temporary is not None and (_SAVED_FILE.match(temporary.group(1)) or temporary.group(1) == MANIFEST):
            found.append(name)
        elif _SAVED_FILE.match(name) and name not in listed:
            found.append(name)
    return found


def remove_unlisted(directory: str, before: Optional[float] = None) -> list:
    """Remove the checkpoint files (rank and common files, see ``_SAVED_FILE``) of
    ``directory`` that its manifest does not list -- every one of them when it has no readable
    manifest. Run by one rank once no rank writes any more. ``before``: only those last
    modified before that time (a sweep of directories another save might be writing).
    Returns the names removed."""
    listed = _listed(directory)
    removed = []
    for name in sorted(os.listdir(directory)):
        if _SAVED_FILE.match(name) and name not in listed:
            try:
                path = os.path.join(directory, name)
                if before is not None and os.path.getmtime(path) >= before:
                    continue
                os.unlink(path)
                removed.append(name)
            except OSError:
                pass
    if removed:
        _fsync_dir(directory)
    return removed


def remove_stale_temporaries(directory: str, started: float) -> list:
    """Remove the temporaries of checkpoint files and manifests that writers killed mid-write
    left in ``directory`` (Note [abandoned temporaries]): those last modified before
    ``started`` (``time.time()`` when the save that just completed began). Returns the names
    removed."""
    removed = []
    for name in sorted(os.listdir(directory)):
        match = _TEMPORARY.match(name)
        if match is None or not (_SAVED_FILE.match(match.group(1)) or match.group(1) == MANIFEST):
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.isfile(path) and os.path.getmtime(path) < started:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass  # gone meanwhile, or not ours to remove: the next save tries again
    if removed:
        _fsync_dir(directory)
    return removed


#: Rank 0's claim on a directory for the save in progress (Note [one save at a time]).
CLAIM = ".fusedist-save-claim.json"


def claim_directory(directory: str) -> dict:
    """Claim ``directory`` for a save starting now (over any earlier claim); the claim."""
    claim = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "started_unix": time.time()}
    data = json.dumps(claim).encode()
    atomic_write(os.path.join(directory, CLAIM), lambda f: f.write(data))
    return claim


def claim_lost(directory: str, claim: dict) -> Optional[str]:
    """None while ``claim`` is still the directory's; else who claimed it since, in words."""
    try:
        with open(os.path.join(directory, CLAIM), "rb") as f:
            now = json.loads(f.read())
    except (OSError, ValueError):
        return "a save that has finished since (the claim file is gone)"
    if now.get("token") == claim["token"]:
        return None
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now.get("started_unix", 0)))
    return f"a save by process {now.get('pid')} on host {now.get('host')}, started {started}"


def release_claim(directory: str, claim: dict) -> Optional[str]:
    """Remove ``claim`` once its save is over, unless another save claimed the directory
    since; who did, in words (:func:`claim_lost`), or None."""
    other = claim_lost(directory, claim)
    if other is None:
        try:
            os.unlink(os.path.join(directory, CLAIM))
        except OSError:
            pass
    return other


def remove_manifest(directory: str) -> None:
    path = os.path.join(directory, MANIFEST)
    if os.path.exists(path):
        os.unlink(path)
        _fsync_dir(directory)


def read_manifest(directory: str) -> dict:
    return read_manifest_and_digest(directory)[0]


def read_manifest_and_digest(directory: str) -> tuple[dict, str]:
    """The manifest and the SHA-256 of the bytes it was parsed from: what identifies the
    checkpoint a rank reads (ranks of one load must all read the same one)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        what = "is a file, not a checkpoint directory" if os.path.exists(directory) else "does not exist"
        raise CheckpointError(f"fusedist.checkpoint: {directory!r} {what}")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"fusedist.checkpoint: {path} does not exist: {directory!r} holds no complete checkpoint "
            "(the manifest is written last, so an interrupted save leaves none)"
        )
    try:
        with open(path, "rb") as f:
            data = f.read()
        manifest = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"fusedist.checkpoint: {path} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"fusedist.checkpoint: {path} is not a fusedist checkpoint manifest")
    if manifest.get("version", 0) > VERSION:
        raise NewerFormatError(
            f"fusedist.checkpoint: {path} has format version {manifest.get('version')}, this fusedist "
            f"reads versions up to {VERSION}; upgrade fusedist", manifest.get("version"))
    return manifest, hashlib.sha256(data).hexdigest()


def not_seen(directory: str, files: dict) -> list[str]:
    """The names in a manifest's ``files`` that ``directory`` does not hold with the listed
    size: files another rank wrote where this one cannot see them (another directory, or one
    not on a filesystem every rank shares). Checked before a manifest lists them."""
    missing = []
    for name, info in sorted(files.items()):
        path = os.path.join(directory, info.get("file", name))
        if not os.path.isfile(path) or os.path.getsize(path) != info["bytes"]:
            missing.append(name)
    return missing


def verify_file(directory: str, name: str, expected: dict) -> str:
    """The path of the file the manifest lists as ``name`` (its own ``file`` name, if any)
    after checking it exists with the manifest's size and checksum."""
    path = os.path.join(directory, expected.get("file", name))
    if not os.path.isfile(path):
        raise CheckpointError(
            f"fusedist.checkpoint: shard file {path} is missing (listed in the manifest): removed since it was "
            "written, or this host does not see the directory as the writing hosts do (not a shared filesystem, "
            "or one whose view of another host's new files lags)")
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        raise CheckpointError(
            f"fusedist.checkpoint: shard file {path} has {size} bytes, the manifest says "
            f"{expected['bytes']} (truncated or overwritten)"
        )
    if file_info(path)["sha256"] != expected["sha256"]:
        raise CheckpointError(
            f"fusedist.checkpoint: shard file {path} is corrupt (SHA-256 differs from the manifest)"
        )
    return path


def load_file(path: str, trusted: bool = False) -> Any:
    """Read one checkpoint file.

    By default with torch's restricted unpickler (``weights_only=True``): tensors, dtypes and
    plain containers only, so a tampered file cannot run code at load. Everything fusedist
    itself writes fits in that (RNG states included, see ``resume.capture_rng_state``); only
    arbitrary objects a user put into ``extra`` or ``per_rank`` need ``trusted=True``.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        if trusted:
            raise CheckpointError(f"fusedist.checkpoint: cannot read {path}: {exc}") from exc
        raise CheckpointError(
            f"fusedist.checkpoint: {path} holds objects other than tensors and plain containers "
            f"(e.g. in `extra` or `per_rank`), which the safe loader refuses ({refusal_reason(exc)}). Pass "
            "trusted=True to load it with full unpickling -- only for a checkpoint from a source "
            "you trust: unpickling can run arbitrary code."
        ) from exc
    except Exception as exc:  # noqa: BLE001 - unpickling fails in many ways
        raise CheckpointError(f"fusedist.checkpoint: cannot read {path}: {exc}") from exc


def refusal_reason(exc: pickle.UnpicklingError) -> str:
    """The line of the restricted unpickler's refusal that names what it refused."""
    return next((line.strip() for line in str(exc).splitlines() if "Unsupported global" in line),
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
