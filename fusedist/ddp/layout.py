"""Gradient buffers and their partition into buckets.

One contiguous buffer per gradient dtype; each bucket is a contiguous range of it, and each
parameter's gradient is a view into its bucket. Buckets are numbered in the order they are
expected to become ready in backward (that is also the order they are launched in, on every
rank). Each bucket is padded to a multiple of ``world_size * SHARD_ALIGN`` elements so it can
be reduce-scattered into equal, aligned shards (ZeRO stage 2).

Note [bucket storage]
    Two ways to hold the buckets, same offsets and views either way:

    * flat (DDP's default): one buffer per dtype, allocated once; every bucket is a view of
      it and always allocated.
    * per bucket (ZeRO stage 2, :meth:`GradLayout.use_bucket_storage`): each bucket owns its
      tensor, allocated zeroed on demand (:meth:`GradLayout.allocate`, when the bucket's first
      gradient arrives) and dropped by :meth:`GradLayout.release` once its reduced shard has
      been stored, so a backward holds only the buckets between "first gradient arrived" and
      "reduce-scatter finished" -- a few buckets, not every gradient. Zeroed because padding
      and the slots of parameters without a gradient must read as zero in the collective.

    ``allocated_bytes`` / ``peak_bytes`` account the bucket storage (the full gradients) and
    the converted copies of buckets on the wire (:meth:`GradLayout.account`); the reducer resets
    the peak at the start of each backward and reports it in ``last_stats``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from .._memory_layout import is_dense, layout_of as memory_order

MiB = 1024 * 1024

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
    # The bucket's gradients: a view buffer[start:end] (flat storage), or the bucket's own
    # tensor, None while released (per-bucket storage). Set by GradLayout.
    data: Optional[torch.Tensor] = None
    # Note [division folded into the copy] (strategy.py), set per synchronized backward by the
    # reducer: the factor the gradient hooks multiply by while copying a fresh gradient into
    # this bucket (None: copy as is), and the views that got theirs another way.
    fold: Optional[float] = None
    unfolded: list = dataclasses.field(default_factory=list)
    # Each parameter's slot order, recorded when the bucket is cut (Note [slot order fixed at
    # bucketing]); filled from the parameters when not given.
    orders: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.orders:
            self.orders = [slot_record(p) for p in self.params]

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def copy_for(self, names: dict) -> "Bucket":
        """The same range and parameters, no storage, under ``names`` (parameter -> name): the
        bucket of a newer wrapper that takes this one over (Note [an optimizer over a module
        wrapped again] in succession.py)."""
        return dataclasses.replace(self, params=list(self.params), names=[names.get(p, n) for p, n in
                                                                           zip(self.params, self.names)],
                                   offsets=list(self.offsets), data=None, fold=None, unfolded=[],
                                   orders=list(self.orders))

    def shard(self, rank: int, world_size: int) -> tuple[int, int]:
        """``[lo, hi)`` offsets (relative to the bucket) of rank's reduce-scatter shard."""
        size = self.numel // world_size
        return rank * size, (rank + 1) * size


class ParamSlot:
    """Where a parameter's gradient lives: its bucket, its offset in the dtype buffer, and
    ``view``, its gradient view of the bucket's storage while that is allocated (else None).
    The view is cut once per allocation and handed out every time, so a gradient hook finds
    it with one attribute read (Note [per-parameter cost] in ``grad_hook.py``). ``ptr``: the
    address it was cut at; ``p.grad.data = t`` moves the view object off it (Note [gradients
    the user holds] in held_grads.py)."""

    __slots__ = ("bucket", "offset", "view", "ptr")

    def __init__(self, bucket: Bucket, offset: int):
        self.bucket = bucket
        self.offset = offset
        self.view: Optional[torch.Tensor] = None
        self.ptr = 0


def shaped_like(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``flat`` (a 1-D slot of ``param.numel()`` elements) seen with ``param``'s shape and, for
    a dense parameter, its strides: a channels_last weight gets a channels_last gradient (as
    torch's DDP and autograd give it), so optimizers walk both in one memory order. Everything
    that maps a parameter to a flat slot (gradient views, ZeRO's parameter storage) goes through
    here, so the slot's element order is the same everywhere."""
    if param.is_contiguous() or not is_dense(param):
        return flat.view(param.shape)
    return flat.as_strided(param.shape, param.stride())


def slot_record(param: torch.Tensor) -> tuple:
    """``param``'s shape and the strides its slot is seen with (None: row-major), as
    :func:`shaped_like` would cut it now: kept by the bucket so later views keep this order.

    Note [slot order fixed at bucketing]
        A slot's element order is what the ranks agreed on and what a consumer of the buckets
        built on (ZeRO's shards, its flat parameter storage): it must not change with the
        parameter. Replacing a parameter's storage by a tensor of other strides between steps
        (``p.set_(t.t())``, a parametrization's setter given a column-major Q) used to make
        per-bucket storage cut the next gradient views in the new order, so ZeRO stage 2 read
        that backward's gradient shard transposed. Views are cut with the recorded order
        instead (as torch's DDP keeps its bucket views from bucketing on); a gradient in
        another layout is copied into the view element by element."""
    if param.is_contiguous() or not is_dense(param):
        return tuple(param.shape), None
    return tuple(param.shape), tuple(param.stride())


def slot_view(flat: torch.Tensor, param: torch.Tensor, record: tuple) -> torch.Tensor:
    """``flat`` seen as ``param``'s gradient in the slot order ``record`` (:func:`slot_record`);
    a parameter since reshaped is cut as it is now."""
    shape, strides = record
    if tuple(param.shape) != shape:
        return shaped_like(flat, param)
    return flat.view(shape) if strides is None else flat.as_strided(shape, strides)


def alias_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory (storage, offset, shape, strides) that is not an autograd
    view of it: a gradient slot handed out as ``p.grad`` has no ``_base`` and takes ``detach_()``,
    as torch's default gradient tensors do (Note [gradients the user holds] in held_grads.py)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def slot_geometry(param: torch.Tensor, record: tuple) -> tuple:
    """The shape and strides (None: row-major) :func:`slot_view` cuts ``param``'s slot with."""
    shape, strides = record
    if tuple(param.shape) == shape:
        return shape, strides
    if param.is_contiguous() or not is_dense(param):
        return tuple(param.shape), None
    return tuple(param.shape), tuple(param.stride())


def _cut_slot(entry: "ParamSlot", empty, storage, offset: int, shape: tuple, strides) -> torch.Tensor:
    """Set a new tensor (made by ``empty``) onto ``storage`` at ``offset`` with ``shape`` and
    ``strides`` (None: row-major) and make it ``entry``'s slot, remembering where it was cut."""
    slot = empty(0)
    if strides is None:
        slot.set_(storage, offset, shape)
    else:
        slot.set_(storage, offset, shape, strides)
    entry.view, entry.ptr = slot, slot.data_ptr()
    return slot


def slot_order(param: torch.Tensor) -> tuple:
    """The strides that order ``param``'s slot (:func:`shaped_like`), ``()`` when row-major. Ranks
    whose slots order a parameter differently (channels_last on one rank only) would reduce
    unrelated elements together, so the ranks compare it (torch's DDP compares the strides)."""
    if param.is_contiguous() or not is_dense(param):
        return ()
    return memory_order(param)


def flat_like(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``t`` (shaped like ``param``) as 1-D in the element order of ``param``'s slot (the
    inverse of :func:`shaped_like`): a view when ``t`` is laid out like the slot, else a copy."""
    if param.is_contiguous() or not is_dense(param):
        return t.reshape(-1)
    if t.stride() == param.stride():
        return t.as_strided((t.numel(),), (1,))
    out = torch.empty(param.numel(), dtype=t.dtype, device=t.device)
    shaped_like(out, param).copy_(t)
    return out


class GradLayout:
    """Buffers, buckets, and each parameter's slot (Note [bucket storage])."""

    def __init__(self, buckets: Sequence[Bucket], sizes: dict, device: torch.device,
                 bucket_storage: bool = False):
        self.buckets = list(buckets)
        self.device = device
        self.slots: dict[torch.nn.Parameter, ParamSlot] = {}
        for bucket in self.buckets:
            for p, off in zip(bucket.params, bucket.offsets):
                self.slots[p] = ParamSlot(bucket, off)
        self.total_bytes = sum(b.nbytes for b in self.buckets)
        if bucket_storage:
            self.use_bucket_storage()
            return
        self.bucket_storage = False
        self.buffers = {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        for bucket in self.buckets:
            bucket.data = self.buffers[bucket.dtype][bucket.start:bucket.end]
            self.cut_views(bucket)
        self.allocated_bytes = self.total_bytes
        self.peak_bytes = self.total_bytes

    def grad_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s gradient view of its bucket (the same tensor until the bucket's storage
        is released, or until ``.data`` moves it off the bucket: then it is cut anew)."""
        slot = self.slots[param]
        if slot.view is None:
            raise RuntimeError(
                f"fusedist: gradient bucket {slot.bucket.index} is released (per-bucket storage); "
                "allocate it before taking a gradient view"
            )
        if slot.view.data_ptr() != slot.ptr:
            return self.recut(param)
        return slot.view

    def cut_views(self, bucket: Bucket) -> None:
        """Each parameter's gradient slot, as :func:`slot_view` cuts it, set onto the bucket's
        storage rather than viewed (:func:`alias_of`), at the cost of a view."""
        data, start = bucket.data, bucket.start
        storage, base, empty = data.untyped_storage(), data.storage_offset(), data.new_empty
        for p, off, record in zip(bucket.params, bucket.offsets, bucket.orders):
            _cut_slot(self.slots[p], empty, storage, base + off - start, *slot_geometry(p, record))

    def recut(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s slot cut anew on its bucket's storage, once its tensor was moved off it
        (``p.grad.data = t``, ``p.grad.set_(t)``): the moved tensor keeps the memory it was given."""
        slot = self.slots[param]
        bucket, data = slot.bucket, slot.bucket.data
        index = next(i for i, q in enumerate(bucket.params) if q is param)
        offset = data.storage_offset() + slot.offset - bucket.start
        shape, strides = slot_geometry(param, bucket.orders[index])
        return _cut_slot(slot, data.new_empty, data.untyped_storage(), offset, shape, strides)

    def record_orders(self) -> None:
        """Record each slot's order from its parameter as it is now (Note [slot order fixed at
        bucketing]): a consumer that lays out its own storage by the parameters (ZeRO's flat
        parameters) fixes the layout at its construction, so views cut from then on follow it.
        Views already cut stay as they are."""
        for bucket in self.buckets:
            bucket.orders = [slot_record(p) for p in bucket.params]

    def _drop_views(self, bucket: Bucket) -> None:
        for p in bucket.params:
            self.slots[p].view = None

    # ---- storage (Note [bucket storage])
    def use_bucket_storage(self) -> None:
        """Switch to one tensor per bucket, every bucket released (current values dropped:
        callers set ``p.grad = None`` for views they handed out)."""
        self.bucket_storage = True
        self.buffers = {}
        for bucket in self.buckets:
            bucket.data = None
            self._drop_views(bucket)
        self.allocated_bytes = 0
        self.peak_bytes = 0

    def is_allocated(self, bucket: Bucket) -> bool:
        return bucket.data is not None

    def allocate(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's storage, allocated zeroed if it was released."""
        if bucket.data is None:
            bucket.data = torch.zeros(bucket.numel, dtype=bucket.dtype, device=self.device)
            self.cut_views(bucket)
            self.allocated_bytes += bucket.nbytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return bucket.data

    def release(self, bucket: Bucket) -> None:
        """Drop the bucket's storage (per-bucket storage only). Its memory is freed once no
        view of it is referenced any more."""
        if not self.bucket_storage:
            raise RuntimeError("fusedist: GradLayout.release needs per-bucket storage (use_bucket_storage())")
        if bucket.data is not None:
            bucket.data = None
            self._drop_views(bucket)
            self.allocated_bytes -= bucket.nbytes

    def release_all(self) -> None:
        for bucket in self.buckets:
            self.release(bucket)

    def account(self, nbytes: int) -> None:
        """Count ``nbytes`` more (negative: fewer) of gradient memory held outside the buckets --
        a bucket's converted copy on the wire -- in ``allocated_bytes`` / ``peak_bytes``."""
        self.allocated_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.allocated_bytes

    def fingerprint(self) -> list[tuple]:
        """Bucket structure as plain data, for cross-rank comparison."""
        return [
            (b.index, str(b.dtype), b.numel, tuple(zip(b.names, (tuple(p.shape) for p in b.params))))
            for b in self.buckets
        ]


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def pack_by_cap(params: Sequence[torch.nn.Parameter], caps: Sequence[int]) -> list[list[int]]:
    """``params`` packed per dtype in the order given, as indices: the k-th bucket of a dtype
    closes once it reaches ``caps[k]`` bytes (the last cap serving every later bucket), the
    parameter that crosses it included (Note [buckets close as torch's do]); the buckets in the
    order they closed, then the ones left open. torch's ``_compute_bucket_assignment_by_size``."""
    caps = list(caps)
    open_groups: dict[torch.dtype, list[int]] = {}
    filled: dict[torch.dtype, int] = {}
    caps_used: dict[torch.dtype, int] = {}
    groups: list[list[int]] = []
    for i, p in enumerate(params):
        cap = caps[min(caps_used.get(p.dtype, 0), len(caps) - 1)]
        open_groups.setdefault(p.dtype, []).append(i)
        filled[p.dtype] = filled.get(p.dtype, 0) + p.numel() * p.element_size()
        if filled[p.dtype] >= cap:
            groups.append(open_groups.pop(p.dtype))
            filled[p.dtype] = 0
            caps_used[p.dtype] = caps_used.get(p.dtype, 0) + 1
    groups.extend(open_groups.values())
    return groups


def build_layout(
    params: Sequence[torch.nn.Parameter],
    names: Sequence[str],
    *,
    caps: Sequence[int],
    world_size: int,
    device: torch.device,
    bucket_storage: bool = False,
) -> GradLayout:
    """Assign ``params`` (in expected readiness order) to buckets, per dtype.

    ``caps`` are bytes: the k-th bucket of each dtype has cap ``caps[k]``, the last entry
    serving every bucket after (``DDPConfig.bucket_caps_bytes``: torch DDP's first and later
    caps, or its ``bucket_cap_mb_list``). A bucket closes once it *reaches* its cap, the
    parameter that crosses it included, as torch DDP's (Note [buckets close as torch's do]).
    ``bucket_storage``: one tensor per bucket, all released (Note [bucket storage]).

    Note [buckets close as torch's do]
        torch DDP adds a parameter to the open bucket, then closes the bucket if it has
        reached its cap (``_compute_bucket_assignment_by_size``), so a bucket may exceed the
        cap by up to one parameter. fusedist once closed every bucket but the first *before*
        a parameter that would overflow it, which bounds a bucket's bytes by the cap but makes
        more, smaller buckets: 18 collectives a step against torch's 13 on the 98M GPT of
        bench_gpt_step. Where each collective has a fixed cost (NCCL over sockets:
        milliseconds), five more are about the gap an H200 measured there, 1.086x torch DDP's
        step (``benchmarks/results/gpu_h200_2026-12-04c``; not re-measured since). The first
        bucket had already been switched, for the same reason in the small: closed before a
        large last layer, it held only that layer's bias, and the first real all-reduce
        waited for another layer of backward. So every bucket closes as torch's: the same
        buckets, hence the same collectives, as the torch DDP a user replaces
        (``tests/test_grad_buffer.py`` compares with torch's assignment). ZeRO stage 2's
        gradient buckets, which these are, may likewise exceed ``bucket_cap_mb`` by up to one
        parameter.
    """
    caps = list(caps)
    if not caps:
        raise ValueError("build_layout: caps must hold at least one bucket cap")
    # Numbered by when each becomes ready (its last parameter), as torch's rebuilt buckets: launches
    # go in index order, so a bucket of another dtype opened early but filled late must not hold
    # back the buckets that fill meanwhile (numbered by opening, none launched before backward ended).
    indices = sorted(pack_by_cap(params, caps), key=lambda group: group[-1])
    groups = [[(params[i], names[i]) for i in group] for group in indices]
    return layout_of_groups(groups, world_size=world_size, device=device, bucket_storage=bucket_storage)


def layout_of_groups(groups: Sequence[Sequence[tuple]], *, world_size: int, device: torch.device,
                     bucket_storage: bool = False) -> GradLayout:
    """A layout whose k-th bucket holds ``groups[k]`` (``(param, name)`` pairs, one dtype, in
    slot order), each bucket padded for ZeRO's equal shards."""
    pad_to = world_size * SHARD_ALIGN
    sizes: dict[torch.dtype, int] = {}
    buckets = []
    for index, group in enumerate(groups):
        params, names = [p for p, _ in group], [n for _, n in group]
        dtype = params[0].dtype
        start = sizes.get(dtype, 0)
        offsets, cursor = [], start
        for p in params:
            offsets.append(cursor)
            cursor += p.numel()
        end = start + _round_up(max(cursor - start, 1), pad_to)
        sizes[dtype] = end
        buckets.append(Bucket(index, dtype, start, end, params, names, offsets))
    return GradLayout(buckets, sizes, device, bucket_storage=bucket_storage)


def torch_unused_groups(params: Sequence[torch.nn.Parameter], caps: Sequence[int]) -> list[list[int]]:
    """torch DDP's buckets with ``find_unused_parameters=True`` (and no static graph), as indices
    into ``params`` (registration order): Note [buckets of find_unused_parameters].

    Note [buckets of find_unused_parameters]
        With ``find_unused_parameters=True`` torch's DDP never rebuilds its buckets from the
        observed order (a rank's unused parameters would make that order differ between
        iterations): it keeps the buckets it cut at wrapping, which differ from fusedist's
        reverse-order ones. Each dtype's parameters are packed in *registration* order, a bucket
        closing once it reaches its cap (``caps[k]`` for the k-th of the dtype, the last serving
        every later one), the buckets sorted by their first parameter and then reversed: bucket 0
        holds the last parameters, each bucket its parameters in registration order. The fused
        reduction does not care (an all-reduce is elementwise), but a communication hook sees
        the buckets: PowerSGD draws its random projections per bucket index and compresses the
        bucket's gradients in their order, so a hooked model cuts its buckets this way
        (``comm_hook.match_torch_unused_buckets``) and trains as torch's does.
    """
    groups = pack_by_cap(params, caps)
    groups.sort(key=lambda g: g[0])
    return groups[::-1]


def append_buckets(existing: Sequence[Bucket], params: Sequence[torch.nn.Parameter], names: Sequence[str], *,
                   bucket_cap_bytes: int, world_size: int) -> list[Bucket]:
    """``existing`` (copied, same ranges) followed by new buckets for ``params`` placed after
    them in each dtype's buffer, numbered on. The existing buckets and so every shard of them
    stay where they are: what a sharded optimizer over them needs when parameters join
    (Note [trainable set changes] in ``trainable.py``)."""
    out = [dataclasses.replace(b, params=list(b.params), names=list(b.names), offsets=list(b.offsets), data=None,
                               fold=None, unfolded=[], orders=list(b.orders))
           for b in existing]
    sizes = _buffer_sizes(out)
    fresh = build_layout(params, names, caps=[bucket_cap_bytes], world_size=world_size, device=torch.device("meta"),
                         bucket_storage=True).buckets
    for b in fresh:
        shift = sizes.get(b.dtype, 0)
        out.append(Bucket(len(out), b.dtype, b.start + shift, b.end + shift, b.params, b.names,
                          [o + shift for o in b.offsets]))
    return out


def layout_of(buckets: Sequence[Bucket], device: torch.device, bucket_storage: bool) -> GradLayout:
    """A layout over ready-made ``buckets`` (their buffers sized to the furthest bucket)."""
    return GradLayout(buckets, _buffer_sizes(buckets), device, bucket_storage=bucket_storage)


def _buffer_sizes(buckets: Sequence[Bucket]) -> dict:
    """Elements of each dtype's buffer: up to the end of its furthest bucket."""
    sizes: dict[torch.dtype, int] = {}
    for b in buckets:
        sizes[b.dtype] = max(sizes.get(b.dtype, 0), b.end)
    return sizes


def converted_param(buckets: Sequence[Bucket], every: bool = False) -> Optional[tuple[Bucket, int]]:
    """``(bucket, position)`` of the first parameter whose dtype is no longer its bucket's (the
    module was converted after its buckets were cut), or None. ``every=False`` looks at each
    bucket's first parameter only: a whole-module conversion changes them all, so one look per
    bucket finds it without a per-parameter cost."""
    for bucket in buckets:
        for position, p in enumerate(bucket.params if every else bucket.params[:1]):
            if p.dtype is not bucket.dtype:
                return bucket, position
    return None


def sparse_gradient_error(rank: int, name: str) -> RuntimeError:
    """The error for a sparse gradient reaching the buckets (the reducer's hook and the
    catch-up of newly trainable parameters)."""
    return RuntimeError(
        f"fusedist DDP (rank {rank}): parameter '{name}' received a sparse gradient; sparse gradients "
        "are averaged only for the weights of nn.Embedding / nn.EmbeddingBag modules built with "
        "sparse=True (as torch's DDP expects them): compute this one through such a module, or densely"
    )
