"""Where each parameter of a sharded unit lives in its flat buffer, and which rows each rank holds.

Note [row-aligned flat layout]
    A unit's parameters are laid end to end in one flat buffer of ``world_size * shard_numel``
    elements; rank ``r`` holds the ``r``-th slice of ``shard_numel``. So one all-gather of the
    shards *is* the unsharded buffer: every gathered parameter is a contiguous view of it, with
    no copy-out (torch's FSDP2 gathers per-parameter dim-0 shards and copies them out).

    A parameter that straddles a shard boundary is cut there. The cut always falls on a
    whole row (a row: one index of dim 0, ``numel // shape[0]`` elements): before placing a
    parameter that would be cut mid-row, the layout pads so that the boundary lands between
    rows, and it makes the shard size a multiple of the row size of any parameter long enough
    to be cut twice. Hence every rank's piece of a parameter is a block of whole rows,
    ``shape (rows, *shape[1:])``: the pieces keep the parameter's number of dimensions, so
    optimizer-group rules such as "no weight decay for ``p.dim() < 2``" sort the pieces as
    they sort the parameters. Padding is below one row per shard boundary plus the tail that
    makes the shards equal.

    A 0-dim parameter is never cut (one element); its piece is the parameter (shape ``()``)
    on the rank holding it and an empty ``(0,)`` tensor elsewhere.

    The multiple-of-row-size rule can blow up when several parameters are cut twice (it
    takes the least common multiple of their row sizes: coprime widths at many ranks). When
    the padding it would add exceeds 1/64 of the unit (and ``MIN_ROW_PADDING`` elements), the
    parameter asking for it is cut anywhere instead, and its pieces are 1-D (``flat_pieces``);
    the rest keep their rows.

Note [trainable section]
    A unit whose parameters are partly frozen (fine-tuning, LoRA: big frozen weights, small
    trainable adapters) is laid out as two sections, each a row-aligned layout of its own:
    the parameters that required gradients when the unit was built, then the frozen ones.
    Rank ``r``'s shard is its trainable shard followed by its frozen shard; the gathered
    buffer is the gathered trainable section followed by the gathered frozen section, so
    every gathered parameter is still one contiguous view -- at the price of one all-gather
    per section (two for such a unit, one for any other).

    Why not one layout and a gradient layout beside it: the gradient shard must line up
    with the parameter pieces (rank ``r``'s ``.grad`` covers the elements its piece holds,
    with no exchange after the reduce-scatter). With one layout the trainable parameters lie
    wherever registration order put them -- all of a LoRA block's adapters after the base
    weight, in the last rank's shard -- so a gradient buffer of each rank's trainable pieces,
    padded to the largest, is world_size times the adapters. With sections, the trainable
    section *is* the gradient layout: the gradient buffer is laid out like the gathered
    trainable section, its reduce-scatter leaves each rank its trainable shard, and every
    piece's gradient is at the piece's offset in that section; the frozen section is never
    reduced, nor given gradient storage. The split is balanced: each rank holds about
    1/world_size of the trainable elements and of the frozen ones.

    Flags changed after wrapping are followed (``grads.py``): a section is reduce-scattered
    when one of its parameters requires a gradient now, so a frozen-section parameter that was
    unfrozen makes its section reduce too (the unit's whole size, as without sections), and
    a trainable-section parameter that was frozen is left a zero slot and no ``.grad`` -- unless
    unsynchronized backwards (``set_requires_gradient_sync(False)``) accumulated gradients for it
    while it was trainable: the synchronized backward reduces those into its ``.grad``, as FSDP2
    does and an unsharded model keeps them.

Note [dtype sections]
    A unit whose parameters have different dtypes (a bf16 decoder layer with fp32 norms or an
    fp32 MoE router: Hugging Face's ``_keep_in_fp32_modules``) is split further: one section
    per (trainable, dtype), in order trainable then frozen, dtypes in order of first
    registration. A flat buffer holds one dtype, so such a unit keeps each section's shard in
    a tensor of its own dtype (``ShardedUnit.shards``) and gathers it into a gathered tensor
    of its own (``ShardedUnit.fulls``): in the section's dtype, or ``mp_policy.param_dtype``
    for floating sections when the policy sets one (FSDP2 casts every floating parameter;
    non-floating ones are never cast). The coordinates stay the unit's (``slots[i].offset``
    and ``piece(i, r).shard_offset`` count elements across the sections), each section's
    tensor starting at its ``full_base`` / ``shard_base``. Each trainable section is
    reduce-scattered on its own (grads.py), in ``reduce_dtype`` or else its gathered dtype, and
    its pieces' ``.grad`` come back in the section's dtype -- each parameter's own, as
    FSDP2's (a ``set_all_reduce_hook`` hook is called once per section, with that section's
    output). Gradient norms (``holder.py``) already sum over any pieces, so a clip is global
    across the dtypes; CPU offload keeps every section's shard on the CPU. The cost against one
    flat buffer is one all-gather and one
    reduce-scatter per extra dtype. A unit of one dtype has ``layout.mixed`` False and is laid
    out, gathered and reduced exactly as before: ``shards`` / ``fulls`` are then slices of
    its one ``shard`` / ``full`` tensor.

    torch 2.13's FSDP2 gathers mixed dtypes through a byte buffer, but its parameter group
    asserts one dtype among the trainable parameters ("uniform original parameter dtype"), so
    there a trainable fp32 router needs a unit of its own. ``model.to(dtype)`` and friends
    (``ShardedUnit.repack``) give each section the dtype its parameters now have.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Slot:
    """One parameter in the flat buffer: ``numel`` elements from ``offset``."""

    offset: int
    numel: int
    shape: tuple
    row_numel: int  # elements per index of dim 0 (1 for 0-dim parameters)


@dataclasses.dataclass(frozen=True)
class Piece:
    """A rank's part of one parameter: ``numel`` elements at ``shard_offset`` of its shard."""

    shard_offset: int
    numel: int
    shape: tuple
    rows: tuple  # (first row, end row) of the parameter this piece holds


#: The padding (elements, all ranks together) the row rule may always add to a unit: 16 KiB of
#: fp32, nothing beside the unit's own buffers, where 1/64 of a small unit (a root holding only
#: a ``Linear(12, 3)`` head) is no padding at all and cut its weight into 1-D pieces, which
#: "no weight decay for p.dim() < 2" then sorted as a bias (Note [row-aligned flat layout]).
MIN_ROW_PADDING = 4096


def _row_numel(shape: tuple) -> int:
    if len(shape) == 0 or shape[0] == 0:
        return 1
    return math.prod(shape[1:])


class UnitLayout:
    """The row-aligned layout of one unit (Note [row-aligned flat layout])."""

    def __init__(self, shapes: Sequence[tuple], world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        shapes = [tuple(int(d) for d in s) for s in shapes]
        numels = [math.prod(s) for s in shapes]
        rows = [_row_numel(s) for s in shapes]
        total = sum(numels)
        # most padding the row rule may add (beyond one row per cut): 1/64 of the unit, and at
        # least MIN_ROW_PADDING elements, so that a small unit (a head, a norm) keeps its rows
        budget = max(total // 64, MIN_ROW_PADDING)
        first = max(1, -(-total // world_size))
        step, shard = 1, first  # the shard size is a multiple of step
        #: parameters cut anywhere, with 1-D pieces (the row rule would pad too much)
        self.flat_pieces: set[int] = set()
        while True:
            offsets, bad = self._place(numels, rows, shard)
            end = offsets[-1] + numels[-1] if offsets else 0
            if bad is not None:
                wider = math.lcm(step, rows[bad])
                if (-(-shard // wider) * wider - first) * world_size > budget:
                    self.flat_pieces.add(bad)
                    rows[bad] = 1
                    step, shard = 1, first  # start over without that parameter's rule
                    continue
                step = wider
            elif end <= shard * world_size:
                break
            shard = max(shard, -(-end // world_size))
            shard = -(-shard // step) * step
        self.shard_numel = shard
        self.slots = [Slot(o, n, s, r) for o, n, s, r in zip(offsets, numels, shapes, rows)]

    @staticmethod
    def _place(numels, rows, shard):
        """Greedy placement for shard size ``shard``: (offsets, None), or (offsets, index) of a
        parameter that would be cut mid-row at a second boundary (the shard size must then be
        a multiple of its row size)."""
        pos, offsets = 0, []
        for i, (n, r) in enumerate(zip(numels, rows)):
            boundary = (pos // shard + 1) * shard
            if n > 1 and boundary < pos + n and (boundary - pos) % r:
                pos += (boundary - pos) % r  # the cut lands between two rows
            offsets.append(pos)
            b = (pos // shard + 1) * shard
            while b < pos + n:
                if (b - pos) % r:
                    return offsets, i
                b += shard
            pos += n
        return offsets, None

    @property
    def total_numel(self) -> int:
        return self.shard_numel * self.world_size

    def piece(self, index: int, rank: int) -> Piece:
        """Rank ``rank``'s piece of parameter ``index``."""
        slot = self.slots[index]
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
        if a >= b:
            flat = not slot.shape or index in self.flat_pieces
            shape = (0,) if flat else (0, *slot.shape[1:])
            return Piece(0, 0, shape, (0, 0))
        if not slot.shape:
            return Piece(a - lo, 1, (), (0, 1))
        if index in self.flat_pieces:
            return Piece(a - lo, b - a, (b - a,), (a - slot.offset, b - slot.offset))
        first, end = (a - slot.offset) // slot.row_numel, (b - slot.offset) // slot.row_numel
        assert (a - slot.offset) % slot.row_numel == 0 and (b - slot.offset) % slot.row_numel == 0, \
            "Note [row-aligned flat layout]: every cut falls between rows"
        return Piece(a - lo, b - a, (end - first, *slot.shape[1:]), (first, end))

    def gaps(self) -> list[tuple[int, int]]:
        """Ranges of the flat buffer holding no parameter (padding), as (start, end)."""
        out, pos = [], 0
        for slot in self.slots:
            if slot.offset > pos:
                out.append((pos, slot.offset))
            pos = max(pos, slot.offset + slot.numel)
        if pos < self.total_numel:
            out.append((pos, self.total_numel))
        return out


@dataclasses.dataclass(frozen=True)
class Section:
    """One row-aligned layout inside a unit: the parameters ``indices`` (unit indices, in
    order), whose shards start at ``shard_base`` of the unit's shard and whose gathered
    buffer starts at ``full_base`` of the unit's gathered buffer."""

    indices: tuple
    layout: UnitLayout
    shard_base: int
    full_base: int
    trainable: bool  # the parameters' requires_grad when the unit was built
    dtype: object = None  # the parameters' dtype (Note [dtype sections]); None: the unit's one dtype
    #: whether ``layout`` is a ChunkLayout of parameters sharded on another dim than 0 (Note
    #: [dim-sharded sections] in chunk_layout.py), whose whole parameters are copies, not views
    chunked: bool = False
    #: whether its parameters choose what is gathered (a ChunkLayout on dim 0 of them; Note
    #: [all-gather extension] in extension.py)
    extension: bool = False

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.shard_base, self.shard_base + self.layout.shard_numel

    @property
    def full_range(self) -> tuple[int, int]:
        return self.full_base, self.full_base + self.layout.total_numel


class SplitLayout:
    """A unit's layout: its trainable and its frozen parameters as two sections, each a
    :class:`UnitLayout` of its own (Note [trainable section]), and within each one section
    per dtype when the parameters' dtypes differ (Note [dtype sections]). Speaks in unit
    coordinates: ``slots[i].offset`` is in the gathered buffer, ``piece(i, r).shard_offset``
    in the shard (element positions; a mixed-dtype unit keeps each section in a tensor of
    its own dtype, at ``shard_base``/``full_base`` of these coordinates)."""

    def __init__(self, shapes: Sequence[tuple], trainable: Sequence[bool], world_size: int,
                 dtypes: Optional[Sequence] = None, dims: Optional[Sequence[int]] = None,
                 extension: Optional[Sequence[bool]] = None):
        if len(shapes) != len(trainable):
            raise ValueError(f"{len(shapes)} shapes but {len(trainable)} trainable flags")
        from .chunk_layout import ChunkLayout

        self.world_size = world_size
        #: each parameter's shard dim (Note [dim-sharded sections] in chunk_layout.py)
        self.dims = [int(d) for d in dims] if dims is not None else [0] * len(shapes)
        self.sections: list[Section] = []
        self._where: dict[int, tuple[int, int]] = {}  # unit index -> (section, index in it)
        ext = [bool(e) for e in extension] if extension is not None else [False] * len(shapes)
        kinds = list(dict.fromkeys(dtypes)) if dtypes is not None else [None]
        #: whether the unit keeps each section in a tensor of its own: its parameters have more
        #: than one dtype (Note [dtype sections]), or some are gathered in another form (Note
        #: [all-gather extension] in extension.py), whose sections have no gathered buffer
        self.mixed = len(kinds) > 1 or any(ext)
        kinds = kinds if self.mixed and dtypes is not None else [None]
        shard_base = full_base = 0
        # each kind's row-aligned section, then its dim-sharded one, then its extension one
        for flag, kind, how in [(f, k, c) for f in (True, False) for k in kinds for c in ("rows", "dim", "ext")]:
            indices = tuple(i for i, t in enumerate(trainable)
                            if bool(t) == flag and (kind is None or dtypes[i] == kind)
                            and how == ("ext" if ext[i] else "dim" if self.dims[i] else "rows"))
            chunked = how != "rows"
            if not indices and (flag or chunked or self.sections or shapes):
                continue  # (a unit without parameters keeps one empty section)
            if chunked:
                layout = ChunkLayout([tuple(shapes[i]) for i in indices], [self.dims[i] for i in indices], world_size)
            else:
                layout = UnitLayout([tuple(shapes[i]) for i in indices], world_size)
            for j, i in enumerate(indices):
                self._where[i] = (len(self.sections), j)
            self.sections.append(Section(indices, layout, shard_base, full_base, flag, kind, chunked, how == "ext"))
            shard_base += layout.shard_numel
            full_base += layout.total_numel
        self.shard_numel, self.total_numel = shard_base, full_base
        self.slots: list[Slot] = []
        self.flat_pieces: set[int] = set()
        for i in range(len(shapes)):
            sec, j = self.section_of(i)
            s = sec.layout.slots[j]
            self.slots.append(Slot(sec.full_base + s.offset, s.numel, s.shape, s.row_numel))
            if j in sec.layout.flat_pieces:
                self.flat_pieces.add(i)

    def section_of(self, index: int) -> tuple[Section, int]:
        """The section holding parameter ``index`` and its index there."""
        k, j = self._where[index]
        return self.sections[k], j

    def piece(self, index: int, rank: int) -> Piece:
        """Rank ``rank``'s piece of parameter ``index`` (``shard_offset`` in the unit's shard)."""
        sec, j = self.section_of(index)
        p = sec.layout.piece(j, rank)
        return dataclasses.replace(p, shard_offset=sec.shard_base + p.shard_offset)

    def element_range(self, index: int, rank: int) -> tuple[int, int]:
        """The elements ``[start, end)`` of parameter ``index`` (flattened) in ``rank``'s piece.
        A piece of a parameter sharded on another dim than 0 is no such range: refused, so no
        code reading pieces as ranges takes it silently (Note [dim-sharded sections])."""
        sec, j = self.section_of(index)
        if sec.chunked:
            raise DimShardedError(index, self.dims[index])
        p = sec.layout.piece(j, rank)
        if not p.numel:
            return 0, 0
        start = rank * sec.layout.shard_numel + p.shard_offset - sec.layout.slots[j].offset
        return start, start + p.numel

    def whole(self, index: int, gathered: torch.Tensor) -> torch.Tensor:
        """Parameter ``index`` whole from ``gathered``, its section's gathered buffer (section
        coordinates): a view, or for a dim-sharded parameter a new tensor (Note [dim-sharded
        sections] in chunk_layout.py)."""
        sec, j = self.section_of(index)
        if sec.chunked:
            return sec.layout.assemble(gathered, j)
        s = sec.layout.slots[j]
        return gathered[s.offset:s.offset + s.numel].view(s.shape)

    def gaps(self) -> list[tuple[int, int]]:
        """Ranges of the gathered buffer holding no parameter (padding), as (start, end)."""
        return [(sec.full_base + a, sec.full_base + b) for sec in self.sections for a, b in sec.layout.gaps()]


class DimShardedError(NotImplementedError):
    """A path that reads pieces as ranges of the flattened parameter met a parameter sharded on
    another dim; the caller names the parameter (Note [dim-sharded sections] in chunk_layout.py)."""

    def __init__(self, index: int, dim: int):
        super().__init__(f"parameter {index} of the unit is sharded on dim {dim}, and this path supports "
                         "only parameters sharded on dim 0")
        self.index, self.dim = index, dim


def alias(storage_of: torch.Tensor, offset: int, shape: tuple) -> torch.Tensor:
    """A new tensor on ``storage_of``'s storage (``offset`` in elements, contiguous ``shape``).

    A tensor of its own rather than a view: it has its own version counter, so writing the
    buffer (a collective landing in it) does not count as modifying a parameter autograd
    saved, and it can be made an ``nn.Parameter`` (a leaf)."""
    stride = torch.empty(shape, device="meta").stride() if shape else ()
    t = torch.empty(0, dtype=storage_of.dtype, device=storage_of.device)
    return t.set_(storage_of.untyped_storage(), storage_of.storage_offset() + offset, shape, stride)


