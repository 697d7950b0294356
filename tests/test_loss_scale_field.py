"""The per-step check's ``loss_scale`` field (Note [loss scale in the step check] in
fusedist/reliability/scale_check.py): a check reads the scale losses were scaled by since the check
before, then nothing -- never a scaler left from an earlier loop, which one rank may have collected
and another not (two healthy ranks once differed there: 0 against 16384)."""

from __future__ import annotations

import gc
import struct

import torch

import fusedist
from fusedist.reliability import scale_check


def _bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def test_a_check_reads_the_scale_of_the_losses_scaled_since_the_check_before_and_nothing_after():
    scale_check.scale_field()  # (whatever an earlier test left)
    init = float(torch.randint(1, 20, ()).item())
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** init)
    loss = torch.randn((), requires_grad=True)
    scaled = scaler.scale(loss)
    assert torch.equal(scaled, loss * 2.0 ** init)  # torch's scale, unchanged
    assert scale_check.scale_field() == _bits(2.0 ** init)
    assert scale_check.scale_field() == 0  # read once: the next check's losses were scaled by nothing
    scaler.scale(loss)
    del scaler, scaled
    gc.collect()
    assert scale_check.scale_field() == _bits(2.0 ** init)  # the value noted, not the scaler
    assert scale_check.scale_field() == 0
    # a loop without a scaler after one with it: nothing, on every rank alike, collected or not
    later = fusedist.amp.GradScaler("cpu", enabled=False)
    later.scale(loss)
    assert scale_check.scale_field() == 0
