"""Per-step cross-rank agreement check of DDP: one tiny all-reduce per synchronized backward.

Note [step check]
    Bucket collectives pair up by issue order, not by meaning: if rank 1 skips a backward,
    its next step's buckets silently average with rank 0's current ones, and the run only
    fails (or hangs) at the very end, far from the cause. So at the end of every synchronized
    backward, after the last bucket was launched (the same position in the collective order
    on every rank), each rank contributes a few integers describing where it is:

        sync_step        synchronized backwards completed before this one
        forward          training forwards (grad enabled) so far, this step's included
        backward         all backwards (no_sync ones included)
        optimizer_steps  optimizer steps taken on this model's parameters
        layout           CRC of the gradient bucket layout
        collective_seq   sequence number of this step's last bucket collective
        unused           parameters without a gradient (0 with find_unused_parameters)

    The vector ``[v, -v]`` is all-reduced with MAX, giving every rank ``max(v)`` and
    ``min(v)`` exactly (int64), so every rank reaches the same verdict -- agreement iff
    max == min -- and on disagreement all of them take the same extra step: an all-gather of
    the vectors, then the same :class:`RankMismatchError` naming the ranks and values.
    Nothing here touches the gradients, so the numerics of the default path are unchanged.

    On CUDA the verdict of step N is read at step N+1 (from a pinned host copy recorded
    behind an event), so the check never adds a host synchronization to a step.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from .._consistency import RankMismatchError
from ..comm import Communicator

FIELDS = ("sync_step", "forward", "backward", "optimizer_steps", "layout", "collective_seq", "unused")

_EXPLAIN = {
    "sync_step": "a rank skipped (or added) a synchronized backward pass, so bucket averages "
    "mixed gradients of different steps",
    "forward": "ranks ran a different number of training forward passes (e.g. a rank computed a loss "
    "and skipped its backward/step, or ran an extra forward)",
    "backward": "ranks ran a different number of backward passes (e.g. one more micro-batch under no_sync())",
    "optimizer_steps": "optimizer.step() was called on a different iteration on some ranks",
    "layout": "the gradient bucket layouts differ",
    "collective_seq": "ranks issued a different number of fusedist collectives before this step "
    "(a collective inside rank-dependent code)",
    "unused": "a different set of parameters received gradients: a different branch of the model ran on some "
    "ranks (pass find_unused_parameters=True if that is intended)",
}


def layout_crc(layout) -> int:
    """A rank-independent 31-bit digest of a layout's fingerprint (Python's hash() is salted)."""
    return zlib.crc32(repr(layout.fingerprint()).encode()) & 0x7FFFFFFF


class StepCheck:
    """Launch/finish pair for the check of one DDP reducer (see Note [step check])."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.k = len(FIELDS)
        self.buf = torch.zeros(2 * self.k, dtype=torch.int64, device=comm.device)
        self.deferred = comm.device.type == "cuda"
        self._pending: Optional[tuple] = None  # CUDA: (host copy, event, values, detail) of the last step

    def launch(self, values: list[int]):
        """Start the check (async); returns the token for :meth:`finish`."""
        if self.deferred and self._pending is not None:
            # Read last step's verdict first: its all-reduce finished long ago.
            host, event, old_values, detail = self._pending
            self._pending = None
            event.synchronize()
            self._verdict(host.tolist(), old_values, detail)
        local = torch.tensor(values + [-v for v in values], dtype=torch.int64)
        if self.deferred:  # pinned + non_blocking: a pageable copy would synchronize the host
            local = local.pin_memory()
        self.buf.copy_(local, non_blocking=self.deferred)
        handle = self.comm.all_reduce(self.buf, op="max", async_op=True, tag="ddp step check")
        return handle, values

    def finish(self, token, detail: dict) -> None:
        """Wait for the check and raise :class:`RankMismatchError` on every rank if it failed."""
        handle, values = token
        handle.wait()
        if self.deferred:
            host = torch.empty_like(self.buf, device="cpu").pin_memory()
            host.copy_(self.buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (host, event, values, detail)
            return
        self._verdict(self.buf.tolist(), values, detail)

    def _verdict(self, reduced: list[int], values: list[int], detail: dict) -> None:
        k = self.k
        if all(reduced[i] == -reduced[k + i] for i in range(k)):
            return
        # Every rank saw the same max/min, so every rank is here: the all-gather pairs up.
        mine = torch.tensor(values, dtype=torch.int64, device=self.comm.device)
        everyone = torch.empty(self.comm.world_size * k, dtype=torch.int64, device=self.comm.device)
        self.comm.all_gather(everyone, mine, tag="ddp step check details")
        table = everyone.view(self.comm.world_size, k).tolist()
        raise RankMismatchError(render_mismatch(table, self.comm.rank, detail))


def render_mismatch(table: list[list[int]], rank: int, detail: dict) -> str:
    """The error text: each differing field, which ranks hold which value, and why it matters."""
    lines = [
        f"fusedist DDP: ranks diverged (detected on every rank; this is rank {rank}) at the end of "
        f"synchronized backward #{table[rank][0]}, after buckets 0..{detail.get('buckets', 0) - 1} of this "
        "step were already reduced:"
    ]
    for field_index, field in enumerate(FIELDS):
        groups: dict[int, list[int]] = {}
        for r, row in enumerate(table):
            groups.setdefault(row[field_index], []).append(r)
        if len(groups) == 1:
            continue
        listing = "; ".join(f"ranks {ranks}: {value}" for value, ranks in sorted(groups.items(), key=lambda kv: kv[1]))
        lines.append(f"  {field}: {listing} -- {_EXPLAIN[field]}")
    unused = detail.get("unused_names")
    if unused:
        lines.append(f"  parameters without a gradient on rank {rank}: {unused[:10]}{' ...' if len(unused) > 10 else ''}")
    lines.append(
        "Every rank must run the same sequence of forward/backward/optimizer.step() calls on its "
        "DistributedDataParallel model; look for rank-dependent control flow around the step named above."
    )
    return "\n".join(lines)
