"""The one switch of the reliability checks."""

from __future__ import annotations

import os


def checks_enabled() -> bool:
    """Whether the always-on checks run (``FUSEDIST_CHECKS=0`` turns them off).

    On by default: the collective monitor, the per-step cross-rank check of DDP and the
    optimizer-step guard. Their cost is fixed per step -- above all the check's one small
    collective, which on the host rides on the last gradient bucket's all-reduce where it can
    (Note [the check carried by the last bucket] in ``carried_check.py``) -- so it is a small
    share of a model's step that does real work (``benchmarks/bench_reliability.py``) and a
    larger one of a tiny model's, whose step is the collectives' latency
    (``benchmarks/bench_ddp_step_overhead.py --phases`` shows where it goes). The switch exists
    to measure exactly that, and as an escape hatch; the construction-time consistency checks
    are not affected by it.
    """
    raw = os.environ.get("FUSEDIST_CHECKS", "1")
    value = raw.strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"FUSEDIST_CHECKS must be 0 or 1 (also false/true, off/on; unset: 1), got {raw!r}")
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


#: Default of ``FUSEDIST_DIVERGENCE_PROBE_S`` (Note [divergence probe] in ``divergence.py``).
DIVERGENCE_PROBE_S = 5.0


def divergence_probe_s() -> float:
    """After how many seconds of one blocking collective wait a rank starts comparing, through the
    store, where every rank of the group waits (``FUSEDIST_DIVERGENCE_PROBE_S``; 0 turns the probe
    off). Waits that end sooner never touch the store."""
    value = os.environ.get("FUSEDIST_DIVERGENCE_PROBE_S", str(DIVERGENCE_PROBE_S)).strip()
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"FUSEDIST_DIVERGENCE_PROBE_S must be a finite number of seconds >= 0 (0: off), "
                         f"got {value!r}")
    return seconds
