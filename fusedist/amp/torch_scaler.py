"""torch's own GradScaler, its found-inf made global over ``fully_shard``'s gradient pieces.

Note [torch's scaler on sharded gradients]
------------------------------------------
torch FSDP2's gradients are DTensors, so ``torch.amp.GradScaler``'s inf/nan check on them is
dispatched with an all-reduce of the found-inf flag across the mesh: every rank skips an
overflowing step together. ``fusedist.fully_shard``'s gradients are plain tensors holding this
rank's piece, so torch's scaler saw only the local piece: a rank whose piece overflowed
skipped alone, its parameters fell behind the others', and the per-step cross-rank check
stopped the run. Loops written for FSDP2 keep torch's scaler (torchtitan's, Hugging Face's
fp16 path), so the first ``fully_shard`` unit installs one narrow replacement, as torch's clip
gets one (Note [torch's clip on sharded gradients] in fusedist/optim/torch_clip.py):

* ``torch.amp.GradScaler._unscale_grads_`` runs torch's function, then, for an optimizer whose
  parameters are ``fully_shard`` pieces, takes the max of the ranks' flags through the units'
  gradient holder (over the shard group, and the replicas and tensor-parallel ranks where
  there are any) and writes it into every per-device flag torch's ``step`` reads. It is a
  collective exactly then: every rank unscales the same optimizer, as FSDP2 requires too.

Optimizers without such parameters, and torch's subclasses that do their own reduction
(``ShardedGradScaler``) or step with the scaler themselves (ZeRO stage 2), are untouched.

The replacement also notes the scaler's scale for the per-step check (Note [torch's GradScaler in
the step check] in fusedist/reliability/scale_check.py), so the first DDP model with the check on
installs it too.
"""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import GradScaler

from ..ownership import gradient_holders_of
from ..reliability.scale_check import unscaled_with

__all__ = ["install", "installed"]

_TORCH_UNSCALE = GradScaler._unscale_grads_
_installed = False


def _unscale_grads_global(self, optimizer, inv_scale, found_inf, allow_fp16):
    per_device = _TORCH_UNSCALE(self, optimizer, inv_scale, found_inf, allow_fp16)
    unscaled_with(self, optimizer)
    from ..fsdp.holder import ShardedGradHolder  # (fsdp imports this module's installer)

    holders = [h for h in gradient_holders_of(optimizer) if isinstance(h, ShardedGradHolder)]
    if not holders:
        return per_device
    flag = torch.zeros(1, dtype=torch.float32, device=found_inf.device)
    for value in per_device.values():
        flag = torch.maximum(flag, value.reshape(1).to(flag.device))
    for holder in holders:  # (a rank without gradients takes part too: its flag is 0)
        holder.all_reduce_found_inf(flag)
    for value in per_device.values():
        value.copy_(flag.reshape(value.shape).to(value.device))
    if not per_device:
        per_device[found_inf.device] = flag.reshape(found_inf.shape)
    return per_device


def install() -> None:
    """Install the replacement (once; Note [torch's scaler on sharded gradients])."""
    global _installed
    if not _installed:
        _installed = True
        GradScaler._unscale_grads_ = _unscale_grads_global


def installed() -> bool:
    return _installed
