"""The wrapped module's parameters copied after the waits for their gathers.

Note [a copy of the inner module under overlapped gathers]
    ``copy.deepcopy(model.module)`` -- an EMA or SWA copy of the inner module, not of the wrapper -- right
    after a step of a ZeroRedundancyOptimizer with ``overlap_param_gather=True`` copied the parameters the
    step's all-gathers were still writing: the wrapper's own copy waits first (Note [a copy under overlapped
    gathers] in copies.py), the inner module's copy runs no code of the wrapper. A copy walks a module's
    ``__dict__`` in its order -- ``_parameters`` first, its hook registries later, ``_modules`` last -- and
    the hooks that wait for the gathers wait as they are copied (Note [a model pickled under overlapped
    gathers] in fusedist/zero/gather.py): so the parameters of the module copied first (the root's own, or
    those of a submodule copied alone) were read before any wait; 1 to 9 copies in 10 differed from the final
    values on 2 gloo ranks. torch's ZeroRedundancyOptimizer gathers before its step returns, so its copies
    hold the final values. When the gathers' waits are installed on the model, each module that holds
    parameters moves its ``_parameters`` entry to the end of its ``__dict__``: the same attributes, in
    another order, which only a copy or pickle reads -- so the waiting hooks are copied, and wait, before the
    parameters are. The module's class is untouched (no subclass, no ``__deepcopy__``); a module added to the
    model later is not moved (the optimizer's waits do not cover it either).
"""

from __future__ import annotations

from torch import nn


def copy_parameters_last(root: nn.Module) -> None:
    """Move the ``_parameters`` entry of every module of ``root`` that holds parameters after its hook
    registries (Note [a copy of the inner module under overlapped gathers])."""
    for module in root.modules():
        state = module.__dict__
        if state.get("_parameters") and next(reversed(state)) != "_parameters":
            state["_parameters"] = state.pop("_parameters")
