"""Where this rank's master and gradient shards live: own tensors, or the storage that already
holds the values.

Note [shards aliasing the parameters and gradients]
    A rank's *flat shard* of a dtype (Note [flat partition] in ``partition.py``) is the
    concatenation of its slices of that dtype's buckets. Two of the tensors over it can be
    storage that exists anyway instead of copies:

    * Masters. With bf16/fp16 parameters they are an FP32 copy: the updates need the
      precision. With fp32 (or fp64) parameters a copy would hold exactly the values the
      parameters hold: the rank's slice of each bucket in the flat parameter buffer
      (``FlatParams``) *is* its master shard. So the inner optimizer updates the parameters'
      own slices in place and the all-gather starts from them (torch's
      ZeroRedundancyOptimizer steps its parameters too). Writes through these views bump the
      flat buffer's version counter, not the parameters' (Note [parameters changed outside
      the optimizer] in ``shards.py`` still tells the program's writes from the optimizer's).
    * Stage 1 gradients. DDP all-reduces whole buckets, so after backward the rank's slice of
      each averaged bucket is its gradient shard, in the parameters' dtype; for fp32 (or fp64)
      parameters it is exactly what the inner optimizer steps with. A parameter whose
      ``p.grad`` is not its bucket view (gradient views off, or a gradient set by hand) has its
      slice copied into its slot at the step, so the slot holds what ``p.grad`` holds, as the
      copy did. The step never writes gradients (a fused inner optimizer applies the scale and
      clip inline; any other is handed scaled copies for the step), so ``p.grad`` stays as
      backward left it.

    Each saves 4 bytes per shard element for fp32 parameters. The flat shard is then not one
    tensor but one view per bucket, so pieces never cross a bucket's slice (``FlatPartition``
    cuts them there) and every range the optimizer asks for lies inside one. Offloaded masters
    and gradients live in host memory and are always copies, as are stage 2's gradient shards
    (the reduce-scatter's output) and the gradients of a ZeRO optimizer without fusedist DDP.
"""

from __future__ import annotations

import bisect
from typing import Callable

import torch

from .partition import BucketShard, FlatPartition


class ShardStore:
    """Ranges of a rank's flat shards by position (``[start, end)`` of a dtype's shard): slices
    of an own tensor per dtype, or, for the other dtypes, of per-bucket views ``view_of(bs)``
    (Note [shards aliasing the parameters and gradients])."""

    def __init__(self, partition: FlatPartition, view_of: Callable[[BucketShard], torch.Tensor], own: dict):
        self.own = own  # dtype -> flat tensor over the rank's shard (copies)
        self.view_of = view_of
        self._shards: dict[torch.dtype, list] = {}  # the bucket shards of each dtype, by position
        for bs in partition.bucket_shards:
            self._shards.setdefault(bs.bucket.dtype, []).append(bs)
        self._starts = {dt: [bs.pos for bs in shards] for dt, shards in self._shards.items()}

    def aliases(self, dtype: torch.dtype) -> bool:
        """Whether ``dtype``'s ranges are views of the per-bucket storage (no copy)."""
        return dtype in self._shards and dtype not in self.own

    def _bucket_shard(self, dtype: torch.dtype, start: int, end: int) -> BucketShard:
        """The bucket shard whose slice holds the range ``[start, end)`` of the ``dtype`` shard."""
        bs = self._shards[dtype][bisect.bisect_right(self._starts[dtype], start) - 1]
        if not bs.pos <= start <= end <= bs.pos + bs.hi - bs.lo:
            raise AssertionError(f"range [{start}, {end}) of the {dtype} shard crosses a bucket's slice")
        return bs

    def slice(self, dtype: torch.dtype, start: int, end: int) -> torch.Tensor:
        """The range ``[start, end)`` of the rank's ``dtype`` shard (a view)."""
        own = self.own.get(dtype)
        if own is not None:
            return own[start:end]
        bs = self._bucket_shard(dtype, start, end)
        return self.view_of(bs)[start - bs.pos:end - bs.pos]

    def own_bytes(self) -> int:
        """Bytes of the copies (aliased ranges are memory that exists anyway)."""
        return sum(t.numel() * t.element_size() for t in self.own.values())

    @torch.no_grad()
    def copy_own_from_views(self, bucket_shards) -> None:
        """Copy the per-bucket values of ``bucket_shards`` into the own tensors (aliased ranges
        already are them)."""
        for bs in bucket_shards:
            own = self.own.get(bs.bucket.dtype)
            if own is not None:
                own[bs.pos:bs.pos + bs.hi - bs.lo].copy_(self.view_of(bs))

    @torch.no_grad()
    def copy_own_from_view_ranges(self, ranges) -> None:
        """Copy the per-bucket values of the shard ranges ``(dtype, start, end)`` (each inside
        one bucket's slice) into the own tensors; aliased ranges already are them. Ranges that
        abut in one bucket's slice are copied as one."""
        runs: list[list] = []  # [dtype, bucket shard, start, end]
        for dtype, start, end in sorted(ranges, key=lambda r: (str(r[0]), r[1])):
            if dtype not in self.own or start >= end:
                continue
            bs = self._bucket_shard(dtype, start, end)
            if runs and runs[-1][1] is bs and runs[-1][3] == start:
                runs[-1][3] = end
            else:
                runs.append([dtype, bs, start, end])
        for dtype, bs, start, end in runs:
            self.own[dtype][start:end].copy_(self.view_of(bs)[start - bs.pos:end - bs.pos])

    @torch.no_grad()
    def copy_own_to_views(self, bucket_shards) -> None:
        """Write the own tensors into the per-bucket storage of ``bucket_shards``."""
        for bs in bucket_shards:
            own = self.own.get(bs.bucket.dtype)
            if own is not None:
                self.view_of(bs).copy_(own[bs.pos:bs.pos + bs.hi - bs.lo])


def own_tensors(partition: FlatPartition, dtypes, master_dtype, device, alloc=torch.empty) -> dict:
    """Own flat shards (in the master dtype) for the ``dtypes`` of ``partition``."""
    return {dt: alloc(n, dtype=master_dtype(dt), device=device)
            for dt, n in partition.shard_numel.items() if dt in dtypes}


def bucket_grad_slice(bs: BucketShard) -> torch.Tensor:
    """The rank's slice of a DDP bucket's averaged gradients (flat bucket storage)."""
    return bs.bucket.data[bs.lo:bs.hi]
