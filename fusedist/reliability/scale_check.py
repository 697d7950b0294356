"""The loss scale of a training step, compared by the per-step check.

Note [loss scale in the step check]
    A rank whose ``GradScaler`` holds another scale than the others' (its state loaded on some ranks
    only, ``update(new_scale)`` called on one rank) scales its loss differently: the bucket averages
    mix gradients of different scales and every rank unscales the average by its own scale, so the
    replicas drift apart. Every counter of the check agrees, so only the parameter digest saw it, at
    its period (``FUSEDIST_PARAM_CHECK_EVERY``). So ``fusedist.amp.GradScaler.scale()`` notes its
    scaler here, and each synchronized backward's check carries the scale of the scaler noted last
    (the same one on every rank running the same program) as the ``loss_scale`` field: the float32
    bits of the scale, 0 without a scaler. It is read only where the scale already lives on the host
    (a CPU scaler): on a GPU reading it would synchronize the host at every step, so the field stays
    0 there and the parameter check remains the net. ``torch.amp.GradScaler`` is not noted (nothing
    of it is called through fusedist).
"""

from __future__ import annotations

import struct
import weakref
from typing import Optional

#: What a difference in the scale means (the step check's words).
EXPLAIN = ("the ranks scaled their losses by different GradScaler scales (the scaler's state loaded, or its scale "
           "set, on some ranks only): the averaged gradients mix scales and each rank unscales them by its own, so "
           "the replicas drift apart; load or set the scaler's state on every rank alike")

_last: Optional[weakref.ref] = None  # the scaler whose scale() ran last


def scaled_with(scaler) -> None:
    """``scaler.scale()`` ran (called by fusedist's GradScaler)."""
    global _last
    _last = weakref.ref(scaler)


def scale_field() -> int:
    """The ``loss_scale`` field: the float32 bits of the last noted scaler's scale when it is on the
    host, else 0 (no scaler, disabled, not initialized yet, or on a device)."""
    scaler = _last() if _last is not None else None
    scale = getattr(scaler, "_scale", None) if scaler is not None and scaler.is_enabled() else None
    if scale is None or scale.device.type != "cpu":
        return 0
    return struct.unpack("<I", struct.pack("<f", float(scale)))[0]


def shown(field: int) -> str:
    """A ``loss_scale`` field as an error shows it."""
    if field == 0:
        return "no GradScaler scale on the host"
    return repr(struct.unpack("<f", struct.pack("<I", field & 0xFFFFFFFF))[0])
