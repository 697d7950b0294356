"""What the direct-NCCL communicator (``nccl_comm.py``) needs before its first collective:
NCCL loaded into the extension, whether this process can run it at all, the bounded
communicator init, and the comm streams, which outlive every communicator."""

from __future__ import annotations

import glob
import importlib.util
import os
import threading
from typing import Optional

import torch

from .. import _extension
from .base import CollectiveError


class NcclUnavailableError(RuntimeError):
    """The direct-NCCL path cannot run here (on at least one rank); the message says why."""


class TorchChosen(NcclUnavailableError):
    """Every rank of the group set ``FUSEDIST_COMM=torch``."""


_load_lock = threading.Lock()


def _nccl_candidates() -> list[str]:
    """Where to look for libnccl, in order: the soname (finds the copy torch already loaded,
    or one on the loader path), then the NCCL wheels' ``nvidia/*/lib`` folders."""
    found = ["libnccl.so.2"]
    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        found += sorted(glob.glob(os.path.join(root, "*", "lib", "libnccl.so*")))
    return found


def load_nccl() -> int:
    """Load NCCL into the extension once and return its version code (e.g. 22704).

    ``FUSEDIST_NCCL_LIBRARY`` (a path) wins when set. Raises :class:`NcclUnavailableError`
    listing everything tried.
    """
    C = _extension.require("_C")
    with _load_lock:
        if C.nccl_library():
            return C.nccl_version()
        explicit = os.environ.get("FUSEDIST_NCCL_LIBRARY")
        if explicit:
            try:
                return C.load_nccl(explicit)
            except RuntimeError as exc:
                raise NcclUnavailableError(f"FUSEDIST_NCCL_LIBRARY={explicit!r}: {exc}") from None
        errors = []
        for candidate in _nccl_candidates():
            try:
                return C.load_nccl(candidate)
            except RuntimeError as exc:
                errors.append(str(exc))
        raise NcclUnavailableError("fusedist: NCCL could not be loaded:\n  " + "\n  ".join(errors))


# Note [bounded NCCL init]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# ncclCommInitRank blocks until every rank has joined and has no timeout of its own. The ranks
# agree on readiness and the unique id first (one all_gather_object, bounded by the process
# group's timeout), so a rank that cannot run NCCL is reported on every rank before anyone
# calls it; a rank that dies after that exchange -- or an NCCL bootstrap that never connects
# -- would still leave the others blocked in it forever. The call therefore runs on a helper
# thread (the extension releases the GIL) and the caller waits for it up to the collective
# timeout, then raises naming the rank. The blocked thread cannot be cancelled (the
# communicator it would abort does not exist yet): it stays parked as a daemon and the process
# must be restarted, which the message says. A non-blocking init (ncclConfig_t with
# blocking=0, then ncclCommAbort) could cancel it, at the price of every later NCCL call
# possibly returning ncclInProgress.


def create_within_timeout(create, timeout_s: float, what: str):
    """Return ``create()``, run on a helper thread and waited for up to ``timeout_s`` seconds
    (Note [bounded NCCL init]); its exception is re-raised here. Raises
    :class:`~fusedist.comm.base.CollectiveError` when it does not return in time."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = create()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="fusedist-nccl-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CollectiveError(
            f"fusedist: {what} did not complete within {timeout_s:g} s: some rank of the group did not "
            "join the NCCL communicator (it failed, or is stuck, after the ranks exchanged the NCCL "
            "unique id), or NCCL's bootstrap cannot connect (check NCCL_SOCKET_IFNAME / NCCL_DEBUG=INFO). "
            "This process cannot recover the NCCL state; restart the job. FUSEDIST_TIMEOUT_S sets "
            "the limit.",
            op="nccl init")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# Note [comm streams live as long as the process]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Tensors of a collective are ``record_stream``-ed on the comm stream (ordering 3 of Note [comm
# stream ordering]), and they routinely outlive the communicator: ZeRO's parameters after the
# process group is destroyed, say. When such a tensor is freed, torch's caching allocator
# records an event on every stream the tensor was used on; had the stream been destroyed with
# its communicator, that event would go to a dead handle. So comm streams are never destroyed:
# a closed communicator hands its stream back to a per-device pool, from which the next
# communicator on that device takes it -- at most one stream per communicator alive at once,
# however often process groups are rebuilt. (torch's own stream pool never frees its streams
# either.)
_stream_pool: dict[int, list] = {}  # device -> free (CommStream, ExternalStream) pairs
_streams_created: list = []  # every pair ever made: holds each stream until the process ends
_stream_lock = threading.Lock()


def take_comm_stream(C, device: int):
    """A (CommStream, torch ExternalStream over it) pair for ``device``: pooled or new."""
    with _stream_lock:
        free = _stream_pool.setdefault(device, [])
        if free:
            return free.pop()
    stream = C.CommStream(device, high_priority=True)
    pair = (stream, torch.cuda.ExternalStream(stream.handle, device=device))
    with _stream_lock:
        _streams_created.append(pair)
    return pair


def return_comm_stream(device: int, stream, torch_stream) -> None:
    with _stream_lock:
        _stream_pool.setdefault(device, []).append((stream, torch_stream))


def local_problem() -> Optional[str]:
    """Why this process cannot run the direct-NCCL path, or None when it can."""
    if not _extension.cuda_ext_available():
        return f"the CUDA extension is not built ({_extension.cuda_ext_error()})"
    C = _extension.require("_C")
    try:
        count = C.device_count()
    except RuntimeError as exc:
        return str(exc)
    if count == 0:
        return "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)"
    if not torch.cuda.is_available():
        return f"this torch build ({torch.__version__}) has no CUDA support"
    try:
        load_nccl()
    except NcclUnavailableError as exc:
        return str(exc)
    return None
