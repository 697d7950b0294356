"""Fragments that are a box of the parameter -- a ``fully_shard`` piece sharded on a dim other
than 0 -- assembled into the whole parameter's flat state.

Note [box fragments]
    Beside the range fragments of Note [fragments] (``state.py``), a checkpoint of a
    ``fully_shard`` model with parameters sharded on dim ``d > 0`` holds, for each such piece,
    one fragment ``{"box": (d, start, length), "master": ..., "state": {...}}``: the piece is
    ``param.narrow(d, start, length)`` (``torch.chunk``'s chunk), its values flattened
    row-major. Written as ranges of the flattened parameter it would be one fragment per index
    of the dims before ``d`` (4096 for a 4096 x 4096 Shard(1) weight, at any world size),
    each a pickled tensor per value. Measured for such a matrix with Adam's moments (its
    model and optimizer fragments), per rank's file: as ranges 0.4-0.6 s to save and 1 s to
    ``torch.load`` (every rank reads every file at load: 8 s per matrix at 8 ranks) and
    1.1 MiB of pickled views, assembled in 0.3-1.1 s; as one box at 8 ranks 0.02 s and
    0.015 s, assembled in 0.35 s. So a box is one fragment, and reading it needs a
    fusedist that knows boxes (checkpoint format version 3, Note [checkpoints of a newer
    fusedist] in ``checkpoint/layout.py``).

    A parameter's fragments are all boxes on one dim or all ranges (a save has one placement
    per parameter); the boxes must tile the dim exactly once. Assembly copies each box into
    its place in the whole parameter, so everything downstream (a DDP, ZeRO-1/2 or
    ``fully_shard`` load at any world size) sees the flat whole state a range save gives; a
    ``fully_shard`` load then cuts its chunk out with ``narrow``. Memory is what a Shard(0)
    load takes (the whole model and optimizer state on the CPU, Note [stage-3 checkpoints]).

Note [region fragments]
    A ``fully_shard`` piece of a tensor-parallel parameter is a block of the *global*
    parameter bounded on several dims at once: a ``RowwiseParallel`` weight's local tensor
    is a block of columns, and the unit's piece of it a block of that block's rows. Such a
    piece is one fragment ``{"region": ((start, length) for every dim), ...}``, its values
    flattened row-major (checkpoint format version 4). A box is the region bounded on one
    dim only, and is assembled as one. The regions of a parameter must tile it exactly once:
    each inside the parameter, none overlapping another, their sizes summing to its size.
"""

from __future__ import annotations

import math

import torch

from .state import StateDictError, same_scalar_state


def is_box(fragment: dict) -> bool:
    """Whether ``fragment`` is a box or a region (not a range of the flattened parameter)."""
    return "box" in fragment or "region" in fragment


def region_of(fragment: dict, shape: tuple) -> tuple:
    """``((start, length), ...)`` per dim of a box or region fragment (Note [region fragments])."""
    if "region" in fragment:
        return tuple((int(s), int(n)) for s, n in fragment["region"])
    dim, start, length = (int(v) for v in fragment["box"])
    return tuple((start, length) if d == dim else (0, size) for d, size in enumerate(shape))


def _check_tiling(frags: list, shape: tuple, which: str, source: str) -> None:
    """Refuses boxes (sorted by start) on several dims, or not covering their dim exactly once."""
    dims = sorted({int(f["box"][0]) for f in frags})
    if len(dims) != 1 or not 0 <= dims[0] < len(shape):
        raise StateDictError(f"{source}: the box fragments of {which} split dims {dims}")
    dim, cursor = dims[0], 0
    for f in frags:
        _, start, length = f["box"]
        if start != cursor or length <= 0:
            break
        cursor += length
    if cursor != shape[dim] or sum(f["box"][2] for f in frags) != shape[dim]:
        raise StateDictError(
            f"{source}: the box fragments of {which} cover "
            f"{[tuple(f['box'][1:]) for f in frags]} of dim {dim}, not exactly [0, {shape[dim]}) once; shards are "
            "missing or come from different checkpoints")


def _check_regions(regions: list, shape: tuple, which: str, source: str) -> None:
    """Refuses regions that do not tile ``shape`` exactly once (Note [region fragments])."""
    def bad(why: str) -> StateDictError:
        return StateDictError(f"{source}: the region fragments of {which} {why}; "
                              "shards are missing or come from different checkpoints")

    for r in regions:
        if len(r) != len(shape) or any(n <= 0 or s < 0 or s + n > size for (s, n), size in zip(r, shape)):
            raise bad(f"hold {list(r)}, not a non-empty block inside the parameter")
    ordered = sorted(regions)
    for i, a in enumerate(ordered):  # quadratic in the pieces of one parameter: a few hundred at most
        for b in ordered[i + 1:]:
            if all(sa < sb + nb and sb < sa + na for (sa, na), (sb, nb) in zip(a, b)):
                raise bad(f"overlap: {list(a)} and {list(b)}")
    volume = sum(math.prod(n for _, n in r) for r in regions)
    if volume != math.prod(shape):
        raise bad(f"cover {volume} of its {math.prod(shape)} elements")


def _place(values: list, shape: tuple, regions: list, what: str, which: str, source: str) -> torch.Tensor:
    """The whole parameter's flat tensor with each region's ``values`` in its place."""
    whole = torch.empty(shape, dtype=values[0].dtype)
    for region, v in zip(regions, values):
        block = whole[tuple(slice(s, s + n) for s, n in region)]
        if not isinstance(v, torch.Tensor) or v.numel() != block.numel():
            raise StateDictError(f"{source}: {what} of {which} is inconsistent across shards")
        block.copy_(v.reshape(block.shape))
    return whole.view(-1)


def assemble_boxes(frags: list, shape: tuple, which: str, *, source: str) -> dict:
    """``{"master", "state"}`` of a parameter (whole, flat) from its box or region fragments; ``which``
    names it in errors (``parameter <index> (shape ...)``, with its name where known)."""
    shape = tuple(int(s) for s in shape)
    if not all(is_box(f) for f in frags):
        raise StateDictError(f"{source}: {which} has both box and range fragments; "
                             "shards come from different checkpoints")
    if all("box" in f for f in frags):
        frags = sorted(frags, key=lambda f: f["box"][1])
        _check_tiling(frags, shape, which, source)
        regions = [region_of(f, shape) for f in frags]
    else:
        regions = [region_of(f, shape) for f in frags]
        _check_regions(regions, shape, which, source)
    keys = set(frags[0]["state"])
    has_master = frags[0]["master"] is not None
    for f in frags:
        if set(f["state"]) != keys or (f["master"] is not None) != has_master:
            raise StateDictError(f"{source}: shards of {which} hold different state keys")
    state: dict = {}
    for key in keys:
        first = frags[0]["state"][key]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            state[key] = _place([f["state"][key] for f in frags], shape, regions, f"state '{key}'", which, source)
            continue
        for f in frags[1:]:
            if not same_scalar_state(first, f["state"][key]):
                raise StateDictError(f"{source}: scalar state '{key}' of {which} differs across shards "
                                     f"({first!r} vs {f['state'][key]!r})")
        state[key] = first
    master = _place([f["master"] for f in frags], shape, regions, "master", which, source) if has_master else None
    return {"master": master, "state": state}
