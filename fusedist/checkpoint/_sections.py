"""What a save writes: the manifest's description of the model and optimizer, each rank's
sections and the common ones rank 0 writes (``save``, the pipelined save and the periodic
``Checkpointer`` build their files from these; ``load`` reads them back in ``_load_plan``)."""

from __future__ import annotations

from typing import Optional

import torch

from .._tensor_tree import to_cpu
from ..zero import ZeroRedundancyOptimizer
from . import _adam_family, _checks, _files, _load_plan, _names, stage3
from ._params import optimizer_params, param_names


def format_version(module: torch.nn.Module) -> int:
    """The lowest format version that reads a save of ``module``: box and region fragments need
    a fusedist that reads them (Note [box fragments], Note [region fragments])."""
    if stage3.has_tensor_parallel(module):
        return _files.REGION_VERSION
    return _files.BOX_VERSION if stage3.has_dim_sharded(module) else _files.BASE_VERSION


def manifest_base(model: torch.nn.Module, optimizer, scaler, world_size: int) -> dict:
    """The manifest :func:`load` reads, less the file list and the time: what was saved and
    at which world size (also written by the periodic ``Checkpointer``)."""
    zero = isinstance(optimizer, ZeroRedundancyOptimizer)
    params = optimizer_params(optimizer) if optimizer is not None else []
    sharded = bool(stage3.units(_names.unwrap(model)))
    where = stage3.piece_index(_names.unwrap(model)) if sharded else {}
    return {
        "format": _files.FORMAT,
        "version": format_version(_names.unwrap(model)),
        "world_size": world_size,
        # Note [stage-3 checkpoints]: the sharded parameters are in the rank files
        "model_sharded": sharded,
        "optimizer": None if optimizer is None else {
            # a stage-3 optimizer is saved as ZeRO shards (whole-parameter fragments)
            "kind": "zero" if zero or sharded else "full",
            "class": _checks.optimizer_class(optimizer).__name__,
            "algorithm": _checks.optimizer_algorithm(optimizer),  # what load compares (check_algorithm)
            # per param group: Adam or AdamW (Note [Adam and AdamW are one class in torch])
            "group_algorithms": _checks.optimizer_group_algorithms(optimizer),
            # and their weight decays (Note [Adam without weight decay is AdamW without it])
            "group_weight_decay": _adam_family.recorded(optimizer.param_groups),
            "stage": optimizer.stage if zero else (3 if sharded else None),
            "param_names": param_names(model, params),
            "param_shapes": [list(stage3.full_shape(p, where)) for p in params],
        },
        "scaler": scaler is not None,
    }


def model_shapes(model) -> dict:
    """The model's canonical state-dict keys and whole shapes (Note [one model per save]); None
    for a module's ``get_extra_state()`` entry, whose size may differ by rank (serialized state)."""
    shapes = _load_plan._expected_model(_names.unwrap(model))[0]
    return {k: None if v is None or _names.is_extra_state(k) else tuple(v)
            for k, v in shapes.items()}


def rank_sections(model, optimizer, rank: int, world_size: int) -> tuple[dict, set]:
    """This rank's sections (ZeRO's optimizer shard; a ``fully_shard`` model's pieces and
    optimizer shard, Note [stage-3 checkpoints]) and the model keys they hold."""
    sections, sharded_keys = {}, set()
    module = _names.unwrap(model)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        sections["optimizer_shard"] = to_cpu(optimizer.shard_state_dict())
    elif stage3.units(module):
        sections["model_shard"], sharded_keys = stage3.model_shard(module, rank, world_size)
        if optimizer is not None:
            sections["optimizer_shard"] = to_cpu(stage3.optimizer_shard(
                module, optimizer, optimizer_params(optimizer), rank, world_size))
    return sections, sharded_keys


def common_model(model, sharded_keys: set) -> dict:
    """The model state rank 0 writes to ``common.pt`` (all of it, less what the rank files hold)."""
    if sharded_keys or stage3.units(_names.unwrap(model)):
        return stage3.common_model(_names.unwrap(model), sharded_keys)
    module = _names.unwrap(model)
    return to_cpu(_names.canonical_state(module, module.state_dict()))


def full_optimizer_state(model, optimizer) -> Optional[dict]:
    """The optimizer state rank 0 writes to ``common.pt``: an unsharded optimizer's (a ZeRO or
    stage-3 optimizer's state is in the rank files)."""
    if optimizer is None or isinstance(optimizer, ZeroRedundancyOptimizer) or stage3.units(_names.unwrap(model)):
        return None
    return to_cpu(optimizer.state_dict())


def common_sections(model, optimizer, scaler, extra, sharded_keys: set) -> dict:
    """Everything rank 0 writes to ``common.pt``."""
    return {
        "model": common_model(model, sharded_keys),
        "optimizer": full_optimizer_state(model, optimizer),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "extra": extra,
    }
