"""The two policy objects of :func:`fusedist.fully_shard`, with torch FSDP2's names and fields."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision, as torch's ``MixedPrecisionPolicy``.

    * ``param_dtype``: dtype of the gathered (unsharded) parameters, hence of forward/backward
      compute and of the all-gather. None: the parameters' own dtype. The sharded parameters
      the optimizer steps keep their own dtype (FP32 master weights for free).
    * ``reduce_dtype``: dtype of the gradient reduce-scatter (and of the local accumulation
      under ``set_requires_gradient_sync(False)``). None: the gradients' dtype (``param_dtype``).
      FP32 here with bf16 ``param_dtype`` sums the ranks' bf16 gradients without rounding.
    * ``output_dtype``: dtype floating-point forward outputs are cast to (None: no cast).
    * ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype`` (default
      True, as torch: a unit's compute runs in one dtype).
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (torch's default ``OffloadPolicy()``): shards live on the compute device."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, their gradients and hence the optimizer state live in host memory.

    Each unshard copies the shard to the compute device before the all-gather; each
    reduce-scattered gradient shard is copied back to the host. The optimizer then steps host
    tensors (``fusedist.optim.FusedAdamW`` runs the C++ CPU Adam on them). ``pin_memory``
    (default True, as torch) pins the host shards so the copies can run asynchronously; it is
    ignored when the compute device is the CPU itself, where offloading changes nothing.
    """

    pin_memory: bool = True


def as_offload_policy(policy) -> Optional[OffloadPolicy]:
    """``policy`` as fusedist's: torch FSDP2's own ``CPUOffloadPolicy`` / ``OffloadPolicy``
    objects are taken for what they say (a script that imports its policies from torch and
    ``fully_shard`` from fusedist offloads as asked instead of silently not at all)."""
    if policy is None or isinstance(policy, OffloadPolicy):
        return policy
    torch_fsdp = getattr(getattr(torch.distributed, "fsdp", None), "_fully_shard", None)
    torch_cpu = getattr(torch_fsdp, "CPUOffloadPolicy", None)
    torch_base = getattr(torch_fsdp, "OffloadPolicy", None)
    if torch_cpu is not None and isinstance(policy, torch_cpu):
        return CPUOffloadPolicy(pin_memory=bool(policy.pin_memory))
    if torch_base is not None and type(policy) is torch_base:
        return OffloadPolicy()
    raise TypeError(f"fusedist.fully_shard: offload_policy must be an OffloadPolicy or CPUOffloadPolicy, "
                    f"got {type(policy).__name__}")
