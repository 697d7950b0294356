"""The refusal of an optimizer that holds a unit's gathered parameters.

Note [an optimizer over gathered parameters]
    While a unit is gathered (``unshard()``, or the root kept gathered after a forward), its
    modules hold the unsharded parameters, so ``module.parameters()`` yields them, and an
    optimizer built then steps them: they are overwritten by the next gather and their
    gradients are never set (backward reduces into the pieces), while the pieces the model
    trains on are never stepped. Training goes on silently with the initial values (torch's
    FSDP2 does the same with its unsharded parameters). An optimizer's first step (and the first
    after a parameter group was added) is checked for a unit's gathered parameters, and raises on
    every rank that holds one, naming the parameter and its module.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

__all__ = ["refuse_gathered_params"]

#: optimizer -> how many parameters it held when they passed the check (a group added later is checked)
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def refuse_gathered_params(optimizer, units) -> None:
    """Raise a RuntimeError when ``optimizer`` holds a gathered parameter of one of ``units``."""
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for unit in list(units):
        for i, (unsharded, visible) in enumerate(zip(unit.unsharded, unit.visible)):
            if id(unsharded) in held or id(visible) in held:
                _refuse(optimizer, unit, i)
    _CHECKED[optimizer] = count


def _refuse(optimizer, unit, index: int) -> None:
    from .tree_names import param_path, unit_where

    rank = dist.get_rank() if dist.is_initialized() else unit.comm.rank
    raise RuntimeError(
        f"fusedist.fully_shard: rank {rank}: the optimizer ({type(optimizer).__name__}) holds the gathered "
        f"parameter '{param_path(unit, index)}' of {unit_where(unit)}, taken while the module was unsharded "
        "(after unshard(), or the root's forward): stepping it changes nothing the model trains on. "
        "Reshard first (module.reshard()) and build the optimizer while the module is resharded, over "
        "module.parameters() then (this rank's pieces).")
