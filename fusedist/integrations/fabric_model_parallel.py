"""``FusedistFabricModelParallelStrategy``: Fabric's ``ModelParallelStrategy`` for modules that
its ``parallelize_fn`` shards with ``fusedist.fully_shard`` instead of FSDP2's.

The loop and the ``parallelize_fn`` stay as written for FSDP2, with fusedist's ``fully_shard``::

    def parallelize(model, device_mesh):
        for block in model.blocks:
            fusedist.fully_shard(block, mesh=device_mesh["data_parallel"])
        return fusedist.fully_shard(model, mesh=device_mesh["data_parallel"])

    fabric = L.Fabric(strategy=FusedistFabricModelParallelStrategy(parallelize), devices=8)

Under Fabric's own strategy such a module trains, but three steps look for FSDP2's classes
and miss fusedist's units (the fixes are the Trainer strategy's, in
``lightning_model_parallel.py``):

* ``fabric.save`` / ``fabric.load`` pick the module to checkpoint as "the one with DTensor
  parameters" and refuse ("Could not find a distributed model", Note [finding the sharded
  model]);
* ``fabric.no_backward_sync`` turns off the gradient reduction of FSDP2 modules only, so every
  micro-batch of an accumulation reduced its gradients (the same numbers, at the cost of a
  reduce-scatter per micro-batch);
* a module built under ``fabric.init_module(empty_init=True)`` is materialized with
  ``reset_parameters()`` on each piece (Note [materializing fully_shard units]).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies import model_parallel as _fabric_model_parallel
from lightning.fabric.strategies.model_parallel import _ParallelBackwardSyncControl

from fusedist.fsdp.api import FullyShardedModule

from .lightning_model_parallel import _fully_shard_modules_count_as_distributed, _materialize

__all__ = ["FusedistFabricModelParallelStrategy"]


class FusedistFabricModelParallelStrategy(ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` (same arguments) for modules sharded with
    ``fusedist.fully_shard`` (module docstring)."""

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        with _fully_shard_modules_materialize_whole():
            return super().setup_module(module)

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        with _fully_shard_modules_count_as_distributed():
            return super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args: Any, **kwargs: Any):
        with _fully_shard_modules_count_as_distributed():
            return super().load_checkpoint(*args, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _BackwardSyncOfUnits()


class _BackwardSyncOfUnits(_ParallelBackwardSyncControl):
    """``fabric.no_backward_sync``: Fabric's context for FSDP2 modules, and fusedist's units
    reduce no gradient inside it either."""

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool):
        fsdp2 = super().no_backward_sync(module, enabled)
        units = [m for m in module.modules() if isinstance(m, FullyShardedModule)]
        if not (enabled and units):
            return fsdp2
        return _units_without_sync(units, fsdp2)


@contextlib.contextmanager
def _units_without_sync(units: list, fsdp2):
    with fsdp2:
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)


@contextlib.contextmanager
def _fully_shard_modules_materialize_whole():
    """Note [materializing fully_shard units], for Fabric's setup_module."""
    saved = _fabric_model_parallel._materialize_distributed_module
    _fabric_model_parallel._materialize_distributed_module = _materialize
    try:
        yield
    finally:
        _fabric_model_parallel._materialize_distributed_module = saved
