"""fusedist.plan: the formulas against published figures, the CLI's output contract and its
bad-input handling (one line naming the flag, exit status 2)."""

import functools
import json
import subprocess
import sys

import pytest

from fusedist.plan import ModelSpec, activation_bytes, count_params, from_hf_config, model_states
from fusedist.plan.model import recomputed_layer_bytes
from fusedist.plan.param_tensors import param_tensors
from fusedist.plan import cli, comm, suggest
from fusedist.plan.memory import STRATEGIES

GB = 1e9  # the ZeRO paper's GB

LLAMA2_7B = {  # Hugging Face config.json of meta-llama/Llama-2-7b-hf (the keys the planner reads)
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
    "vocab_size": 32000, "tie_word_embeddings": False,
}
GPT2 = ["--layers", "12", "--hidden", "768", "--heads", "12", "--seq", "1024", "--vocab", "50257"]


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ published figures
def test_zero_paper_figure_1():
    """ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB."""
    psi, n = 7.5e9, 64
    got = {s: model_states(psi, n, s, "bf16", "adamw", convention="paper").device / GB
           for s in ("ddp", "zero1", "zero2", "zero3")}
    assert got["ddp"] == pytest.approx(120.0)
    assert round(got["zero1"], 1) == 31.4
    assert round(got["zero2"], 1) == 16.6
    assert round(got["zero3"], 1) == 1.9


def test_zero_paper_figure_1_through_the_cli(capsys):
    code, out, _ = run_cli(capsys, "--params", "7.5e9", "--gpus", "64", "--seq", "2048", "--convention", "paper",
                           "--json")
    assert code == 0
    mem = json.loads(out)["memory"]
    assert [round(mem[s]["model_states_bytes"] / GB, 1) for s in ("ddp", "zero1", "zero2", "zero3")] == \
        [120.0, 31.4, 16.6, 1.9]


def test_activations_gpt3_layer():
    """Korthikanti et al. 2022 on one GPT-3 175B layer: s = 2048, h = 12288, a = 96, b = 1."""
    s, h, a, b = 2048, 12288, 96, 1
    one_layer = ModelSpec(layers=1, hidden=h, heads=a, seq=s, vocab=1)
    outside = s * b * h + 4 * s * b * h + 4 * s * b * 1  # embedding mask, output layer's inputs, logits

    by_hand = s * b * h * (34 + 5 * a * s // h)  # 5·96·2048/12288 = 80: 114·sbh
    assert by_hand == 2_868_903_936
    assert activation_bytes(one_layer, b, s, "bf16", "none") - outside == by_hand
    assert activation_bytes(one_layer, b, s, "bf16", "selective") - outside == 34 * s * b * h == 855_638_016
    # full: the paper's stored input 2·sbh, plus the one layer backward recomputes at a time,
    # held in full beside it (114·sbh here): the peak, not just what is stored
    assert recomputed_layer_bytes(one_layer, b, s, "bf16", "full") == by_hand
    assert activation_bytes(one_layer, b, s, "bf16", "full") - outside == 2 * s * b * h + by_hand == 2_919_235_584
    # tensor + sequence parallelism divides everything by t
    assert activation_bytes(one_layer, b, s, "bf16", "none", tp=8) == (by_hand + outside) // 8


def test_activations_llama_layer_gqa_swiglu():
    """Korthikanti et al.'s per-tensor accounting (Section 4.1) for a Llama-3-8B layer: K and V
    are kv_dim = 8 · 128 = 1024 wide (grouped-query attention), the SwiGLU MLP keeps four
    ffn-wide tensors (gate, up, silu(gate), their product) where GELU keeps two. The GPT
    constant 34·s·b·h (139,264 bytes per token at h = 4096) understates it by a third."""
    s, b, h, kv_dim, f, a = 4096, 1, 4096, 1024, 14336, 32
    spec = ModelSpec(arch="llama", layers=1, hidden=h, heads=a, kv_heads=8, ffn_hidden=f, seq=s, vocab=1)
    # embedding's dropout mask; the final RMSNorm's fp32 rows, bf16 normalised rows and fp32 rstd;
    # the output layer's input; fp32 logits
    outside = s * b * h + (4 * h + 2 * h + 4) * s * b + 2 * s * b * h + 4 * s * b * 1
    per_token = (2 * (h + h + 2 * kv_dim + h)  # attention: q/k/v input, Q, K and V, output projection input
                 + 2 * (h + 4 * f)  # MLP: gate/up input, gate, up, silu(gate), product
                 + 2 * (4 * h + 2 * h + 4)  # two RMSNorms (Note [what a norm keeps] in fusedist/plan/norm_bytes.py)
                 + 2 * h)  # two 1-byte dropout masks, as in the paper
    assert per_token == 208_904  # 176,128 when an RMSNorm was counted as keeping its bf16 input only
    assert activation_bytes(spec, b, s, "bf16", "selective") - outside == per_token * s * b
    assert activation_bytes(spec, b, s, "bf16", "none") - outside == per_token * s * b + 5 * a * s * s * b
    # full: the stored layer input plus the recomputed layer's working set (the "none" figure)
    assert (activation_bytes(spec, b, s, "bf16", "full") - outside
            == 2 * s * b * h + per_token * s * b + 5 * a * s * s * b)
    # fp32: the 2-byte tensors double, the masks stay; an RMSNorm's fp32 rows and rstd stay, its
    # normalised rows double: 8h + 4 a token
    fp32_token = 4 * (h + h + 2 * kv_dim + h) + 4 * (h + 4 * f) + 2 * (8 * h + 4) + 2 * h
    assert (activation_bytes(spec, b, s, "fp32", "selective") - (s * b * h + (8 * h + 4 + 4 * h + 4) * s * b)
            == fp32_token * s * b)


def test_training_flops_count_the_attention_scores():
    """PaLM (Chowdhery et al. 2022), Appendix B: 6N + 12·L·H·Q·T FLOPs per token; Narayanan
    et al. 2021, Section 5.1, with full recomputation: 96·B·s·l·h²·(1 + s/6h + V/16lh), i.e.
    8 per parameter and 16·l·s·h for the attention. The 6Ψ rule alone misses 16% of a 7B
    Llama's step at s = 4096 and more than half at s = 32768."""
    from fusedist.plan import timing
    from fusedist.plan.model import attention_flops_per_token

    spec = ModelSpec(arch="llama", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000, seq=4096)
    psi = count_params(spec)
    fwd = attention_flops_per_token(spec, 4096)
    assert fwd == 4 * 32 * 4096 * 4096
    assert timing.flops_per_token(psi, "none", fwd) == 6 * psi + 12 * 32 * 4096 * 4096
    assert timing.flops_per_token(psi, "selective", fwd) == 6 * psi + 16 * 32 * 4096 * 4096
    assert timing.flops_per_token(psi, "full", fwd) == 8 * psi + 16 * 32 * 4096 * 4096
    assert 0.15 < 12 * 32 * 4096 * 4096 / (6 * psi) < 0.17
    assert attention_flops_per_token(spec, 32768) * 3 > 6 * psi
    # Narayanan et al.'s expression, without the logits term (counted in Ψ here): B = 1, s = 4096
    s, l, h = 4096, 32, 4096
    assert 16 * l * s * h == 96 * s * l * h * h * (s / (6 * h)) / s
    assert attention_flops_per_token(ModelSpec(params=7e9), 4096) == 0



def test_training_flops_leave_out_the_embedding_lookups():
    """Note [lookups are not products]: Llama-3-8B's untied 128256 x 4096 input embedding does
    no matrix product (its output layer does), a tied table does the output layer's, and gpt's
    position embedding is a lookup too. A model given by --params alone has no shape to tell:
    every parameter counts."""
    from fusedist.plan import Job, build_plan, resolve_hardware
    from fusedist.plan.model import matmul_params

    llama3 = dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256,
                  seq=8192)
    untied, tied = ModelSpec(**llama3, tied=False), ModelSpec(**llama3, tied=True)
    assert count_params(untied) == 8_030_261_248  # the model card's 8.03B
    assert matmul_params(untied) == 8_030_261_248 - 128256 * 4096
    assert matmul_params(tied) == count_params(tied)  # the one table is the output layer's weight
    gpt2 = ModelSpec(arch="gpt", layers=12, hidden=768, heads=12, vocab=50257, seq=1024)
    assert matmul_params(gpt2) == count_params(gpt2) - 1024 * 768
    assert matmul_params(ModelSpec(params=7e9)) == 7e9
    job, hw = Job(gpus=8, micro_batch=1, seq=8192), resolve_hardware("h100")
    a, b = build_plan(untied, job, hw), build_plan(tied, job, hw)
    assert (a["inputs"]["assumptions"]["flops_per_token"] == b["inputs"]["assumptions"]["flops_per_token"]
            == 6 * (8_030_261_248 - 128256 * 4096) + 12 * 32 * 8192 * 4096)
    assert a["time"]["ddp"]["compute_s"] == b["time"]["ddp"]["compute_s"]

def test_parameter_counts():
    gpt2 = ModelSpec(arch="gpt", layers=12, hidden=768, heads=12, seq=1024, vocab=50257)
    assert count_params(gpt2) == 124_439_808  # GPT-2 small, tied embeddings


def test_llama2_7b_from_hf_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    spec = from_hf_config(str(path))
    assert spec.arch == "llama" and spec.seq == 4096
    assert count_params(spec) == 6_738_415_616


def test_gpt2_hf_config_keys(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                                "n_positions": 1024, "vocab_size": 50257}))
    assert count_params(from_hf_config(str(path))) == 124_439_808


# ------------------------------------------------------------------ conventions and volumes
def test_fusedist_convention_adds_fp32_gradient_shard():
    psi, n = 1e9, 8
    paper = {s: model_states(psi, n, s, "bf16", convention="paper") for s in STRATEGIES}
    ours = {s: model_states(psi, n, s, "bf16", convention="fusedist") for s in STRATEGIES}
    assert ours["ddp"].device == paper["ddp"].device == 16 * psi
    assert ours["zero1"].device == paper["zero1"].device + 4 * psi / n
    assert ours["zero2"].device == paper["zero2"].device + 2 * psi / n  # fp32, not 16-bit, shard
    # fp32 training: no master copy (K = 8) for DDP, nor for ZeRO (its masters are the
    # parameters' own slices); ZeRO-Offload keeps an FP32 host copy (K = 12, on the host)
    assert model_states(psi, n, "ddp", "fp32", convention="fusedist").device == 16 * psi
    assert model_states(psi, n, "zero2", "fp32", convention="fusedist").device == 4 * psi + 12 * psi / n
    assert model_states(psi, n, "zero1", "fp32", convention="fusedist").device == 8 * psi + 8 * psi / n
    off32 = model_states(psi, n, "zero2_offload", "fp32", convention="fusedist")
    assert off32.device == 4 * psi + 4 * psi / n and off32.host == (12 + 4) * psi / n
    assert model_states(psi, n, "zero2", "fp32", convention="paper").device == 4 * psi + 12 * psi / n
    # ZeRO-Offload (its paper's Section 4): the 16-bit parameters stay on the GPU, the gradient
    # shard and the K term go to the host; stage 3 sends the parameter shard there too
    off = model_states(psi, n, "zero2_offload", "bf16", convention="paper")
    assert off.device == 2 * psi and off.host == (2 + 12) * psi / n
    off3 = model_states(psi, n, "zero3_offload", "bf16", convention="paper")
    assert off3.device == 0 and off3.host == 16 * psi / n
    # fully_shard with CPUOffloadPolicy keeps every shard, the gradient's too, on the host
    ours3 = model_states(psi, n, "zero3_offload", "bf16", convention="fusedist")
    assert ours3.device == 0 and ours3.host == 16 * psi / n
    assert ours3.terms == {"host:params": 2 * psi / n, "host:grad_shard": 2 * psi / n,
                           "host:optimizer": 12 * psi / n}


def test_communication_volumes():
    psi, n = 1e9, 8
    ring = 2 * (n - 1) / n
    assert comm.bytes_per_step(psi, n, "ddp", "bf16") == pytest.approx(ring * psi * 2)
    assert comm.bytes_per_step(psi, n, "zero2", "bf16") == pytest.approx(ring * psi * 2)
    assert comm.bytes_per_step(psi, n, "zero3", "bf16") == pytest.approx(1.5 * ring * psi * 2)
    assert comm.bytes_per_step(psi, n, "zero1", "bf16", "paper") == pytest.approx(ring * psi * 2)
    assert comm.bytes_per_step(psi, n, "zero1", "bf16", "fusedist") == pytest.approx(1.5 * ring * psi * 2)
    assert comm.bytes_per_step(psi, 1, "ddp", "bf16") == 0


def test_suggestions():
    assert suggest.grad_accum(512, 2, 64) == (4, 512)
    assert suggest.grad_accum(500, 2, 64) == (4, 512)  # rounded up to a multiple of b·dp
    assert suggest.grad_accum(None, 2, 64) == (1, 128)
    lr = suggest.learning_rate(3e-4, 256, 1024)
    assert lr["linear"] == pytest.approx(1.2e-3) and lr["sqrt"] == pytest.approx(6e-4)


def test_nothing_fits_gives_a_model_parallel_layout(capsys):
    code, out, _ = run_cli(capsys, "--arch", "llama", "--layers", "80", "--hidden", "8192", "--heads", "64",
                           "--kv-heads", "8", "--ffn-hidden", "28672", "--vocab", "32000", "--seq", "4096",
                           "--gpus", "64", "--recompute", "selective", "--json")
    plan = json.loads(out)
    assert code == 0 and not any(plan["memory"][s]["fits"] for s in STRATEGIES)
    lay = plan["suggestion"]["layout"]
    assert lay["dp"] * lay["tp"] * lay["pp"] == 64 and lay["tp"] <= 8 and lay["tp"] * lay["pp"] > 1
    assert lay["total_bytes"] <= 80e9


def test_layout_tensor_parallel_divides_the_key_value_heads(capsys):
    """Megatron-LM splits grouped-query attention by whole query groups (the key/value heads
    must divide by tp): with one key/value head (multi-query) no tensor parallelism is
    possible (and the same 70B model then needs full recomputation, or a pipeline whose first
    stage holds fewer micro-batches than stages: Note [activations under pipeline parallelism])."""
    shape = ["--arch", "llama", "--layers", "80", "--hidden", "8192", "--heads", "64", "--ffn-hidden", "28672",
             "--vocab", "32000", "--seq", "3072", "--gpus", "64", "--json"]  # at 4096 RMSNorm's fp32 rows need tp=4
    for kv in ("8", "2"):
        code, out, _ = run_cli(capsys, *shape, "--kv-heads", kv, "--recompute", "selective")
        lay = json.loads(out)["suggestion"]["layout"]
        assert code == 0 and lay["tp"] == 2, (kv, lay)
    # 16 micro-batches a step under 1F1B: the first stage holds pp of them, all 80 blocks' worth
    code, out, _ = run_cli(capsys, *shape, "--kv-heads", "1", "--recompute", "selective", "--global-batch", "1024")
    assert code == 1 and json.loads(out)["suggestion"]["layout"] is None  # was tp=2
    # one micro-batch a step: torch's Schedule1F1B refuses fewer micro-batches than stages (it had been
    # suggested), GPipe runs it, a stage holding its 80 / pp blocks of it
    code, out, _ = run_cli(capsys, *shape, "--kv-heads", "1", "--recompute", "selective")
    suggestion = json.loads(out)["suggestion"]
    assert code == 1 and suggestion["layout"] is None
    assert "fewer than the 2 stages torch's Schedule1F1B needs" in suggestion["layouts_refused"]["pp=2"]
    code, out, _ = run_cli(capsys, *shape, "--kv-heads", "1", "--recompute", "selective", "--pp-schedule", "gpipe")
    lay = json.loads(out)["suggestion"]["layout"]
    assert code == 0 and lay["tp"] == 1 and lay["pp"] > 1, lay
    code, out, _ = run_cli(capsys, *shape, "--kv-heads", "1", "--recompute", "full")
    assert code == 0 and json.loads(out)["suggestion"]["strategy"] == "zero3"  # ZeRO-3 fits with full recompute


# ------------------------------------------------------------------ the JSON contract
def test_json_contract(capsys):
    code, out, _ = run_cli(capsys, *GPT2, "--gpus", "16", "--micro-batch", "4", "--global-batch", "256",
                           "--ref-lr", "6e-4", "--ref-batch", "512", "--json")
    assert code == 0
    plan = json.loads(out)
    for s in STRATEGIES:
        assert {"model_states_bytes", "activation_bytes", "temp_bytes", "total_bytes", "host_bytes",
                "fits"} <= set(plan["memory"][s])
        assert {"bytes_per_step", "seconds"} <= set(plan["comm"][s])
        assert {"compute_s", "step_s", "tokens_per_s"} <= set(plan["time"][s])
    assert {"strategy", "layout", "grad_accum_steps", "lr"} <= set(plan["suggestion"])
    assert plan["suggestion"]["strategy"] == "ddp" and plan["suggestion"]["grad_accum_steps"] == 4
    assert plan["inputs"]["params"] == 124_439_808 and plan["inputs"]["assumptions"]["mfu"] == 0.4
    assert plan["inputs"]["gpus_per_node"] == 8 and plan["inputs"]["gpu"]["name"] == "h100"
    # (6·Ψ + 12·L·s·d_q)·tokens / (N · peak · MFU), Ψ without the 1024 x 768 position embedding
    # (a lookup); the tied token embedding is the output layer's weight and counts
    tokens = 256 * 1024
    per_token = 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 1024 * 768
    assert plan["inputs"]["matmul_params"] == 124_439_808 - 1024 * 768
    assert plan["time"]["ddp"]["compute_s"] == pytest.approx(per_token * tokens / (16 * 989e12 * 0.4))
    assert plan["memory"]["ddp"]["total_bytes"] == (plan["memory"]["ddp"]["model_states_bytes"]
                                                    + plan["memory"]["ddp"]["activation_bytes"]
                                                    + plan["memory"]["ddp"]["temp_bytes"])


def test_table_output(capsys):
    code, out, _ = run_cli(capsys, *GPT2, "--gpus", "8")
    assert code == 0
    assert "124,439,808 parameters" in out and "suggestion: ddp" in out
    for s in STRATEGIES:
        assert f"\n{s} " in out


# ------------------------------------------------------------------ bad input
BAD = [
    (["--params", "-5", "--gpus", "8", "--seq", "8"], "--params"),
    (["--layers", "-2", "--hidden", "64", "--heads", "4", "--seq", "8", "--vocab", "9", "--gpus", "2"], "--layers"),
    (["--layers", "2", "--hidden", "64", "--heads", "5", "--seq", "8", "--vocab", "9", "--gpus", "2"], "--heads"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "3", "--seq", "8", "--vocab", "9",
      "--gpus", "2"], "--kv-heads"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--gpu", "v100"], "--gpu"),
    (["--params", "7e9", "--gpus", "0", "--seq", "8"], "--gpus"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--micro-batch", "-1"], "--micro-batch"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--mfu", "1.5"], "--mfu"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--gpu-memory-gb", "-80"], "--gpu-memory-gb"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--gpu", "custom"], "--gpu"),
    (["--params", "many", "--gpus", "8"], "--params"),
    (["--params", "7e9", "--gpus", "8"], "--seq"),
    (["--params", "7e9", "--seq", "8"], "--gpus"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--precision", "fp8"], "--precision"),
    (["--hf-config", "/nonexistent/config.json", "--gpus", "8"], "--hf-config"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--measure"], "--measure"),
    # non-finite numbers went through every comparison and ended in a traceback
    (["--params", "inf", "--gpus", "8", "--seq", "8"], "--params"),
    (["--params", "nan", "--gpus", "8", "--seq", "8"], "--params"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--scratch-gb", "nan"], "--scratch-gb"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--gpu-memory-gb", "inf"], "--gpu-memory-gb"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--host-memory-gb", "0"], "--host-memory-gb"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--host-memory-gbps", "-1"], "--host-memory-gbps"),
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--bucket-cap-mb", "inf"], "--bucket-cap-mb"),
    # a count that rounds to no parameters was planned as an empty model
    (["--params", "0.4", "--gpus", "8", "--seq", "8"], "--params"),
    (["--params", "7e9", "--gpus", "-8", "--seq", "8"], "--gpus"),
    # a global batch that is not whole micro-batches on every GPU was rounded up silently
    (["--params", "7e9", "--gpus", "8", "--seq", "8", "--micro-batch", "3", "--global-batch", "100"],
     "--global-batch"),
    # past what the planner models: an overflow traceback, Infinity in --json, or minutes of a
    # walk over a million layers
    (["--params", "1e307", "--gpus", "8", "--seq", "2048"], "--params"),
    (["--params", "1e17", "--gpus", "8", "--seq", "2048", "--json"], "--params"),
    (["--layers", "1000000", "--hidden", "64", "--heads", "4", "--seq", "8", "--vocab", "9", "--gpus", "8"],
     "--layers"),
    (["--layers", "2", "--hidden", str(2 ** 600), "--heads", "4", "--seq", "8", "--vocab", "9", "--gpus", "8"],
     "--hidden"),
    (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", str(10 ** 160), "--vocab", "9", "--gpus", "8"],
     "--seq"),
    (["--params", "7e9", "--gpus", str(2 ** 40), "--seq", "8"], "--gpus"),
    # shape options beside --params were ignored
    (["--params", "7B", "--gpus", "8", "--seq", "4096", "--arch", "llama", "--kv-heads", "3"], "--params"),
    (["--params", "7B", "--gpus", "8", "--seq", "4096", "--ffn-hidden", "7"], "--params"),
]


@pytest.mark.parametrize("argv,flag", BAD, ids=[f"{flag}-{i}" for i, (_, flag) in enumerate(BAD)])
def test_bad_input_one_line_naming_the_flag(capsys, monkeypatch, argv, flag):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # --measure outside torchrun
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert flag in lines[0] and lines[0].startswith("python -m fusedist.plan: error:")


@pytest.mark.parametrize("content", ['{"hidden_size": 10', "[1, 2]", json.dumps({"hidden_size": 64}),
                                     json.dumps({**LLAMA2_7B, "num_attention_heads": 30}),
                                     json.dumps({**LLAMA2_7B, "vocab_size": -1})])
def test_bad_hf_config(capsys, tmp_path, content):
    path = tmp_path / "config.json"
    path.write_text(content)
    code, _, err = run_cli(capsys, "--hf-config", str(path), "--gpus", "8")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--hf-config" in err


def test_the_arch_given_with_a_config_is_refused_even_if_it_is_the_default(capsys, tmp_path):
    """--arch gpt beside --hf-config was taken for the default and ignored."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    code, _, err = run_cli(capsys, "--hf-config", str(path), "--arch", "gpt", "--gpus", "8")
    assert code == 2 and err.strip() == "python -m fusedist.plan: error: --hf-config: --arch comes from the config"


def test_a_config_past_the_bounds_is_refused(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA2_7B, "num_hidden_layers": 10 ** 9}))
    code, _, err = run_cli(capsys, "--hf-config", str(path), "--gpus", "8")
    # the refusal names the config's key, as the other bounds on a config do ('hidden_size' ...)
    assert code == 2 and ("--hf-config: 'num_hidden_layers' 1000000000 is beyond what the planner models "
                          "(at most 100000)") in err
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_layer": 10 ** 9, "n_head": 12,
                                "n_positions": 1024, "vocab_size": 50257}))
    code, _, err = run_cli(capsys, "--hf-config", str(path), "--gpus", "8")
    assert code == 2 and "--hf-config: 'n_layer' 1000000000 is beyond" in err


def test_measure_with_a_world_size_that_is_not_a_number(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "abc")
    code, _, err = run_cli(capsys, "--measure", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "8",
                           "--vocab", "9")
    assert code == 2 and "WORLD_SIZE='abc' is not a rank count" in err


# Every ``python -m fusedist.plan`` process of this file (each imports torch), started at once on
# the first use and shared by the tests that read them: {arguments: (exit status, stdout, stderr)}.
_PROCESS_ARGV = [
    ("--layers", "2", "--hidden", "64", "--heads", "5", "--seq", "8", "--vocab", "9", "--gpus", "2"),
    ("--params", "7e12", "--gpus", "8", "--seq", "4096"),
    ("--layers", "200", "--hidden", "32768", "--heads", "256", "--vocab", "32000", "--seq", "4096", "--gpus", "8"),
    ("--params", "7e12", "--gpus", "8", "--seq", "4096", "--json"),
]


@functools.lru_cache(maxsize=None)
def _processes() -> dict:
    procs = {argv: subprocess.Popen([sys.executable, "-m", "fusedist.plan", *argv], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for argv in _PROCESS_ARGV}
    try:
        outputs = {argv: proc.communicate(timeout=300) for argv, proc in procs.items()}
        return {argv: (procs[argv].returncode, out, err) for argv, (out, err) in outputs.items()}
    finally:
        for proc in procs.values():
            proc.kill()


def test_bad_input_exit_status_without_traceback():
    proc = subprocess.CompletedProcess(_PROCESS_ARGV[0], *_processes()[_PROCESS_ARGV[0]])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "python -m fusedist.plan: error: --heads: 5 heads do not divide --hidden 64"


def test_measure_world_size_not_whole_nodes(capsys, monkeypatch):
    """Under torchrun --gpus may be left out: the message gives the world size, not None."""
    monkeypatch.setenv("WORLD_SIZE", "12")
    code, _, err = run_cli(capsys, "--measure", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "8",
                           "--vocab", "9")
    assert code == 2 and err.strip().endswith("--gpus-per-node: 12 GPUs are not whole nodes of 8")


def test_global_batch_not_divisible_names_the_multiples(capsys):
    code, out, err = run_cli(capsys, "--params", "7e9", "--gpus", "8", "--seq", "8", "--micro-batch", "3",
                             "--global-batch", "100")
    assert code == 2 and out == ""
    assert "multiple of --micro-batch 3 x 8 GPUs = 24 (e.g. 96 or 120)" in err
    code, out, _ = run_cli(capsys, "--params", "7e9", "--gpus", "8", "--seq", "8", "--micro-batch", "3",
                           "--global-batch", "96", "--json")
    assert code == 0 and json.loads(out)["suggestion"]["grad_accum_steps"] == 4


def test_nothing_fits_exits_1_with_the_plan(tmp_path):
    """A model that fits nowhere prints its plan (which says so) and exits 1, no traceback."""
    runs = _processes()
    for argv in _PROCESS_ARGV[1:3]:
        proc = subprocess.CompletedProcess(argv, *runs[argv])
        assert proc.returncode == 1, proc.stderr
        assert "suggestion: nothing fits" in proc.stdout and "Traceback" not in proc.stderr
        assert proc.stderr.strip() == "python -m fusedist.plan: nothing fits (exit status 1): see the suggestion above"
    proc = subprocess.CompletedProcess(_PROCESS_ARGV[3], *runs[_PROCESS_ARGV[3]])
    assert proc.returncode == 1 and json.loads(proc.stdout)["suggestion"]["strategy"] is None
    # --params has no shape: no layout was searched, and the message says so (the first run's table)
    assert "no (dp, tp, pp) layout was searched" in runs[_PROCESS_ARGV[1]][1]


def test_help_and_assumptions_in_the_output(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "exit status: 0" in out and "1 nothing fits" in out and "2 bad input" in out
    assert "--kv-heads KV_HEADS" in out and "key/value heads" in out
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    code, out, _ = run_cli(capsys, "--hf-config", str(path), "--gpus", "8")
    assert code == 0
    assert "seq 4096 (the model maximum: --seq sets the training length)" in out
    assert "GPU memory: the datasheet's" in out and "activations: Korthikanti et al. 2022, unfused attention" in out
    # the table's columns stay apart when a number needs all of its width
    code, out, _ = run_cli(capsys, "--params", "7e12", "--gpus", "8", "--seq", "4096")
    assert "ddp             112000.00      n/a    1.00 112001.00    0.00  NO" in out


def test_gpt2_config_seq_past_its_positions(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                                "n_positions": 1024, "vocab_size": 50257}))
    code, _, err = run_cli(capsys, "--hf-config", str(path), "--gpus", "8", "--seq", "2048")
    assert code == 2 and "--seq: 2048 is longer than the model's 1024 learned positions" in err


def test_optimizer_k():
    from fusedist.plan.memory import optimizer_k
    assert optimizer_k("bf16", "adamw") == 12  # FP32 master, momentum, variance
    assert optimizer_k("fp32", "adamw") == 8  # fp32 parameters are their own master
    assert optimizer_k("bf16", "sgd") == 8 and optimizer_k("fp32", "sgd") == 4
    assert optimizer_k("fp32", "adamw", "zero2", "fusedist") == 8  # its masters are the parameters
    assert optimizer_k("fp32", "adamw", "zero2_offload", "fusedist") == 12  # a host copy


def test_hf_config_source_and_moe(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    code, out, _ = run_cli(capsys, "--hf-config", str(path), "--gpus", "8")
    assert code == 0 and "from hf-config (llama)" in out
    # a model type the planner does not know is refused, not counted as llama blocks
    # (tests/test_plan_configs.py: Falcon-7B was counted 11.16B instead of 6.92B)
    path.write_text(json.dumps({**LLAMA2_7B, "model_type": "newmodel"}))
    code, _, err = run_cli(capsys, "--hf-config", str(path), "--gpus", "8")
    assert code == 2 and "'model_type' 'newmodel'" in err and len(err.strip().splitlines()) == 1
    # expert keys in a family not counted as a mixture of experts are refused, naming the key
    path.write_text(json.dumps({**LLAMA2_7B, "num_local_experts": 8}))
    code, _, err = run_cli(capsys, "--hf-config", str(path), "--gpus", "8")
    assert code == 2 and "--hf-config" in err and "mixture-of-experts" in err and "'num_local_experts'" in err
    # a Mixtral config without its top-k is refused naming the key, not counted with a guess
    path.write_text(json.dumps({**LLAMA2_7B, "model_type": "mixtral", "num_local_experts": 8}))
    code, _, err = run_cli(capsys, "--hf-config", str(path), "--gpus", "8")
    assert code == 2 and "'num_experts_per_tok'" in err


def test_fusedist_zero3_is_fully_shard_with_any_optimizer():
    """fusedist's ZeRO-3 (fully_shard) leaves the optimizer to the user, as DDP does: an FP32
    master only for 16-bit parameters, and the gradient shard in the parameters' dtype."""
    from fusedist.plan.memory import optimizer_k
    psi, n = 1e9, 8
    assert optimizer_k("fp32", "adamw", "zero3", "fusedist") == 8
    assert optimizer_k("bf16", "adamw", "zero3", "fusedist") == 12
    assert model_states(psi, n, "zero3", "fp32", convention="fusedist").device == 16 * psi / n
    assert model_states(psi, n, "zero3", "bf16", convention="fusedist").device == 16 * psi / n
    assert model_states(psi, n, "zero3", "bf16", convention="paper").device == 16 * psi / n


def test_zero3_temporary_memory_counts_the_root_unit_and_two_blocks():
    """fully_shard keeps the root unit (embeddings, output layer) gathered through backward,
    next to the block in use and the one prefetched: the temporary term counts all three.
    Its gradients go through a flat buffer of the whole unit and a 1/N output, two reductions
    in flight (MAX_IN_FLIGHT in fusedist/fsdp/grads.py): (1 + 1/N) x (root + block), not two
    25 MiB buckets -- for Llama-7B at N = 8 1.05 GB, where 52 MB was planned. --measure checks both
    against memory_stats()' peaks (tests/test_plan_measure.py)."""
    from fusedist.plan.memory import temp_bytes
    from fusedist.plan.model import embedding_params, layer_params

    spec = ModelSpec(arch="llama", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000, seq=4096)
    psi, block, root = count_params(spec), layer_params(spec), embedding_params(spec)
    assert root > block  # Llama-7B: the root (262M) is larger than a block (202M)
    kw = dict(precision="bf16", unit_params=block, bucket_cap_mb=25.0, scratch_bytes=0.0)
    zero3 = temp_bytes("zero3", psi, root_params=root, n=8, **kw)
    gathered = 2 * (2 * block + root)  # bf16: 2 bytes per gathered parameter
    reducing = 2 * (1 + 1 / 8) * (root + block)  # the two largest units' flat buffers and outputs
    assert zero3 == pytest.approx(gathered + reducing)
    assert reducing > 1.04e9
    assert temp_bytes("zero3", 7e9, precision="bf16", unit_params=0, bucket_cap_mb=25.0,
                      scratch_bytes=0.0) == 2 * 25 * 2**20  # --params: no units known, two buckets


def test_b200_preset(capsys):
    """B200 SXM from NVIDIA's DGX B200 / HGX B200 figures (8 GPUs: 1,440 GB at 64 TB/s, BF16 36 and
    TF32 18 PFLOPS with sparsity, NVLink 5 at 1.8 TB/s a GPU): per GPU and direction, dense."""
    from fusedist.plan import PRESETS, resolve_hardware

    b200 = resolve_hardware("b200")
    assert b200 == PRESETS["b200"]
    assert (b200.memory_gb, b200.hbm_gbps) == (1440 / 8, 64_000 / 8)
    assert b200.peak_flops("bf16") == 36e15 / 8 / 2 and b200.peak_flops("fp32") == 18e15 / 8 / 2
    assert b200.intra_node_gbps == 1800 / 2 == 2 * PRESETS["h100"].intra_node_gbps
    # Llama-2-7B on 8 GPUs: the compute term scales with the dense peak, the NVLink term with
    # the link, and 180 GB holds ZeRO-1's 149 GB (40 GB of states, 108 GB of unfused-attention
    # activations) where 80 GB does not
    argv = ["--arch", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32", "--ffn-hidden", "11008",
            "--vocab", "32000", "--seq", "4096", "--gpus", "8", "--json"]
    plans = {}
    for gpu in ("h100", "b200"):
        code, out, _ = run_cli(capsys, *argv, "--gpu", gpu)
        assert code == 0
        plans[gpu] = json.loads(out)
    h, b = plans["h100"], plans["b200"]
    assert b["time"]["ddp"]["compute_s"] == pytest.approx(h["time"]["ddp"]["compute_s"] * 989 / 2250)
    assert b["comm"]["ddp"]["seconds"] == pytest.approx(h["comm"]["ddp"]["seconds"] / 2)
    assert not h["memory"]["zero1"]["fits"] and b["memory"]["zero1"]["fits"]
    code, out, _ = run_cli(capsys, *argv[:-1], "--gpu", "b200")
    assert "GPU: b200, 180 GB (8000 GB/s), peak 2250 TFLOPS (bf16/fp16 dense)" in out


def test_a_model_parallel_suggestion_says_how_to_build_it(capsys):
    """The suggested layout comes with the fusedist and torch calls that build it: the mesh,
    tensor parallelism, the data-parallel strategy and, for pipeline stages, the stage class and
    a checkpoint of every stage that restores at another split."""
    from fusedist.plan import report

    code, out, _ = run_cli(capsys, "--arch", "llama", "--layers", "80", "--hidden", "8192", "--heads", "64",
                           "--kv-heads", "8", "--ffn-hidden", "28672", "--vocab", "32000", "--seq", "3072",
                           "--gpus", "64", "--recompute", "selective")
    assert code == 0 and "dp=32 x tp=2 x pp=1 with zero3" in out, out
    assert 'how: mesh = init_device_mesh("cuda", (32, 2), mesh_dim_names=("dp", "tp"))' in out, out
    # the default figure is Megatron-LM's: its layers, not torch's parallelize_module (--tp-style torchtitan)
    assert "Megatron-LM's layers within a node" in out and 'fully_shard(block, mesh=mesh["dp"])' in out, out
    assert "PipelineStage" not in out  # pp=1
    lines = "\n".join(report.recipe({"dp": 4, "tp": 2, "pp": 2, "ep": 1, "strategy": "zero2", "total_bytes": 0}))
    assert 'init_device_mesh("cuda", (2, 4, 2), mesh_dim_names=("pp", "dp", "tp"))' in lines, lines
    assert "ZeroRedundancyOptimizer(..., stage=2" in lines and "fusedist.pipelining.PipelineStage(" in lines, lines
    assert 'Checkpointer(root, process_group=mesh["dp", "tp"], pipeline=True)' in lines, lines
    lines = "\n".join(report.recipe({"dp": 8, "tp": 1, "pp": 4, "ep": 1, "strategy": "ddp", "total_bytes": 0}))
    assert '(4, 8), mesh_dim_names=("pp", "dp")' in lines and 'process_group=mesh["dp"], pipeline=True' in lines
    assert "parallelize_module" not in lines and "fusedist.DistributedDataParallel(module" in lines, lines


# ------------------------------------------------------------------ host memory (offload)
def test_offload_fits_only_where_the_nodes_host_memory_holds_it(capsys):
    """Note [host memory fits too]: a node's ranks share its host memory. Before, a 7T-parameter
    model "fit" on 8 GPUs with zero3_offload (no model states on the GPU), needing 112 TB of
    host memory on the node."""
    psi = 7e12
    code, out, _ = run_cli(capsys, "--params", str(psi), "--gpus", "8", "--seq", "8", "--json")
    plan = json.loads(out)
    off3 = plan["memory"]["zero3_offload"]
    assert off3["model_states_bytes"] == 0 and off3["total_bytes"] < 80 * GB  # the GPU alone would fit
    assert off3["host_bytes"] == 16 * psi / 8 and off3["host_node_bytes"] == 16 * psi
    assert not off3["host_fits"] and not off3["fits"]
    assert off3["host_headroom_bytes"] == 2000 * GB - 16 * psi
    assert code == 1 and plan["suggestion"]["strategy"] is None
    for s in ("ddp", "zero1", "zero2", "zero3"):  # nothing offloaded: the host check passes
        assert plan["memory"][s]["host_fits"] and plan["memory"][s]["host_node_bytes"] == 0


LLAMA_7B = ["--arch", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32", "--ffn-hidden", "11008",
            "--vocab", "32000", "--seq", "4096", "--micro-batch", "1", "--recompute", "selective"]


def test_host_memory_per_node_is_shared_by_the_nodes_ranks(capsys):
    """The 7B Llama of the README on 8 GPUs with 8 per node (one node) and with 4 per node
    (two nodes): the same bytes a GPU, a node's sum over its own ranks only."""
    code, out, _ = run_cli(capsys, *LLAMA_7B, "--gpus", "8", "--gpus-per-node", "8", "--json")
    one = json.loads(out)["memory"]
    spec = ModelSpec(arch="llama", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000)
    psi = count_params(spec)
    steps = 4 * len(param_tensors(spec))  # the pieces' step counts (Note [step counts] in memory.py)
    assert one["zero3_offload"]["host_bytes"] == round(16 * psi / 8) + steps
    assert one["zero3_offload"]["host_node_bytes"] == round(16 * psi) + 8 * steps
    code, out, _ = run_cli(capsys, *LLAMA_7B, "--gpus", "8", "--gpus-per-node", "4", "--json")
    two = json.loads(out)["memory"]
    assert two["zero3_offload"]["host_bytes"] == one["zero3_offload"]["host_bytes"]
    assert two["zero3_offload"]["host_node_bytes"] == round(16 * psi / 2) + 4 * steps


def test_host_memory_gb_decides_what_offload_fits(capsys):
    """With 120 GB of host memory a node, the 7B Llama's zero2_offload (15.16 GB x 8 = 121 GB)
    no longer fits while zero3_offload (13.48 x 8 = 108 GB) still does; at 100 GB neither,
    and the table names the host as the reason."""
    def plan_at(host_gb):
        code, out, _ = run_cli(capsys, *LLAMA_7B, "--gpus", "8", "--host-memory-gb", str(host_gb), "--json")
        return json.loads(out)
    mem = plan_at(120)["memory"]
    assert mem["zero2_offload"]["host_node_bytes"] > 120 * GB >= mem["zero3_offload"]["host_node_bytes"]
    assert not mem["zero2_offload"]["fits"] and mem["zero2_offload"]["headroom_bytes"] > 0
    assert mem["zero3_offload"]["fits"]
    plan = plan_at(100)
    assert plan["inputs"]["gpu"]["host_memory_gb"] == 100
    assert not plan["memory"]["zero2_offload"]["fits"] and not plan["memory"]["zero3_offload"]["fits"]
    assert plan["memory"]["zero2"]["fits"]  # nothing on the host
    code, out, _ = run_cli(capsys, *LLAMA_7B, "--gpus", "8", "--host-memory-gb", "100")
    row = next(line for line in out.splitlines() if line.startswith("zero3_offload "))
    assert "NO (+" in row and "host 107.81 a node, 7.81 over its 100" in row, row
    assert "host memory 100 GB at 563 GB/s a node" in out


def test_the_offloaded_update_takes_the_nodes_host_memory_bandwidth(capsys):
    """The host optimizer update runs in step(), after backward: per parameter of a GPU's shard
    it reads the gradient, reads and writes K, and writes the 16-bit parameter, and a node's
    ranks share its host memory bandwidth (563 GB/s for an H100 node)."""
    psi = count_params(ModelSpec(arch="llama", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000))

    def plan(*extra):
        code, out, _ = run_cli(capsys, *LLAMA_7B, "--global-batch", "256", *extra, "--json")
        return json.loads(out)

    one_node = plan("--gpus", "8")
    t, c = one_node["time"], one_node["comm"]
    # fusedist's bf16 ZeRO-2 offload: FP32 gradient staging 4 + Adam's K = 12 twice + bf16 param 2
    assert t["zero2_offload"]["host_update_s"] == pytest.approx(psi * 30 / 563e9)
    assert c["zero2_offload"]["host_update_bytes_per_step"] == round(psi * 30 / 8)
    # fully_shard offload: the bf16 gradient shard 2 + 24 + 2
    assert t["zero3_offload"]["host_update_s"] == pytest.approx(psi * 28 / 563e9)
    for s in ("ddp", "zero1", "zero2", "zero3"):
        assert t[s]["host_update_s"] == 0 and c[s]["host_update_bytes_per_step"] == 0
    for s in ("zero2_offload", "zero3_offload"):  # after backward: added to both step times
        other = c[s]["seconds"] + c[s]["pcie_seconds"]
        assert t[s]["step_s"] == pytest.approx(max(t[s]["compute_s"], other) + t[s]["host_update_s"])
        assert t[s]["step_s_no_overlap"] == pytest.approx(t[s]["compute_s"] + other + t[s]["host_update_s"])
    # half the bandwidth, twice the time; two nodes: each node's 8 ranks update half as much
    assert plan("--gpus", "8", "--host-memory-gbps", "281.5")["time"]["zero2_offload"]["host_update_s"] == \
        pytest.approx(2 * t["zero2_offload"]["host_update_s"])
    assert plan("--gpus", "16")["time"]["zero2_offload"]["host_update_s"] == \
        pytest.approx(t["zero2_offload"]["host_update_s"] / 2)
    # fp32 parameters are their host masters (K = 12 for ZeRO-2 offload, 8 for fully_shard's)
    fp32 = plan("--gpus", "8", "--precision", "fp32")["time"]
    assert fp32["zero2_offload"]["host_update_s"] == pytest.approx(psi * (4 + 24) / 563e9)
    assert fp32["zero3_offload"]["host_update_s"] == pytest.approx(psi * (4 + 16) / 563e9)
    # the paper's ZeRO-Offload reads 16-bit gradients: 2 + 24 + 2
    paper = plan("--gpus", "8", "--convention", "paper")["time"]
    assert paper["zero2_offload"]["host_update_s"] == pytest.approx(psi * 28 / 563e9)
    assert plan("--gpus", "8", "--gpu", "a100")["time"]["zero2_offload"]["host_update_s"] == \
        pytest.approx(psi * 30 / 410e9)
