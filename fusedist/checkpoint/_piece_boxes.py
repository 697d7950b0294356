"""Which box of the whole parameter a ``fully_shard`` piece sharded on a dim other than 0 is,
and how to cut a rank's piece out of the whole parameter at load.

A checkpoint writes such a piece as one box fragment (Note [box fragments] in
``zero/box_fragments.py``); a Shard(0) piece stays a range fragment, as before. At load every
parameter is assembled whole from every rank's fragments, and this rank's piece is cut out
of it: a range for Shard(0), ``narrow`` on the dim otherwise (Note [stage-3 checkpoints]).
"""

from __future__ import annotations

from typing import Optional

import torch


def chunk_box(unit, index: int) -> Optional[tuple[int, int, int]]:
    """``(dim, start, length)`` of this rank's piece of parameter ``index`` of ``unit`` when it
    is sharded on a dim other than 0 (``torch.chunk``'s chunk); None for a Shard(0) one."""
    sec, j = unit.layout.section_of(index)
    if not sec.chunked:
        return None
    start, length = sec.layout.chunk(j, unit.rank)
    return sec.layout.dims[j], start, length


def has_box(unit, index: int) -> bool:
    """Whether the piece is a box (of either rank): the parameter is sharded on another dim."""
    return unit.layout.section_of(index)[0].chunked


def cut(flat_whole: torch.Tensor, unit, index: int) -> torch.Tensor:
    """This rank's piece of parameter ``index``, flattened and of its own storage, out of the
    whole parameter ``flat_whole`` (flattened, row-major; the global parameter of a
    tensor-parallel one)."""
    whole = flat_whole.view(unit.whole_shape(index))
    if unit.tp[index] is not None:  # the global parameter: this rank's local tensor first
        whole = unit.tp[index].local_of_global(whole)
    return unit.piece_of_whole(index, whole).clone(memory_format=torch.contiguous_format).reshape(-1)
