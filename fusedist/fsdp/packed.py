"""Quantized-storage parameters (torchao's NF4 weights for QLoRA) in a ``fully_shard`` unit.

Note [quantized storage]
------------------------
QLoRA fine-tunes low-rank adapters over a frozen base model whose Linear weights are stored
4-bit: torchao's ``NF4Tensor`` holds a weight as several inner tensors -- the packed 4-bit codes
(``quantized_data``), the per-block scales quantized again (``quantized_scalers``), one
factor per block of scales (``quantization_factor``) -- and two that every part of it
shares (``scaler_mean``, the ``nf4`` lookup table). No inner tensor has the weight's shape,
so it is not a wrapper of one tensor (Note [all-gather extension] in extension.py). FSDP2
shards it with the subclass's own ops: ``torch.chunk`` on dim 0 cuts every inner tensor
that scales with the rows, and the all-gather extension gathers those and rebuilds the
weight. fusedist follows that contract and stores the result in its flat shard:

* **The bytes table.** At ``fully_shard`` the weight is cut into ``world`` chunks by its own
  ``torch.chunk``. Each chunk's inner tensors are laid end to end as bytes -- the cut ones
  (``sharded``), then the shared ones (``scaler_mean`` is data: a load must carry it) -- each
  at an offset aligned to 16 bytes, so every dtype views in place. The rows of the ``(world,
  nbytes)`` uint8 table are the chunks; the unit shards that table like any parameter of its
  own section, so each rank stores exactly its chunk: ``1/world`` of the weight's bytes.
* **The piece** is the subclass again, rebuilt (``__tensor_unflatten__``) over views of the
  rank's row: what ``model.parameters()`` yields, with the subclass's shape ``(rows/world,
  cols)``; the gather asks it (``fsdp_pre_all_gather``), as FSDP2 asks its local shard, and
  ``fsdp_post_all_gather`` rebuilds the whole weight from the gathered inner tensors
  (extension.py's gathers do the rest: one all-gather of bytes, freed on reshard).
* **Frozen only.** Nothing steps quantized codes (QLoRA's base weights are frozen), and a
  uint8 table cannot require grad: a trainable one is refused by name.
* **Even rows only.** The subclass's chunks must all have one layout (FSDP2 needs the same:
  NF4 cuts its blocks evenly), so the rows must divide by the world size and every cut
  inner tensor must split into equal parts, else the parameter is refused by name.
* **Conversions** (``model.to()``, ``.double()``) move the rows like any piece's data and cast
  nothing: the table is bytes, and the subclass keeps the dtype it dequantizes to (an
  unsharded model's ``.to(dtype)`` would turn an NF4 weight into a dense one).
* **What reads it:** ``full_state_dict`` gives the whole subclass (as FSDP2's full state dict
  does) and ``load_full_state_dict`` takes one -- or a plain high-precision weight, which the
  subclass's own ``copy_`` quantizes on every rank before each keeps its chunk.
* **Checkpoints** hold the weight's *canonical bytes*: its inner tensors whole, end to end in
  ``__tensor_flatten__``'s order (aligned as in a row), which depend on the weight alone. A
  rank's chunk is a few ranges of them (its part of each cut inner tensor); the shared
  tensors and alignment gaps are held by every rank alike. ``model.state_dict()`` gives each
  rank's ranges as one entry (DCP writes the alike ranges once), ``fusedist.checkpoint``
  writes them as range fragments (the alike ones from the group's first rank), so both load
  into a ``fully_shard`` model at any world size whose chunks the subclass can cut. Both
  record the bytes' layout (:func:`layout_record`): the byte count does not tell it (Note
  [the layout of quantized storage in DCP] in dcp.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .extension import ExtensionSpec, as_bytes

__all__ = ["PackedSpec", "is_packed_candidate", "canonical_slots", "layout_record", "to_canonical", "from_canonical",
           "ctx_on"]

_ALIGN = 16  # bytes: every dtype views in place at such an offset


def _joins_into(parts: list, whole: torch.Tensor) -> bool:
    """Whether ``parts`` joined on dim 0 are ``whole`` (by shape alone on the meta device)."""
    joined = torch.cat(parts)
    return joined.shape == whole.shape and (whole.is_meta or torch.equal(joined, whole))


def is_packed_candidate(p) -> bool:
    """Whether ``p`` is a traceable wrapper subclass with the all-gather extension that is not a
    wrapper of one tensor of its shape (quantized storage, Note [quantized storage])."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(p) and hasattr(p, "fsdp_pre_all_gather")


def ctx_on(ctx, device: torch.device):
    """``ctx`` (a ``__tensor_flatten__`` context) on ``device``: a context that records its
    device (NF4's ``tensor_meta``, a dataclass) moves with the inner tensors -- a wrapper's
    device is fixed at its creation."""
    if not isinstance(ctx, dict):
        return ctx
    return {k: dataclasses.replace(v, device=device) if dataclasses.is_dataclass(v) and hasattr(v, "device")
            else v for k, v in ctx.items()}


def canonical_slots(whole) -> tuple[list, int]:
    """The layout of the canonical bytes of quantized storage ``whole`` (Note [quantized
    storage]): ``(name, byte offset, shape, dtype)`` of each inner tensor whole, end to end in
    ``__tensor_flatten__``'s order at aligned offsets, and the bytes in all. It depends on the
    weight alone, so an unsharded model computes the same layout a unit does."""
    slots, offset = [], 0
    for n in whole.__tensor_flatten__()[0]:
        t = getattr(whole, n)
        slots.append((n, offset, tuple(t.shape), t.dtype))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return slots, max(offset, _ALIGN)


def layout_record(slots: list) -> list:
    """The layout ``slots`` (:func:`canonical_slots`) as checkpoints record it: ``[name, byte
    offset, shape, dtype name]`` of each inner tensor, plain values only (fusedist's own
    checkpoints and torch DCP ones both record it). The bytes alone do
    not tell it: NF4 weights quantized with other block sizes can have the same byte count."""
    return [[n, int(offset), list(shape), str(dtype).replace("torch.", "")] for n, offset, shape, dtype in slots]


def to_canonical(whole) -> torch.Tensor:
    """The canonical bytes of the whole subclass ``whole`` (on the CPU): what a checkpoint of a
    ``fully_shard`` model holds for it."""
    slots, nbytes = canonical_slots(whole)
    out = torch.zeros(nbytes, dtype=torch.uint8)
    for n, offset, _, _ in slots:
        flat = as_bytes(getattr(whole, n)).cpu()
        out[offset:offset + flat.numel()].copy_(flat)
    return out


def from_canonical(data: torch.Tensor, like):
    """The canonical bytes ``data`` as the whole subclass of ``like`` (a model's own parameter,
    whose class, context and inner layout they must have: the caller checks the byte count),
    on ``like``'s device, in fresh storage."""
    slots, _ = canonical_slots(like)
    flat = data.detach().reshape(-1).to(like.device)
    inner = {n: flat[offset:offset + math.prod(shape) * dtype.itemsize].clone().view(dtype).view(shape)
             for n, offset, shape, dtype in slots}
    return type(like).__tensor_unflatten__(inner, like.__tensor_flatten__()[1], like.shape, like.stride())


class PackedSpec(ExtensionSpec):
    """How a unit holds one quantized-storage parameter (Note [quantized storage]): the byte
    offsets of its inner tensors in a row of its table, which of them the chunks cut, and the
    chunk's context to rebuild a piece from."""

    packed = True

    def __init__(self, param, module, world_size: int, rank: int, where: str):
        super().__init__(param, module)
        self.world_size = world_size
        self.outer_shape = tuple(param.shape)
        self.outer_stride = param.stride()
        names = param.__tensor_flatten__()[0]
        if param.requires_grad:
            raise NotImplementedError(
                f"{where}, holds quantized storage (inner tensors {names}) and requires grad; such parameters are "
                "frozen (QLoRA trains adapters beside them) and fusedist shards them as bytes. Freeze it "
                "(param.requires_grad_(False)) before fully_shard.")
        if param.dim() == 0 or param.shape[0] % world_size:
            raise NotImplementedError(
                f"{where}, holds quantized storage of shape {self.outer_shape}, whose rows do not divide evenly over "
                f"{world_size} ranks; such parameters are cut by their own torch.chunk into equal chunks (FSDP2 "
                "needs the same). Use a world size dividing the rows, or keep it out of the units (ignored_params).")
        try:
            chunks = torch.chunk(param.detach(), world_size, dim=0)
        except Exception as e:  # the subclass's own refusal (NF4: blocks that do not split evenly)
            raise NotImplementedError(
                f"{where}, holds quantized storage of shape {self.outer_shape}, which its class cannot cut into "
                f"{world_size} chunks on dim 0 ({type(e).__name__}: {e}); use a world size that divides its blocks, "
                "or keep it out of the units (ignored_params).") from None
        whole = {n: getattr(param, n) for n in names}
        #: the inner tensors the chunks cut, in row order; the others every chunk shares
        self.sharded = [n for n in names if getattr(chunks[0], n) is not whole[n]
                        and tuple(getattr(chunks[0], n).shape) != tuple(whole[n].shape)]
        shared = [n for n in names if n not in self.sharded]
        layouts = {tuple((n, tuple(getattr(c, n).shape), getattr(c, n).dtype) for n in names) for c in chunks}
        cut_whole = all(_joins_into([getattr(c, n) for c in chunks], whole[n]) for n in self.sharded)
        if len(chunks) != world_size or len(layouts) != 1 or not cut_whole:
            raise NotImplementedError(
                f"{where}, holds quantized storage whose chunks over {world_size} ranks are not alike (inner tensors "
                f"{names}); fusedist stores such parameters as equal chunks whose cut inner tensors join on dim 0. "
                "Keep it out of the units (ignored_params), or use torch.distributed.fsdp.fully_shard.")
        #: (name, byte offset in a row, shape, dtype), cut tensors first; the row's bytes
        self.slots, offset = [], 0
        for n in self.sharded + shared:
            t = getattr(chunks[0], n)
            self.slots.append((n, offset, tuple(t.shape), t.dtype))
            offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self.row_bytes = max(offset, _ALIGN)
        self.chunk_shape, self.chunk_stride = tuple(chunks[rank].shape), chunks[rank].stride()
        self.chunk_ctx = chunks[rank].__tensor_flatten__()[1]
        self.rank = rank
        #: the whole parameter's bytes as checkpoints hold them at any world size: its inner
        #: tensors whole, end to end in ``__tensor_flatten__``'s order (name, byte offset, shape,
        #: dtype)
        self.canonical, self.canonical_bytes = canonical_slots(param)

    # -- the table and the rows
    def _pack(self, part) -> torch.Tensor:
        """The bytes of ``part`` (a chunk, or a piece): one row."""
        row = torch.zeros(self.row_bytes, dtype=torch.uint8, device=getattr(part, self.slots[0][0]).device)
        for n, offset, shape, dtype in self.slots:
            flat = as_bytes(getattr(part, n))
            row[offset:offset + flat.numel()].copy_(flat)
        return row

    def table(self, whole) -> torch.Tensor:
        """The ``(world, row bytes)`` table of the whole parameter: row ``r`` is chunk ``r``."""
        return torch.stack([self._pack(c) for c in torch.chunk(whole.detach(), self.world_size, dim=0)])

    def inner(self, p) -> torch.Tensor:
        """What the unit stores for ``p``: the table of the whole parameter (at ``fully_shard``),
        or a piece's row -- a view of the shard it lies on, else a copy."""
        if tuple(p.shape) == self.outer_shape and self.world_size > 1:
            return self.table(p)
        first = getattr(p, self.slots[0][0])
        base = first.storage_offset() * first.element_size()
        if base % _ALIGN == 0 and all(
                getattr(p, n).untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and getattr(p, n).storage_offset() * getattr(p, n).element_size() == base + offset
                and getattr(p, n).is_contiguous() for n, offset, _, _ in self.slots):
            return torch.empty(0, dtype=torch.uint8, device=first.device).set_(
                first.untyped_storage(), base, (1, self.row_bytes))
        return self._pack(p).view(1, -1)

    def _views(self, row: torch.Tensor, slots=None) -> dict:
        flat = row.reshape(-1)
        return {n: flat[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for n, offset, shape, dtype in (slots or self.slots)}

    def _ctx(self, ctx, device: torch.device):
        return ctx_on(ctx, device)

    def wrap(self, inner: torch.Tensor, like=None) -> torch.Tensor:
        """The piece: the subclass over views of the row ``inner`` (``like`` is not needed: the
        row holds every inner tensor)."""
        return self.cls.__tensor_unflatten__(self._views(inner), self._ctx(self.chunk_ctx, inner.device),
                                             torch.Size(self.chunk_shape), self.chunk_stride)

    def set_inner(self, piece, inner: torch.Tensor) -> None:
        """Point ``piece``'s inner tensors at views of the row ``inner``."""
        for n, t in self._views(inner).items():
            setattr(piece, n, t)

    def _whole(self, inner: dict, device: torch.device):
        """The whole parameter (the subclass) over the inner tensors ``inner``."""
        return self.cls.__tensor_unflatten__(inner, self._ctx(self.ctx, device), torch.Size(self.outer_shape),
                                             self.outer_stride)

    def whole_of_table(self, table: torch.Tensor):
        """The whole parameter (the subclass) from its gathered table: the cut inner tensors of
        every row joined on dim 0, the shared ones of row 0."""
        rows = [self._views(table[r]) for r in range(self.world_size)]
        return self._whole({n: torch.cat([r[n] for r in rows]) if n in self.sharded else rows[0][n].clone()
                            for n, _, _, _ in self.slots}, table.device)

    # -- the canonical bytes (Note [quantized storage]: what checkpoints hold)
    def _own_ranges(self, rank: int) -> list:
        """The byte ranges of the canonical bytes that ``rank``'s chunk alone holds: its part of
        each cut inner tensor."""
        out = []
        for n, offset, shape, dtype in self.canonical:
            if n in self.sharded:
                length = math.prod(shape) * dtype.itemsize // self.world_size
                out.append((offset + rank * length, offset + (rank + 1) * length))
        return out

    def held_ranges(self, shared: bool = True) -> list:
        """This rank's byte ranges of the canonical bytes, in order: its own, and with
        ``shared`` the ranges no rank holds alone (the shared tensors, the alignment gaps)."""
        ranges = self._own_ranges(self.rank)
        if shared:
            cursor = 0
            for lo, hi in sorted(r for k in range(self.world_size) for r in self._own_ranges(k)):
                if lo > cursor:
                    ranges.append((cursor, lo))
                cursor = hi
            if cursor < self.canonical_bytes:
                ranges.append((cursor, self.canonical_bytes))
        return sorted(ranges)

    def _spans(self) -> list:
        """Where each inner tensor of this rank's row lies in the canonical bytes: ``(offset in
        the row, offset in the canonical bytes, bytes)``."""
        where = {n: offset for n, offset, _, _ in self.canonical}
        out = []
        for n, at, shape, dtype in self.slots:
            nbytes = math.prod(shape) * dtype.itemsize
            out.append((at, where[n] + (self.rank * nbytes if n in self.sharded else 0), nbytes))
        return out

    def _canonical_of_row(self, row: torch.Tensor) -> torch.Tensor:
        """The canonical bytes with this rank's row in place (the other ranks' parts zero)."""
        out, flat = torch.zeros(self.canonical_bytes, dtype=torch.uint8, device=row.device), row.reshape(-1)
        for at, start, nbytes in self._spans():
            out[start:start + nbytes].copy_(flat[at:at + nbytes])
        return out

    def _row_of_canonical(self, canonical: torch.Tensor) -> torch.Tensor:
        """This rank's row cut from the canonical bytes."""
        row, flat = torch.zeros(1, self.row_bytes, dtype=torch.uint8, device=canonical.device), canonical.reshape(-1)
        for at, start, nbytes in self._spans():
            row[0, at:at + nbytes].copy_(flat[start:start + nbytes])
        return row

    def entry_parts(self, row: torch.Tensor, shared: bool = True) -> list:
        """This rank's held ranges of the canonical bytes with their bytes, ``((lo, hi), bytes)``
        in order: what its checkpoint fragments carry."""
        canonical = self._canonical_of_row(row)
        return [((lo, hi), canonical[lo:hi]) for lo, hi in self.held_ranges(shared)]

    def entry(self, row: torch.Tensor, shared: bool = True) -> torch.Tensor:
        """:meth:`entry_parts`' bytes end to end: this rank's state-dict entry."""
        return torch.cat([part for _, part in self.entry_parts(row, shared)])

    def row_of_entry(self, entry: torch.Tensor) -> torch.Tensor:
        canonical = torch.zeros(self.canonical_bytes, dtype=torch.uint8, device=entry.device)
        cursor, flat = 0, entry.reshape(-1)
        for lo, hi in self.held_ranges():
            canonical[lo:hi].copy_(flat[cursor:cursor + hi - lo])
            cursor += hi - lo
        return self._row_of_canonical(canonical)

    def as_whole(self, whole):
        """``whole`` as the subclass (or a plain weight, which the subclass's ``copy_`` quantizes):
        its canonical bytes are made the subclass."""
        if isinstance(whole, self.cls) or whole.dtype != torch.uint8 or tuple(whole.shape) != (self.canonical_bytes,):
            return whole
        return self._whole(self._views(whole, self.canonical), whole.device)

    def row_of_whole(self, whole, key: str, template: torch.Tensor) -> torch.Tensor:
        """This rank's row of ``whole``: the canonical bytes (as a checkpoint holds them), the
        subclass of the parameter's shape, or a plain weight, which the subclass quantizes (its
        ``copy_`` into ``template``'s row made whole)."""
        if not isinstance(whole, self.cls) and whole.dtype == torch.uint8 and tuple(whole.shape) == (
                self.canonical_bytes,):
            return self._row_of_canonical(whole.to(template.device))
        if not isinstance(whole, self.cls):
            if whole.is_floating_point() and tuple(whole.shape) == self.outer_shape:
                made = self.whole_of_table(template.reshape(1, -1).expand(self.world_size, -1).clone())
                made.copy_(whole.to(template.device))
                whole = made
            else:
                raise TypeError(
                    f"'{key}' is a {type(whole).__name__} of dtype {whole.dtype} and shape {tuple(whole.shape)}; the "
                    f"model holds it as {self.cls.__name__} {self.outer_shape} (quantized storage, Note [quantized "
                    f"storage]): load that class, its {self.canonical_bytes} canonical bytes, or a floating-point "
                    "weight of its shape for it to quantize")
        chunk = torch.chunk(whole.detach(), self.world_size, dim=0)[self.rank] \
            if tuple(whole.shape) == self.outer_shape else None
        got = [(tuple(getattr(chunk, n).shape), getattr(chunk, n).dtype) for n, _, _, _ in self.slots] \
            if chunk is not None else None
        if got != [(shape, dtype) for _, _, shape, dtype in self.slots]:
            raise ValueError(f"'{key}' is a {type(whole).__name__} of shape {tuple(whole.shape)} whose chunks hold "
                             f"{got}; the model's {self.outer_shape} chunks hold "
                             f"{[(shape, dtype) for _, _, shape, dtype in self.slots]} (other block sizes?)")
        return self._pack(chunk).view(1, -1)
