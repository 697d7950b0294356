"""The dim ``shard_placement_fn`` shards each parameter on, checked before anything changes.

FSDP2's contract: ``shard_placement_fn(param)`` returns ``Shard(dim)`` or None (the default,
``Shard(0)``); a negative dim counts from the end. Anything else is refused, as FSDP2 refuses it
(``ValueError: Invalid shard_placement_fn result``): ``_StridedShard`` included, which FSDP2 builds
itself for a parameter tensor parallelism shards on the same dim, and which in torch 2.13 is no
``Shard`` (the exact type is compared all the same: a subclass would carry a layout Shard(dim) is
not). fusedist lays out dim 0 as always and other dims as in Note [dim-sharded sections]
(chunk_layout.py).
"""

from __future__ import annotations

from typing import Callable, Optional


def shard_dim(param, fqn: str, shard_placement_fn: Optional[Callable], where: str) -> int:
    """The normalized dim ``param`` (named ``fqn``) is sharded on; raises naming the parameter
    for anything but ``Shard(dim)`` or None, or a dim ``param`` does not have."""
    if shard_placement_fn is None:
        return 0
    from torch.distributed.tensor import Shard

    placement = shard_placement_fn(param)
    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise NotImplementedError(
            f"fusedist.fully_shard({where}): shard_placement_fn returned {placement!r} for '{fqn}' (shape "
            f"{tuple(param.shape)}); only Shard(dim) or None is supported, as in torch's FSDP2 (which refuses "
            "anything else, _StridedShard included: 'Invalid shard_placement_fn result'). Return Shard(dim); "
            "for a parameter tensor parallelism already shards, distribute it before fully_shard, which then "
            "lays it out as FSDP2 does.")
    ndim = param.dim()
    if ndim == 0 and placement.dim in (0, -1):
        return 0  # (one element: never cut, Note [row-aligned flat layout])
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < ndim:
        raise ValueError(
            f"fusedist.fully_shard({where}): shard_placement_fn returned {placement!r} for '{fqn}', which has "
            f"shape {tuple(param.shape)} ({ndim} dims): the dim is out of range.")
    return dim
