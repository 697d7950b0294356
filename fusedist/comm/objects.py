"""Python objects exchanged through a communicator's collectives (construction checks,
checkpoint agreement, optimizer-state consolidation).

Why not torch's ``all_gather_object`` / ``gather_object``: they wait on the process group's
own timeout and fail with gloo's raw error ("Timed out waiting 30000ms for send operation",
"Connection closed by peer"), naming neither the call nor the rank that is missing. Built on
the communicator's tensor collectives, an object exchange is bounded by the collective
timeout, tagged with what it is for, and observed by the reliability monitor, so a rank that
never joins turns into a :class:`~fusedist.reliability.StallError` whose report says which op
each rank is in.

Every exchange starts with a fixed-size header (payload size and the exchange's name) that
all ranks gather; only then does the payload move. Ranks that reach *different* exchanges at
the same point (one in ``checkpoint.save``, another in ``consolidate_state_dict``) would
otherwise pair their messages silently; the header lets every rank see it and raise the same
:class:`CollectiveError` naming what each rank was in, with the group still in step.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

import torch

from .base import CollectiveError, Communicator

#: Bytes of an exchange's name carried in the header (longer names are cut).
NAME_BYTES = 96
#: What every header's messages are matched by (Note [exchange tags] in exchange_tags.py).
HEADER_LABEL = "fusedist object exchange header"


def all_gather_object(comm: Communicator, obj: Any, *, tag: str) -> list:
    """Every rank's ``obj``, in rank order, on every rank. A collective; ``tag`` names it in
    errors and stall reports (e.g. "DistributedDataParallel construction: model check")."""
    if comm.world_size == 1:
        return [obj]
    sizes, row = _rows(comm, obj, tag)
    out = torch.empty(row.numel() * comm.world_size, dtype=torch.uint8, device=comm.device)
    comm.all_gather(out, row, tag=tag)
    return _decode_rows(out, sizes)


def gather_object(comm: Communicator, obj: Any, dst: int, *, tag: str) -> Optional[list]:
    """Every rank's ``obj`` in rank order on rank ``dst`` (group rank), None on the others. A
    collective; only ``dst`` receives the payloads."""
    if comm.world_size == 1:
        return [obj]
    sizes, row = _rows(comm, obj, tag, root=f" (to rank {dst})")
    out = (torch.empty(row.numel() * comm.world_size, dtype=torch.uint8, device=comm.device)
           if comm.rank == dst else None)
    comm.gather(out, row, dst, tag=tag)
    return _decode_rows(out, sizes) if out is not None else None


def broadcast_object(comm: Communicator, obj: Any, src: int, *, tag: str) -> Any:
    """Rank ``src``'s ``obj`` on every rank (the others' ``obj`` is ignored). A collective."""
    if comm.world_size == 1:
        return obj
    payload = _encode(obj, comm.device) if comm.rank == src else None
    sizes = _exchange_headers(comm, _size(payload) if comm.rank == src else 0, tag, payload,
                              root=f" (from rank {src})")
    if payload is None:
        payload = torch.empty(sizes[src], dtype=torch.uint8, device=comm.device)
    comm.broadcast(payload, src, tag=tag)
    return obj if comm.rank == src else _decode_rows(payload, [sizes[src]])[0]


def _rows(comm: Communicator, obj: Any, tag: str, root: str = ""):
    """Every rank's payload size (after the header exchange) and this rank's payload padded
    to the largest: equal rows, as all-gather and gather need."""
    payload = _encode(obj, comm.device)
    sizes = _exchange_headers(comm, _size(payload), tag, payload, root)
    return sizes, _padded(payload, max(sizes))


def _monitored(comm: Communicator) -> None:
    """Attach the reliability monitor (idempotent), so a failed exchange raises with a stall
    report. Imported here: the reliability package builds on this one."""
    from ..reliability import attach_monitor

    attach_monitor(comm)


def _exchange_headers(comm: Communicator, nbytes: int, tag: str, payload=None, root: str = "") -> list[int]:
    """Gather every rank's (payload size, exchange name); return the sizes, or raise on every
    rank if the ranks are in different exchanges or some rank's object could not be pickled
    (``payload``: this rank's :class:`_Unpicklable`, raised here). ``root`` (" (from rank 1)")
    ends the name of a rooted exchange, never cut: ranks that disagree on the root rank are in
    different exchanges too, raised here at once rather than as a timeout of the payload's
    broadcast or gather (whose messages would never pair)."""
    _monitored(comm)
    suffix = root.encode()
    name = tag.encode()[:NAME_BYTES - len(suffix)] + suffix
    header = torch.zeros(1 + NAME_BYTES, dtype=torch.int64)
    header[0] = nbytes
    header[1 : 1 + len(name)] = torch.tensor(list(name), dtype=torch.int64)
    header = header.to(comm.device)
    everyone = torch.empty(comm.world_size * header.numel(), dtype=torch.int64, device=comm.device)
    # One label for every header, so ranks in different exchanges pair here and see it.
    comm.all_gather(everyone, header, tag=tag, label=HEADER_LABEL)
    rows = everyone.view(comm.world_size, -1).cpu()
    names = [bytes(row[1:][row[1:] > 0].tolist()).decode(errors="replace") for row in rows]
    if len(set(names)) > 1:
        raise _mismatch(comm, tag, names)
    sizes = [int(row[0]) for row in rows]
    failed = [r for r, n in enumerate(sizes) if n < 0]
    if isinstance(payload, _Unpicklable):
        raise payload.error
    if failed:
        raise CollectiveError(
            f"fusedist ({tag}, rank {comm.rank} of {comm.world_size}): the object of rank(s) {failed} "
            "could not be pickled for this exchange (their error says why); nothing was exchanged",
            op="all_gather", tag=tag, rank=comm.rank)
    return sizes


def _mismatch(comm: Communicator, tag: str, names: list[str]) -> CollectiveError:
    where = "; ".join(f"rank {r}: {n}" for r, n in enumerate(names))
    return CollectiveError(
        f"fusedist ({tag}, rank {comm.rank} of {comm.world_size}): the ranks are in different "
        f"exchanges ({where}). These calls are collectives: every rank must make the same "
        "fusedist calls in the same order (e.g. consolidate_state_dict and fusedist.checkpoint.save "
        "on every rank).",
        op="all_gather", tag=tag, rank=comm.rank,
    )


class _Unpicklable:
    """This rank's object failed to pickle: its header says so (size -1), so every rank raises
    after the header exchange instead of the others waiting out the timeout for a rank that
    raised before it, with the group still in step."""

    def __init__(self, error: Exception):
        self.error = error


def _encode(obj: Any, device: torch.device):
    try:
        data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:  # noqa: BLE001 - pickling raises many types; re-raised after the headers
        return _Unpicklable(exc)
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def _size(payload) -> int:
    return -1 if isinstance(payload, _Unpicklable) else payload.numel()


def _padded(payload: torch.Tensor, width: int) -> torch.Tensor:
    """``payload`` zero-padded to ``width`` bytes (itself when it is the widest: no copy of
    what may be a whole optimizer shard)."""
    if payload.numel() == width:
        return payload
    out = torch.zeros(width, dtype=torch.uint8, device=payload.device)
    out[: payload.numel()] = payload
    return out


def _decode_rows(flat: torch.Tensor, sizes: list[int]) -> list:
    rows = flat.view(len(sizes), -1).cpu()
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(sizes)]
