"""A ZeroRedundancyOptimizer's param groups after a load, compared across its ranks.

Note [the same hyperparameters after a load]
    ``ZeroRedundancyOptimizer.load_state_dict`` compares the groups it would install across the
    ranks (Note [the same hyperparameters on every rank] in ``zero/hyper_checks.py``);
    ``fusedist.checkpoint.load`` installs them itself and compared nothing. Each rank takes the
    settings its checkpoint read holds, and keeps its own where the saved groups lack one: a
    rank that read another torch distributed checkpoint of the same layout (whose metadata, all
    the ranks compare of it, records no value) or kept a setting of its own stepped its slices
    with another ``lr``, silently. So each rank sends the groups as the load would leave them
    with the exchange every load makes anyway (no collective more), and every rank refuses
    alike, before anything is loaded, naming the group, the setting and each rank's value.
"""

from __future__ import annotations

from typing import Optional

from ..zero import ZeroRedundancyOptimizer, hyper_checks
from ._files import CheckpointError


def entries(plan: Optional[dict], optimizer, world) -> Optional[list]:
    """This rank's entries (``hyper_checks.hyperparameter_entries``) of the groups the load of
    ``plan`` leaves ``optimizer`` with; None where they are not compared (not a ZeRO optimizer
    over the load's ranks, or a plan that failed: that failure is reported instead)."""
    if plan is None or not isinstance(optimizer, ZeroRedundancyOptimizer) or world.comm is not optimizer.comm:
        return None
    loaded = plan.get("optimizer")
    groups = optimizer.param_groups if loaded is None else [{**g, **h} for g, h in zip(optimizer.param_groups,
                                                                                          loaded[1])]
    return hyper_checks.hyperparameter_entries(groups)


def check(gathered: list, ranks: list, directory: str) -> None:
    """``gathered``: every rank's :func:`entries`, in the world's rank order; ``ranks``: their
    job ranks. Raises on every rank alike where they differ."""
    compared = [(rank, e) for rank, e in zip(ranks, gathered) if e is not None]
    if len(compared) < 2:
        return
    first = compared[0][1]
    for rank, mine in compared[1:]:
        if mine == first:
            continue
        at = next((i for i, (a, b) in enumerate(zip(first, mine)) if a != b), min(len(first), len(mine)))
        by_value: dict = {}
        for r, e in compared:
            shown = hyper_checks.label(e[at]) if at < len(e) else f"{len(e) - 1} entries"
            by_value.setdefault(shown, []).append(r)
        differ = "; ".join(f"{value} on ranks {rs}" for value, rs in by_value.items())
        raise CheckpointError(
            f"fusedist.checkpoint: loading {directory}, the ranks' ZeroRedundancyOptimizer would hold different "
            f"hyperparameters: {differ}. Every rank must load the same checkpoint into optimizers built alike; "
            f"nothing was loaded. {hyper_checks.HINT}")
