"""Where the parameters a ``shard_placement_fn`` shards on a dim other than 0 live in a unit.

Note [dim-sharded sections]
    ``shard_placement_fn(param) -> Shard(dim)`` with ``dim != 0`` (expert weights split by
    columns, matrices an optimizer such as Muon wants whole along dim 0) asks for torch's
    FSDP2 semantics: rank ``r``'s piece is ``torch.chunk(param, S, dim)[r]`` -- empty, with
    ``0`` on ``dim``, past the last chunk -- and a piece at rest has that shape. The
    row-aligned layout (Note [row-aligned flat layout] in layout.py) cannot give that: its
    pieces are runs of whole rows wherever the flat buffer is cut. So such parameters are laid
    out as FSDP2 lays out every parameter, in a section of their own (one per trainable flag
    and dtype, after the row-aligned section of the same kind, Note [trainable section] and
    Note [dtype sections]): each parameter has a slot of chunk 0's size (its length on
    ``dim`` rounded up over ``S``, times the other dims) at the same offset of every rank's
    shard, and rank ``r``'s chunk is stored contiguously at the start of that slot, the rest
    zero padding. The piece is a contiguous tensor on the shard, as every other piece, so
    optimizers, clipping and the scaler treat it alike. (FSDP2 keeps the chunk in a slot shaped
    like chunk 0 and narrows it, which for a short last chunk on an inner dim is a strided
    tensor; with the whole chunk first, only the slot's tail is padding.)

    The price, paid by these parameters only: the gathered section holds rank ``r``'s chunks
    at ``r * shard_numel``, so a whole parameter is not a view of it. After each all-gather
    the chunks are copied out into the unsharded parameter's own buffer (one strided copy
    when ``S`` divides the length on ``dim``, else one per rank), and before the
    reduce-scatter each unsharded gradient is copied into its chunks' places (torch's
    ``chunk_cat``). That is one extra copy of these parameters each way, their whole size
    held twice while the unit is gathered, and one more all-gather and reduce-scatter per unit
    holding them (a section is one collective). Parameters sharded on dim 0 (the default)
    stay in the row-aligned sections, gathered as views with no copy, exactly as without a
    ``shard_placement_fn``.

    Unlike FSDP2 in torch 2.13, a length on ``dim`` that ``S`` does not divide is accepted
    (FSDP2 raises ``NotImplementedError``): the last chunks are shorter, or empty, and the
    padding lies in the slot, never in the piece.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .layout import Piece, Slot


class ChunkLayout:
    """The layout of one dim-sharded section (Note [dim-sharded sections]); the same
    questions as :class:`~fusedist.fsdp.layout.UnitLayout` answers, in the section's
    coordinates. ``slots[j].offset`` is the parameter's slot in every rank's shard (its
    place in the gathered section is that plus ``r * shard_numel`` for rank ``r``'s chunk)."""

    def __init__(self, shapes: Sequence[tuple], dims: Sequence[int], world_size: int):
        self.world_size = world_size
        self.dims = [int(d) for d in dims]
        self.flat_pieces: set = set()  # (never: every piece is a chunk)
        self.slots: list[Slot] = []
        self.slot_numel: list[int] = []  # chunk 0's elements: the slot each rank gives the parameter
        #: where each whole parameter starts in the unsharded copy-out buffer, and that buffer's size
        self.whole_offsets: list[int] = []
        pos = whole = 0
        for shape, d in zip(shapes, self.dims):
            shape = tuple(int(s) for s in shape)
            numel = math.prod(shape)
            chunk = -(-shape[d] // world_size)
            padded = chunk * (numel // shape[d]) if shape[d] else 0
            self.slots.append(Slot(pos, numel, shape, 1))
            self.slot_numel.append(padded)
            self.whole_offsets.append(whole)
            pos += padded
            whole += numel
        self.shard_numel = pos
        self.whole_numel = whole

    @property
    def total_numel(self) -> int:
        return self.shard_numel * self.world_size

    def chunk(self, j: int, rank: int) -> tuple[int, int]:
        """``(start, length)`` on its dim of parameter ``j``'s chunk ``rank`` (torch.chunk's)."""
        shape, d = self.slots[j].shape, self.dims[j]
        size = -(-shape[d] // self.world_size)
        start = min(rank * size, shape[d])
        return start, min(size, shape[d] - start)

    def piece(self, j: int, rank: int) -> Piece:
        slot, d = self.slots[j], self.dims[j]
        start, length = self.chunk(j, rank)
        shape = slot.shape[:d] + (length,) + slot.shape[d + 1:]
        return Piece(slot.offset, math.prod(shape), shape, (start, start + length))

    def gaps(self) -> list[tuple[int, int]]:
        """The padding of the gathered section: the end of each slot its chunk leaves empty."""
        out = []
        for r in range(self.world_size):
            for j, slot in enumerate(self.slots):
                a = r * self.shard_numel + slot.offset
                used = self.piece(j, r).numel
                if used < self.slot_numel[j]:
                    out.append((a + used, a + self.slot_numel[j]))
        return out

    # ------------------------------------------------------------------ copies
    def _even_view(self, gathered: torch.Tensor, j: int):
        """Parameter ``j``'s chunks in ``gathered`` as one strided view ``(outer, S, chunk,
        inner)`` when ``S`` divides its length on its dim, else None."""
        slot, d = self.slots[j], self.dims[j]
        n = slot.shape[d]
        if n % self.world_size or not slot.numel:
            return None
        c = n // self.world_size
        outer, inner = math.prod(slot.shape[:d]), math.prod(slot.shape[d + 1:])
        return gathered.as_strided((outer, self.world_size, c, inner), (c * inner, self.shard_numel, inner, 1),
                                   gathered.storage_offset() + slot.offset)

    def _pairs(self, gathered: torch.Tensor, whole: torch.Tensor, j: int):
        """``(chunk in gathered, its place in whole)`` for each rank holding a chunk."""
        d = self.dims[j]
        for r in range(self.world_size):
            p = self.piece(j, r)
            if p.numel:
                a = r * self.shard_numel + p.shard_offset
                yield gathered[a:a + p.numel].view(p.shape), whole.narrow(d, p.rows[0], p.rows[1] - p.rows[0])

    def copy_out(self, gathered: torch.Tensor, j: int, whole: torch.Tensor) -> None:
        """Write parameter ``j`` whole into ``whole`` from the gathered section ``gathered``."""
        even = self._even_view(gathered, j)
        if even is not None:
            whole.view(even.shape[0], even.shape[1], even.shape[2], even.shape[3]).copy_(even)
            return
        for src, dst in self._pairs(gathered, whole, j):
            dst.copy_(src)

    def copy_in(self, gathered: torch.Tensor, j: int, whole: torch.Tensor, add: bool = False) -> None:
        """Write (or add) the whole tensor ``whole`` into parameter ``j``'s chunks of a buffer
        laid out as the gathered section: the layout a reduce-scatter hands each rank its
        chunk from."""
        even = self._even_view(gathered, j)
        if even is not None:
            src = whole.reshape(even.shape)
            even.add_(src) if add else even.copy_(src)
            return
        for dst, src in self._pairs(gathered, whole, j):
            dst.add_(src) if add else dst.copy_(src)

    def assemble(self, gathered: torch.Tensor, j: int) -> torch.Tensor:
        """Parameter ``j`` whole, a new tensor, from the gathered section ``gathered``."""
        whole = torch.empty(self.slots[j].shape, dtype=gathered.dtype, device=gathered.device)
        self.copy_out(gathered, j, whole)
        return whole
