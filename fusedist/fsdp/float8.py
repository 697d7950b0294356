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

    With tensor parallelism the amax is also the maximum over the tensor-parallel group, as
    torchao's is (it reduces the DTensor weight over its whole 2-D mesh): one scale for the
    global weight on every rank. The gathers without it reduce over the shard group only (the
    mesh FSDP2 hands ``fsdp_pre_all_gather``), so there each tensor-parallel rank's scale is
    its local tensor's; with it, fusedist's training is FSDP2's with torchao's precompute.
    Likewise an fp16 weight's scale is clamped to fp16's largest value, as torchao clamps it.
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
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    where = piece_index(units_of(module))
    by_group: dict = {}  # (id(comm), id(tp comm)) -> (comm, tp comm or None, [(piece, float8 dtype)])
    for m in module.modules():
        hit = where.get(id(m.weight)) if isinstance(m, Float8Linear) else None
        if hit is None:
            continue
        unit, i = hit
        piece = unit.sharded[i]
        if isinstance(piece, WeightWithDynamicFloat8CastTensor):
            entry = (piece, m.config.cast_config_weight.target_dtype)
            tp = unit.tp_comm if unit.tp[i] is not None else None  # (a tensor-parallel weight's local tensor)
            by_group.setdefault((id(unit.comm), id(tp)), (unit.comm, tp, []))[2].append(entry)
    for comm, tp, entries in by_group.values():
        local = [p._tensor.abs().max() if p.numel() else p._tensor.new_zeros(()) for p, _ in entries]
        amax = torch.stack(local).to(torch.float32)
        # (in host memory under CPUOffloadPolicy: reduced through the communicator's device)
        all_reduce_on_comm_device(comm, amax, "max", "fully_shard float8 scales")
        if tp is not None:  # the global weight's amax, as torchao's over the DTensor's 2-D mesh
            all_reduce_on_comm_device(tp, amax, "max", "fully_shard float8 scales (tensor-parallel)")
        for (piece, dtype), a in zip(entries, amax):
            piece._precomputed_scale = _scale(a.to(piece.dtype), dtype)


def _scale(amax: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """torchao's precomputed scale of a weight of ``amax`` (its dtype the weight's): no rounding
    to a power of 2 (the float8 gather's own scale has none), and for an fp16 weight at most
    fp16's largest value, as torchao's ``precompute_float8_dynamic_scale_for_fsdp`` clamps it
    (the gather's own scale is not clamped: a weight whose amax is below 448 / 65504 trains
    otherwise with it than without)."""
    from torchao.float8.float8_utils import amax_to_scale

    scale = amax_to_scale(amax, float8_dtype)
    if amax.dtype is torch.float16:
        scale = torch.clamp(scale, max=torch.finfo(torch.float16).max)
    return scale
