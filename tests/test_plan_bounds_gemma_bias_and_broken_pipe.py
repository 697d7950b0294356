"""The planner against what it reads, builds and promises: a config.json whose layer count is
past what the planner models is refused at once (not walked block by block); every bias a
family's attention builds from its config is counted; a long-context config is planned at the
--seq given; a model past 1e16 parameters is refused however it is given; the job line is the
job asked for; a reader closing the pipe early is neither a traceback nor "nothing fits"."""

import json
import os
import random
import resource
import subprocess
import sys

import pytest
import torch
from torch import nn

from fusedist.plan import count_params, from_hf_config

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway walk fails, not the machine


@pytest.mark.parametrize("family", [
    {"model_type": "qwen3_moe", "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4,
     "num_experts_per_tok": 2},
    {"model_type": "mistral", "sliding_window": 8},
], ids=["experts-per-block", "window-per-block"])
def test_a_config_with_more_layers_than_modelled_is_refused_at_once(tmp_path, family):
    """Which blocks hold experts or a window is decided block by block; a config of 10^12
    layers must get the bound's one-line refusal (exit 2), not minutes and gigabytes of walk."""
    cfg = {"hidden_size": 64, "num_hidden_layers": 10**12, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64, **family}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "fusedist.plan", "--hf-config", str(path), "--gpus", "2",
                           "--seq", "16"], capture_output=True, text=True, timeout=120, cwd=_ROOT,
                          preexec_fn=_limit_memory)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "--hf-config" in last and "at most 100000" in last, last


def _gemma_reference(cfg) -> int:
    """Parameters of GemmaForCausalLM as transformers' modeling_gemma.py builds it: q/k/v/o
    with ``bias=config.attention_bias``, a bias-free gated MLP, two RMSNorms a block, the
    final norm, the output layer tied to the embedding."""
    h, f, heads, kv, d = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                          cfg["num_key_value_heads"], cfg["head_dim"])
    bias = cfg["attention_bias"]
    layers = nn.ModuleList(nn.ModuleDict({
        "q_proj": nn.Linear(h, heads * d, bias=bias), "k_proj": nn.Linear(h, kv * d, bias=bias),
        "v_proj": nn.Linear(h, kv * d, bias=bias), "o_proj": nn.Linear(heads * d, h, bias=bias),
        "gate_proj": nn.Linear(h, f, bias=False), "up_proj": nn.Linear(h, f, bias=False),
        "down_proj": nn.Linear(f, h, bias=False), "input_layernorm": nn.RMSNorm(h),
        "post_attention_layernorm": nn.RMSNorm(h)}) for _ in range(cfg["num_hidden_layers"]))
    model = nn.ModuleDict({"embed_tokens": nn.Embedding(cfg["vocab_size"], h), "layers": layers,
                           "norm": nn.RMSNorm(h)})
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gemma_attention_bias_is_counted(tmp_path, seed):
    rng = random.Random(seed)
    kv = rng.choice([1, 2])
    cfg = {"model_type": "gemma", "hidden_size": 8 * rng.randint(2, 8), "intermediate_size": rng.randint(8, 96),
           "num_hidden_layers": rng.randint(1, 4), "num_attention_heads": kv * rng.randint(1, 3),
           "num_key_value_heads": kv, "head_dim": rng.choice([4, 8, 16]), "vocab_size": rng.randint(10, 300),
           "max_position_embeddings": 64, "attention_bias": True}
    with torch.device("meta"):
        expected = _gemma_reference(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert count_params(from_hf_config(str(path))) == expected


def _plan(argv):
    import contextlib
    import io

    from fusedist.plan.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("positions", [2**27, 10**9])
def test_a_long_context_config_is_planned_at_the_given_seq(tmp_path, positions):
    """A llama-type config's maximum positions are only the default --seq (RoPE has no
    position table to count): with --seq given, a config of a billion positions is planned,
    as the same model at 4096 positions is; without it, the refusal names --seq."""
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096}
    short, long = tmp_path / "short.json", tmp_path / "long.json"
    short.write_text(json.dumps(cfg))
    long.write_text(json.dumps({**cfg, "max_position_embeddings": positions}))
    code, out, err = _plan(["--hf-config", str(long), "--gpus", "2", "--seq", "256", "--json"])
    assert code == 0, err
    ref_code, ref, _ = _plan(["--hf-config", str(short), "--gpus", "2", "--seq", "256", "--json"])
    assert ref_code == 0
    got, want = json.loads(out), json.loads(ref)
    assert got["inputs"]["params"] == want["inputs"]["params"] and got["memory"] == want["memory"]
    code, _, err = _plan(["--hf-config", str(long), "--gpus", "2"])
    assert code == 2 and err.strip().splitlines()[-1].startswith("python -m fusedist.plan: error: --seq:"), err


@pytest.mark.parametrize("global_batch", [None, 64])
def test_the_job_line_gives_the_job_as_asked_when_a_layout_is_suggested(global_batch):
    """With no data-parallel strategy fitting, the suggested layout has fewer data-parallel
    ranks; the job line (and the tables, whose tokens per step are the job's) stay the job's:
    global batch = micro-batch x GPUs x accumulation for the GPUs asked."""
    gpus, micro, seq = 8, 1, 4096
    argv = ["--arch", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
            "--ffn-hidden", "14336", "--vocab", "128256", "--seq", str(seq), "--gpus", str(gpus),
            "--micro-batch", str(micro)] + (["--global-batch", str(global_batch)] if global_batch else [])
    code, out, err = _plan(argv)
    assert code == 0, err
    _, plan_json, _ = _plan(argv + ["--json"])
    plan = json.loads(plan_json)
    assert plan["suggestion"]["layout"]["dp"] < gpus  # the case at hand: a layout, not a strategy
    batch = global_batch or micro * gpus
    accum = batch // (micro * gpus)
    job_line = next(line for line in out.splitlines() if line.startswith("job:"))
    assert f"global batch {batch} (gradient accumulation {accum})" in job_line, job_line
    assert plan["inputs"]["assumptions"]["tokens_per_step"] == batch * seq
    assert f"({batch * seq:,} tokens)" in out


@pytest.mark.parametrize("source", ["shape", "head_dim", "kv_lora_rank", "shared_expert_intermediate_size"])
def test_a_model_past_the_parameter_bound_is_refused_however_given(tmp_path, source):
    """--params past 1e16 is refused; a shape or a config whose dimensions are each within
    their bounds but multiply past 1e16 parameters must be too, naming where it came from."""
    import test_plan_configs as published
    if source == "shape":
        argv = ["--arch", "llama", "--layers", "1000", "--hidden", str(1 << 20), "--heads", "16", "--vocab", "100",
                "--seq", "16"]
        flag = "--layers"
    else:
        base = {"head_dim": published.QWEN3_8B, "kv_lora_rank": published.DEEPSEEK_V3,
                "shared_expert_intermediate_size": published.QWEN15_MOE}[source]
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**base, source: 10**12}))
        argv, flag = ["--hf-config", str(path), "--seq", "4096"], "--hf-config"
    code, out, err = _plan(argv + ["--gpus", "8"])
    assert code == 2 and out == "", out[:300]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"python -m fusedist.plan: error: {flag}:") and "at most 1e+16" in last, last
    under = [a if a != str(1 << 20) else "4096" for a in argv]  # the same shape at a width planned
    if source == "shape":
        assert _plan(under + ["--gpus", "8"])[0] in (0, 1)


def test_a_reader_that_stops_early_gets_no_traceback_and_no_nothing_fits_status():
    """``python -m fusedist.plan ... | head``: the reader closing the pipe is not the plan's
    failure; status 1 would say "nothing fits" (this 7B model fits on 8 GPUs)."""
    proc = subprocess.Popen([sys.executable, "-m", "fusedist.plan", "--params", "7B", "--gpus", "8", "--seq", "4096"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=_ROOT)
    proc.stdout.close()  # before the plan is written: its print meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
