"""``grad_norm``: Lightning's gradient-norm helper, for gradients that ZeRO stage 2 shards.

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
    norms of its slices and one all-reduce of one number per parameter (the sum of ``|g|^p``,
    or the max for ``p = inf``) gives the global norms, the same on every rank. Under
    ``"16-mixed"`` the shards still hold the scaled gradients when the hook runs (the step
    applies the unscale, Note [lazy unscale] in ``fusedist/amp/grad_scaler.py``); the pending
    inverse scale is applied here, as Lightning's hook sees unscaled gradients.

    It reads the optimizer's partition (which slice of its shard is which parameter's, Note
    [flat partition] in ``fusedist/zero/partition.py``) in one place, :func:`_held_norms`.
"""

from __future__ import annotations

from typing import Union

import torch
from lightning.pytorch.utilities import grad_norm as _lightning_grad_norm

from fusedist.ownership import gradient_holder
from fusedist.zero import ZeroRedundancyOptimizer

__all__ = ["grad_norm"]

_TAG = "lightning grad_norm"


def grad_norm(module: torch.nn.Module, norm_type: Union[float, int, str],
              group_separator: str = "/") -> dict[str, torch.Tensor]:
    """Each parameter's gradient norm and their total, as ``lightning.pytorch.utilities.grad_norm``
    returns them, including for gradients held by a ZeRO stage-2 optimizer (Note [gradient
    norms under ZeRO stage 2]). With such an optimizer it is a collective: every rank calls it
    at the same point (``on_before_optimizer_step`` is such a point)."""
    named = list(module.named_parameters())
    holders = {}
    for _, p in named:
        holder = gradient_holder(p) if p.grad is None else None
        if isinstance(holder, ZeroRedundancyOptimizer) and holder.stage == 2:
            holders[id(holder)] = holder
    if not holders:
        return _lightning_grad_norm(module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    held: dict[int, torch.Tensor] = {}
    for zero in holders.values():
        held.update(_held_norms(zero, norm_type))
    norms = {}
    for name, p in named:
        norm = p.grad.data.norm(norm_type) if p.grad is not None else held.get(id(p))
        if norm is not None:
            norms[f"grad_{norm_type}_norm{group_separator}{name}"] = norm
    if norms:  # the total as Lightning computes it, from the per-parameter norms
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms


@torch.no_grad()
def _held_norms(zero: ZeroRedundancyOptimizer, norm_type: float) -> dict[int, torch.Tensor]:
    """``id(param) -> global norm of its gradient`` for the parameters ``zero`` holds a gradient
    of in this step (none before the first backward after a step, as ``p.grad`` is None then)."""
    if not zero._fusedist_has_grads():  # same answer on every rank: a synchronized backward ran
        return {}
    shards = zero.gradient_shards()
    entries = zero._partition.entries  # this rank's slice of each parameter, in its flat shard
    slices = [shards[e.dtype][e.pos:e.pos + e.numel] for e in entries]
    device = zero.comm.device if zero.comm is not None else (slices[0].device if slices else torch.device("cpu"))
    partial = torch.zeros(len(zero._params), dtype=torch.float64, device=device)
    if slices:
        local = torch.stack([n.double() for n in torch._foreach_norm(slices, norm_type)]).to(device)
        index = torch.tensor([e.index for e in entries], device=device)
        partial[index] = local if norm_type == float("inf") else local.pow(norm_type)
    if zero.comm is not None and zero.world_size > 1:
        zero.comm.all_reduce(partial, op="max" if norm_type == float("inf") else "sum", tag=_TAG)
    norms = partial if norm_type == float("inf") else partial.pow(1.0 / norm_type)
    inv_scale = zero.step_context.inv_scale  # a pending unscale (Note [gradient norms under ZeRO stage 2])
    if inv_scale is not None:
        norms = norms * inv_scale.to(norms).reshape(())
    without = set(zero._params_without_grad())
    return {id(zero._params[i]): norms[i].to(zero._params[i].dtype)
            for i in zero._trainable if i not in without}
