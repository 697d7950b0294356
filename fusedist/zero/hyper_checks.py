"""Param-group hyperparameters that differ between the ranks of a ZeroRedundancyOptimizer.

Note [the same hyperparameters on every rank]
    Each rank steps only its own slice of every parameter, with its own copy of the param
    groups. A rank built with another ``lr`` (a config read per host, a rank-dependent default,
    ``ReduceLROnPlateau`` stepped on a rank's local loss) therefore updated its slices with that
    value and the others theirs: after the all-gather every parameter is a patchwork of slices
    trained at different rates, and nothing fails. torch's ZeroRedundancyOptimizer has the same
    hazard, at the granularity of whole parameters; an unsharded optimizer under DDP drifts the
    replicas apart instead. So wherever the ranks already meet -- the constructor's and
    ``add_param_group``'s parameter check (Note [the same parameters on every rank] in
    ``param_checks.py``), whose one exchange carries these entries too, and ``load_state_dict``,
    which compares the hyperparameters it would install before installing any -- every rank
    raises the same :class:`fusedist.RankMismatchError` naming the param group, the
    hyperparameter and each rank's value. (This makes ``load_state_dict`` a collective; a
    sharded optimizer is loaded on every rank anyway, each taking its own part. A state dict
    refused on one rank only is refused on every rank, after the comparison.)

    What is compared: the number of groups, each group's parameter count and every setting of
    the group except those that only pick how torch runs the same math (``foreach``, ``fused``,
    ``capturable``, ``differentiable``): ``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``momentum``, ``maximize``... and what LR schedulers keep there (``initial_lr``). Floats are
    compared by ``repr`` (a NaN equals itself; 1 and 1.0 are the same rate), a one-element
    tensor by its value (reading a device scalar once here, never in a step).

    ``step()`` compares nothing and so costs nothing: an LR scheduler changes the rates of every
    rank alike at every step, and a comparison per step would be a collective per step (one
    gated on a rank-local "changed" test would pair with another rank's parameter all-gather
    when only one rank changed its value -- the very case to catch). A change made on one rank
    only after construction is caught at the next ``add_param_group`` or ``load_state_dict``.
"""

from __future__ import annotations

import torch

from .._consistency import RankMismatchError, check_same_across_ranks

# Settings that choose an implementation of the same update, not the update.
_HOW_IT_RUNS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


def _comparable(value):
    """``value`` in a form equal across ranks exactly when the update it gives is the same."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        try:
            return repr(float(value))
        except OverflowError:  # (an int beyond float range)
            return repr(value)
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return repr(float(value.detach().reshape(()).item()))
        return f"tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return tuple(_comparable(v) for v in value)
    return type(value).__name__


def hyperparameter_entries(groups) -> list:
    """One entry per group (its parameter count) and per setting of it, in a fixed order."""
    entries = [("hyper", "groups", len(groups))]
    for gi, group in enumerate(groups):
        entries.append(("hyper", gi, "parameters", len(group["params"]) if "params" in group else 0))
        for key in sorted(k for k in group if k not in _HOW_IT_RUNS):
            entries.append(("hyper", gi, key, _comparable(group[key])))
    return entries


def label(entry) -> str:
    """An entry of :func:`hyperparameter_entries` for an error message."""
    if entry[1] == "groups":
        return f"{entry[2]} param groups"
    value = entry[3]
    shown = value if not isinstance(value, tuple) else "(" + ", ".join(map(str, value)) + ")"
    return f"param group {entry[1]}: {entry[2]}={shown}"


HINT = ("Every rank must give each param group the same hyperparameters (lr, betas, eps, weight_decay, ...): each "
        "rank steps its own slice of every parameter with its own copy of the groups, so a rank with another value "
        "trains its slices differently, silently. Set them from the same config on every rank; an LR scheduler "
        "(or a ReduceLROnPlateau) must be stepped alike on every rank, with a metric averaged over the ranks.")


class _Refusal:
    """A rank's own refusal of the state dict as an entry: equal to another rank's refusal of the
    same kind whatever its text (which may name the rank), so that ranks refusing alike go on to
    raise their own errors, and ranks refusing where others load are a difference."""

    def __init__(self, exc: BaseException):
        self.kind = type(exc).__name__
        self.reason = str(exc).split(";")[0][:200]

    def __eq__(self, other) -> bool:
        return isinstance(other, _Refusal) and other.kind == self.kind

    __hash__ = None


def check_loaded_hyperparameters(zero, groups: list, refusal=None) -> None:
    """``load_state_dict``: the groups as the load would leave them compared across ranks before
    any is installed (Note [the same hyperparameters on every rank]); ``refusal``: this rank's own
    validation error, raised after the comparison so that a state dict refused on one rank only
    fails on every rank alike instead of leaving the others waiting here."""
    if zero.comm is None or zero.world_size == 1:
        if refusal is not None:
            raise refusal
        return
    entries = hyperparameter_entries(groups)
    if refusal is not None:
        entries.insert(0, _Refusal(refusal))

    def describe(entry):
        if isinstance(entry, _Refusal):
            return f"this rank's own refusal of the state dict ({entry.kind}: {entry.reason})"
        return label(entry)

    try:
        check_same_across_ranks(
            entries, "the param groups' hyperparameters after ZeroRedundancyOptimizer.load_state_dict", describe,
            comm=zero.comm, op="ZeroRedundancyOptimizer.load_state_dict: hyperparameter check",
            hint="Load the same state dict on every rank (or the complete set of shards); nothing was loaded. "
            + HINT)
    except RankMismatchError as exc:
        raise exc from refusal
    if refusal is not None:
        raise refusal
