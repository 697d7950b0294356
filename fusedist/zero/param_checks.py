"""Parameter lists a ZeroRedundancyOptimizer refuses, with the reason, before it builds shards.

Kept apart from the optimizer because each check is about what the *user* passed -- the
``params`` argument, a group given to ``add_param_group``, the same list on every rank -- and
says so in torch's terms; the shards themselves are never half-built when one fails.

Note [the same parameters on every rank]
    Every rank shards the same flat space (Note [flat partition] in ``partition.py``), so the
    ranks must pass the same parameters: the same count, shapes, dtypes, trainability and
    param groups, in the same order. With a fusedist DDP model its construction check sees the
    model; the optimizer's own list (which parameters, in which groups and order) is not the
    model's. Without one nothing compared them: ranks whose lists differed built different
    buckets, and the first parameter all-gather received a message of another size (gloo
    aborted the process) or, with equal sizes in another order, every rank silently stepped
    other parameters' elements. torch's ZeroRedundancyOptimizer has the same hazard. So the
    constructor exchanges one small description per parameter (a collective: every rank
    constructs the optimizer, as every rank wraps the model) and every rank raises the same
    :class:`fusedist.RankMismatchError` naming the first parameter that differs and the ranks.
    ``add_param_group`` compares the group it adds the same way, before the group joins, and a
    refusal of a rank's own list (a subset of a DDP model's parameters in stage 2) is raised only
    after the comparison, so that a list differing on one rank fails on every rank alike.
    The same exchange carries every param group's hyperparameters (Note [the same
    hyperparameters on every rank] in ``hyper_checks.py``), after the parameters. The memory
    format is: a parameter channels_last on one rank only lies in another element order in
    that rank's flat buffer (``shaped_like``), and the ranks would exchange unrelated elements.
"""

from __future__ import annotations

import re

import torch

from .._consistency import RankMismatchError, describe_difference, describe_unshared, gather_objects
from ..ddp.layout import slot_order
from . import hyper_checks


def check_param_groups_given(params) -> list:
    """``params`` as a list; a group dict without ``"params"`` is refused as torch's
    ZeroRedundancyOptimizer refuses it (torch's ``Optimizer`` fails with a bare KeyError)."""
    if isinstance(params, torch.Tensor):
        return params  # torch's Optimizer raises its TypeError for a single tensor
    params = list(params)
    for gi, group in enumerate(params):
        if isinstance(group, dict) and "params" not in group:
            raise ValueError(
                f"ZeroRedundancyOptimizer: param group {gi} has no 'params' key (it has {sorted(group)}); "
                "each parameter group passed via `params` must map 'params' to the group's parameters"
            )
    return params


def check_distinct(params: list, group_of: list, describe, first: int = 0) -> None:
    """Refuse a parameter given twice (from index ``first`` on). torch's optimizers only warn
    when one group lists a tensor twice, and step it twice per step; a sharded parameter has
    one slot in the flat space, so it cannot be stepped twice. (Twice in *different* groups
    torch refuses already.)"""
    seen: dict = {}
    for i, p in enumerate(params):
        j = seen.setdefault(p, i)
        if j != i and i >= first:
            raise ValueError(
                f"ZeroRedundancyOptimizer: {describe(i)} in param group {group_of[i]} is the same tensor as "
                f"{describe(j)} in param group {group_of[j]}; pass each parameter once (torch's optimizers "
                "would step it twice per step, and warn that this will become an error)"
            )


def check_same_params_on_every_rank(zero, params=None, group_of=None, first: int = 0, refusal=None) -> None:
    """Note [the same parameters on every rank]: ``params`` (default: the optimizer's), whose
    indices start at ``first``. ``add_param_group`` checks the group it adds (before the group
    joins): ranks adding different parameters grew different buckets, and the next step's
    all-gathers silently exchanged unrelated elements (without DDP) or left the ranks whose
    group missed a parameter DDP reduces raising alone while the others waited. ``refusal``: an
    error of this rank's own list, raised after the comparison (:func:`wiring.find_ddp`)."""
    if zero.comm is None or zero.world_size == 1:
        if refusal is not None:
            raise refusal
        return
    params = zero._params if params is None else params
    group_of = zero._group_of if group_of is None else group_of
    entries = [(first + i, group_of[i], tuple(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad),
                slot_order(p)) for i, p in enumerate(params)]
    if refusal is not None:  # refused on some ranks only: the difference to name first (without the rank)
        reason = re.sub(r"\s*\(rank \d+\)", "", str(refusal)).split(";")[0][:160]
        entries.insert(0, ("refused", type(refusal).__name__, reason))

    def label(e):
        if e[0] == "refused":
            return f"this rank's own refusal of its list ({e[1]}: {e[2]})"
        return (f"parameter {e[0]} (param group {e[1]}) shape {e[2]} {e[3]}"
                + (f" in the memory order of strides {e[5]}" if e[5] else "")
                + ("" if e[4] else " requires_grad=False"))

    adding = first > 0
    op = "ZeroRedundancyOptimizer" + (".add_param_group" if adding else " construction") + ": parameter check"
    # One exchange for both (Note [the same hyperparameters on every rank] in hyper_checks.py),
    # compared apart: a parameter list one entry short must not pair its hyperparameters with
    # the others' parameters.
    hyper = hyper_checks.hyperparameter_entries(zero.param_groups)
    everyone = gather_objects((entries, hyper), zero.comm, op)
    _raise_if_different(
        [e[0] for e in everyone], zero.comm.rank, label,
        "the param group given to ZeroRedundancyOptimizer.add_param_group" if adding
        else "the parameter list given to ZeroRedundancyOptimizer",
        "Every rank must add the same parameters, in the same order; the group was not added." if adding
        else "Every rank must pass the same parameters, in the same param groups and order "
        "(e.g. model.parameters() of the same model on every rank).")
    _raise_if_different(
        [e[1] for e in everyone], zero.comm.rank, hyper_checks.label,
        "the param groups' hyperparameters given to ZeroRedundancyOptimizer"
        + (".add_param_group (the new group's, or the groups' before it)" if adding else ""),
        ("Every rank must add the group with the same hyperparameters; the group was not added. " if adding
         else "") + hyper_checks.HINT)
    if refusal is not None:
        raise refusal


def _raise_if_different(entries_by_rank: list, rank: int, label, what: str, hint: str) -> None:
    """The :class:`fusedist.RankMismatchError` of ``check_same_across_ranks`` for one part of an
    exchange that carried several."""
    difference = describe_difference(entries_by_rank, label)
    if difference is None:
        return
    counts = ", ".join(f"rank {r}: {len(e)}" for r, e in enumerate(entries_by_rank))
    try:  # (an extra to the message: it must never replace the error itself)
        unshared = describe_unshared(entries_by_rank, label) if len(set(map(len, entries_by_rank))) > 1 else None
    except Exception:  # noqa: BLE001
        unshared = None
    raise RankMismatchError(
        f"fusedist: {what} differs across ranks (this is rank {rank}); {difference}. Entry counts: {counts}. {hint}"
        + (f" Not on every rank: {unshared}." if unshared else ""))
