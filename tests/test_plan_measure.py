"""``python -m fusedist.plan --measure`` under torchrun (2 CPU ranks, gloo, a tiny model):
the planner's model-state and communication bytes must be within 5% of what fusedist's DDP,
ZeRO-1, ZeRO-2 and ZeRO-2 with CPU offload allocate and send."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from torchrun_launch import finish, launch  # noqa: E402

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "256", "--micro-batch", "2",
        "--steps", "3"]


def _measure(*extra):
    proc = launch("-m", "fusedist.plan", "--measure", "--json", *TINY, *extra)
    code, out = finish(proc, timeout=240)
    start = out.find("{\n")
    assert start >= 0, out[-3000:]
    return code, json.loads(out[start:out.rindex("\n}") + 2]), out


@pytest.mark.parametrize("extra", [("--precision", "fp32"),
                                   ("--precision", "bf16", "--arch", "llama", "--kv-heads", "2",
                                    "--ffn-hidden", "96")], ids=["gpt-fp32", "llama-bf16"])
def test_measured_within_5_percent(extra):
    code, result, out = _measure(*extra)
    assert code == 0, out[-3000:]
    measured = result["measured"]
    assert result["within_tolerance"] is True
    for s in ("ddp", "zero1", "zero2", "zero2_offload"):
        m = measured[s]
        assert abs(m["model_states_bytes"] / m["predicted_model_states_bytes"] - 1) <= 0.05, (s, m)
        assert abs(m["comm_bytes_per_step"] / m["predicted_comm_bytes_per_step"] - 1) <= 0.05, (s, m)
        assert m["step_s"] > 0
    off = measured["zero2_offload"]
    assert abs(off["host_bytes"] / off["predicted_host_bytes"] - 1) <= 0.05
    # the strategies differ as predicted: ZeRO-2 holds less than DDP, ZeRO-1 sends 1.5x DDP
    assert measured["zero2"]["model_states_bytes"] < measured["ddp"]["model_states_bytes"]
    assert measured["zero1"]["comm_bytes_per_step"] == pytest.approx(1.5 * measured["ddp"]["comm_bytes_per_step"],
                                                                      rel=0.05)
    for s in ("zero3", "zero3_offload"):
        assert measured[s] == "not measured (fusedist has no ZeRO-3 yet)"
