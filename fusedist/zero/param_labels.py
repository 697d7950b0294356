"""How a ZeroRedundancyOptimizer's errors name a parameter: by its path in the model where one is known.

Note [naming a parameter given without its name]
    Most programs pass ``model.parameters()``, which carries no names, so an error said
    ``parameter 5 (shape (64,))`` -- an index into the optimizer's list that the user has to count out.
    The parameter's module is often known all the same: a fusedist ``DistributedDataParallel`` registers
    the parameters of the module it wraps (frozen ones and a subset given to the optimizer included,
    ``fusedist.ownership``), and a ``fully_shard`` unit records the parameters it took over with their
    names. Parameters given as ``model.named_parameters()`` carry their names in the group's
    ``param_names`` (torch's optimizers keep them there). Each error names the parameter by the first
    of these that knows it, keeping the index (state dicts are indexed by it) and the shape. The
    lookups walk the model's parameters once per message, and once where the ranks compare their
    parameter lists (the construction, ``add_param_group``: the names ride along for the message,
    and are not compared): never in a step.
"""

from __future__ import annotations

from typing import Optional

import torch


def module_paths(params: list, ddp=None) -> list:
    """:func:`module_path` of every parameter of ``params`` (None where unknown), walking each model's
    parameters once: a construction-time exchange names every parameter, and a per-parameter walk of
    a model of thousands of parameters would cost their square."""
    from ..checkpoint._names import canonical_key
    from ..ownership import data_parallel_owner, wrapping_owner

    walked: dict = {}

    def in_wrapper(wrapper, p):
        if id(wrapper) not in walked:
            module = wrapper.module
            walked[id(wrapper)] = {}
            for n, q in module.named_parameters(remove_duplicate=False):
                walked[id(wrapper)].setdefault(id(q), canonical_key(module, n))
        return walked[id(wrapper)].get(id(p))

    out = []
    for p in params:
        wrappers = (w for w in (ddp, data_parallel_owner(p), wrapping_owner(p)) if w is not None)
        out.append(next((n for n in (in_wrapper(w, p) for w in wrappers) if n is not None), None)
                   or _fully_shard_path(p))
    return out


def names_for_exchange(zero, params: list, group_of: list) -> list:
    """Each of ``params``' name (or None) for a description exchanged across ranks; never raises:
    it runs before a collective, and a rank raising there alone would leave the others waiting."""
    try:
        paths = module_paths(params, getattr(zero, "ddp", None))
        return [path or given_name(zero.param_groups, group_of, i) for i, path in enumerate(paths)]
    except Exception:  # noqa: BLE001 - a name is for the message only
        return [None] * len(params)


class NamedEntry(tuple):
    """One parameter's description in an exchange across ranks, its name last: the name is for the
    message, the ranks compare the rest (the same parameter may be named otherwise on a rank whose
    model is wrapped otherwise, and that is no difference)."""

    def __eq__(self, other):
        if isinstance(other, NamedEntry):
            return tuple(self[:-1]) == tuple(other[:-1])
        return tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(tuple(self[:-1]))


def module_path(p: torch.Tensor, ddp=None) -> Optional[str]:
    """``p``'s name in the model holding it (Note [naming a parameter given without its name]):
    ``ddp``'s module (default: the fusedist DDP wrapper registered for ``p``), or the root of the
    ``fully_shard`` unit holding it; None where neither knows it."""
    return module_paths([p], ddp)[0]


def _fully_shard_path(p: torch.Tensor) -> Optional[str]:
    """The path of a ``fully_shard`` unit's parameter (or piece) from its root once the root ran
    forward, else its name in the unit; None for any other tensor."""
    from ..fsdp.owners import owner_of

    owned = owner_of(p)
    if owned is None:
        return None
    from ..fsdp.tree_names import param_path

    return param_path(*owned)


def fully_shard_holds(p: torch.Tensor) -> bool:
    """Whether a live ``fully_shard`` unit holds ``p``: its elements are already sharded over the ranks."""
    from ..fsdp.owners import owner_of

    return owner_of(p) is not None


def given_name(param_groups: list, group_of: list, index: int) -> Optional[str]:
    """Parameter ``index``'s name in its group's ``param_names`` (given as ``named_parameters()``), or None."""
    if index >= len(group_of) or group_of[index] >= len(param_groups):  # (a group torch refused to add)
        return None
    gi = group_of[index]
    group = param_groups[gi]
    names = group.get("param_names")
    if names is None or len(names) != len(group["params"]):
        return None
    return names[index - group_of.index(gi)]


def name_of(zero, index: int, params: Optional[list] = None, group_of: Optional[list] = None) -> Optional[str]:
    """Parameter ``index``'s module path, else its given name (``params``, ``group_of``: the
    optimizer's list with a group being added), else None."""
    params = zero._params if params is None else params
    group_of = getattr(zero, "_group_of", []) if group_of is None else group_of
    return module_path(params[index], getattr(zero, "ddp", None)) or given_name(zero.param_groups, group_of, index)


def short(zero, index: int, params: Optional[list] = None, group_of: Optional[list] = None) -> str:
    """``parameter <index> ('<name>')``: :func:`describe` without the shape, for a parameter a
    message names next to another."""
    name = name_of(zero, index, params, group_of)
    return f"parameter {index}" + (f" ('{name}')" if name else "")


def named(zero, index: int, params: Optional[list] = None, group_of: Optional[list] = None) -> str:
    """`` (named '<name>')`` or nothing: what follows ``parameter <index> has dtype ...`` in a
    message about the parameter's dtype."""
    name = name_of(zero, index, params, group_of)
    return f" (named '{name}')" if name else ""


def label(p: torch.Tensor, index: int, name: Optional[str]) -> str:
    """``parameter <index> ('<name>', shape ...)``, or without the name where none is known."""
    return label_of(index, tuple(p.shape), name)


def label_of(index: int, shape: tuple, name: Optional[str]) -> str:
    """:func:`label` from a parameter's description (one exchanged across ranks)."""
    return f"parameter {index} (" + (f"'{name}', " if name else "") + f"shape {shape})"


def describe(zero, index: int, params: Optional[list] = None, group_of: Optional[list] = None) -> str:
    """Parameter ``index`` of ``zero`` (or of ``params`` in the groups ``group_of``: the optimizer's
    list with a group being added) for an error: by its module path, else its given name, else its
    index and shape alone."""
    params = zero._params if params is None else params
    return label(params[index], index, name_of(zero, index, params, group_of))
