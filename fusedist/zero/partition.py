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
    *pieces*: maximal runs of one bucket's slice whose parameters share a param group (padding
    is absorbed into the run before it), so with one param group it steps one tensor per bucket
    and hyperparameters of several groups are still honoured. Pieces stop at bucket slices
    because masters and gradients may be the parameters' and DDP's own slices of the buckets
    (Note [shards aliasing the parameters and gradients] in ``shard_store.py``), which are not
    contiguous with each other.

    Parameters created with ``requires_grad=False`` (frozen) are in no bucket and own no
    elements: they are never sharded, stepped or given state.

Note [piece splitting]
    torch optimizers skip a parameter whose gradient is None: its value, its moments and its
    step count stay as they are. A piece is stepped as one tensor with one step count, so when
    some of its parameters have no gradient in a step, the piece is split at their boundaries
    first and the pieces holding only such parameters get ``grad=None`` for that step (the
    inner optimizer then skips them, as torch does). Splitting slices the piece's elementwise
    state and copies its scalar state (``step``); pieces never merge again, so a parameter's
    step count can differ from its neighbours' from then on. Splits happen only when needed:
    with every parameter receiving a gradient, a group's pieces stay one tensor per bucket.

    Cuts are placed at the start of each entry's *owned range*: ``[entry.pos, next entry's
    pos)``, the first entry of a dtype starting at 0, so padding stays with the parameter
    before it and a split never cuts a parameter. A rank's slice of a bucket that is all
    padding (the bucket's parameters end before it) is a piece of its own, owned by no entry:
    it holds zeros and is always stepped (it stays zero).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Optional, Sequence

import torch

from .._wrapper import wrapped_name
from ..ddp.layout import SHARD_ALIGN, Bucket, _round_up, shaped_like


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


@dataclasses.dataclass(eq=False)
class BucketShard:
    """Where this rank's slice of a bucket lives: ``[start + lo, start + hi)`` in the flat
    parameter/gradient space, ``[pos, pos + hi - lo)`` in the flat shard. ``bucket`` alone
    changes, to the same bucket of a newer DDP wrapper (:meth:`FlatPartition.follow_buckets`)."""

    bucket: Bucket
    lo: int
    hi: int
    pos: int


class FlatPartition:
    """The rank's view of the flat partition (Note [flat partition])."""

    def __init__(self, buckets: Sequence[Bucket], params: Sequence[torch.Tensor], group_of: Sequence[int],
                 rank: int, world_size: int, sharded: Optional[Sequence[int]] = None):
        """``params`` are all the optimizer's parameters (their indices are the state dicts'
        indices); ``sharded`` the indices that must lie in a bucket (default: all), the
        others (frozen parameters) own no elements."""
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
        expected = range(len(params)) if sharded is None else sharded
        missing = [i for i in expected if i not in self.offset_of]
        if missing:
            raise ValueError(f"ZeroRedundancyOptimizer: parameters {missing[:10]} are in no bucket")
        self.entries.sort(key=lambda e: (str(e.dtype), e.pos))
        self.entry_of: dict[int, ShardEntry] = {e.index: e for e in self.entries}
        self.owned_start: dict[int, int] = {}  # Note [piece splitting]
        seen: set = set()
        for e in self.entries:
            self.owned_start[e.index] = e.pos if e.dtype in seen else 0
            seen.add(e.dtype)
        self.owned_end: dict[int, int] = {}
        for e, nxt in zip(self.entries, self.entries[1:] + [None]):
            same = nxt is not None and nxt.dtype == e.dtype
            self.owned_end[e.index] = nxt.pos if same else self.shard_numel[e.dtype]
        self.pieces = self._pieces()
        self._index_pieces()

    def _pieces(self) -> list[Piece]:
        return self._pieces_of(self.bucket_shards)

    def _pieces_of(self, bucket_shards: Sequence[BucketShard]) -> list[Piece]:
        """Pieces tiling ``bucket_shards``: a new piece at each bucket shard's start (a piece
        is then one view of the per-bucket storage: Note [shards aliasing the parameters and
        gradients] in ``shard_store.py``) and where the param group changes."""
        pieces = []
        for bs in bucket_shards:
            dtype, end = bs.bucket.dtype, bs.pos + bs.hi - bs.lo
            if end == bs.pos:
                continue
            inside = [e for e in self.entries if e.dtype == dtype and bs.pos <= e.pos < end]
            group = inside[0].group if inside else (pieces[-1].group if pieces else 0)  # padding only: any group
            runs = [[group, bs.pos]]
            for e in inside[1:]:
                if e.group != runs[-1][0]:
                    runs.append([e.group, e.pos])
            for k, (group, start) in enumerate(runs):
                pieces.append(Piece(dtype, group, start, runs[k + 1][1] if k + 1 < len(runs) else end))
        return pieces

    def _index_pieces(self) -> None:
        self._starts: dict[torch.dtype, list[int]] = {}
        self._slots: dict[torch.dtype, list[int]] = {}
        order = sorted(range(len(self.pieces)), key=lambda k: (str(self.pieces[k].dtype), self.pieces[k].start))
        for k in order:
            piece = self.pieces[k]
            self._starts.setdefault(piece.dtype, []).append(piece.start)
            self._slots.setdefault(piece.dtype, []).append(k)

    def piece_index(self, entry: ShardEntry) -> int:
        """Index in :attr:`pieces` of the piece holding ``entry``."""
        starts = self._starts.get(entry.dtype, [])
        j = bisect.bisect_right(starts, entry.pos) - 1
        if j < 0:
            raise AssertionError("every shard entry lies in a piece")
        k = self._slots[entry.dtype][j]
        assert self.pieces[k].start <= entry.pos < self.pieces[k].end
        return k

    def piece_of(self, entry: ShardEntry) -> Piece:
        return self.pieces[self.piece_index(entry)]

    def cuts_around(self, indices: Iterable[int]) -> dict:
        """Shard positions to cut at so that the parameters ``indices`` (those this rank owns
        elements of) are separated from the others (Note [piece splitting])."""
        cuts: dict[torch.dtype, set] = {}
        for index in indices:
            e = self.entry_of.get(index)
            if e is not None:
                cuts.setdefault(e.dtype, set()).update((self.owned_start[index], self.owned_end[index]))
        return cuts

    def split(self, cuts: dict) -> dict[int, list[Piece]]:
        """Cut pieces at the positions ``cuts[dtype]`` that fall strictly inside them.
        Returns ``{old piece index: its replacement pieces, in order}`` for the pieces that
        were cut; :attr:`pieces` keeps its order with each cut piece replaced in place."""
        replaced: dict[int, list[Piece]] = {}
        pieces: list[Piece] = []
        for k, piece in enumerate(self.pieces):
            inside = sorted(c for c in cuts.get(piece.dtype, ()) if piece.start < c < piece.end)
            if not inside:
                pieces.append(piece)
                continue
            bounds = [piece.start, *inside, piece.end]
            subs = [Piece(piece.dtype, piece.group, a, b) for a, b in zip(bounds, bounds[1:])]
            replaced[k] = subs
            pieces.extend(subs)
        if replaced:
            self.pieces = pieces
            self._index_pieces()
        return replaced

    def keep_pieces_of(self, old: "FlatPartition") -> None:
        """This partition grew from ``old`` by appended buckets (Note [growing the partition] in
        ``grow.py``): keep ``old``'s pieces, splits included, and add pieces for the new slices
        of each dtype. Owned ranges end at the old shard's end, so later cuts never join the
        two regions."""
        for dtype in self.shard_numel:
            barrier = old.shard_numel.get(dtype, 0)
            fresh = [e for e in self.entries if e.dtype == dtype and e.pos >= barrier]
            for e in self.entries:
                if e.dtype == dtype and e.pos < barrier:
                    self.owned_end[e.index] = min(self.owned_end[e.index], barrier)
            if fresh:
                self.owned_start[fresh[0].index] = barrier
        pieces = list(old.pieces) + self._pieces_of(self.bucket_shards[len(old.bucket_shards):])
        self.pieces = pieces
        self._index_pieces()

    def follow_buckets(self, buckets: Sequence[Bucket]) -> bool:
        """Refer to ``buckets`` -- the same ranges of the same parameters, held by a newer DDP
        wrapper that took this partition's buckets over (Note [an optimizer over a module wrapped
        again] in ``fusedist/ddp/succession.py``) -- instead of the retired wrapper's, whose
        gradient storage they would keep alive. Returns whether any bucket changed."""
        changed = False
        for k, (bs, bucket) in enumerate(zip(self.bucket_shards, buckets)):
            if bs.bucket is bucket:
                continue
            old = bs.bucket
            if (old.dtype, old.start, old.end, old.numel) != (bucket.dtype, bucket.start, bucket.end, bucket.numel):
                raise AssertionError(f"bucket {k} of the followed DDP model is not the partition's bucket {k}")
            bs.bucket = bucket
            self.buckets[k] = bucket
            changed = True
        return changed

    def padding_elements(self) -> int:
        """Elements of this rank's flat shards that belong to no parameter."""
        return sum(self.shard_numel.values()) - sum(e.numel for e in self.entries)


class FlatParams:
    """One flat tensor per dtype holding the parameters at their flat-space offsets.

    Parameters are re-pointed into it (``p.data`` becomes a view), so the updated shards can
    be all-gathered in place, straight into the parameters every rank computes with. Values
    and memory formats are unchanged (a channels_last weight stays channels_last: its slot
    holds it in memory order, as DDP's gradient slot does, ``shaped_like``); user code keeps
    using the same ``Parameter`` objects. A wrapper subclass (torchao's float8 training
    weight, ``fusedist/_wrapper.py``) has its wrapped tensor re-pointed: setting its ``.data``
    would leave the tensor its ops read stale, and every step after the first would compute
    with the initial weights.
    """

    def __init__(self, partition: FlatPartition, params: Sequence[torch.Tensor], device: torch.device):
        self.buffers = {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in partition.sizes.items()}
        # (parameter index, its slot as the parameter sees it, the slot's data_ptr)
        self._slots: list[tuple[int, torch.Tensor, int]] = []
        with torch.no_grad():
            for index, off in partition.offset_of.items():
                p = params[index]
                view = shaped_like(self.buffers[p.dtype][off:off + p.numel()], p)
                view.copy_(p.detach())
                _point_at(p, view)
                if view.numel():
                    self._slots.append((index, view, view.data_ptr()))

    @torch.no_grad()
    def take_up_moved(self, params: Sequence[torch.Tensor], describe) -> list:
        """Copy each parameter whose storage is no longer its slot into the slot and point it
        back there; returns their indices (Note [parameters moved off the flat buffer] in
        ``shards.py``). One data_ptr comparison per parameter when nothing moved."""
        moved = []
        for index, view, ptr in self._slots:
            p = params[index]
            inner = wrapped_name(p)
            t = p if inner is None else getattr(p, inner)
            if t.data_ptr() == ptr:
                continue
            if t.shape != view.shape or t.dtype != view.dtype:
                raise RuntimeError(
                    f"ZeroRedundancyOptimizer: {describe(index)} was replaced between steps by a tensor of shape "
                    f"{tuple(t.shape)} {t.dtype} (e.g. by p.set_() or p.data = ...); its shard was built for "
                    f"shape {tuple(view.shape)} {view.dtype}. Replace a parameter only by values of its own "
                    "shape and dtype, or build the optimizer after changing the model")
            view.copy_(t.detach())
            _point_at(p, view)
            moved.append(index)
        return moved

    def shard_view(self, bs: BucketShard) -> torch.Tensor:
        b = bs.bucket
        return self.buffers[b.dtype][b.start + bs.lo:b.start + bs.hi]

    def bucket_view(self, bs: BucketShard) -> torch.Tensor:
        b = bs.bucket
        return self.buffers[b.dtype][b.start:b.end]


def _point_at(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``p`` compute with ``view``: a wrapper subclass through its wrapped tensor
    (:class:`FlatParams`), any other parameter through ``p.data``."""
    inner = wrapped_name(p)
    if inner is not None:
        setattr(p, inner, view)
    else:
        p.data = view
