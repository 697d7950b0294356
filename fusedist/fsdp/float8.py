"""torchao's float8 training weights under ``fully_shard``: the scales of the next gathers in one
all-reduce.

Note [precomputed float8 scales]
    With float8 all-gathers (Note [all-gather extension] in extension.py) each gather of a
    float8 weight computes its scale from the amax of the whole weight: one small all-reduce
    per weight per gather, twice a step where units reshard after forward. torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` does them all in one all-reduce after the
    optimizer step, but it looks for FSDP2's DTensor weights, finds none among fusedist's
    pieces, and returns having done nothing. :func:`precompute_float8_dynamic_scale_for_fsdp`
    is its counterpart for fusedist's units: the scale of each float8 weight a unit shards,
    from the maximum over the shard group of the pieces' amaxes (one all-reduce per group),
    by torchao's own ``amax_to_scale`` as its gathers compute it -- so the gathers are bit for
    bit those without it --
    set where ``fsdp_pre_all_gather`` reads it (``_precomputed_scale`` on the piece). Call it
    after each optimizer step, as torchao's: a scale left from an earlier step is used as is.
"""

from __future__ import annotations

import torch
from torch import nn

from .holder import all_reduce_on_comm_device
from .state_dict import piece_index, units_of

__all__ = ["precompute_float8_dynamic_scale_for_fsdp"]


@torch.no_grad()
def precompute_float8_dynamic_scale_for_fsdp(module: nn.Module) -> None:
    """Set the float8 scale of every dynamically scaled float8 weight of ``module``'s
    ``fully_shard`` units for their next gathers (Note [precomputed float8 scales]). A
    collective over each shard group: every rank calls it."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import amax_to_scale
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    where = piece_index(units_of(module))
    by_group: dict = {}  # id(comm) -> (comm, [(piece, float8 dtype)])
    for m in module.modules():
        hit = where.get(id(m.weight)) if isinstance(m, Float8Linear) else None
        if hit is None:
            continue
        unit, i = hit
        piece = unit.sharded[i]
        if isinstance(piece, WeightWithDynamicFloat8CastTensor):
            entry = (piece, m.config.cast_config_weight.target_dtype)
            by_group.setdefault(id(unit.comm), (unit.comm, []))[1].append(entry)
    for comm, entries in by_group.values():
        local = [p._tensor.abs().max() if p.numel() else p._tensor.new_zeros(()) for p, _ in entries]
        amax = torch.stack(local).to(torch.float32)
        # (in host memory under CPUOffloadPolicy: reduced through the communicator's device)
        all_reduce_on_comm_device(comm, amax, "max", "fully_shard float8 scales")
        for (piece, dtype), a in zip(entries, amax):
            # (no rounding to a power of 2: the float8 gather's own scale has none)
            piece._precomputed_scale = amax_to_scale(a.to(piece.dtype), dtype)
