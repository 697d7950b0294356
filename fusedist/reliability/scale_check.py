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
    step, so the field stays 0 there and the parameter check remains the net.

Note [torch's GradScaler in the step check]
    Loops written for torch's DDP keep ``torch.amp.GradScaler`` with fusedist's wrapper; nothing of its
    ``scale()`` runs through fusedist. Its ``step()`` and ``unscale_()`` both reach
    ``GradScaler._unscale_grads_`` (the inf check before a fused optimizer's step too), which fusedist
    already replaces by torch's function plus a found-inf reduction (Note [torch's scaler on sharded
    gradients] in fusedist/amp/torch_scaler.py); there the scale is noted as above, when the optimizer
    holds parameters of a checked model and the scale lives on the host. It is noted on that model's
    watch, not process-wide: noted after the backward it scaled, the last step's note is still unread
    when a loop ends, and a later model (the next loop of a program that caught the error) must not
    read it. The check of the next synchronized backward carries it (the process-wide note first, where
    fusedist's scaler made one): a scale changed on one rank is named one step later than with
    fusedist's scaler, on every rank alike.
"""

from __future__ import annotations

import struct

#: What a difference in the scale means (the step check's words).
EXPLAIN = ("the ranks scaled their losses by different GradScaler scales (the scaler's state loaded, or its scale "
           "set, on some ranks only): the averaged gradients mix scales and each rank unscales them by its own, so "
           "the replicas drift apart; load or set the scaler's state on every rank alike")

_since_check = 0  # the float32 bits of the scale losses were scaled by since a check read it (0: none)


def _host_bits(scaler) -> int:
    """The float32 bits of the scaler's scale when it is on the host (0: disabled, none yet, or on a device)."""
    scale = getattr(scaler, "_scale", None) if scaler.is_enabled() else None
    if scale is None or scale.device.type != "cpu":
        return 0
    return struct.unpack("<I", struct.pack("<f", float(scale)))[0]


def scaled_with(scaler) -> None:
    """``scaler.scale()`` ran (called by fusedist's GradScaler once it has its scale): note the scale
    when it is on the host."""
    global _since_check
    bits = _host_bits(scaler)
    if bits:
        _since_check = bits


def unscaled_with(scaler, optimizer) -> None:
    """torch's ``GradScaler`` unscales (or checks) ``optimizer``'s gradients (Note [torch's GradScaler in
    the step check]): note its scale on the watches of the checked models the optimizer steps (a
    scaler of a model trained on one rank alone is no concern of the check)."""
    from .optimizer_guard import watches_of  # (here: the guard imports what imports this module)

    bits = _host_bits(scaler)
    if bits:
        for watch in watches_of(optimizer):
            watch.unscaled_by = bits


def scale_field(watch=None) -> int:
    """The ``loss_scale`` field of ``watch``'s check: the scale noted since the last read, which it
    clears (0: none noted)."""
    global _since_check
    field, _since_check = _since_check, 0
    if watch is None:
        return field
    mine, watch.unscaled_by = watch.unscaled_by, 0
    return field or mine


def shown(field: int) -> str:
    """A ``loss_scale`` field as an error shows it."""
    if field == 0:
        return "no GradScaler scale on the host"
    return repr(struct.unpack("<f", struct.pack("<I", field & 0xFFFFFFFF))[0])
