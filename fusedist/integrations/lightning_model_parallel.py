"""``FusedistModelParallelStrategy``: Lightning's ``ModelParallelStrategy`` for a LightningModule
whose ``configure_model`` shards with :func:`fusedist.fully_shard`.

Lightning trains FSDP2 models with ``ModelParallelStrategy``: the module's ``configure_model``
applies ``fully_shard`` over ``self.device_mesh["data_parallel"]``, and the strategy saves and
loads through torch's Distributed Checkpoint helpers. Swapping that ``fully_shard`` import for
fusedist's trains the same (forward, backward, the optimizer step, Lightning's sharded and full
checkpoints, saved interchangeably with torch's), but two of the strategy's steps go wrong on
fusedist's pieces, which are plain tensors where FSDP2's are DTensors:

* Mixed precision (``"16-mixed"``): torch's GradScaler finds inf in this rank's pieces only
  and would skip a step on the rank whose piece overflowed alone; this strategy scales with
  ``fusedist.amp.GradScaler``, whose found-inf flag is the ranks' combined one, and clips
  (``Trainer(gradient_clip_val=...)``) with ``fusedist.clip_grad_norm_`` after its unscale:
  the precision adapters of ``lightning_precision.py``. (Lightning's own clip, torch's
  ``clip_grad_norm_``, is global on fusedist's pieces too: Note [torch's clip on sharded
  gradients] in ``fusedist/optim/torch_clip.py``.)
* Resuming (``trainer.fit(ckpt_path=...)``): Lightning finds the model to load among the
  objects it restores by its DTensor parameters and finds none: "Could not find a distributed
  model in the provided checkpoint state" (Note [finding the sharded model]).
* Building on the meta device (``with trainer.init_module(empty_init=True)``): Lightning
  materializes with ``reset_parameters()`` on each submodule, which on fusedist's pieces fails
  (a piece cut anywhere is 1-D: "Fan in and fan out can not be computed") or draws the same
  numbers on every rank; the strategy initializes with ``fusedist.fsdp.init_parameters``, the
  unsharded model's values (Note [materializing fully_shard units]).

Gradient norms: Lightning's ``grad_norm`` reads ``p.grad``, here the gradient of this rank's
piece, so it would log per-rank piece norms; log
``fusedist.integrations.lightning.grad_norm(self, norm_type)`` instead, the whole parameters'
norms as FSDP2's DTensors give them, the same on every rank (Note [gradient norms of
fully_shard pieces] in ``lightning_grad_norm.py``).

Use it where ``ModelParallelStrategy`` was (same arguments)::

    from fusedist.integrations.lightning import FusedistModelParallelStrategy
    trainer = L.Trainer(strategy=FusedistModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))

Tensor parallelism (``tensor_parallel_size > 1``): ``configure_model`` applies its plan on
``self.device_mesh["tensor_parallel"]`` and ``fusedist.fully_shard`` on ``["data_parallel"]``, which
shards tensor-parallel modules as FSDP2 does (Note [tensor-parallel parameters] in
``fusedist/fsdp/tensor_parallel.py``); the clip and resuming from sharded checkpoints are tested
against FSDP2 at 2x2, and ``grad_norm`` gives each global parameter's gradient norm (tested
against FSDP2's DTensor gradients in tests/test_fully_shard_tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Optional

import torch
from lightning.fabric.strategies import model_parallel as _fabric_model_parallel
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies import model_parallel as _pytorch_model_parallel

from fusedist.fsdp.api import FullyShardedModule
from fusedist.fsdp.param_init import init_parameters

from .lightning_precision import RoutesPrecision

__all__ = ["FusedistModelParallelStrategy"]


class FusedistModelParallelStrategy(RoutesPrecision, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (same arguments) for modules sharded with
    ``fusedist.fully_shard``: global-norm clipping, fusedist's GradScaler, and resuming from
    Lightning's sharded or full checkpoints, meta-device builds initialized as the unsharded
    model (module docstring)."""

    def setup(self, trainer) -> None:
        with _fully_shard_modules_materialize_whole():
            super().setup(trainer)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        with _fully_shard_modules_count_as_distributed():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)


# Note [finding the sharded model]
# Lightning's loader (lightning.fabric.strategies.model_parallel._load_checkpoint) picks the
# module to restore as "the one with DTensor parameters". A sharded checkpoint it then loads
# with torch's get_model_state_dict / set_model_state_dict and Distributed Checkpoint, which
# take fusedist.fully_shard's pieces as they take FSDP2's DTensors (fsdp/dcp.py); a full
# checkpoint (save_distributed_checkpoint=False) it loads submodule by submodule with
# set_model_state_dict(submodule, ...), which every module holding a unit's parameters takes
# too (Note [state-dict hooks on every module of a unit] in fsdp/state_dict_hooks.py). So, for the duration
# of this strategy's load_checkpoint, the predicate also accepts a module holding fully_shard
# units. The replacement is scoped (restored on exit, even on error) and checks DTensors
# first, so a module sharded with torch's fully_shard loads exactly as before.


_lightning_predicate = _fabric_model_parallel._has_dtensor_modules


def _holds_units(module: object) -> bool:
    return isinstance(module, torch.nn.Module) and any(isinstance(sub, FullyShardedModule) for sub in module.modules())


def _holds_sharded_parameters(module: object) -> bool:
    return _lightning_predicate(module) or _holds_units(module)


@contextlib.contextmanager
def _fully_shard_modules_count_as_distributed():
    saved = _fabric_model_parallel._has_dtensor_modules
    _fabric_model_parallel._has_dtensor_modules = _holds_sharded_parameters
    try:
        yield
    finally:
        _fabric_model_parallel._has_dtensor_modules = saved


# Note [materializing fully_shard units]
# A module built on the meta device (trainer.init_module(empty_init=True)) is materialized by
# ModelParallelStrategy.setup with Lightning's _materialize_distributed_module: to_empty, then
# reset_parameters() on every submodule holding parameters or buffers, which on FSDP2's
# DTensors sees the global shapes. On fusedist's pieces it initializes each piece as a tensor
# of its own shape: every rank draws the same numbers for different rows, and a piece cut
# anywhere (1-D, Note [row-aligned flat layout] in fsdp/layout.py) makes nn.Linear's init
# fail ("Fan in and fan out can not be computed"). For a module holding fully_shard units the
# strategy runs the same reset_parameters() calls, in the same order (module.modules(): a
# parent before its children, so a child's reset_parameters overwrites what its parent's
# wrote, as under Lightning), through fusedist.fsdp.init_parameters, which makes each unit
# whole while its submodules initialize: the values the unsharded model gets from the same
# RNG state, each rank keeping its rows. Lightning's warning for submodules
# without reset_parameters() is kept. Scoped to setup, as Note [finding the sharded model].


_lightning_materialize = _pytorch_model_parallel._materialize_distributed_module


def _materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Note [materializing fully_shard units]."""
    if not (_holds_units(module) and _has_meta_device_parameters_or_buffers(module)):
        return _lightning_materialize(module, device)
    module.to_empty(device=device)
    uninitialized = set()

    def reset(sub: torch.nn.Module) -> None:
        if not any(True for _ in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))):
            return
        reset_method = getattr(sub, "reset_parameters", None)
        if callable(reset_method):
            reset_method()
        else:
            uninitialized.add(type(sub).__name__)

    init_parameters(module, reset, order="modules")  # Lightning's order: parents first
    if uninitialized:
        rank_zero_warn(
            "FusedistModelParallelStrategy: modules built on the meta device without a reset_parameters() method "
            f"keep uninitialized memory in their parameters or buffers: {', '.join(sorted(uninitialized))}"
        )


@contextlib.contextmanager
def _fully_shard_modules_materialize_whole():
    saved = _pytorch_model_parallel._materialize_distributed_module
    _pytorch_model_parallel._materialize_distributed_module = _materialize
    try:
        yield
    finally:
        _pytorch_model_parallel._materialize_distributed_module = saved
