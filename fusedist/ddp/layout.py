"""Flat gradient buffers and their partition into buckets.

One contiguous buffer per gradient dtype; each bucket is a contiguous range of it, and each
parameter's gradient is a view into its bucket. Buckets are numbered in the order they are
expected to become ready in backward (that is also the order they are launched in, on every
rank). Each bucket is padded to a multiple of ``world_size * SHARD_ALIGN`` elements so it can
be reduce-scattered into equal, aligned shards (ZeRO stage 2).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

#: Shard starts are aligned to this many elements (64 bytes of fp32): aligned vector loads.
SHARD_ALIGN = 16


@dataclasses.dataclass(eq=False)
class Bucket:
    """A contiguous range ``[start, end)`` of the ``dtype`` gradient buffer."""

    index: int
    dtype: torch.dtype
    start: int
    end: int
    params: list
    names: list
    offsets: list  # each param's offset in the dtype buffer
    data: Optional[torch.Tensor] = None  # view buffer[start:end], set by GradLayout

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard(self, rank: int, world_size: int) -> tuple[int, int]:
        """``[lo, hi)`` offsets (relative to the bucket) of rank's reduce-scatter shard."""
        size = self.numel // world_size
        return rank * size, (rank + 1) * size


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    bucket: Bucket
    offset: int  # in the dtype buffer


class GradLayout:
    """Buffers, buckets, and each parameter's slot."""

    def __init__(self, buckets: Sequence[Bucket], sizes: dict, device: torch.device):
        self.buckets = list(buckets)
        self.buffers = {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        self.slots: dict[torch.nn.Parameter, ParamSlot] = {}
        for bucket in self.buckets:
            bucket.data = self.buffers[bucket.dtype][bucket.start:bucket.end]
            for p, off in zip(bucket.params, bucket.offsets):
                self.slots[p] = ParamSlot(bucket, off)

    def grad_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        slot = self.slots[param]
        return self.buffers[slot.bucket.dtype][slot.offset:slot.offset + param.numel()].view(param.shape)

    def fingerprint(self) -> list[tuple]:
        """Bucket structure as plain data, for cross-rank comparison."""
        return [
            (b.index, str(b.dtype), b.numel, tuple(zip(b.names, (tuple(p.shape) for p in b.params))))
            for b in self.buckets
        ]


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def build_layout(
    params: Sequence[torch.nn.Parameter],
    names: Sequence[str],
    *,
    bucket_cap_bytes: int,
    first_bucket_cap_bytes: int,
    world_size: int,
    device: torch.device,
) -> GradLayout:
    """Assign ``params`` (in expected readiness order) to buckets, per dtype.

    A bucket closes when adding the next parameter would exceed its cap (the first bucket of
    each dtype uses ``first_bucket_cap_bytes``); a parameter larger than the cap gets a bucket
    of its own.
    """
    pad_to = world_size * SHARD_ALIGN
    open_buckets: dict[torch.dtype, dict] = {}
    closed: list[dict] = []
    caps_used: dict[torch.dtype, int] = {}

    def close(dtype):
        b = open_buckets.pop(dtype)
        closed.append(b)
        caps_used[dtype] = caps_used.get(dtype, 0) + 1

    order = 0
    for p, name in zip(params, names):
        dtype = p.dtype
        cap = first_bucket_cap_bytes if caps_used.get(dtype, 0) == 0 else bucket_cap_bytes
        b = open_buckets.get(dtype)
        nbytes = p.numel() * p.element_size()
        if b is not None and b["bytes"] + nbytes > cap:
            close(dtype)
            b = None
        if b is None:
            b = open_buckets[dtype] = {"dtype": dtype, "params": [], "names": [], "bytes": 0, "order": order}
            order += 1
        b["params"].append(p)
        b["names"].append(name)
        b["bytes"] += nbytes
    for dtype in list(open_buckets):
        close(dtype)
    closed.sort(key=lambda b: b["order"])

    sizes: dict[torch.dtype, int] = {}
    buckets = []
    for index, b in enumerate(closed):
        start = sizes.get(b["dtype"], 0)
        offsets, cursor = [], start
        for p in b["params"]:
            offsets.append(cursor)
            cursor += p.numel()
        end = start + _round_up(max(cursor - start, 1), pad_to)
        sizes[b["dtype"]] = end
        buckets.append(Bucket(index, b["dtype"], start, end, b["params"], b["names"], offsets))
    return GradLayout(buckets, sizes, device)
