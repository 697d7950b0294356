"""What the data-parallel strategies of Lightning's Trainer and Fabric share: the ZeRO stage
they take, and the names they register under (Note [strategy names] in ``lightning.py``)."""

from __future__ import annotations

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
