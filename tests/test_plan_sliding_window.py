"""Sliding-window attention in the planner (Note [sliding windows] in fusedist/plan/model.py):
which blocks of each family's published config attend through a window, the attention FLOPs
they are charged (min(s, w) keys a query, PaLM's convention for the full s), a window no
shorter than the sequence giving the full-attention plan, and the built model's mask."""

import json
import os
import sys

import pytest
import torch

from fusedist.plan import Job, PlanError, activation_bytes, build_plan, from_hf_config, resolve_hardware
from fusedist.plan import cli
from fusedist.plan.model import attention_flops_per_token

sys.path.insert(0, os.path.dirname(__file__))
from test_plan_configs import (GEMMA2_27B, GEMMA2_2B, GEMMA2_9B, GEMMA3_1B, LLAMA3_8B, MISTRAL_7B,  # noqa: E402
                               MIXTRAL_8X7B, PHI3_MINI, QWEN2_7B, QWEN3_30B_A3B, QWEN3_8B)

GEMMA3_1B_GLOBAL = (5, 11, 17, 23)  # (i + 1) % 6 == 0: every sixth block attends globally
# google/gemma-3-1b-pt as newer transformers write it: each block's attention named
GEMMA3_1B_TYPES = {**{k: v for k, v in GEMMA3_1B.items() if k != "sliding_window_pattern"},
                   "layer_types": ["full_attention" if i in GEMMA3_1B_GLOBAL else "sliding_attention"
                                   for i in range(26)]}

WINDOWS = [
    # mistralai/Mistral-7B-v0.1: every block, 4096 (Mistral 7B paper, Section 2)
    ("mistral-7b-v0.1", MISTRAL_7B, 4096, tuple(range(32))),
    # MistralConfig's default window is 4096 when the key is left out
    ("mistral-default", {k: v for k, v in MISTRAL_7B.items() if k != "sliding_window"}, 4096, tuple(range(32))),
    # mistralai/Mistral-7B-v0.3: "sliding_window": null, full attention
    ("mistral-7b-v0.3", {**MISTRAL_7B, "sliding_window": None}, None, ()),
    # mistralai/Mixtral-8x7B-v0.1: null
    ("mixtral-8x7b", MIXTRAL_8X7B, None, ()),
    # microsoft/Phi-3-mini-4k-instruct: 2047 on every block
    ("phi3-mini", PHI3_MINI, 2047, tuple(range(32))),
    # google/gemma-2-*: the even blocks local, the odd ones global (Gemma 2 paper, Section 2)
    ("gemma2-2b", GEMMA2_2B, 4096, tuple(range(0, 26, 2))),
    ("gemma2-9b", GEMMA2_9B, 4096, tuple(range(0, 42, 2))),
    ("gemma2-27b", GEMMA2_27B, 4096, tuple(range(0, 46, 2))),
    # google/gemma-3-1b-pt: 512, five local blocks to one global (Gemma 3 report, Section 2)
    ("gemma3-1b", GEMMA3_1B, 512, tuple(i for i in range(26) if i not in GEMMA3_1B_GLOBAL)),
    ("gemma3-1b-layer-types", GEMMA3_1B_TYPES, 512, tuple(i for i in range(26) if i not in GEMMA3_1B_GLOBAL)),
    # Qwen/Qwen2-7B, Qwen3-8B, Qwen3-30B-A3B: use_sliding_window false (the default), no window
    ("qwen2-7b", QWEN2_7B, None, ()),
    ("qwen3-8b", QWEN3_8B, None, ()),
    ("qwen3-30b-a3b", QWEN3_30B_A3B, None, ()),
    # with it on, the blocks from max_window_layers up
    ("qwen2-7b-swa", {**QWEN2_7B, "use_sliding_window": True, "max_window_layers": 20}, 131072, tuple(range(20, 28))),
    # Qwen3-MoE (transformers 5): every block, max_window_layers not read (tests/test_plan_layer_rules.py)
    ("qwen3-moe-swa", {**QWEN3_30B_A3B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 40},
     4096, tuple(range(48))),
    # Llama has no window
    ("llama3-8b", LLAMA3_8B, None, ()),
]


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("name,cfg,window,blocks", WINDOWS, ids=[w[0] for w in WINDOWS])
def test_windowed_blocks_of_published_configs(tmp_path, name, cfg, window, blocks):
    spec = from_hf_config(_write(tmp_path, cfg))
    assert spec.sliding_window == window
    assert spec.window_layers == blocks


def test_windowed_attention_flops_exact(tmp_path):
    """Gemma-3-1B at s = 4096: 22 blocks charged 512 keys a query, 4 charged 4096; each key
    costs 2·d_q for QKᵀ and 2·d_q for the product with V (PaLM, Appendix B)."""
    spec = from_hf_config(_write(tmp_path, GEMMA3_1B))
    d_q = 4 * 256
    assert attention_flops_per_token(spec, 4096) == 4 * d_q * (22 * 512 + 4 * 4096) == 113_246_208
    assert spec.windowed_layers(4096) == 22
    # Mistral-7B at s = 16384: every block sees 4096 keys, a quarter of the full count
    mistral = from_hf_config(_write(tmp_path, MISTRAL_7B))
    full = from_hf_config(_write(tmp_path, {**MISTRAL_7B, "sliding_window": None}))
    assert attention_flops_per_token(mistral, 16384) == 4 * 4096 * 32 * 4096
    assert attention_flops_per_token(full, 16384) == 4 * attention_flops_per_token(mistral, 16384)
    # Gemma-2-9B at s = 8192: 21 blocks of 4096 keys and 21 of 8192
    gemma2 = from_hf_config(_write(tmp_path, GEMMA2_9B))
    assert attention_flops_per_token(gemma2, 8192) == 4 * 16 * 256 * (21 * 4096 + 21 * 8192)


def test_window_not_shorter_than_seq_is_the_full_attention_plan(tmp_path):
    """A window of at least --seq keys limits nothing: the plan is the full-attention plan to
    the byte and the second, and no block is counted as windowed."""
    hw = resolve_hardware("h100")
    windowed = from_hf_config(_write(tmp_path, MISTRAL_7B))
    full = from_hf_config(_write(tmp_path, {**MISTRAL_7B, "sliding_window": None}))
    for seq in (1024, 4096):
        job = Job(gpus=8, micro_batch=1, seq=seq)
        a, b = build_plan(windowed, job, hw), build_plan(full, job, hw)
        assert a["inputs"]["windowed_layers"] == 0 and a["inputs"]["sliding_window"] == 4096
        for key in ("memory", "comm", "time", "suggestion"):
            assert a[key] == b[key], key
        assert a["inputs"]["assumptions"]["flops_per_token"] == b["inputs"]["assumptions"]["flops_per_token"]
    job = Job(gpus=8, micro_batch=1, seq=4097)
    a, b = build_plan(windowed, job, hw), build_plan(full, job, hw)
    assert a["inputs"]["windowed_layers"] == 32
    assert a["time"]["ddp"]["compute_s"] < b["time"]["ddp"]["compute_s"]


def test_window_leaves_activation_memory_as_megatron_counts_it(tmp_path):
    """The planner's activations are Megatron's unfused attention, whose a·s² softmax, mask and
    dropout tensors are materialised whatever the mask (Note [sliding windows])."""
    windowed = from_hf_config(_write(tmp_path, MISTRAL_7B))
    full = from_hf_config(_write(tmp_path, {**MISTRAL_7B, "sliding_window": None}))
    for recompute in ("none", "selective", "full"):
        assert (activation_bytes(windowed, 1, 16384, "bf16", recompute)
                == activation_bytes(full, 1, 16384, "bf16", recompute))


def test_plan_reports_windowed_layers(tmp_path, capsys):
    path = _write(tmp_path, GEMMA2_2B)
    assert cli.main(["--hf-config", path, "--gpus", "8", "--seq", "8192", "--json"]) in (0, 1)
    plan = json.loads(capsys.readouterr().out)
    assert plan["inputs"]["windowed_layers"] == 13 and plan["inputs"]["sliding_window"] == 4096
    assert plan["inputs"]["model"]["window_layers"] == list(range(0, 26, 2))
    assert cli.main(["--hf-config", path, "--gpus", "8", "--seq", "8192"]) in (0, 1)
    out = capsys.readouterr().out
    assert ", sliding window 4096 on 13 of 26 layers," in out.splitlines()[0]
    assert "(seq -> window 4096 in 13 windowed layers)" in out
    assert cli.main(["--hf-config", path, "--gpus", "8", "--seq", "4096"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert ", sliding window 4096 on 13 layers (no shorter than seq 4096: full attention)," in line
    # a model without a window says nothing of one
    assert cli.main(["--hf-config", _write(tmp_path, LLAMA3_8B), "--gpus", "8", "--seq", "4096", "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert inputs["windowed_layers"] == 0 and inputs["sliding_window"] is None


REFUSED = [
    ({**GEMMA3_1B_TYPES, "layer_types": GEMMA3_1B_TYPES["layer_types"][:-1]}, "'layer_types'"),
    ({**GEMMA3_1B_TYPES, "layer_types": ["local"] * 26}, "'layer_types'"),
    ({**MISTRAL_7B, "sliding_window": 0}, "'sliding_window'"),
    ({**QWEN2_7B, "use_sliding_window": True, "max_window_layers": -1}, "'max_window_layers'"),
    ({**QWEN2_7B, "use_sliding_window": "yes"}, "'use_sliding_window'"),
    ({**GEMMA3_1B, "sliding_window_pattern": 0}, "'sliding_window_pattern'"),
]


@pytest.mark.parametrize("cfg,field", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_bad_window_keys_are_refused_naming_the_field(tmp_path, cfg, field):
    with pytest.raises(PlanError) as info:
        from_hf_config(_write(tmp_path, cfg))
    assert info.value.flag == "--hf-config" and field in str(info.value), str(info.value)


def test_built_model_attends_through_the_window(tmp_path):
    """The block --measure builds masks keys outside (i - w, i], as transformers' mask does,
    and a window no shorter than the sequence is plain causal attention."""
    from fusedist.plan.torch_model import Block, Transformer

    tiny = {**MISTRAL_7B, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64, "sliding_window": 3}
    spec = from_hf_config(_write(tmp_path, tiny))
    assert [b.window for b in Transformer(spec).blocks] == [3, 3]
    torch.manual_seed(0)
    block = Block(spec, window=3)
    b, s, heads, hd = 2, 7, 4, 8
    q, k, v = (torch.randn(b, heads, s, hd) for _ in range(3))
    scores = q @ k.transpose(-1, -2) / hd ** 0.5
    i = torch.arange(s)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3)
    expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(block._scores(q, k, v), expected)
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(Block(spec, window=7)._scores(q, k, v), causal)
    assert not torch.allclose(block._scores(q, k, v), causal)
