"""``grad_norm``: Lightning's gradient-norm helper, for gradients that fusedist shards.

Note [gradient norms under ZeRO stage 2]
    Lightning's ``lightning.pytorch.utilities.grad_norm(module, norm_type)``, which its docs
    log from ``on_before_optimizer_step``, reads ``p.grad``. Under ``strategy="ddp"`` (and
    ``FusedistStrategy`` with ``zero_stage`` 0 or 1) that is each parameter's gradient averaged
    over the ranks, so every rank logs the same global norms. ZeRO stage 2 keeps no
    ``p.grad``: each rank holds its slice of every averaged gradient in the optimizer's flat
    shards, and Lightning's helper returns ``{}`` -- nothing is logged, and nothing says so.

    Handing the hook a ``p.grad`` would all-gather the whole gradient every step, the memory
    stage 2 exists to save. This ``grad_norm`` takes Lightning's arguments and returns its keys
    and values under every strategy: where ``p.grad`` is the gradient it is Lightning's own
    function; for parameters whose gradient a stage-2 optimizer holds, each rank takes the
    norms of its slices (``ZeroRedundancyOptimizer.gradient_slices``) and one all-reduce of one
    number per parameter (the sum of ``|g|^p``, or the max for ``p = inf``) gives the global
    norms, the same on every rank. Under ``"16-mixed"`` the shards still hold the scaled
    gradients when the hook runs (the step applies the unscale, Note [lazy unscale] in
    ``fusedist/amp/grad_scaler.py``); the pending inverse scale is applied here, as
    Lightning's hook sees unscaled gradients.

Note [gradient norms of fully_shard pieces]
    Under ``FusedistModelParallelStrategy`` a ``fusedist.fully_shard`` parameter is this rank's
    piece, a plain tensor, and ``p.grad`` the piece's gradient: Lightning's helper would log
    each rank's piece norms, different on every rank. With torch's FSDP2 the parameters are
    DTensors and ``p.grad.norm()`` is the whole parameter's norm. So pieces are grouped by
    their gradient holder (``fusedist.ownership.gradient_holder``: one per shard group), whose
    ``parameter_grad_norms`` takes one all-reduce of one number per parameter over the shard
    group -- on HSDP not across replicas, which hold copies of the same gradient shard; with
    tensor parallelism one more over the tensor-parallel group, for the parameters split
    across it.

A parameter's holder decides which path it takes, in the module's parameter order, so every
rank issues the same collectives in the same order: the function is a collective whenever the
module has sharded gradients (``on_before_optimizer_step`` runs on every rank at the same point).
"""

from __future__ import annotations

from typing import Union

import torch
from lightning.pytorch.utilities import grad_norm as _lightning_grad_norm

from fusedist.fsdp.holder import ShardedGradHolder
from fusedist.optim.grad_norms import per_tensor_global_norms
from fusedist.ownership import gradient_holder
from fusedist.zero import ZeroRedundancyOptimizer

__all__ = ["grad_norm"]

_TAG = "lightning grad_norm"


def grad_norm(module: torch.nn.Module, norm_type: Union[float, int, str],
              group_separator: str = "/") -> dict[str, torch.Tensor]:
    """Each parameter's gradient norm and their total, as ``lightning.pytorch.utilities.grad_norm``
    returns them, including for gradients held by a ZeRO stage-2 optimizer (Note [gradient
    norms under ZeRO stage 2]) and for ``fusedist.fully_shard`` pieces (Note [gradient norms of
    fully_shard pieces]). With either it is a collective: every rank calls it at the same point."""
    named = list(module.named_parameters())
    stage2, pieces = {}, {}  # id(holder) -> holder, and -> (holder, its pieces in module order)
    sharded = set()  # id(p) of the pieces: their p.grad is not the gradient
    for _, p in named:
        holder = gradient_holder(p)
        if isinstance(holder, ShardedGradHolder):
            pieces.setdefault(id(holder), (holder, []))[1].append(p)
            sharded.add(id(p))
        elif p.grad is None and isinstance(holder, ZeroRedundancyOptimizer) and holder.stage == 2:
            stage2[id(holder)] = holder
    if not stage2 and not pieces:
        return _lightning_grad_norm(module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    held: dict[int, torch.Tensor] = {}
    for zero in stage2.values():
        held.update(_held_norms(zero, norm_type))
    for holder, params in pieces.values():
        for p, norm in zip(params, holder.parameter_grad_norms(params, norm_type)):
            if norm is not None:
                held[id(p)] = norm.to(p.grad.dtype)
    norms = {}
    for name, p in named:
        norm = held.get(id(p))
        if norm is None and p.grad is not None and id(p) not in sharded:
            norm = p.grad.data.norm(norm_type)
        if norm is not None:
            norms[f"grad_{norm_type}_norm{group_separator}{name}"] = norm
    if norms:  # the total as Lightning computes it, from the per-parameter norms
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms


@torch.compiler.disable  # its all-reduce, traced in a compiled training step, failed on every rank
@torch.no_grad()
def _held_norms(zero: ZeroRedundancyOptimizer, norm_type: float) -> dict[int, torch.Tensor]:
    """``id(param) -> global norm of its gradient`` for the parameters ``zero`` holds a gradient
    of in this step (none before the first backward after a step, as ``p.grad`` is None then)."""
    pairs = zero.gradient_slices()  # the same parameters in the same order on every rank
    if not pairs:  # (on every rank: no synchronized backward since the step)
        return {}
    device = zero.comm.device if zero.comm is not None else pairs[0][1].device
    distributed = zero.comm is not None and zero.world_size > 1
    norms = per_tensor_global_norms(
        [s for _, s in pairs], norm_type, device,
        lambda t, op: zero.comm.all_reduce(t, op=op, tag=_TAG) if distributed else None)
    inv_scale = zero.step_context.inv_scale  # a pending unscale (Note [gradient norms under ZeRO stage 2])
    if inv_scale is not None:
        norms = norms * inv_scale.to(norms).reshape(())
    return {id(p): norms[k].to(p.dtype) for k, (p, _) in enumerate(pairs)}
