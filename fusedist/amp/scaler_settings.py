"""The checks of a GradScaler's settings: those torch takes silently but cannot train with.

torch checks only ``growth_factor > 1`` and ``backoff_factor < 1``; a scale of 0, a backoff
factor of 0, an infinite growth factor or a growth interval of 0 pass its checks and then train
wrongly without an error. fusedist's GradScaler checks them wherever they enter: the
constructor, the setters, ``update(new_scale)`` and ``load_state_dict``.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch

_TORCH_STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _real(value) -> Optional[float]:
    try:
        return None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        return None


def check_device(device) -> None:
    """torch.amp.GradScaler's first argument is the device type; torch.cuda.amp.GradScaler's (the
    deprecated alias code swaps for it) is ``init_scale``. torch's takes a number there silently:
    ``GradScaler(2.0**14)`` kept the default scale of 65536 and trained with it."""
    if isinstance(device, (int, float)):
        raise TypeError(
            f"GradScaler: the first argument is the device type (e.g. 'cuda'), as torch.amp.GradScaler's, got the "
            f"number {device!r}; torch.cuda.amp.GradScaler's first argument is init_scale: pass "
            f"GradScaler('cuda', init_scale={device!r})"
        )


def check_settings(where: str, scale_name: str, scale, growth_factor, backoff_factor, growth_interval) -> None:
    """torch checks only growth_factor > 1 and backoff_factor < 1; the values below pass its
    checks yet train wrongly without an error: a scale of 0 zeroes every gradient (or makes
    every step overflow), a backoff factor <= 0 or an infinite growth factor makes the scale 0,
    negative or inf after one update, and growth_interval <= 0 never grows the scale. Without a
    ``scale_name`` the scale is not checked (a setter's call)."""
    problems = []
    s, gf, bf = _real(scale), _real(growth_factor), _real(backoff_factor)
    if scale_name is not None and (s is None or not (math.isfinite(s) and s > 0)):
        problems.append(f"{scale_name} must be a finite number > 0, got {scale!r}")
    if gf is None or not math.isfinite(gf):
        problems.append(f"growth_factor must be a finite number, got {growth_factor!r}")
    if bf is None or not bf > 0:
        problems.append(f"backoff_factor must be a number > 0, got {backoff_factor!r}")
    try:
        interval = None if isinstance(growth_interval, bool) else operator.index(growth_interval)
    except TypeError:
        interval = None
    if interval is None or interval < 1:
        problems.append(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


def checked_new_scale(new_scale, device_type: str):
    """``update(new_scale)`` with a number: torch takes any, but a scale of 0 zeroes every
    gradient (the steps go on, the scale never grows from 0), and an inf or nan one makes every
    gradient non-finite (every step skipped, the backoff keeps it there), silently, as with
    ``init_scale`` (:func:`check_settings`). A tensor is not read: that would be a host sync.

    Returns the scale in the form torch's update takes: a float (its update fills the scale only
    from a ``float``, and failed on an int with "'int' object has no attribute 'device'"), or a
    tensor of the scale's shape: its docstring asks for a 1-element tensor, but its scale has
    shape ``()``, so ``torch.tensor([s])`` failed in ``copy_`` ("output with shape [] doesn't
    match the broadcast shape [1]"). A tensor torch's update refuses (on another device type, of
    several elements, requiring grad) is refused here with its message, before the update changes
    anything (torch's refuses before it does; the hysteresis count was reset first)."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.device.type != device_type or new_scale.numel() != 1 or new_scale.requires_grad:
            raise AssertionError("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                                 "torch.FloatTensor with requires_grad=False.")
        return new_scale.reshape(())
    s = _real(new_scale)
    if s is None or not (math.isfinite(s) and s > 0):
        raise ValueError(f"GradScaler.update: new_scale must be a finite number > 0, got {new_scale!r}")
    return s


def _check_loaded_min_scale(min_scale) -> None:
    """A loaded ``min_scale`` is checked as the constructor checks it, less the bound by
    ``init_scale`` (a loaded scale may lie below the floor): an infinite one never let the scale
    back off (every step skipped, with a warning at each update), a string failed only at the
    first overflow, and 0 or less silently meant no floor."""
    m = _real(min_scale)
    if min_scale is not None and (m is None or not (math.isfinite(m) and m > 0)):
        raise ValueError(f"GradScaler.load_state_dict: min_scale must be None or a finite number > 0, "
                         f"got {min_scale!r}")


def check_loaded_state(state_dict: dict) -> None:
    """Check a state dict before any of it is loaded: torch's load stops half-way at a missing
    key, and takes the values the constructor refuses."""
    missing = [k for k in _TORCH_STATE_KEYS if k not in state_dict]
    if missing:
        raise KeyError(f"GradScaler.load_state_dict: the state dict lacks {missing} "
                       f"(it has {sorted(state_dict)}); not a GradScaler state dict?")
    check_settings("GradScaler.load_state_dict", "scale", *(state_dict[k] for k in _TORCH_STATE_KEYS[:4]))
    hysteresis = state_dict.get("hysteresis", 1)
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
        raise ValueError(f"GradScaler.load_state_dict: hysteresis must be an integer >= 1, got {hysteresis!r}")
    _check_loaded_min_scale(state_dict.get("min_scale"))
