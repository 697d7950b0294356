"""The FUSEDIST_* settings checked when ``init_distributed`` creates the process group: each one a
rank reads is valid, and those that decide which collectives a step runs are the same on every rank.

Note [settings that must agree]
    ``FUSEDIST_CHECKS`` (the per-step check's collective), ``FUSEDIST_PARAM_CHECK_EVERY`` (the
    parameter comparison's), ``FUSEDIST_GLOO_COLLECTIVES``, ``FUSEDIST_AGREE_PARTS`` and
    ``FUSEDIST_COMM`` (how each collective is carried) change the collectives a rank issues. One
    rank launched with another value paired its collectives with the wrong ones of its peers: a
    stall until the collective timeout ("Application timeout caused pair closure", 600 s by default)
    or "Connection closed by peer", naming no setting. Others are read long after the start: a bad
    ``FUSEDIST_CHECKPOINT_PEER_SILENCE_S`` was refused at the first save, perhaps hours in. So
    ``init_distributed`` all-gathers each rank's raw values once (a few bytes), and every rank
    raises the same error naming the variable, the ranks and their values. A setting's reader is
    imported only where some rank set the variable, so an unset environment costs the one
    exchange. The collective timeout is not compared: ranks with different timeouts pair their
    collectives as torch's do (a rank gives up sooner, naming the stall), as torch's
    ``init_process_group`` allows a timeout per rank. A program that made its group with torch's own
    ``init_process_group`` skips this; ``DistributedDataParallel``'s construction check compares the
    readings of the settings that must agree (:func:`must_agree_readings`) with the model's.
"""

from __future__ import annotations

import importlib
import os

import torch.distributed as dist

#: variable -> (module, reader, must agree across ranks); the reader parses os.environ[variable]
SETTINGS = {
    "FUSEDIST_CHECKS": ("fusedist.reliability.config", "checks_enabled", True),
    "FUSEDIST_PARAM_CHECK_EVERY": ("fusedist.reliability.config", "param_check_every", True),
    "FUSEDIST_GLOO_COLLECTIVES": ("fusedist.comm.gloo_exchange", "mode_from_env", True),
    "FUSEDIST_AGREE_PARTS": ("fusedist.comm.part_agreement", "enabled", True),
    "FUSEDIST_COMM": ("fusedist.comm", "communicator_choice", True),
    "FUSEDIST_DIVERGENCE_PROBE_S": ("fusedist.reliability.config", "divergence_probe_s", False),
    "FUSEDIST_CHECKPOINT_PEER_SILENCE_S": ("fusedist.checkpoint._writer", "peer_silence", False),
}


class SettingsError(ValueError):
    """A FUSEDIST_* setting is refused or differs across ranks (raised on every rank alike)."""


def check_settings_agree(group=None) -> None:
    """Raise :class:`SettingsError` on every rank of ``group`` (default: the default group) where a
    rank's FUSEDIST_* setting is invalid, or one that must agree differs (Note [settings that must
    agree]). One all-gather of the raw values; a second only where some rank's value differs."""
    raw = {name: os.environ.get(name) for name in SETTINGS}
    raws = [None] * dist.get_world_size(group)
    dist.all_gather_object(raws, raw, group=group)
    rank = dist.get_rank(group)
    mixed = [name for name in SETTINGS if len({r[name] for r in raws}) > 1]
    readings = {name: _read(name) for name in SETTINGS if raw[name] is not None or name in mixed}
    # (a value every rank shares gets the same verdict everywhere, with no second exchange)
    _raise_refused(rank, {name: [(list(range(len(raws))), raw[name], reading)]
                          for name, reading in readings.items() if name not in mixed})
    if not mixed:
        return
    gathered = [None] * len(raws)
    dist.all_gather_object(gathered, {name: readings[name] for name in mixed}, group=group)
    by_value = {name: _ranks_by_value(raws, gathered, name) for name in mixed}
    _raise_refused(rank, by_value)
    for name in mixed:
        if SETTINGS[name][2] and len({reading for _, _, reading in by_value[name]}) > 1:
            values = "; ".join(f"ranks {ranks}: {'unset' if value is None else repr(value)}"
                               for ranks, value, _ in by_value[name])
            raise SettingsError(
                f"fusedist.init_distributed: {name} differs across ranks (this is rank {rank}): {values}. It decides "
                "which collectives each step runs, so ranks that differ would pair their collectives wrongly and "
                f"stall; set {name} alike on every rank (or on none)")


def must_agree_readings() -> list:
    """``(variable, this rank's reading)`` of each setting that must agree across ranks, for a
    model's construction check to compare: a program that made its group with torch's own
    ``init_process_group`` never ran :func:`check_settings_agree` (Note [settings that must agree])."""
    readings = []
    for name, (_, _, agree) in SETTINGS.items():
        if agree:
            status, value = _read(name)
            readings.append((name, repr(value) if status == "ok" else f"refused ({value})"))
    return readings


def _read(name: str):
    """``("ok", value)`` of this rank's setting ``name``, or ``("refused", message)``."""
    module, reader, _ = SETTINGS[name]
    try:
        return ("ok", getattr(importlib.import_module(module), reader)())
    except Exception as exc:  # noqa: BLE001 - any refusal is every rank's verdict, not this rank's alone
        return ("refused", str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")


def _ranks_by_value(raws: list, gathered: list, name: str) -> list:
    """``[(ranks, raw value, reading)]`` of ``name``, one row per distinct raw value, in rank order."""
    rows: dict = {}
    for rank, (raw, readings) in enumerate(zip(raws, gathered)):
        rows.setdefault(raw[name], ([], readings[name]))[0].append(rank)
    return [(ranks, value, reading) for value, (ranks, reading) in rows.items()]


def _raise_refused(rank: int, by_value: dict) -> None:
    for name, rows in by_value.items():
        for ranks, value, (status, message) in rows:
            if status == "refused":
                raise SettingsError(f"fusedist.init_distributed: {name}={value!r} is refused on ranks {ranks} (this "
                                    f"is rank {rank}): {message}")
