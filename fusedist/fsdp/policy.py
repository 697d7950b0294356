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
    hint = ""
    if hasattr(policy, "offload_params"):  # FSDP1's CPUOffload, which torch's fully_shard silently ignores
        hint = (f"; this is FSDP1's CPUOffload: pass CPUOffloadPolicy() to offload "
                f"(offload_params={policy.offload_params!r} here), or nothing to keep the shards on the device")
    raise TypeError(f"fusedist.fully_shard: offload_policy must be an OffloadPolicy or CPUOffloadPolicy, "
                    f"got {type(policy).__name__}{hint}")


_DTYPE_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype")


def as_mixed_precision_policy(policy):
    """``policy`` checked at ``fully_shard``: torch FSDP2's ``MixedPrecisionPolicy`` or fusedist's
    (or an object with their four fields), each dtype None or a ``torch.dtype``. Anything else
    used to fail deep inside the first forward -- FSDP1's ``MixedPrecision`` (no ``output_dtype``,
    inputs not cast by default) as a matmul dtype mismatch, a dtype given as text ("bfloat16"
    from a config file) as a failed cast -- naming neither the argument nor what to pass."""
    if policy is None:
        return MixedPrecisionPolicy()
    fields = _DTYPE_FIELDS + ("cast_forward_inputs",)
    missing = [f for f in fields if not hasattr(policy, f)]
    if missing:
        hint = ""
        if hasattr(policy, "buffer_dtype") or hasattr(policy, "keep_low_precision_grads"):
            hint = (" This is FSDP1's MixedPrecision; FSDP2's fully_shard takes MixedPrecisionPolicy(param_dtype=..., "
                    "reduce_dtype=...) (buffers are not cast: convert them with module.to() before sharding).")
        raise TypeError(f"fusedist.fully_shard: mp_policy must be a MixedPrecisionPolicy, got "
                        f"{type(policy).__name__} (it has no {', '.join(missing)}).{hint}")
    for field in _DTYPE_FIELDS:
        value = getattr(policy, field)
        if value is not None and not isinstance(value, torch.dtype):
            raise TypeError(f"fusedist.fully_shard: mp_policy.{field} must be a torch.dtype or None, got "
                            f"{type(value).__name__} {value!r}; pass e.g. torch.bfloat16, not its name")
    if not isinstance(policy.cast_forward_inputs, bool):
        raise TypeError(f"fusedist.fully_shard: mp_policy.cast_forward_inputs must be a bool, got "
                        f"{type(policy.cast_forward_inputs).__name__} {policy.cast_forward_inputs!r}")
    return policy
