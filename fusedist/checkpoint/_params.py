"""The parameters an optimizer steps, and the canonical names (Note [canonical names] in
``_names.py``) a checkpoint gives them: what ``save`` writes into the manifest and what ``load``
matches them against."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..zero import param_labels
from . import _names, stage3


def optimizer_params(optimizer) -> list:
    """Every parameter of every group, in the order of the optimizer's state dict."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def param_names(model: torch.nn.Module, params) -> list[str]:
    """Canonical names of ``params`` in ``model`` (a stage-3 model's shards take the names of
    the parameters they shard)."""
    module = _names.unwrap(model)
    names = {p: _names.canonical_key(module, n) for n, p in module.named_parameters()}
    for unit in stage3.units(module):  # a unit gathered now: its modules hold the unsharded parameters
        for sp, u in zip(unit.sharded, unit.unsharded):
            if u in names:
                names.setdefault(sp, names[u])
    return [names.get(p, f"<not in model: {tuple(p.shape)}>") for p in params]


def known_name(name: str) -> Optional[str]:
    """A name of :func:`param_names`, None for a parameter the model does not hold."""
    return None if name.startswith("<not in model") else name


def labeller(names: list, params) -> Callable[[int], str]:
    """``name(index)`` for the errors of ZeRO's state assembly (fusedist/zero/state.py): ``parameter <index>
    ('<key>', shape ...)`` by the checkpoint's name of the parameter, so an error names it by its path in the
    model, not only by a position in the optimizer's list (Note [naming a parameter given without its name]
    in fusedist/zero/param_labels.py)."""
    def name(index: int) -> str:
        key = known_name(names[index]) if index < len(names) and names[index] else None
        return param_labels.label(params[index], index, key)
    return name
