"""``python -m fusedist.plan --measure`` under torchrun (2 CPU ranks, gloo, a tiny model):
the planner's model-state and communication bytes must be within 5% of what fusedist's DDP,
ZeRO-1, ZeRO-2, ZeRO-2 with CPU offload and ZeRO-3 (``fully_shard``, also with
``CPUOffloadPolicy``) allocate and send. Each
strategy trains a freshly built model, all in one launch.

Every CPU measurement of this file runs in ONE torchrun job (tests/scripts/plan_measure_many.py
calls the CLI's ``main`` once per case; the first case initializes as the CLI does, the later
ones find a fresh process group made for them; each destroys its group at the end), after one
warm-up step per strategy instead of the CLI's three: a launch costs more than the
measurements, and no figure checked here moves after the first step (the optimizer state
exists and the buckets are built by then)."""

import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from torchrun_launch import finish, launch  # noqa: E402

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "256", "--micro-batch", "2",
        "--steps", "3"]
WARMUP = 1
MANY = os.path.join(os.path.dirname(__file__), "scripts", "plan_measure_many.py")


def _json_of(out):
    start = out.find("{\n")
    assert start >= 0, out[-3000:]
    return json.loads(out[start:out.rindex("\n}") + 2])


def _cases():
    """(id, CLI arguments) of every CPU measurement; MoE configs as files written by the fixture."""
    cases = {"gpt-fp32": [*TINY, "--precision", "fp32"],
             "llama-bf16": [*TINY, "--precision", "bf16", "--arch", "llama", "--kv-heads", "2", "--ffn-hidden", "96"]}
    for name in MOE_CONFIGS:
        cases[name] = ["--hf-config", name, "--seq", "32", "--micro-batch", "2", "--steps", "3", "--precision", "fp32"]
    return cases


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """{case id: (exit status or None, output)} of the one launch measuring every case in turn."""
    root = tmp_path_factory.mktemp("measure")
    names, cases = list(_cases()), []
    for name, args in _cases().items():
        if name in MOE_CONFIGS:
            path = root / f"{name}.json"
            path.write_text(json.dumps(MOE_CONFIGS[name]))
            args = [str(path) if a == name else a for a in args]
        cases.append(["--measure", "--json", *args])
    (root / "cases.json").write_text(json.dumps(cases))
    # 600 s: the 5 cases took 60-90 s on a loaded 2-core machine (5 launches of 240 s each before)
    code, out = finish(launch(MANY, str(WARMUP), str(root / "cases.json")), timeout=600)
    results, current = {}, None
    for line in out.splitlines(keepends=True):
        mark = re.fullmatch(r"@@ case (\d+) (start|exit (-?\d+))", line.rstrip("\n"))
        if mark and mark[2] == "start":
            current = names[int(mark[1])]
            results[current] = [None, ""]
        elif mark:
            results[current][0], current = int(mark[3]), None
        elif current:
            results[current][1] += line
    for name in names:  # a case that did not finish: the launch's own output says why
        if results.get(name, [None])[0] is None:
            results[name] = (None, f"case {name} did not finish (launch exit {code}):\n{out[-3000:]}")
    return results


@pytest.mark.parametrize("case", ["gpt-fp32", "llama-bf16"])
def test_measured_within_5_percent(launched, case):
    code, out = launched[case]
    assert code == 0, out[-3000:]
    result = _json_of(out)
    measured = result["measured"]
    assert result["within_tolerance"] is True
    _every_rank_within(result)
    for s in ("ddp", "zero1", "zero2", "zero2_offload", "zero3"):
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
    _zero3_checks(measured)
    _zero3_offload_checks(measured)
    _mfu_checks(measured)


def _mfu_checks(measured):
    """The MFU is against the best rate the ranks reach in the step's dtype over the step's own
    matrix products (Note [the measured peak]): a step of those products and more cannot beat
    it. (A 1024 x 1024 bf16 calibration on a CPU without bf16 matrix units gave 100-265%.)"""
    for s, m in measured.items():
        if isinstance(m, dict):
            assert 0 < m["achieved_mfu"] <= 1, (s, m["achieved_mfu"], m["matmul_flops"])


TINY_QWEN2_MOE = {  # routed experts, a gated shared one, q/k/v biases
    "model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 256}
TINY_DEEPSEEK_V3 = {  # latent attention, a dense first block, routed experts and an ungated shared one
    "model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16,
    "num_attention_heads": 4, "num_hidden_layers": 2, "n_routed_experts": 4, "n_shared_experts": 2,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "q_lora_rank": 24, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "max_position_embeddings": 64, "vocab_size": 128}


TINY_ALTERNATING = {  # dense blocks 0 and 2, MoE blocks 1 and 3 (decoder_sparse_step 2); windows on 0 and 2
    **TINY_QWEN2_MOE, "intermediate_size": 32, "moe_intermediate_size": 64, "num_hidden_layers": 4, "vocab_size": 64,
    "decoder_sparse_step": 2, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}


MOE_CONFIGS = {"qwen2_moe": TINY_QWEN2_MOE, "deepseek_v3": TINY_DEEPSEEK_V3, "alternating-windowed": TINY_ALTERNATING}


@pytest.mark.parametrize("case", list(MOE_CONFIGS))
def test_measured_mixture_of_experts(launched, case):
    """Mixture-of-experts configs (and DeepSeek's latent attention) train and hold and send
    what the planner counts for every parameter, experts included."""
    cfg = MOE_CONFIGS[case]
    code, out = launched[case]
    result = _json_of(out)
    assert code == 0, (result["out_of_tolerance"], out[-3000:])
    plan, measured = result["plan"], result["measured"]
    assert plan["inputs"]["active_params"] < plan["inputs"]["params"] == measured["ddp"]["params"]
    if cfg is TINY_ALTERNATING:  # built where the config puts them, as the plan counts them
        assert plan["inputs"]["model"]["dense_ids"] == [0, 2] and plan["inputs"]["windowed_layers"] == 2
    for s in ("ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"):
        assert abs(measured[s]["model_states_error"]) <= 0.05 and abs(measured[s]["comm_error"]) <= 0.05, s
    assert abs(measured["zero3_offload"]["host_error"]) <= 0.05
    # ZeRO-3's temporary bytes: the two consecutive blocks gathered together, a dense and an
    # MoE one where they alternate (the largest block twice was 56% over on TINY_ALTERNATING)
    assert abs(measured["zero3"]["temp_error"]) <= 0.01
    _every_rank_within(result)
    _mfu_checks(measured)


def _every_rank_within(result):
    """The verdict covers every rank's figures (each rank measures its own pieces and peaks;
    rank 0 prints), and it names the rank and figure that is off."""
    errors = result["rank_errors"]
    assert set(errors) == {s for s, m in result["measured"].items() if isinstance(m, dict)}
    for s, figures in errors.items():
        for k, per_rank in figures.items():
            assert len(per_rank) == 2 and all(abs(e) <= 0.05 for e in per_rank), (s, k, per_rank)
    assert result["out_of_tolerance"] == []


def _zero3_checks(measured):
    """ZeRO-3 moves what the planner says for the reason it says: per unit (2 blocks + the
    root) two parameter all-gathers (forward, and again in backward) and one gradient
    reduce-scatter; the flat buffers' padding is added to the prediction, not absorbed by
    the tolerance, so it must stay a small, explicit term."""
    z3 = measured["zero3"]
    assert z3["units"] == 3
    # (+ the per-step cross-rank check: one all-reduce of 16 integers, Note [stage-3 step check])
    assert z3["collectives_per_step"] == {"all_gather": 6, "reduce_scatter": 3, "all_reduce": 1}, z3
    assert z3["gathered_bytes_at_rest"] == 0  # nothing stays gathered between steps
    assert 0 <= z3["padding_comm_bytes_per_step"] <= 0.01 * z3["predicted_comm_bytes_per_step"]
    assert 0 <= z3["padding_model_states_bytes"] <= 0.01 * z3["predicted_model_states_bytes"]
    # with the padding the prediction is all but exact: what is left is the optimizer's
    # per-parameter step counters (model states) and nothing at all (communication)
    assert abs(z3["model_states_error"]) <= 1e-3, z3
    assert abs(z3["comm_error"]) <= 1e-3, z3
    # the temporary term: two blocks and the root gathered, and (1 + 1/N) x (root + block) of
    # gradients on their way through the reduce-scatters -- or only the root's, when block 0's
    # reduction lands before the root's is issued -- as memory_stats() sees them at peak
    assert z3["peak_gathered_bytes"] > 0 and z3["peak_scratch_bytes"] > 0
    assert 0 < z3["predicted_min_gathered_and_scratch_bytes"] < z3["predicted_gathered_and_scratch_bytes"], z3
    assert abs(z3["temp_error"]) <= 0.01, z3
    # ZeRO-3 holds half of DDP's model states at N = 2 ((p + g + K)Ψ/N, the same K as DDP) ...
    assert z3["model_states_bytes"] == pytest.approx(measured["ddp"]["model_states_bytes"] / 2, rel=0.01)
    # ... and sends 1.5x DDP's volume
    assert z3["comm_bytes_per_step"] == pytest.approx(1.5 * measured["ddp"]["comm_bytes_per_step"], rel=0.01)


def _zero3_offload_checks(measured):
    """Note [measuring ZeRO-3 offload]: zero3's model states, all in host memory (the pieces,
    their gradients and the optimizer state), and zero3's collectives and temporary bytes."""
    z3, off = measured["zero3"], measured["zero3_offload"]
    assert off["predicted_model_states_bytes"] == 0 and off["model_states_error"] == 0
    assert off["host_bytes"] == pytest.approx(z3["model_states_bytes"], rel=1e-6)
    # (zero3's step counts, torch AdamW's at fp32, are in host memory already: Note [step counts] in memory.py)
    assert off["predicted_host_bytes"] == z3["predicted_model_states_bytes"] + z3["predicted_host_bytes"]
    assert 0 <= off["padding_host_bytes"] <= 0.01 * off["predicted_host_bytes"]
    assert abs(off["host_error"]) <= 1e-3 and abs(off["comm_error"]) <= 1e-3, off
    assert off["collectives_per_step"] == z3["collectives_per_step"]
    assert abs(off["temp_error"]) <= 0.01 and off["gathered_bytes_at_rest"] == 0, off


def test_a_prediction_of_nothing_is_met_only_by_nothing():
    """zero3_offload's device model states are predicted 0 (Note [measuring ZeRO-3 offload]):
    any measured byte there is off without bound, never a division by zero."""
    from fusedist.plan.measure import _out_of_tolerance, _relative_error

    assert _relative_error(0, 0) == 0.0 and _relative_error(105, 100) == pytest.approx(0.05)
    assert _relative_error(1, 0) == float("inf")
    assert _out_of_tolerance({"zero3_offload": {"model_states_error": [0.0, _relative_error(4, 0)]}}) == \
        ["rank 1: zero3_offload model states off by +inf% (tolerance 5%)"]


def test_a_figure_off_on_one_rank_fails_the_run_naming_the_rank():
    """Rank 0 within tolerance does not make the run pass: the verdict reads every rank's
    figures (an MoE run once exited 1 on rank 1 alone, with no word of why)."""
    from fusedist.plan.measure import _out_of_tolerance

    errors = {"zero3": {"model_states_error": [0.001, -0.002], "temp_error": [0.004, 0.08]},
              "ddp": {"comm_error": [-0.07, 0.0]}}
    assert _out_of_tolerance(errors) == ["rank 1: zero3 temp off by +8.00% (tolerance 5%)",
                                         "rank 0: ddp comm off by -7.00% (tolerance 5%)"]
    assert _out_of_tolerance({"ddp": {"comm_error": [0.05, -0.05]}}) == []
    assert _out_of_tolerance({"zero1": {"host_error": [float("nan"), 0.0]}}) == \
        ["rank 0: zero1 host off by +nan% (tolerance 5%)"]


def test_zero3_temporary_peak_is_checked_against_a_range():
    """Note [measuring ZeRO-3]: the peak holds two gradient reductions in flight, or one when the
    first lands before the next is issued; the error is the distance outside that range."""
    from fusedist.plan import memory
    from fusedist.plan.measure import _range_error

    assert _range_error(100, 80, 100) == _range_error(80, 80, 100) == _range_error(90, 80, 100) == 0
    assert _range_error(110, 80, 100) == pytest.approx(0.10) and _range_error(60, 80, 100) == pytest.approx(-0.25)
    # blocks of 10 and 30 elements, a root of 50, N = 2, fp32: 40 + 50 gathered; in backward's order
    # the reductions (flat buffer + 1/N output) are 45 (block 1), 15 (block 0), 75 (the root)
    two = memory.temp_bytes("zero3", 90, "fp32", [10, 30], 25, 0, root_params=50, n=2)
    one = memory.temp_bytes("zero3", 90, "fp32", [10, 30], 25, 0, root_params=50, n=2, in_flight=1)
    assert (two, one) == ((40 + 50 + 15 + 75) * 4, (40 + 50 + 75) * 4)


@pytest.mark.gpu
def test_zero3_offload_holds_no_model_state_on_the_gpu():
    """Note [measuring ZeRO-3 offload] on CUDA, where the split can fail: with CPUOffloadPolicy
    the pieces, their gradients and the optimizer state are all in host memory (one rank)."""
    proc = launch("-m", "fusedist.plan", "--measure", "--json", *TINY, "--precision", "bf16", nproc=1)
    code, out = finish(proc, timeout=240)
    start = out.find("{\n")
    assert start >= 0, out[-3000:]
    result = json.loads(out[start:out.rindex("\n}") + 2])
    off, z3 = result["measured"]["zero3_offload"], result["measured"]["zero3"]
    assert off["model_states_bytes"] == 0 and off["host_bytes"] > 0, off
    assert abs(off["host_error"]) <= 0.05 and z3["host_bytes"] == 0, (off, z3)
    assert code == 0, (result["out_of_tolerance"], out[-3000:])
