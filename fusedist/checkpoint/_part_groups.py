"""The param groups of a pipeline part's optimizer against the saved stages' groups it takes.

Note [param groups across a pipeline re-split]
    A part loaded from several saved stages (another pipeline split) takes each group's settings
    from the saved groups of its parameters, by name: a re-split legitimately merges groups
    (two saved parts' groups into one) and splits them (a saved part's groups over two target
    parts). Two cases have no one answer, and torch's ``set_optimizer_state_dict`` answers them
    silently (it copies every matching saved group's settings over the target group's, the last
    one winning, and a target group whose saved group also maps to a later one is left without
    settings):

    - one target group holds parameters saved in groups whose settings differ (``lr`` 0.1 in
      one saved part, 0.2 in the other): one group steps with one ``lr``, and which one is not
      the checkpoint's to choose;
    - one saved group's parameters land in two target groups of one part whose own settings
      differ (``weight_decay`` 0 for the biases, 0.1 for the weights): the load gives both the
      saved group's settings, erasing the distinction the optimizer was built with.

    Both are refused before anything is loaded, naming the part, the group, the setting and
    its values. Groups that agree merge and split as before. The same holds for torch's
    distributed checkpoint of a pipeline-parallel job, whose parts' groups are put together by
    name too.

    A group's ``param_names`` (an optimizer built from ``named_parameters()``) is not a
    setting: each saved part's groups list their own parameters, so comparing them refused
    every merge of such groups ("different settings"); a merged or split group takes its
    members' saved names instead.
"""

from __future__ import annotations

import torch

from ._files import CheckpointError

#: Group entries that are not settings: the parameters, and torch's names of them (an optimizer
#: built from ``named_parameters()``), which are each parameter's and follow it into its group.
NOT_SETTINGS = ("params", "param_names")


def same_value(a, b) -> bool:
    """Whether two saved settings (numbers, tensors, tuples, dicts of them) are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def check(groups: list, origins: list, names: list, optimizer_groups: list, part: str, source: str) -> None:
    """``groups``: the saved groups the part takes (parameters by name), ``origins[i]`` naming
    where ``groups[i]`` was saved ("group 0 of part 1 of ranks [1]"); ``names``: the part
    optimizer's parameter names, in the order of ``optimizer_groups``. Raises as Note [param
    groups across a pipeline re-split] says."""
    group_of = {name: gi for gi, g in enumerate(groups) for name in g.get("params", [])}
    targets: dict = {}  # saved group -> the target groups holding its parameters
    start = 0
    for index, own in enumerate(optimizer_groups):
        members = [n for n in names[start:start + len(own["params"])] if n in group_of]
        start += len(own["params"])
        holder = {}  # saved group -> its first parameter in this target group
        for name in members:
            holder.setdefault(group_of[name], name)
        for saved in holder:
            targets.setdefault(saved, []).append(index)
        first, *rest = list(holder) or [None]
        for other in rest:
            key = _differing(groups[first], groups[other], [*groups[first], *groups[other]])
            if key is not None:
                raise CheckpointError(
                    f"fusedist.checkpoint: {source}: param group {index} of {part} holds {holder[first]!r}, saved "
                    f"in {origins[first]} with {key}={_value(groups[first], key)}, and {holder[other]!r}, saved in "
                    f"{origins[other]} with {key}={_value(groups[other], key)}: one group steps with one {key}, "
                    "and which one is not the checkpoint's to choose. Put them in separate param groups (as they were "
                    "saved), or load with optimizer=None; nothing was loaded")
    for saved, indices in targets.items():
        for a, b in zip(indices, indices[1:]):
            key = _differing(optimizer_groups[a], optimizer_groups[b], list(groups[saved]))
            if key is not None:
                raise CheckpointError(
                    f"fusedist.checkpoint: {source}: param groups {a} and {b} of {part} differ in {key} "
                    f"({_value(optimizer_groups[a], key)} and {_value(optimizer_groups[b], key)}) but both hold "
                    f"parameters saved in {origins[saved]} ({_first_in(groups[saved], names)!r} ...), whose "
                    f"{key}={_value(groups[saved], key)} the load would give both: the checkpoint does not know "
                    "the distinction. Build the groups as they were saved, or load with optimizer=None; "
                    "nothing was loaded")


def _differing(a: dict, b: dict, keys: list):
    """The first of the settings ``keys`` in which ``a`` and ``b`` differ (one lacking it
    included), or None."""
    for key in keys:
        if key in NOT_SETTINGS:
            continue
        if (key in a) != (key in b) or (key in a and not same_value(a[key], b[key])):
            return key
    return None


def _value(group: dict, key: str) -> str:
    return repr(group[key]) if key in group else "(none)"


def _first_in(group: dict, names: list) -> str:
    return next((n for n in group.get("params", []) if n in names), group.get("params", ["?"])[0])
