"""This rank's master shards: the values a ZeroRedundancyOptimizer's inner optimizer steps.

Note [masters aliasing the parameters]
    With bf16/fp16 parameters the masters are an FP32 copy of the rank's shard: the updates
    need the precision. With fp32 (or fp64) parameters a copy would hold exactly the values the
    parameters already hold: the rank's slice of each bucket in the flat parameter buffer
    (``FlatParams``) *is* its master shard. So for those dtypes the masters are views of that
    buffer: the inner optimizer updates the parameters' own slices in place, the all-gather
    starts from them, and the 4 bytes per element of the shard a copy would cost are saved
    (torch's ZeroRedundancyOptimizer steps its parameters directly too). A rank's shard of a
    dtype is then not one tensor but one view per bucket, so pieces never cross a bucket's
    slice (``FlatPartition`` cuts them there) and every master range the optimizer asks for
    lies inside one. Writes through these views bump the flat buffer's version counter, not
    the parameters' (Note [parameters changed outside the optimizer] in ``shards.py`` still
    tells the program's writes from the optimizer's). Offloaded masters live in host memory
    and are always copies.
"""

from __future__ import annotations

import bisect
from typing import Optional

import torch

from .partition import FlatParams, FlatPartition


class MasterShards:
    """Master ranges by flat-shard position (``[start, end)`` of a dtype's shard): slices of
    an own tensor per dtype, or views of the flat parameter buffer for the dtypes that alias
    it (Note [masters aliasing the parameters])."""

    def __init__(self, partition: FlatPartition, flat_params: Optional[FlatParams], own: dict):
        self.own = own  # dtype -> flat tensor over the rank's shard (copies)
        self.flat_params = flat_params
        self._shards: dict[torch.dtype, list] = {}
        for bs in partition.bucket_shards:
            if bs.bucket.dtype not in own:
                self._shards.setdefault(bs.bucket.dtype, []).append(bs)
        self._starts = {dt: [bs.pos for bs in shards] for dt, shards in self._shards.items()}

    @classmethod
    def build(cls, partition: FlatPartition, flat_params: FlatParams, master_dtype, device) -> "MasterShards":
        """Masters for ``partition`` kept on ``device``: views of ``flat_params`` where the
        master dtype is the parameters' dtype, else own (uninitialized) tensors."""
        own = {dt: torch.empty(n, dtype=master_dtype(dt), device=device)
               for dt, n in partition.shard_numel.items() if master_dtype(dt) != dt}
        return cls(partition, flat_params, own)

    def aliases(self, dtype: torch.dtype) -> bool:
        """Whether the masters of ``dtype`` are the parameters themselves."""
        return dtype in self._shards

    def slice(self, dtype: torch.dtype, start: int, end: int) -> torch.Tensor:
        """The masters at ``[start, end)`` of the rank's ``dtype`` shard (a view)."""
        own = self.own.get(dtype)
        if own is not None:
            return own[start:end]
        shards = self._shards[dtype]
        bs = shards[bisect.bisect_right(self._starts[dtype], start) - 1]
        if not bs.pos <= start <= end <= bs.pos + bs.hi - bs.lo:
            raise AssertionError(f"master range [{start}, {end}) of {dtype} crosses a bucket's slice")
        view = self.flat_params.shard_view(bs)
        return view[start - bs.pos:end - bs.pos]

    def own_bytes(self) -> int:
        """Bytes of master copies (the aliased masters are the parameters' own memory)."""
        return sum(t.numel() * t.element_size() for t in self.own.values())

    @torch.no_grad()
    def copy_from_params(self, partition: FlatPartition) -> None:
        """Copy the parameters' values into the master copies (aliased masters already are them)."""
        for bs in partition.bucket_shards:
            own = self.own.get(bs.bucket.dtype)
            if own is not None:
                own[bs.pos:bs.pos + bs.hi - bs.lo].copy_(self.flat_params.shard_view(bs))

    @torch.no_grad()
    def copy_to_params(self, partition: FlatPartition) -> None:
        """Write the master copies into the parameters' slices (before the all-gathers)."""
        for bs in partition.bucket_shards:
            own = self.own.get(bs.bucket.dtype)
            if own is not None:
                self.flat_params.shard_view(bs).copy_(own[bs.pos:bs.pos + bs.hi - bs.lo])
