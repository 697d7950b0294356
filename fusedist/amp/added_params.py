"""Parameters added to an optimizer between ``GradScaler.unscale_`` and ``step``.

# Note [a param group added after unscale_]
``unscale_`` unscales (or, lazily, records an inverse scale for) the gradients of the parameters
the optimizer holds *then*, and checks those alone for inf/NaN. A group added afterwards --
``optimizer.add_param_group`` between the two calls, e.g. a layer unfrozen by a callback that
runs after the clip -- keeps its *scaled* gradients: torch.amp.GradScaler steps them as they are
(an SGD update ``scale`` times too large, 65536x by default, and an inf in them is stepped into
the weights), silently. fusedist's scaler refuses that ``step``, naming the group, on every path
(torch's optimizers, the fused ones, lazy or not). A group whose parameters have no gradient yet
(the usual unfreezing: frozen parameters have none) is stepped as torch steps it, since nothing
of it is scaled. ``unscale_`` records the number of parameters of each group; ``step`` looks only
at the parameters beyond those counts, so the check costs nothing per parameter.
"""

from __future__ import annotations

from typing import Optional

RECORD_KEY = "param_counts_at_unscale"


def param_counts(optimizer) -> Optional[tuple]:
    """The number of parameters of each of ``optimizer``'s groups (None without param groups)."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return None
    return tuple(len(group["params"]) for group in groups)


def check_none_added(optimizer, counts: Optional[tuple]) -> None:
    """Raise where a parameter with a gradient joined ``optimizer`` after ``unscale_`` recorded
    ``counts`` (Note [a param group added after unscale_])."""
    if counts is None:
        return
    groups = getattr(optimizer, "param_groups", None)
    if groups is None or param_counts(optimizer) == counts:
        return
    added = []
    for index, group in enumerate(groups):
        known = counts[index] if index < len(counts) else 0
        with_grads = [p for p in group["params"][known:] if getattr(p, "grad", None) is not None]
        if with_grads:
            shapes = ", ".join(str(tuple(p.shape)) for p in with_grads[:4]) + (", ..." if len(with_grads) > 4 else "")
            added.append(f"param group {index} ({len(with_grads)} added parameter(s) with gradients, shapes {shapes})")
    if not added:
        return
    raise RuntimeError(
        f"GradScaler.step: {'; '.join(added)} joined {type(optimizer).__name__} after GradScaler.unscale_(): "
        "their gradients still hold the *scaled* values and were not checked for inf/NaN, so stepping them "
        "would apply an update 'scale' times too large (torch.amp.GradScaler does so silently). Add the param "
        "group before unscale_() (before the backward, or after scaler.update()), or set the added parameters' "
        ".grad to None before step()."
    )
