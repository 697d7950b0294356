"""The refusal of a second ``fully_shard`` call on a module already sharded.

torch's FSDP2 refuses it too ("can only be applied to a module once"): the module's parameters
are already pieces of a unit, and sharding them again would shard the pieces. What a user
usually wants from the second call -- other settings -- the sharded module's ``set_*`` methods
give; a different mesh or policy needs the model built and sharded afresh.
"""

from __future__ import annotations

from torch import nn

from .state import state_of
from .tree_names import unit_where

__all__ = ["refuse_sharded_again"]


def refuse_sharded_again(module: nn.Module) -> None:
    """Raise a ValueError naming ``module`` (its path under the root once the root ran) when
    ``fully_shard`` already sharded it."""
    st = state_of(module)
    if st is None:
        return
    where = unit_where(st.unit) if st.unit is not None else _class_name(module)
    raise ValueError(
        f"fusedist.fully_shard: {where} is already sharded: fully_shard is applied once per module. To change its "
        "settings, call the sharded module's set_* methods (set_reshard_after_forward, set_reshard_after_backward, "
        "set_requires_gradient_sync, set_modules_to_forward_prefetch, ...); for another mesh or policy, build the "
        "model again and call fully_shard once on each module with those arguments.")


def _class_name(module: nn.Module) -> str:
    """The class ``fully_shard`` found ``module`` with, not its sharded class."""
    from .api import FullyShardedModule
    from .sharded_class import original_class

    cls = type(module)
    return (original_class(cls, FullyShardedModule) if issubclass(cls, FullyShardedModule) else cls).__name__
