"""The one switch of the reliability checks."""

from __future__ import annotations

import os


def checks_enabled() -> bool:
    """Whether the always-on checks run (``FUSEDIST_CHECKS=0`` turns them off).

    On by default: the collective monitor, the per-step cross-rank check of DDP and the
    optimizer-step guard together cost well under 1% of a step (measured in
    ``benchmarks/bench_reliability.py``). The switch exists to measure exactly that, and as
    an escape hatch; the construction-time consistency checks are not affected by it.
    """
    value = os.environ.get("FUSEDIST_CHECKS", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"FUSEDIST_CHECKS must be 0 or 1, got {value!r}")
    return value in ("1", "true", "on")


#: Default period of the parameter check (Note [parameter check] in ``param_check.py``).
PARAM_CHECK_EVERY = 100


def param_check_every() -> int:
    """Every how many synchronized backwards the replicated parameters are compared across
    ranks, and at every ``check_consistency()`` (``FUSEDIST_PARAM_CHECK_EVERY``; 0 turns the
    comparison off, for replicas that differ on purpose). Part of the per-step check: nothing
    with ``FUSEDIST_CHECKS=0``."""
    value = os.environ.get("FUSEDIST_PARAM_CHECK_EVERY", str(PARAM_CHECK_EVERY)).strip()
    try:
        every = int(value)
    except ValueError:
        every = -1
    if every < 0:
        raise ValueError(f"FUSEDIST_PARAM_CHECK_EVERY must be a whole number of steps >= 0 (0: off), got {value!r}")
    return every
