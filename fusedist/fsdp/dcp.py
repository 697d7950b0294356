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
    ``shape``/``numel()``/``len()`` are the piece's (except to torch's async-save stager: Note [staging a piece]). Tensor's own Python methods that rebuild a
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
    first, as FSDP2's do, so no gathered copy outlives a load (``_reshard_at_rest``).

The full-state-dict options of torch's helpers are read in ``torch_helpers.py`` (Note [full
state dict through torch's helpers]).
"""

from __future__ import annotations

import copy
import math
import sys
import weakref
from typing import Optional

import torch
from torch import nn

from .._wrapper import values_of
from .torch_helpers import full_state_dict_requested

__all__ = ["ShardedPiece", "install_state_dict_hooks", "chunks_of"]


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
    def wrap_ranges(entry: torch.Tensor, full_shape, ranges) -> "ShardedPiece":
        """The entry of quantized storage (Note [quantized storage] in packed.py): ``entry`` is
        the byte ranges ``ranges`` of its canonical bytes (1-D, of ``full_shape``), end to end."""
        return ShardedPiece._carrier(entry, full_shape, Ranges(ranges), tuple(entry.shape))

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
        self._fs_size, self._fs_writes = src._fs_size, src._fs_writes
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
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(o),
                                                                                 sizes=torch.Size(s)),
                                                      properties=props, size=self._fs_size))
                for o, s in self._chunks()]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

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


# ---------------------------------------------------------------------------- hooks
# Note [state-dict hooks on every module of a unit]
#     A unit's parameters live on the modules under the module ``fully_shard`` was called on
#     (``blocks.0.mlp.0.weight`` is ``_parameters["weight"]`` of a Linear deep in the block),
#     and torch's state-dict calls are made on any of them: ``block.mlp.state_dict()``,
#     ``block.mlp.load_state_dict(pretrained)``, ``get_model_state_dict(block.mlp, ...)``,
#     ``set_model_state_dict(block.mlp, full, ...)`` (partial loads, LoRA adapters, one layer
#     exported; Lightning loads a full checkpoint submodule by submodule). With FSDP2 each
#     parameter is a DTensor, so these work from any module. Hooks on the unit's module alone
#     see none of these calls: the submodule returned its plain pieces (saved by DCP as
#     replicated tensors, one rank's rows as the whole) and refused whole parameters with a
#     shape mismatch against the piece.
#
#     So every module of the unit that holds parameters directly (and each module ``fully_shard``
#     was called on, which reshards at rest) gets the hooks, and each module's hooks handle its
#     *own* parameters only -- ``prefix + attr`` -- wherever the call starts: state_dict() puts
#     a ShardedPiece (or, under ``get_model_state_dict(full_state_dict=True)``, the whole
#     parameter) in the dict, load_state_dict cuts a whole parameter to this rank's piece and
#     reports a wrong shape against the whole parameter's shape, as FSDP2 does. Each module's
#     hooks run at its own level of the recursion, before any ancestor's state-dict post-hook
#     and after every ancestor's load pre-hook, so the keys are the module paths even under
#     torch's ``checkpoint_wrapper``, whose hooks drop and restore ``_checkpoint_wrapped_module.``
#     at the wrapper's level. A full state dict gathers each unit once per dict, not once per
#     module, and keeps whole only the parameters that dict will hold: those of the modules
#     under the module the state dict is taken of (torch's helper names it: Note [full state
#     dict through torch's helpers] in torch_helpers.py). ``get_model_state_dict(block.attn,
#     full_state_dict=True)`` all-gathers the block once, copies out ``attn``'s parameters and
#     frees the gathered buffer at once; the rest of the block is never held whole, and what
#     the per-dict cache keeps are the dict's own entries, released with it (FSDP2 gathers
#     each DTensor entry on its own, so it holds no more either). The modules' own parameters
#     are found from the unit's registrations (``_slots_of``), built once per unit, not by a
#     walk over the unit.

_KEEP_VARS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()
# a hooked module -> the module fully_shard was called on, whose state holds the unit
_OWNER: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def install_state_dict_hooks(module: nn.Module) -> None:
    """The state-dict hooks of a module that ``fully_shard`` gave a unit and of the modules
    under it that hold its parameters (Note [state-dict hooks on every module of a unit])."""
    from .members import managed_modules

    for _, sub in managed_modules(module):
        if sub in _OWNER or (sub is not module and not any(p is not None for p in sub._parameters.values())):
            continue
        _OWNER[sub] = module
        sub.register_state_dict_pre_hook(_pre_state_dict)
        sub.register_state_dict_post_hook(_post_state_dict)
        sub.register_load_state_dict_pre_hook(_pre_load_state_dict)


def _unit_state(module: nn.Module):
    """The fully_shard state holding the unit of ``module``'s parameters, or None."""
    from .state import state_of

    owner = _OWNER.get(module)
    return state_of(owner) if owner is not None else None


def _entries(module: nn.Module, prefix: str):
    """``(key, unit, index)`` of every sharded parameter ``module`` holds itself (its
    submodules' are their own hooks' (Note [state-dict hooks on every module of a unit])): the
    unit's own parameters and those it borrows, while the module still holds them."""
    st = _unit_state(module)
    if st is None or st.unit is None:
        return
    unit = st.unit
    for attr, k, i in _slots_of(unit).get(id(module), ()):
        holder = unit if k < 0 else unit.borrowed[k][0]
        p = module._parameters.get(attr)
        if p is not None and (p is holder.sharded[i] or p is holder.visible[i]):
            yield f"{prefix}{attr}", holder, i


_SLOTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _slots_of(unit) -> dict:
    """id of each module holding a parameter of ``unit`` -> ``(attr, k, index)`` of each such
    parameter: ``k`` -1 for the unit's own parameter ``index``, else the position in
    ``unit.borrowed`` of the unit lending it (ints only: no reference back to the modules).
    Built once per unit: each module's hook finds its own parameters without a walk over the
    whole unit."""
    slots = _SLOTS.get(unit)
    if slots is None:
        slots = {}
        for i, regs in enumerate(unit.registrations):
            for m, attr in regs:
                slots.setdefault(id(m), []).append((attr, -1, i))
        for k, (_, i, regs) in enumerate(unit.borrowed):
            for m, attr in regs:
                slots.setdefault(id(m), []).append((attr, k, i))
        _SLOTS[unit] = slots
    return slots


def _reshard_at_rest(module: nn.Module) -> None:
    """Reshard the module's unit before its state dict is taken or loaded, as FSDP2's
    state-dict pre-hooks do: a load (or ``dcp.load`` into the entries) writes the pieces, and a
    copy gathered before it would be stale (Note [forward without gradients] in ``state.py``).
    Not while the unit's forward or backward is running, nor between a forward and its
    backward (which reads the gathered parameters)."""
    from . import recovery

    st = _unit_state(module)
    if st is None or st.unit is None or st.backward_pending:
        return
    if st.ctx is not None and recovery.is_running(st.ctx):
        return
    st.unit.reshard()


def _pre_state_dict(module, prefix, keep_vars) -> None:
    _reshard_at_rest(module)
    _KEEP_VARS[module] = bool(keep_vars)


def as_entry(value: torch.Tensor, unit, index: int) -> ShardedPiece:
    """``value`` -- parameter ``index`` of ``unit``'s piece, or a state tensor shaped like it --
    as a state-dict entry: a ShardedPiece that knows the whole parameter's shape and range."""
    region = piece_region(unit, index)
    spec = unit.ext[index]
    if spec is not None and spec.packed:  # its ranges of the canonical bytes (Note [quantized storage])
        return ShardedPiece.wrap_ranges(spec.entry(spec.inner(value.detach())), (spec.canonical_bytes,), region)
    # (an extension piece: the high-precision values its subclass wraps, Note [all-gather extension])
    value = values_of(value.detach())
    if isinstance(value, ShardedPiece):
        value = value.local()
    if not value.is_contiguous():
        value = value.contiguous()
    if _is_box(region):
        entry = ShardedPiece.wrap_box(value, unit.layout.slots[index].shape, *region)
    else:
        entry = ShardedPiece.wrap(value, unit.layout.slots[index].shape, *region)
    spec = unit.tp[index]
    if spec is not None:  # Note [tensor-parallel parameters] in tensor_parallel.py
        entry._fs_size = torch.Size(spec.global_shape)
        entry.placed(spec.local_shape, spec.offsets)
    if unit.tp_comm is not None and (spec is None or spec.replicated):
        # held alike by the tensor-parallel ranks, but cut by layouts that may differ between them
        # (local tensors of unequal sizes in the unit): written by the first one only
        entry._fs_writes = unit.tp_comm.rank == 0
    return entry


def whole_to_piece(value: torch.Tensor, unit, index: int) -> torch.Tensor:
    """``value`` cut to this rank's piece of parameter ``index`` of ``unit`` (a view) when it has
    the whole parameter's shape, as a full state dict's entries do; anything else as it is (a
    piece as saved at this layout, or a shape the loader itself reports)."""
    piece_shape, full_shape = tuple(unit.sharded[index].shape), unit.whole_shape(index)
    if tuple(value.shape) == piece_shape or tuple(value.shape) != full_shape:
        return value
    if isinstance(value, ShardedPiece):
        value = value.local()
    if unit.tp[index] is not None:  # the global parameter: this rank's local tensor of it first
        value = unit.tp[index].local_of_global(value)
    return unit.piece_of_whole(index, value)


_GATHERED: dict = {}  # id of a state dict being filled -> _FullDict


class _FullDict:
    """What one full state dict being filled has gathered: per unit, the whole parameters it
    takes (the others None), and which those are."""

    def __init__(self, top: Optional[nn.Module]):
        # id(unit) -> indices of its parameters held by the modules under ``top`` (None: unknown)
        self.wanted = _wanted_under(top) if top is not None else None
        self.wholes: dict = {}  # id(unit) -> gather_params' list


def _wanted_under(top: nn.Module) -> dict:
    """id of each unit -> the indices of its parameters that the modules under ``top`` hold
    (its own and those lent to other units): what ``top``'s state dict takes."""
    wanted: dict = {}
    for m in top.modules():
        for _, holder, i in _entries(m, ""):
            wanted.setdefault(id(holder), set()).add(i)
    return wanted


def _whole(state_dict, unit, i: int, to_cpu: bool, top: Optional[nn.Module]) -> torch.Tensor:
    """Parameter ``i`` of ``unit`` whole, for the full state dict ``state_dict`` of ``top``:
    the unit is gathered once per dict, keeping only what the dict takes (Note [state-dict
    hooks on every module of a unit]) -- a collective the first time."""
    from .state_dict import gather_params

    entry = _GATHERED.get(id(state_dict))
    if entry is None:
        try:
            weakref.finalize(state_dict, _GATHERED.pop, id(state_dict), None)
        except TypeError:  # a destination that takes no weak reference: gather for each entry
            return gather_params(unit, to_cpu=to_cpu, only={i})[i]
        entry = _GATHERED[id(state_dict)] = _FullDict(top)
    wholes = entry.wholes.get(id(unit))
    if wholes is None:
        only = entry.wanted.get(id(unit), set()) | {i} if entry.wanted is not None else None
        wholes = entry.wholes[id(unit)] = gather_params(unit, to_cpu=to_cpu, only=only)
    return wholes[i]


@torch.no_grad()
def _post_state_dict(module, state_dict, prefix, local_metadata) -> None:
    if _KEEP_VARS.pop(module, False):
        return  # the parameters themselves, as asked
    entries = [(key, unit, i) for key, unit, i in _entries(module, prefix) if key in state_dict]
    full = full_state_dict_requested() if entries else None
    for key, unit, i in entries:
        if full is None:
            state_dict[key] = as_entry(unit.sharded[i], unit, i)
        else:
            state_dict[key] = _whole(state_dict, unit, i, *full)


@torch.no_grad()
def _pre_load_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs) -> None:
    """An entry of the whole parameter's shape (a full state dict) is cut to this rank's piece;
    one of another shape is reported against the whole parameter's shape, as FSDP2 reports it."""
    _reshard_at_rest(module)
    for key, unit, i in _entries(module, prefix):
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if unit.ext[i] is not None and unit.ext[i].packed:
            problem = _load_packed(value, unit, i, key)
            if problem is not None:
                error_msgs.append(f"size mismatch for {key}: {problem}")
            state_dict[key] = unit.sharded[i].detach()  # loaded above; copied onto itself
            continue
        problem = _wrong_entry(value, unit, i)
        if problem is None:
            state_dict[key] = whole_to_piece(value, unit, i)
            continue
        error_msgs.append(f"size mismatch for {key}: {problem}")
        state_dict[key] = unit.sharded[i].detach()  # copied onto itself; the load raises with the message


def _load_packed(value: torch.Tensor, unit, index: int, key: str) -> Optional[str]:
    """Load ``value`` into quantized-storage parameter ``index`` (Note [quantized storage] in
    packed.py): its entry as saved at this layout (or at any, through DCP), its canonical
    bytes, the whole subclass, or a plain weight to quantize. Returns why it cannot, or None."""
    spec, row = unit.ext[index], unit.piece_data(index)
    region = piece_region(unit, index)
    if isinstance(value, ShardedPiece):
        if value.size() != torch.Size((spec.canonical_bytes,)) or value.element_range != region:
            return (f"the entry holds {describe_region(value.element_range)} of {tuple(value.size())} canonical "
                    f"bytes of quantized storage, this rank's {describe_region(region)} of ({spec.canonical_bytes},) "
                    "(a state dict of another world size or layout: load it with torch.distributed.checkpoint, or "
                    "load whole parameters).")
        value = value.local()
    entry_bytes = sum(hi - lo for lo, hi in region)
    try:
        if value.dtype == torch.uint8 and tuple(value.shape) == (entry_bytes,) != (spec.canonical_bytes,):
            row.copy_(spec.row_of_entry(value))  # (this rank's entry as saved at this layout)
        else:
            row.copy_(spec.row_of_whole(value, key, row))
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _wrong_entry(value: torch.Tensor, unit, index: int) -> Optional[str]:
    """Why ``value`` cannot load into parameter ``index`` of ``unit``, or None: it must be the
    whole parameter, this rank's piece of it as this layout cuts it, or that piece's entry."""
    full_shape = unit.whole_shape(index)
    if isinstance(value, ShardedPiece):
        if value.size() != torch.Size(full_shape):
            return (f"copying a param with shape {value.size()} from checkpoint, the shape in current model "
                    f"is {torch.Size(full_shape)}.")
        region = piece_region(unit, index)
        if value.element_range != region or value.placement != unit.placement(index):
            return (f"the entry is a piece holding {describe_region(value.element_range)} of the parameter, "
                    f"this rank's piece holds {describe_region(region)} (a state dict of another world size or "
                    "layout: load it with torch.distributed.checkpoint, or load whole parameters).")
        return None
    if tuple(value.shape) in (tuple(full_shape), tuple(unit.sharded[index].shape)):
        return None
    return (f"copying a param with shape {value.shape} from checkpoint, the shape in current model is "
            f"{torch.Size(full_shape)}.")
