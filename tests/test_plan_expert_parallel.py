"""Expert parallelism (--ep) for mixtures of experts: each MoE layer's routed experts split
over ep ranks of the data-parallel group. What a rank holds whole divides by ep for the
experts; what ZeRO shards stays Ψ/N (the expert states over the N/ep ranks holding the same
experts, Megatron-Core's expert-data-parallel group); the gradients and parameters of the
experts go through collectives over N/ep ranks; every MoE layer adds the all-to-alls of its
tokens. --ep 1 is the plan without expert parallelism."""

import json
import os
import sys

import pytest

from fusedist.plan import Job, build_plan, from_hf_config, model_states, resolve_hardware
from fusedist.plan import cli, comm
from fusedist.plan.memory import STRATEGIES, temp_bytes
from fusedist.plan.model import embedding_params, expert_params
from fusedist.plan.param_tensors import block_tensors, param_tensors

sys.path.insert(0, os.path.dirname(__file__))
from test_plan_configs import LLAMA3_8B, MIXTRAL_8X22B, MIXTRAL_8X7B, QWEN3_30B_A3B  # noqa: E402

PSI = 46_702_792_704  # Mixtral-8x7B
EXPERTS = 32 * 8 * 3 * 4096 * 14336  # 32 MoE layers x 8 experts x SwiGLU(4096, 14336)
HW = resolve_hardware("h100")


def _write(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture
def mixtral(tmp_path):
    return from_hf_config(_write(tmp_path, MIXTRAL_8X7B))


def test_expert_parameters(mixtral, tmp_path):
    """The routed experts are what ep splits; router and shared experts stay dense."""
    assert expert_params(mixtral) == EXPERTS == 45_097_156_608
    assert expert_params(from_hf_config(_write(tmp_path, LLAMA3_8B))) == 0
    qwen = from_hf_config(_write(tmp_path, QWEN3_30B_A3B))
    assert expert_params(qwen) == 48 * 128 * 3 * 2048 * 768


def test_expert_states_divide_by_ep(mixtral):
    """Mixtral-8x7B on 64 GPUs, ep = 8: a rank holds the dense parameters and 1/8 of the
    experts (p, g and, under DDP, K of them); ZeRO's shards are Ψ/N at every ep."""
    n, ep = 64, 8
    held = PSI - EXPERTS + EXPERTS // ep
    assert held == 1_605_636_096 + 5_637_144_576
    one = build_plan(mixtral, Job(gpus=n, micro_batch=1, seq=4096), HW)["memory"]
    eight = build_plan(mixtral, Job(gpus=n, micro_batch=1, seq=4096, ep=ep), HW)["memory"]
    steps = 4 * len(param_tensors(mixtral, ep))  # FusedAdamW's count a tensor (Note [step counts] in memory.py)
    assert eight["ddp"]["terms"] == {"params": 2 * held, "grads": 2 * held, "optimizer": 12 * held, "steps": steps}
    assert one["ddp"]["terms"] == {"params": 2 * PSI, "grads": 2 * PSI, "optimizer": 12 * PSI, "steps": steps}
    assert eight["zero1"]["terms"] == {"params": 2 * held, "grads": 2 * held, "optimizer": round(12 * PSI / n),
                                       "grad_shard": round(4 * PSI / n),
                                       "host:steps": eight["zero1"]["terms"]["host:steps"]}
    assert eight["zero2"]["terms"]["params"] == 2 * held
    for s in ("zero1", "zero2", "zero2_offload"):  # the shards do not move (the inner optimizer's pieces do)
        moved = ("params", "grads", "host:steps")
        assert {k: v for k, v in eight[s]["terms"].items() if k not in moved} == \
            {k: v for k, v in one[s]["terms"].items() if k not in moved}, s
    for s in ("zero3", "zero3_offload"):
        assert eight[s]["terms"] == one[s]["terms"], s
        assert eight[s]["temp_bytes"] < one[s]["temp_bytes"]  # 1/8 of a block's experts gathered
    assert model_states(PSI, n, "ddp", "bf16", held=held).device == 16 * held


def test_ep_1_is_the_plan_without_expert_parallelism(mixtral):
    job = Job(gpus=16, micro_batch=1, seq=4096, global_batch=64)
    plain, ep1 = build_plan(mixtral, job, HW), build_plan(mixtral, Job(**{**job.__dict__, "ep": 1}), HW)
    assert plain == ep1
    assert all(plain["comm"][s]["all_to_all_bytes_per_step"] == 0 for s in STRATEGIES)
    # and the gradient collectives are those of all Ψ over all N
    assert plain["comm"]["ddp"]["bytes_per_step"] == round(2 * 15 / 16 * PSI * 2)


def test_expert_gradients_reduce_over_n_over_ep(mixtral):
    """Dense gradients over the 64 ranks, each rank's 1/8 of the experts over the 8 ranks that
    hold the same ones (ring all-reduce 2(n-1)/n)."""
    plan = build_plan(mixtral, Job(gpus=64, micro_batch=1, seq=4096, ep=8), HW)
    dense, local = PSI - EXPERTS, EXPERTS / 8
    assert plan["comm"]["ddp"]["bytes_per_step"] == round(2 * 63 / 64 * dense * 2 + 2 * 7 / 8 * local * 2)
    assert plan["comm"]["zero3"]["bytes_per_step"] == round(63 / 64 * dense * 6 + 7 / 8 * local * 6)
    # ep = N: each expert on one rank, its gradients reduced nowhere
    qwen_like = comm.expert_parallel_bytes(1000, 800, 8, 8, "ddp", "bf16")
    assert qwen_like == pytest.approx(2 * 7 / 8 * 200 * 2)


def test_all_to_all_volume_by_hand():
    """Mixtral-8x7B, micro-batch 1 x 4096 tokens, bf16, ep = 8, top-2, 32 MoE layers: each
    all-to-all moves 4096 x 4096 x 2 x 2 bytes per GPU, 7/8 of it to other ranks; dispatch and
    combine in forward and backward, 4 a layer (6 with full recomputation)."""
    one = 4096 * 4096 * 2 * 2 * 7 // 8
    assert one == 58_720_256
    assert comm.all_to_all_bytes(4096, 4096, 2, 2, 8, 32, 4) == 4 * 32 * one == 7_516_192_768
    assert comm.all_to_all_bytes(4096, 4096, 2, 2, 8, 32, comm.all_to_all_passes("full")) == 6 * 32 * one
    assert comm.all_to_all_bytes(4096, 4096, 2, 2, 1, 32, 4) == 0  # ep = 1: no all-to-all


def test_all_to_all_in_the_plan(mixtral, tmp_path):
    """Per step: every accumulated micro-batch; within a node at NVLink's rate, across nodes at
    the network's; on the step's critical path, not overlapped."""
    job = Job(gpus=64, micro_batch=1, seq=4096, global_batch=128, ep=8, recompute="selective")
    plan = build_plan(mixtral, job, HW)
    c, t = plan["comm"]["zero2"], plan["time"]["zero2"]
    assert plan["suggestion"]["strategy"] is not None and plan["suggestion"]["layout"]["dp"] == 64
    assert plan["suggestion"]["grad_accum_steps"] == 2
    assert c["all_to_all_bytes_per_step"] == 2 * 7_516_192_768
    assert c["all_to_all_gbps"] == 450
    assert c["all_to_all_seconds"] == pytest.approx(2 * 7_516_192_768 / 450e9)
    assert t["step_s"] == pytest.approx(max(t["compute_s"], c["seconds"]) + c["all_to_all_seconds"])
    qwen = from_hf_config(_write(tmp_path, QWEN3_30B_A3B))
    wide = build_plan(qwen, Job(gpus=64, micro_batch=1, seq=4096, ep=16), HW)["comm"]["ddp"]
    assert wide["all_to_all_gbps"] == 50  # 16 ranks span two nodes of 8
    # 48 MoE layers, top-8 of 2048-wide tokens, 15/16 of them leave the rank
    assert wide["all_to_all_bytes_per_step"] == 4 * 48 * 4096 * 2048 * 8 * 2 * 15 // 16
    assert comm.expert_bandwidth_gbps(4, 64, 8, 450, 50) == 450
    assert comm.expert_bandwidth_gbps(3, 6, 8, 450, 50) == 450  # the job within one node


def test_zero3_gathers_a_rank_s_experts(mixtral):
    """ZeRO-3 under ep gathers a block's dense part whole and its experts over the N/ep ranks
    holding them: 1/ep of them; the reduce-scatter's output is 1/N of the whole block."""
    n, ep = 64, 8
    blocks = [sum(block_tensors(mixtral, i, ep)) for i in range(32)]  # the tensors a rank gathers
    whole = sum(block_tensors(mixtral, 0))
    assert whole - blocks[0] == EXPERTS // 32 * 7 // 8
    root = embedding_params(mixtral)
    expected = temp_bytes("zero3", PSI, "bf16", blocks, 25, 1e9, root_params=root, n=n,
                          unit_outputs=[whole / n] * 32)
    assert root > blocks[0]  # the reductions in flight at the peak: block 0's and the root's
    assert expected == pytest.approx(2 * (2 * blocks[0] + root) + 2 * (blocks[0] + whole / n + root * (1 + 1 / n))
                                     + 1e9)
    plan = build_plan(mixtral, Job(gpus=n, micro_batch=1, seq=4096, ep=ep), HW)
    assert plan["memory"]["zero3"]["temp_bytes"] == round(expected)


def test_suggester_tries_expert_parallelism(tmp_path, capsys):
    """Mixtral-8x22B on 512 GPUs of 22 GB: at ep = 1 nothing fits (ZeRO-3 gathers two blocks
    of 2.4B parameters), at ep = 4 ZeRO-3 does, before any tensor or pipeline parallelism.
    (22 GB: full recomputation's peak holds the block being recomputed, 9.04 GB of activations
    in all; ZeRO-3 at ep = 4 then needs 20.78 GB.)"""
    path = _write(tmp_path, MIXTRAL_8X22B)
    argv = ["--hf-config", path, "--gpus", "512", "--seq", "4096", "--recompute", "full", "--gpu-memory-gb", "22"]
    assert cli.main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert not any(plan["memory"][s]["fits"] for s in STRATEGIES)
    layout = plan["suggestion"]["layout"]
    assert {k: layout[k] for k in ("dp", "tp", "pp", "ep", "strategy")} == \
        {"dp": 512, "tp": 1, "pp": 1, "ep": 4, "strategy": "zero3"}
    assert plan["suggestion"]["strategy"] == "zero3"
    assert cli.main([*argv, "--ep", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["zero3"]["fits"]
    assert cli.main(argv) == 0
    assert ("suggestion: no data-parallel strategy fits at ep=1; zero3 with the experts over ep=4 of the 512 "
            "GPUs does") in capsys.readouterr().out


def test_json_and_report(tmp_path, capsys):
    path = _write(tmp_path, MIXTRAL_8X7B)
    assert cli.main(["--hf-config", path, "--gpus", "64", "--seq", "4096", "--ep", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["inputs"]["ep"] == 8 and plan["inputs"]["expert_params"] == EXPERTS
    assert plan["suggestion"]["layout"]["ep"] == 8
    assert {"all_to_all_bytes_per_step", "all_to_all_seconds", "all_to_all_gbps"} <= set(plan["comm"]["ddp"])
    assert cli.main(["--hf-config", path, "--gpus", "64", "--seq", "4096", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert ", expert parallelism 8" in out
    assert "expert parallelism ep=8: 45,097,156,608 routed-expert parameters, 1/8 of them on each GPU; " \
           "all-to-alls 7.52 GB per step per GPU at 450 GB/s" in out


REFUSED = [
    (["--hf-config", "MIXTRAL", "--gpus", "8", "--ep", "3"], "--ep: 3 does not divide the 8 experts"),
    (["--hf-config", "QWEN", "--gpus", "8", "--ep", "16"], "--ep: 16 does not divide the 8 data-parallel GPUs"),
    (["--hf-config", "LLAMA", "--gpus", "8", "--ep", "2"], "--ep: 2: expert parallelism needs a mixture of experts"),
    (["--params", "7B", "--gpus", "8", "--seq", "4096", "--ep", "2"], "a model given by --params has no experts"),
    (["--hf-config", "MIXTRAL", "--gpus", "8", "--ep", "0"], "--ep: must be positive, got 0"),
]


@pytest.mark.parametrize("argv,message", REFUSED, ids=[m for _, m in REFUSED])
def test_refusals_name_the_flag(tmp_path, capsys, argv, message):
    paths = {"MIXTRAL": _write(tmp_path, MIXTRAL_8X7B, "m.json"), "QWEN": _write(tmp_path, QWEN3_30B_A3B, "q.json"),
             "LLAMA": _write(tmp_path, LLAMA3_8B, "l.json")}
    argv = [paths.get(a, a) for a in argv]
    if "--seq" not in argv:
        argv += ["--seq", "4096"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_measure_refuses_expert_parallelism(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["--measure", "--hf-config", _write(tmp_path, MIXTRAL_8X7B), "--seq", "32", "--ep", "2"]) == 2
    assert "--ep: 2: --measure trains fusedist's data-parallel strategies" in capsys.readouterr().err


def test_build_plan_checks_ep_too(mixtral):
    """The Python API refuses what the command line does."""
    from fusedist.plan import PlanError

    with pytest.raises(PlanError, match="--ep: 3 does not divide the 8 experts"):
        build_plan(mixtral, Job(gpus=24, micro_batch=1, seq=4096, ep=3), HW)
