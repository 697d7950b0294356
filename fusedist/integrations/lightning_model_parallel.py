"""``FusedistModelParallelStrategy``: Lightning's ``ModelParallelStrategy`` for a LightningModule
whose ``configure_model`` shards with :func:`fusedist.fully_shard`.

Lightning trains FSDP2 models with ``ModelParallelStrategy``: the module's ``configure_model``
applies ``fully_shard`` over ``self.device_mesh["data_parallel"]``, and the strategy saves and
loads through torch's Distributed Checkpoint helpers. Swapping that ``fully_shard`` import for
fusedist's trains the same (forward, backward, the optimizer step, Lightning's sharded and full
checkpoints, saved interchangeably with torch's), but two of the strategy's steps go wrong on
fusedist's pieces, which are plain tensors where FSDP2's are DTensors:

* Gradient clipping (``Trainer(gradient_clip_val=...)``): Lightning clips with
  ``torch.nn.utils.clip_grad_norm_``, whose norm over plain pieces is this rank's, not the
  model's -- each rank clips by another coefficient and the ranks' training silently departs
  from FSDP2's. This strategy clips with ``fusedist.clip_grad_norm_`` (the global norm, one
  small all-reduce), and ``"16-mixed"`` scales with ``fusedist.amp.GradScaler``, whose
  found-inf flag is the ranks' combined one (torch's scaler would skip a step on the rank
  whose piece overflowed only): the precision adapters of ``lightning_precision.py``.
* Resuming (``trainer.fit(ckpt_path=...)``): Lightning finds the model to load among the
  objects it restores by its DTensor parameters and finds none: "Could not find a distributed
  model in the provided checkpoint state"; and it loads a full checkpoint one submodule at a
  time, which fusedist's pieces do not take (Note [finding the sharded model]).

Use it where ``ModelParallelStrategy`` was (same arguments)::

    from fusedist.integrations.lightning import FusedistModelParallelStrategy
    trainer = L.Trainer(strategy=FusedistModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))

Tensor parallelism (``tensor_parallel_size > 1``) makes DTensor parameters, which
``fusedist.fully_shard`` refuses by name; this strategy is for its data-parallel mesh.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from lightning.fabric.strategies import model_parallel as _fabric_model_parallel
from lightning.pytorch.strategies import ModelParallelStrategy

from fusedist.fsdp.api import FullyShardedModule

from .lightning_precision import RoutesPrecision

__all__ = ["FusedistModelParallelStrategy"]


class FusedistModelParallelStrategy(RoutesPrecision, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (same arguments) for modules sharded with
    ``fusedist.fully_shard``: global-norm clipping, fusedist's GradScaler, and resuming from
    Lightning's sharded or full checkpoints (module docstring)."""

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        with _fully_shard_modules_count_as_distributed():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)


# Note [finding the sharded model]
# Lightning's loader (lightning.fabric.strategies.model_parallel._load_checkpoint) picks the
# module to restore as "the one with DTensor parameters". A sharded checkpoint it then loads
# with torch's get_model_state_dict / set_model_state_dict and Distributed Checkpoint, which
# take fusedist.fully_shard's pieces as they take FSDP2's DTensors (fsdp/dcp.py). A full
# checkpoint (save_distributed_checkpoint=False) it loads submodule by submodule with
# set_model_state_dict(submodule, ...), which on a DTensor parameter scatters the whole value
# but on a piece of a Linear inside a unit is a shape mismatch: fusedist cuts whole
# parameters to pieces in the unit's own load_state_dict (every rank has read the whole
# checkpoint by then), so that is what a fusedist module is given instead. So, for the
# duration of this strategy's load_checkpoint, the predicate also accepts a module holding
# fully_shard units, and the full-checkpoint load of such a module (without DTensors) is its
# own load_state_dict. The replacements are scoped (restored on exit, even on error) and
# check DTensors first, so a module sharded with torch's fully_shard loads exactly as before.


_lightning_predicate = _fabric_model_parallel._has_dtensor_modules
_lightning_raw_load = _fabric_model_parallel._load_raw_module_state


def _holds_units(module: object) -> bool:
    return isinstance(module, torch.nn.Module) and any(isinstance(sub, FullyShardedModule) for sub in module.modules())


def _holds_sharded_parameters(module: object) -> bool:
    return _lightning_predicate(module) or _holds_units(module)


def _load_whole_parameters(state_dict: dict, module: torch.nn.Module, world_size: int = 1, strict: bool = True) -> None:
    if _lightning_predicate(module) or not _holds_units(module):
        return _lightning_raw_load(state_dict, module, world_size=world_size, strict=strict)
    module.load_state_dict(state_dict, strict=strict)  # the units cut whole parameters to pieces


@contextlib.contextmanager
def _fully_shard_modules_count_as_distributed():
    saved = _fabric_model_parallel._has_dtensor_modules, _fabric_model_parallel._load_raw_module_state
    _fabric_model_parallel._has_dtensor_modules = _holds_sharded_parameters
    _fabric_model_parallel._load_raw_module_state = _load_whole_parameters
    try:
        yield
    finally:
        _fabric_model_parallel._has_dtensor_modules, _fabric_model_parallel._load_raw_module_state = saved
