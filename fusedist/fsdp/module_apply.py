"""``model.apply(fn)`` on a ``fully_shard`` module: ``fn`` sees whole parameters, so an
initialization gives the unsharded model's values.

Note [apply on a sharded model]
    A model built on the meta device, sharded, materialized with ``to_empty`` and then
    initialized with ``model.apply(init_fn)`` (HF's ``_init_weights``, a torchtitan-style init)
    ran ``init_fn`` on each rank's pieces: every rank drew the same numbers for its own rows
    from the same RNG state (duplicated rows across ranks), and its results changed with the
    world size. torch's FSDP2 initializes DTensors there: on GPU a random init of a shard draws
    the shard's part of a stream, on a CPU mesh each rank draws the same numbers for its
    shard (its rows repeat across ranks, as fusedist's did). So ``apply`` on a sharded module
    runs ``init_parameters(module, fn)`` (Note [initializing like the unsharded model] in
    param_init.py): ``fn`` is called on every submodule in ``nn.Module.apply``'s order with
    the parameters its unit holds made whole, each rank keeping its rows -- exactly the
    unsharded model's ``apply(fn)`` from the same RNG state, at any world size. Call it on
    every rank with the same RNG state, as an unsharded init would be.

    It runs as torch's ``apply`` instead -- on the pieces -- where there is nothing whole to
    make or it would break a pass: a unit still on the meta device (before ``to_empty``),
    a unit in the middle of a forward or between a forward with gradients and its backward
    (its gathered parameters are in use), and inside another ``apply`` (``fn`` calling
    ``sub.apply(g)``). A module not given to ``fully_shard`` (``model.blocks.apply(fn)``
    where ``blocks`` is a ModuleList) has torch's ``apply``: use ``init_parameters`` on the
    sharded module there. What ``fn`` reads is whole only where written since the unit was
    made whole (the rows of other ranks read as zeros), and ``fn`` runs without gradients
    recorded, as an initialization does. Units are made whole only for an ``fn`` that reads or
    writes parameters (Note [whole only when read] in param_init.py): an ``fn`` that sets a flag
    on each module costs no copies and leaves gathered units gathered, as FSDP2's ``apply``.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from .param_init import init_parameters
from .state import state_of

__all__ = ["apply_whole"]

_RUNNING = [0]  # applies running in the process (one inside another runs on the pieces)


def apply_whole(module: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    """``module.apply(fn)`` with whole parameters (Note [apply on a sharded model]); ``module``."""
    whole = not _RUNNING[0] and _can_make_whole(module)
    _RUNNING[0] += 1
    try:
        if whole:
            init_parameters(module, fn)
        else:
            nn.Module.apply(module, fn)
    finally:
        _RUNNING[0] -= 1
    return module


def _can_make_whole(module: nn.Module) -> bool:
    """Whether every unit under ``module`` holds data and none is in a forward or awaits its backward."""
    for m in module.modules():
        st = state_of(m)
        if st is None:
            continue
        if st.forward_running or st.backward_pending or (st.unit is not None and st.unit.is_meta):
            return False
    return True
