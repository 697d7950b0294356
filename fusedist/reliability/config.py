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
