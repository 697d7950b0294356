"""The loss scale of a training step, compared by the per-step check.

Note [loss scale in the step check]
    A rank whose ``GradScaler`` holds another scale than the others' (its state loaded on some ranks
    only, ``update(new_scale)`` called on one rank) scales its loss differently: the bucket averages
    mix gradients of different scales and every rank unscales the average by its own scale, so the
    replicas drift apart. Every counter of the check agrees, so only the parameter digest saw it, at
    its period (``FUSEDIST_PARAM_CHECK_EVERY``). So ``fusedist.amp.GradScaler.scale()`` notes the
    scale it multiplied by, and the next check to read it carries it as the ``loss_scale`` field (the
    float32 bits of the scale) and clears it: a check reads the scale of the losses scaled since the
    check before, 0 where none was. The value, not the scaler, is kept: a scaler left from an earlier
    loop (another Trainer's, in one process) is collected on one rank and not yet on another, and
    reading it at the check once made two healthy ranks differ. It is noted only where the scale
    already lives on the host (a CPU scaler): on a GPU reading it would synchronize the host at every
    step, so the field stays 0 there and the parameter check remains the net. ``torch.amp.GradScaler``
    is not noted (nothing of it is called through fusedist).
"""

from __future__ import annotations

import struct

#: What a difference in the scale means (the step check's words).
EXPLAIN = ("the ranks scaled their losses by different GradScaler scales (the scaler's state loaded, or its scale "
           "set, on some ranks only): the averaged gradients mix scales and each rank unscales them by its own, so "
           "the replicas drift apart; load or set the scaler's state on every rank alike")

_since_check = 0  # the float32 bits of the scale losses were scaled by since a check read it (0: none)


def scaled_with(scaler) -> None:
    """``scaler.scale()`` ran (called by fusedist's GradScaler once it has its scale): note the scale
    when it is on the host."""
    global _since_check
    scale = getattr(scaler, "_scale", None) if scaler.is_enabled() else None
    if scale is not None and scale.device.type == "cpu":
        _since_check = struct.unpack("<I", struct.pack("<f", float(scale)))[0]


def scale_field() -> int:
    """The ``loss_scale`` field: the scale noted since the last read, which it clears (0: none noted)."""
    global _since_check
    field, _since_check = _since_check, 0
    return field


def shown(field: int) -> str:
    """A ``loss_scale`` field as an error shows it."""
    if field == 0:
        return "no GradScaler scale on the host"
    return repr(struct.unpack("<f", struct.pack("<I", field & 0xFFFFFFFF))[0])
