"""fusedist.amp.choose_precision: the probe's answer, overrides, and agreement across ranks."""

import pytest
import torch

from fusedist.amp import precision as P
from fusedist.testing import run_distributed


def test_cpu_probe_compares_bf16_with_fp32(monkeypatch):
    timings = {torch.float32: 1.0, torch.bfloat16: 0.5}
    monkeypatch.setattr(P, "_matmul_seconds", lambda dtype, device: timings[dtype])
    fast = P.choose_precision("cpu")
    assert (fast.name, fast.dtype, fast.needs_scaler) == ("bf16", torch.bfloat16, False)
    assert "2.00x" in fast.reason
    timings[torch.bfloat16] = 0.95  # bf16 barely faster: not worth the rounding
    slow = P.choose_precision("cpu")
    assert slow.name == "fp32" and "needs >= 1.2x" in slow.reason


def test_real_probe_returns_a_supported_choice():
    choice = P.choose_precision("cpu")
    assert choice.name in ("bf16", "fp32") and "matmul" in choice.reason


def test_requested_precision_skips_the_probe(monkeypatch):
    monkeypatch.setattr(P, "_matmul_seconds", lambda *a: pytest.fail("probed despite an explicit choice"))
    fp16 = P.choose_precision("cpu", choice="fp16")
    assert fp16.needs_scaler and fp16.dtype == torch.float16 and fp16.reason == "requested"
    with pytest.raises(ValueError, match="precision must be one of"):
        P.choose_precision("cpu", choice="fp8")


def _disagreeing_ranks(rank, world_size):
    from fusedist.amp import precision

    # Timings differ between ranks (noise, a busy core): rank 0's answer must win everywhere.
    precision._local_choice = lambda device: precision.PrecisionChoice(("bf16", "fp32", "fp32")[rank], f"rank {rank}")
    choice = precision.choose_precision("cpu")
    return choice.name, choice.reason


def test_ranks_take_rank_zeros_choice():
    assert run_distributed(_disagreeing_ranks, 3) == [("bf16", "rank 0")] * 3
