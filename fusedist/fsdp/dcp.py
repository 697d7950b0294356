"""``model.state_dict()`` of a ``fully_shard`` model for torch's Distributed Checkpoint (DCP) and
its state-dict helpers (``torch.distributed.checkpoint.state_dict``).

Note [pieces in torch's distributed checkpoint]
    DCP saves a plain tensor as *replicated* (one rank writes it whole) and loads one by
    checking ``tensor.size()`` against the saved size. A piece (Note [sharded parameters] in
    unit.py) is neither: saved as a plain tensor only one rank's piece was written, and a load
    failed on the shape or, with equal-shaped pieces, loaded that one piece on every rank.
    DCP's extension protocol for tensors sharded its own way (``planner_helpers``:
    ``__create_write_items__``, ``__create_chunk_list__``; ``utils.find_tensor_shard``:
    ``__get_tensor_shard__``) lets a tensor say which chunks of the whole tensor it holds.

    The carrier: ``state_dict()`` (not ``keep_vars=True``, which returns the parameters
    themselves, as fusedist's own checkpoint and full-state-dict code need) returns each
    sharded parameter as a :class:`ShardedPiece` -- an alias of the piece (same storage, same
    ``shape``, contiguous) that also knows the whole parameter's shape and the elements
    ``[lo, hi)`` of the flattened parameter it holds. Why a small ``torch.Tensor`` subclass
    rather than attributes on the returned tensors: attributes go into a tensor's pickled
    state, so ``torch.save(model.state_dict())`` would store fusedist objects (and
    ``torch.load(weights_only=True)`` refuse them); a subclass pickles as the plain piece
    (``__reduce_ex__``), has its methods in one place, and follows ``.to()``/``.cpu()``/
    ``.clone()``/``.detach()`` (``cpu_offload`` of the sharded state-dict helpers) where
    attributes would be dropped. Every other op returns a plain tensor, so to ``copy_``,
    ``load_state_dict`` and arithmetic an entry is the piece it was before.

    One deliberate difference: ``size()`` is the *whole* parameter's size (DCP's load compares
    it with the checkpoint's, as it does for a DTensor, whose size is the global one), while
    ``shape``/``numel()``/``len()`` are the piece's (except to torch's async-save stager: Note
    [staging a piece]). Tensor's own Python methods that rebuild a
    tensor from ``self.size()`` (``__deepcopy__``, ``__reduce_ex__``, ``__repr__``) are
    overridden to use the piece.

    A piece of a parameter sharded on another dim (Note [dim-sharded sections] in
    chunk_layout.py) knows its box instead of a range -- offsets ``(0, .., start, .., 0)``,
    sizes the piece's shape -- and is that one chunk: torch's FSDP2 writes a ``Shard(dim)``
    DTensor as the same chunk, so checkpoints interchange both ways.

    The chunks: a piece of whole rows is one chunk ``offsets (first_row, 0, ...)``, ``sizes
    (rows, *shape[1:])``. A piece cut anywhere (Note [row-aligned flat layout], 1-D pieces) is
    a flat range of the parameter: it is written as the few boxes that tile that range (a
    partial row, whole rows, a partial row -- recursively in the inner dimensions), so any
    layout, at any world size, reads and writes the parameter's own N-D chunks: a checkpoint
    saved at 2 ranks loads at 3, and a torch FSDP2 model's checkpoint is the same parameters.
    An empty piece holds no chunk (a parameter with no elements: rank 0 writes an empty chunk,
    so the key exists). Loading writes straight into the pieces (the boxes are views of them),
    then ``load_state_dict`` copies each piece onto itself.

    The same hook makes the entries describe the *pieces* even while a unit is gathered (the
    module holds the unsharded parameters then): the pieces are what the optimizer steps
    and what a load must fill, the gathered copy may be in ``param_dtype`` or stale. Except during a
    forward, a backward or between a forward and its backward, the pre-hooks reshard the unit
    first, as FSDP2's do, so no gathered copy outlives a load (``_reshard_at_rest`` in
    state_dict_hooks.py).

This module is the carrier, :class:`ShardedPiece`, and the regions it describes; the hooks
that put the entries in ``state_dict()`` and take them in ``load_state_dict`` are in
``state_dict_hooks.py``, and the full-state-dict options of torch's helpers are read in
``torch_helpers.py`` (Note [full state dict through torch's helpers]).
"""

from __future__ import annotations

import copy
import math
import sys
from typing import Optional

import torch

__all__ = ["ShardedPiece", "chunks_of", "describe_region", "piece_region"]


def chunks_of(shape: tuple, lo: int, hi: int) -> list:
    """The boxes tiling elements ``[lo, hi)`` of a row-major tensor of ``shape``, in order: a
    list of ``(offsets, sizes)`` (tuples). Whole rows make one box; a range that starts or ends
    mid-row adds a box for each partial row, recursively in the inner dimensions."""
    if hi <= lo:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    r0, a = divmod(lo, inner)
    r1, b = divmod(hi, inner)
    zeros = (0,) * (len(shape) - 1)
    if r0 == r1:  # inside one row
        return [((r0, *o), (1, *s)) for o, s in chunks_of(shape[1:], a, b)]
    out = []
    if a:
        out += [((r0, *o), (1, *s)) for o, s in chunks_of(shape[1:], a, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *zeros), (r1 - r0, *shape[1:])))
    if b:
        out += [((r1, *o), (1, *s)) for o, s in chunks_of(shape[1:], 0, b)]
    return out


# ops whose result is the same piece's values (another device or dtype, a copy): they keep the carrier
_KEEPS = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.clone, torch.clone,
          torch.Tensor.detach, torch.detach, torch.Tensor.contiguous, torch.Tensor.pin_memory,
          torch.Tensor.float, torch.Tensor.double, torch.Tensor.half, torch.Tensor.bfloat16}


class ShardedPiece(torch.Tensor):
    """A state-dict entry of a sharded parameter: this rank's piece (``shape``, data) that
    knows the whole parameter's size (``size()``, as for a DTensor) and the elements ``[lo,
    hi)`` of the flattened parameter it holds (Note [pieces in torch's distributed checkpoint])."""

    _fs_size: torch.Size
    _fs_range: tuple  # (lo, hi) of the flattened parameter, or a box ((offsets), (sizes))
    _fs_piece_shape: tuple
    # tensor parallelism (Note [tensor-parallel parameters] in tensor_parallel.py): the range or
    # box is of this rank's local tensor, of shape ``_fs_local``, which sits at ``_fs_shift`` in
    # the global parameter (``_fs_size``); None for a plain parameter
    _fs_local: Optional[tuple] = None
    _fs_shift: Optional[tuple] = None
    # whether this rank writes the entry's chunks: not for a parameter every tensor-parallel rank
    # holds alike, except on the first of them (Note [tensor-parallel parameters])
    _fs_writes: bool = True
    # quantized storage: the layout of its canonical bytes (``packed.layout_record``), which the
    # checkpoint records and a load checks (Note [the layout of quantized storage in DCP])
    _fs_layout: Optional[list] = None
    # what FSDP2's DTensor entry would answer (``dtensor_view.EntryLayout``): placements, mesh, its
    # shard, and the group ``full_tensor``/``to_local`` gather over; None for an entry made without a
    # unit (Note [entries read as DTensors] in dtensor_view.py)
    _fs_view = None

    @staticmethod
    def wrap(piece: torch.Tensor, full_shape, lo: int, hi: int) -> "ShardedPiece":
        if not piece.is_contiguous() or piece.numel() != hi - lo:
            raise ValueError(f"a piece must be contiguous and hold its range: shape {tuple(piece.shape)}, "
                             f"range [{lo}, {hi})")
        return ShardedPiece._carrier(piece, full_shape, (lo, hi), tuple(piece.shape))

    @staticmethod
    def wrap_box(piece: torch.Tensor, full_shape, offsets: tuple, sizes: tuple) -> "ShardedPiece":
        """The entry of a piece that is the box ``offsets``/``sizes`` of the whole parameter (a
        chunk on another dim than 0, Note [dim-sharded sections] in chunk_layout.py)."""
        if not piece.is_contiguous() or tuple(piece.shape) != tuple(sizes):
            raise ValueError(f"a piece must be contiguous and of its box's sizes: shape {tuple(piece.shape)}, "
                             f"box sizes {tuple(sizes)}")
        return ShardedPiece._carrier(piece, full_shape, (tuple(offsets), tuple(sizes)), tuple(piece.shape))

    @staticmethod
    def wrap_ranges(entry: torch.Tensor, full_shape, ranges, layout: Optional[list] = None) -> "ShardedPiece":
        """The entry of quantized storage (Note [quantized storage] in packed.py): ``entry`` is
        the byte ranges ``ranges`` of its canonical bytes (1-D, of ``full_shape``), end to end,
        laid out as ``layout`` says (Note [the layout of quantized storage in DCP])."""
        out = ShardedPiece._carrier(entry, full_shape, Ranges(ranges), tuple(entry.shape))
        out._fs_layout = layout
        return out

    @staticmethod
    def _carrier(t: torch.Tensor, full_shape, element_range, piece_shape) -> "ShardedPiece":
        with torch._C.DisableTorchFunctionSubclass():
            out = t.as_subclass(ShardedPiece)
        out._fs_size = torch.Size(full_shape)
        out._fs_range = _region(element_range)
        out._fs_piece_shape = tuple(piece_shape)
        return out

    def placed(self, local_shape, shift) -> "ShardedPiece":
        """This entry, whose region is of a local tensor of ``local_shape`` sitting at offsets
        ``shift`` in the global parameter of ``size()`` (tensor parallelism)."""
        self._fs_local, self._fs_shift = tuple(local_shape), tuple(int(s) for s in shift)
        return self

    def full_tensor(self) -> torch.Tensor:
        """The whole parameter from this entry's values on every rank, as FSDP2's
        ``DTensor.full_tensor()`` gives it: a collective, every rank calls it for the same entry
        (Note [whole entries] in whole_entry.py)."""
        from .whole_entry import full_tensor_of

        return full_tensor_of(self)

    def to_local(self) -> torch.Tensor:
        """This rank's shard as FSDP2's ``DTensor.to_local()`` gives it: the entry's storage where
        the piece is that shard, else a copy made by a collective every rank of the shard group
        calls (Note [entries read as DTensors] in dtensor_view.py)."""
        from .whole_entry import to_local_of

        return to_local_of(self)

    @property
    def placements(self) -> tuple:
        """FSDP2's placements of this parameter's DTensor (Note [entries read as DTensors])."""
        return self._view("placements").placements

    @property
    def device_mesh(self):
        """The mesh FSDP2's DTensor of this parameter is on (Note [entries read as DTensors])."""
        return self._view("device_mesh").device_mesh

    def _view(self, what: str):
        if self._fs_view is None:
            raise AttributeError(f"{what}: this piece ({describe_region(self._fs_range)} of a parameter of shape "
                                 f"{tuple(self._fs_size)}) was not made by a fully_shard model's state_dict()")
        return self._fs_view

    def local(self) -> torch.Tensor:
        """The piece as a plain tensor (same storage)."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    @property
    def full_shape(self) -> torch.Size:
        return self._fs_size

    @property
    def element_range(self) -> tuple:
        """``(lo, hi)`` of the flattened parameter, or the box ``((offsets), (sizes))`` of a
        piece of a parameter sharded on another dim."""
        return self._fs_range

    def _like(self, other: torch.Tensor) -> "ShardedPiece":
        local = self._fs_local if self._fs_local is not None else self._fs_size
        if isinstance(self._fs_range, Ranges):
            return ShardedPiece.wrap_ranges(other, local, self._fs_range)._placed_as(self)
        if _is_box(self._fs_range):
            out = ShardedPiece.wrap_box(other, local, *self._fs_range)
        else:
            out = ShardedPiece.wrap(other, local, *self._fs_range)
        return out._placed_as(self)

    def _placed_as(self, src: "ShardedPiece") -> "ShardedPiece":
        """This entry with ``src``'s place in the parameter: its whole size, and for tensor
        parallelism the local tensor's shape and offsets and whether this rank writes it."""
        self._fs_size, self._fs_writes, self._fs_layout = src._fs_size, src._fs_writes, src._fs_layout
        self._fs_view = src._fs_view
        return self.placed(src._fs_local, src._fs_shift) if src._fs_local is not None else self

    @property
    def placement(self) -> Optional[tuple]:
        """``(local shape, offsets)`` of a tensor-parallel entry's local tensor, else None."""
        return (self._fs_local, self._fs_shift) if self._fs_local is not None else None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        src = args[0] if args else None
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], ShardedPiece):
            _refuse_whole_from_piece(args[0], args[1])  # Note [staging a piece]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if isinstance(src, ShardedPiece) and isinstance(out, torch.Tensor) and out is not src:
            if func is torch.Tensor.new_empty:  # Note [staging a piece]
                return ShardedPiece._carrier(out, src._fs_size, src._fs_range, src._fs_piece_shape)._placed_as(src)
            if func in _KEEPS and out.shape == src.shape and out.is_contiguous():
                return src._like(out)
        return out

    # -- what Tensor's Python methods would rebuild from size(): use the piece
    def size(self, dim: Optional[int] = None):
        shape = self._fs_size
        if sys._getframe(1).f_code is _stager_code():  # Note [staging a piece]
            shape = torch.Size(self._fs_piece_shape)
        return shape if dim is None else shape[dim]

    def __reduce_ex__(self, proto):
        return self.local().__reduce_ex__(proto)  # pickled as the plain piece (as before)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        out = self._like(copy.deepcopy(self.local(), memo))
        memo[id(self)] = out
        return out

    def __repr__(self, *, tensor_contents=None):
        return (f"ShardedPiece({describe_region(self._fs_range)} of a parameter of shape {tuple(self._fs_size)}, "
                f"piece {self.local()!r})")

    # -- DCP's extension protocol
    def _chunks(self) -> list:
        if isinstance(self._fs_range, Ranges):  # (1-D: the canonical bytes of quantized storage)
            return [((lo,), (hi - lo,)) for lo, hi in self._fs_range if hi > lo]
        if _is_box(self._fs_range):
            offsets, sizes = self._fs_range
            chunks = [(offsets, sizes)] if math.prod(sizes) else []
        else:
            chunks = chunks_of(tuple(self._fs_local or self._fs_size), *self._fs_range)
        if self._fs_shift is not None:  # the local tensor's boxes, placed in the global parameter
            chunks = [(tuple(o + s for o, s in zip(offsets, self._fs_shift)), sizes) for offsets, sizes in chunks]
        if not chunks and math.prod(self._fs_size) == 0 and len(self._fs_size):
            chunks = [((0,) * len(self._fs_size), tuple(self._fs_size))]  # so that the key exists
        return chunks

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        if not self._fs_writes:
            return []
        props = TensorProperties.create_from_tensor(self.local())
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._recorded(ChunkStorageMetadata(
                              offsets=torch.Size(o), sizes=torch.Size(s))), properties=props, size=self._fs_size))
                for o, s in self._chunks()]

    def _recorded(self, chunk):
        """``chunk`` carrying the layout of quantized storage (Note [the layout of quantized
        storage in DCP])."""
        if self._fs_layout is not None:
            setattr(chunk, LAYOUT_KEY, self._fs_layout)
        return chunk

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        _check_layout_at_read(self)
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in self._chunks()]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        flat, start = self.local().view(-1), 0
        for o, s in self._chunks():
            n = math.prod(s)
            if torch.Size(o) == index.offset:
                return flat[start:start + n].view(s)
            start += n
        raise ValueError(f"FQN '{index.fqn}': this rank's piece ({describe_region(self._fs_range)} of shape "
                         f"{tuple(self._fs_size)}) holds no chunk at offsets {tuple(index.offset or ())}")


# Note [the layout of quantized storage in DCP]
#     A quantized-storage entry is its canonical bytes (Note [quantized storage] in packed.py),
#     and the byte count does not tell their layout: NF4 weights quantized with other scaler
#     block sizes can have the same count, and a load read one as the other -- other numbers,
#     silently. So each chunk the entry writes carries the layout (``LAYOUT_KEY``, plain lists:
#     DCP pickles the chunks' fields into ``.metadata``, where torch's own loads, a FSDP2 model's
#     among them, ignore it). A load compares it with the model's: ``dcp.load`` into the entries
#     of ``model.state_dict()`` when torch's planner asks an entry for its chunks (the caller's
#     ``md``: the checkpoint's record of the key, found as ``_stager_code`` finds the stager),
#     and ``fusedist.checkpoint.load`` from the metadata it reads (``_from_dcp.read``). A
#     checkpoint written before the record has none: only its byte count is checked.
LAYOUT_KEY = "fusedist_packed_layout"


def recorded_layout(md) -> Optional[list]:
    """The layout of quantized storage recorded in DCP's metadata ``md`` of one key (a
    ``TensorStorageMetadata``), or None (Note [the layout of quantized storage in DCP])."""
    for chunk in getattr(md, "chunks", None) or ():
        layout = getattr(chunk, LAYOUT_KEY, None)
        if layout is not None:
            return [list(r) for r in layout]
    return None


def layout_mismatch(key: str, recorded: Optional[list], layout: Optional[list]) -> Optional[str]:
    """Why canonical bytes recorded as ``recorded`` cannot load into a weight of ``layout``, or
    None (either unknown, or the same)."""
    if recorded is None or layout is None or [list(r) for r in recorded] == [list(r) for r in layout]:
        return None
    return (f"'{key}' holds quantized storage whose inner tensors are {_inner(recorded)}; the model's weight has "
            f"{_inner(layout)} (quantized with other block sizes?): its bytes would load as other numbers. "
            "Quantize the model's weight as the saved one was")


def _inner(layout: list) -> str:
    return ", ".join(f"{n} {tuple(shape)} {dtype}" for n, _, shape, dtype in layout)


def _read_items_code():
    """The code object of torch's ``planner_helpers._create_read_items``, or None."""
    helpers = sys.modules.get("torch.distributed.checkpoint.planner_helpers")
    return getattr(getattr(helpers, "_create_read_items", None), "__code__", None)


def _check_layout_at_read(piece: "ShardedPiece") -> None:
    """Refuse a ``dcp.load`` of canonical bytes recorded in another layout than ``piece``'s
    (Note [the layout of quantized storage in DCP]): torch's planner asks for the chunks from
    ``_create_read_items(fqn, md, obj)``, through ``_create_chunk_list``."""
    if piece._fs_layout is None:
        return
    try:
        frame = sys._getframe(3)  # (this, __create_chunk_list__, _create_chunk_list, _create_read_items)
    except ValueError:
        return
    code = _read_items_code()
    if code is None or frame.f_code is not code:
        return
    fqn, md = frame.f_locals.get("fqn"), frame.f_locals.get("md")
    problem = layout_mismatch(str(fqn), recorded_layout(md), piece._fs_layout)
    if problem is not None:  # (not a ValueError: torch's caller rewords those as a metadata type error)
        raise RuntimeError(f"fully_shard state dict: loading torch's distributed checkpoint: {problem}")


class Ranges(tuple):
    """Byte ranges ``((lo, hi), ...)`` of quantized storage's canonical bytes that one entry
    holds (Note [quantized storage] in packed.py): a region of its own kind."""


def _is_box(region: tuple) -> bool:
    return isinstance(region[0], tuple) and not isinstance(region, Ranges)


def _region(region: tuple) -> tuple:
    if isinstance(region, Ranges):
        return Ranges((int(lo), int(hi)) for lo, hi in region)
    if _is_box(region):
        return tuple(int(o) for o in region[0]), tuple(int(s) for s in region[1])
    return int(region[0]), int(region[1])


def describe_region(region: tuple) -> str:
    if isinstance(region, Ranges):
        return f"the byte ranges {[tuple(r) for r in region]}"
    if _is_box(region):
        return f"the box at offsets {list(region[0])} of sizes {list(region[1])}"
    return f"elements [{region[0]}, {region[1]})"


def piece_region(unit, index: int) -> tuple:
    """What this rank's piece of parameter ``index`` of ``unit`` holds: ``(lo, hi)`` of the
    flattened parameter, or for a dim-sharded parameter its box ``((offsets), (sizes))``."""
    if unit.ext[index] is not None and unit.ext[index].packed:  # Note [quantized storage] in packed.py
        return Ranges(unit.ext[index].held_ranges())
    sec, j = unit.layout.section_of(index)
    if not sec.chunked:
        return tuple(unit.element_range(index))
    piece, dim = sec.layout.piece(j, unit.rank), unit.layout.dims[index]
    return tuple(piece.rows[0] if d == dim else 0 for d in range(len(piece.shape))), tuple(piece.shape)


# Note [staging a piece]
#     ``dcp.async_save`` first stages the state dict to CPU memory. Its default stager rebuilds
#     every tensor from its metadata: ``y = x.new_empty([])`` (a plain tensor, for a subclass),
#     then ``y.set_(copy of x's storage, x.storage_offset(), x.size(), x.stride())``, then the
#     attributes in ``x.__dict__``. For a piece, ``size()`` is the whole parameter's (what DCP's
#     load compares), so the staged entry was a plain tensor of the whole shape over the
#     piece's storage: it read past the piece (a neighbour's values, or memory never written)
#     and was saved as one replicated tensor -- a checkpoint that loads wrong values, silently.
#     ``set_`` does not pass through ``__torch_function__``, so the piece answers that one
#     caller: ``size()`` called from the stager's ``_offload_tensor`` (its code object,
#     compared by identity, only once torch has imported the stager) is the piece's shape, and
#     ``new_empty`` on a piece returns a piece (the carrier and its metadata kept). The staged
#     entry is then this rank's piece, saved as its chunks. Code that instead builds a plain
#     tensor of ``size()`` and copies a piece into it (torch's ``BlockingAsyncStager``,
#     ``_create_cpu_state_dict``) is refused at the copy: the piece cannot fill the whole
#     parameter, and the carrier would be lost.


def _stager_code():
    """The code object of torch's default async-save stager's tensor copy, or None."""
    stager = sys.modules.get("torch.distributed.checkpoint._state_dict_stager")
    offload = getattr(getattr(stager, "StateDictStager", None), "_offload_tensor", None)
    return getattr(offload, "__code__", None)


def _refuse_whole_from_piece(dest, piece: ShardedPiece) -> None:
    if isinstance(dest, ShardedPiece) or tuple(dest.shape) == piece._fs_piece_shape:
        return
    if tuple(dest.shape) == tuple(piece._fs_size):
        raise ValueError(
            f"fully_shard state dict: a tensor of the whole parameter's shape {tuple(piece._fs_size)} cannot be "
            f"filled from this rank's piece ({describe_region(piece._fs_range)}); code that builds a plain tensor of "
            "entry.size() and copies the entry into it (torch's BlockingAsyncStager) would save one rank's "
            "piece as the whole parameter. Stage with dcp.async_save's default stager, or use "
            "get_state_dict(..., options=StateDictOptions(cpu_offload=True)) (Note [staging a piece])")
