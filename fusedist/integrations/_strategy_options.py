"""What the data-parallel strategies of Lightning's Trainer and Fabric share: the ZeRO stage
they take, the names they register under (Note [strategy names] in ``lightning.py``), and the
clip by norm that sees sharded gradients."""

from __future__ import annotations

import torch

import fusedist

from ._optimizer_swap import stepping_for

_NAMES = (("fusedist", {}, "fused optimizers"),
          ("fusedist_zero1", {"zero_stage": 1}, "ZeRO stage 1"),
          ("fusedist_zero2", {"zero_stage": 2}, "ZeRO stage 2"),
          ("fusedist_find_unused_parameters_true", {"find_unused_parameters": True},
           "fused optimizers, find_unused_parameters=True"))


def check_zero_stage(strategy: str, zero_stage) -> None:
    if type(zero_stage) is not int or zero_stage not in (0, 1, 2):  # (not True, not 1.0)
        raise ValueError(f"{strategy}: zero_stage must be 0, 1 or 2, got {zero_stage!r}")


def register_names(cls, strategy_registry) -> None:
    """``cls`` under the strategy names, in the framework's ``strategy_registry``."""
    for name, options, what in _NAMES:
        strategy_registry.register(name, cls, description=f"fusedist DDP with {what}", override=True, **options)


def clip_by_norm(optimizer, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients ``optimizer`` steps to a global norm of ``max_norm``, returning the norm:
    a ZeroRedundancyOptimizer's own clip (its shards' global norm), else ``fusedist.clip_grad_norm_``
    over its parameters, which torch's clip over ``p.grad`` would miss on stage 2 (Note [Lightning
    precision] in ``lightning_precision.py``)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
    # (one that forwards to a newer successor: Note [an earlier successor forwards to the new one])
    while (successor := stepping_for(optimizer)) is not None:
        optimizer = successor
    if isinstance(optimizer, fusedist.ZeroRedundancyOptimizer):
        return optimizer.clip_grad_norm_(max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return fusedist.clip_grad_norm_(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)
