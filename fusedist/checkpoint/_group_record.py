"""Which parameters each param group held, recorded beside a flattened optimizer state.

Note [param groups of a flattened optimizer state]
    torch's ``get_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict=True))``
    (torchtitan's form) writes each parameter's group settings under its own name
    (``param_groups.<name>.lr``): which parameters shared a group is lost. A parameter the
    loading optimizer holds in another group than the saved one, or groups merged or split,
    could then not be told from the saved grouping whenever the settings agree, where the
    nested form is refused (Note [parameters moved between param groups] in ``_from_dcp.py``).
    :func:`record_param_groups` adds one entry, ``param_group_members``: the names of each
    group's parameters, in the optimizer's order of groups. torch's ``dcp.load`` reads only
    the keys of the state dict it fills, and ``set_optimizer_state_dict`` only the keys it
    asks for, so the entry changes nothing for torch; ``fusedist.checkpoint.load`` rebuilds
    the groups from it and checks them as it checks a nested state. A flattened state without
    it (written by torch alone, or before the entry existed) loads as before: one group per
    parameter, compared by settings.
"""

from __future__ import annotations

from typing import Optional

from ._files import CheckpointError
from ._names import DDP_PREFIX
from ._params import optimizer_params, param_names

#: the key of the record in a flattened optimizer state dict (no parameter's name: it has no dot)
MEMBERS = "param_group_members"


def record_param_groups(model, optimizer, optim_state_dict: dict) -> dict:
    """``optim_state_dict`` (flattened by torch's ``get_state_dict``) with the names of each
    param group's parameters added as ``param_group_members`` (Note [param groups of a
    flattened optimizer state]); a nested state, which records its groups itself, is
    returned as it is. ``optimizer``: the optimizer, or the list ``get_state_dict`` was given
    (their groups in turn). Save the result with ``dcp.save`` in place of the flattened state."""
    if "state" in optim_state_dict and "param_groups" in optim_state_dict:
        return optim_state_dict
    flattened = {key.split(".", 1)[1].rpartition(".")[0] for key in optim_state_dict
                 if key.startswith("param_groups.")}
    members = []
    for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        names, start = param_names(model, optimizer_params(opt)), 0
        for group in opt.param_groups:
            members.append([_as_saved(n, flattened) for n in names[start:start + len(group["params"])]])
            start += len(group["params"])
    absent = [n for group in members for n in group if n not in flattened]
    if absent:
        raise ValueError(
            f"fusedist.checkpoint.record_param_groups: the optimizer's parameter {absent[0]!r} has no "
            f"'param_groups.{absent[0]}.<setting>' entry in the flattened state dict ({len(absent)} such): pass the "
            "state get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)) "
            "returned for this model and optimizer")
    return dict(optim_state_dict, **{MEMBERS: [group for group in members if group]})


def _as_saved(name: str, flattened: set) -> str:
    """``name`` as the flattened state spells it: with DDP's ``module.`` where the state kept it."""
    return DDP_PREFIX + name if name not in flattened and DDP_PREFIX + name in flattened else name


def recorded(optim: dict, source: str) -> Optional[list]:
    """The recorded names of each param group's parameters; None where none are recorded."""
    members = optim.get(MEMBERS)
    if members is None:
        return None
    if not (isinstance(members, (list, tuple)) and all(
            isinstance(g, (list, tuple)) and all(isinstance(n, str) for n in g) for g in members)):
        raise CheckpointError(f"fusedist.checkpoint: {source}: entry {MEMBERS!r} is not a list of param groups' "
                              f"parameter names (it is a {type(members).__name__}); nothing was loaded")
    return [list(g) for g in members]
