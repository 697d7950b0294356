"""Which elements of the flat parameter space each rank owns (ZeRO's bookkeeping).

Note [flat partition]
    Parameters of one dtype are laid out back to back in a flat space, cut into buckets; each
    bucket is padded to a multiple of ``world_size * SHARD_ALIGN`` elements and rank ``r`` owns
    the ``r``-th equal slice of every bucket (``Bucket.shard``). With a fusedist DDP model the
    buckets *are* DDP's gradient buckets, so a bucket's reduce-scatter output is exactly the
    rank's gradient slice of it; without DDP an equivalent layout is built here.

    A rank's *flat shard* of a dtype is the concatenation of its slices of that dtype's buckets,
    in bucket order. Master weights, optimizer state and sharded gradients are flat tensors
    over it. Each parameter intersects a rank's shard in at most one contiguous element range
    (a parameter lies inside one bucket) -- a :class:`ShardEntry`. The inner optimizer sees
    *pieces*: maximal runs of the flat shard whose parameters share a param group (padding is
    absorbed into a neighbouring run), so with one param group it steps one flat tensor per
    dtype and hyperparameters of several groups are still honoured.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..ddp.layout import SHARD_ALIGN, Bucket


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def bucketize(params: Sequence[torch.Tensor], names: Sequence[str], *, cap_bytes: int, world_size: int) -> list:
    """Buckets for parameters that are not in a fusedist DDP model: per dtype, in reverse
    order (the order gradients are produced in, as DDP assumes), each bucket at most
    ``cap_bytes`` (a larger parameter gets its own) and padded like DDP's."""
    pad_to = world_size * SHARD_ALIGN
    buckets: list[Bucket] = []
    sizes: dict[torch.dtype, int] = {}
    open_: dict[torch.dtype, dict] = {}

    def close(dtype):
        b = open_.pop(dtype)
        start = sizes.get(dtype, 0)
        offsets, cursor = [], start
        for p in b["params"]:
            offsets.append(cursor)
            cursor += p.numel()
        end = start + _round_up(max(cursor - start, 1), pad_to)
        sizes[dtype] = end
        buckets.append(Bucket(len(buckets), dtype, start, end, b["params"], b["names"], offsets))

    for p, name in zip(reversed(list(params)), reversed(list(names))):
        b = open_.get(p.dtype)
        nbytes = p.numel() * p.element_size()
        if b is not None and b["bytes"] + nbytes > cap_bytes:
            close(p.dtype)
            b = None
        if b is None:
            b = open_[p.dtype] = {"params": [], "names": [], "bytes": 0}
        b["params"].append(p)
        b["names"].append(name)
        b["bytes"] += nbytes
    for dtype in list(open_):
        close(dtype)
    return buckets


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """The part ``[lo, hi)`` of flattened parameter ``index`` that this rank owns, stored at
    ``[pos, pos + hi - lo)`` of its flat shard of ``dtype``."""

    index: int
    group: int
    dtype: torch.dtype
    lo: int
    hi: int
    pos: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclasses.dataclass(frozen=True)
class Piece:
    """Range ``[start, end)`` of the flat shard of ``dtype`` stepped with param group ``group``."""

    dtype: torch.dtype
    group: int
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class BucketShard:
    """Where this rank's slice of a bucket lives: ``[start + lo, start + hi)`` in the flat
    parameter/gradient space, ``[pos, pos + hi - lo)`` in the flat shard."""

    bucket: Bucket
    lo: int
    hi: int
    pos: int


class FlatPartition:
    """The rank's view of the flat partition (Note [flat partition])."""

    def __init__(self, buckets: Sequence[Bucket], params: Sequence[torch.Tensor], group_of: Sequence[int],
                 rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.buckets = list(buckets)
        index_of = {p: i for i, p in enumerate(params)}
        self.sizes: dict[torch.dtype, int] = {}
        self.shard_numel: dict[torch.dtype, int] = {}
        self.bucket_shards: list[BucketShard] = []
        self.entries: list[ShardEntry] = []
        self.offset_of: dict[int, int] = {}  # param index -> offset in the flat space
        for bucket in self.buckets:
            if bucket.numel % (world_size * SHARD_ALIGN):
                raise ValueError(
                    f"ZeroRedundancyOptimizer: bucket {bucket.index} has {bucket.numel} elements, not a "
                    f"multiple of world_size * {SHARD_ALIGN}; it was built for another world size"
                )
            lo, hi = bucket.shard(rank, world_size)
            pos = self.shard_numel.get(bucket.dtype, 0)
            self.bucket_shards.append(BucketShard(bucket, lo, hi, pos))
            self.shard_numel[bucket.dtype] = pos + hi - lo
            self.sizes[bucket.dtype] = max(self.sizes.get(bucket.dtype, 0), bucket.end)
            first, last = bucket.start + lo, bucket.start + hi
            for p, off in zip(bucket.params, bucket.offsets):
                index = index_of[p]
                self.offset_of[index] = off
                s, e = max(off, first), min(off + p.numel(), last)
                if s < e:
                    self.entries.append(ShardEntry(index, group_of[index], p.dtype, s - off, e - off, pos + s - first))
        missing = [i for i in range(len(params)) if i not in self.offset_of]
        if missing:
            raise ValueError(f"ZeroRedundancyOptimizer: parameters {missing[:10]} are in no bucket")
        self.entries.sort(key=lambda e: (str(e.dtype), e.pos))
        self.pieces = self._pieces()

    def _pieces(self) -> list[Piece]:
        pieces = []
        for dtype, total in self.shard_numel.items():
            runs: list[list] = []  # [group, start]
            for e in self.entries:
                if e.dtype != dtype:
                    continue
                if not runs:
                    runs.append([e.group, 0])  # leading padding joins the first run
                elif runs[-1][0] != e.group:
                    runs.append([e.group, e.pos])
            if not runs:
                runs.append([0, 0])  # a shard of padding only
            for k, (group, start) in enumerate(runs):
                end = runs[k + 1][1] if k + 1 < len(runs) else total
                pieces.append(Piece(dtype, group, start, end))
        return pieces

    def piece_of(self, entry: ShardEntry) -> Piece:
        for piece in self.pieces:
            if piece.dtype == entry.dtype and piece.start <= entry.pos < piece.end:
                return piece
        raise AssertionError("every shard entry lies in a piece")

    def padding_elements(self) -> int:
        """Elements of this rank's flat shards that belong to no parameter."""
        return sum(self.shard_numel.values()) - sum(e.numel for e in self.entries)


class FlatParams:
    """One flat tensor per dtype holding the parameters at their flat-space offsets.

    Parameters are re-pointed into it (``p.data`` becomes a view), so the updated shards can
    be all-gathered in place, straight into the parameters every rank computes with. Values
    are unchanged; user code keeps using the same ``Parameter`` objects.
    """

    def __init__(self, partition: FlatPartition, params: Sequence[torch.Tensor], device: torch.device):
        self.buffers = {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in partition.sizes.items()}
        with torch.no_grad():
            for index, p in enumerate(params):
                off = partition.offset_of[index]
                flat = self.buffers[p.dtype][off:off + p.numel()]
                flat.copy_(p.detach().reshape(-1))
                p.data = flat.view(p.shape)

    def shard_view(self, bs: BucketShard) -> torch.Tensor:
        b = bs.bucket
        return self.buffers[b.dtype][b.start + bs.lo:b.start + bs.hi]

    def bucket_view(self, bs: BucketShard) -> torch.Tensor:
        b = bs.bucket
        return self.buffers[b.dtype][b.start:b.end]
