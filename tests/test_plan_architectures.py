"""The planner's parameter count of each family it reads from a ``config.json``, against a
module built from the same config the way transformers' modeling code builds that family
(module names as there: ``q_proj``, ``block_sparse_moe.experts[i].w1``, ``shared_expert_gate``,
...), with the dimensions scaled down and the structure kept: ``sum(p.numel())`` must be
the planner's count exactly, and, for mixtures of experts, the module's parameters outside
the experts a token is not routed to must be its active count.

The reference here is written from the families' published modeling code, not from
:class:`~fusedist.plan.model.ModelSpec`, so a field the planner misreads (a norm it forgets,
an expert width taken from the wrong key) shows up as a difference. The full-size published
totals are checked in tests/test_plan_configs.py."""

import json

import pytest
import torch
from torch import nn

from fusedist.plan import active_params, count_params, from_hf_config

import test_plan_configs as published

# What a family builds beyond llama's block (transformers' modeling_<family>.py)
_QK_NORM = {"qwen3", "qwen3_moe", "gemma3_text"}  # q_norm, k_norm: RMSNorm(head_dim)
_SANDWICH = {"gemma2", "gemma3_text"}  # pre_/post_feedforward_layernorm besides the usual two
_QKV_BIAS = {"qwen2", "qwen2_moe"}  # q/k/v Linear(bias=True), o_proj without
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3_text"}
_HEAD_DIM_DEFAULT = {"gemma": 256, "gemma2": 256, "gemma3_text": 256}


def _mlp(h, f, bias=False):
    return nn.ModuleDict({"gate_proj": nn.Linear(h, f, bias=bias), "up_proj": nn.Linear(h, f, bias=bias),
                          "down_proj": nn.Linear(f, h, bias=bias)})


def _is_sparse(cfg, i):
    """Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer's choice for layer i."""
    return (i not in (cfg.get("mlp_only_layers") or []) and cfg["num_experts"] > 0
            and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0)


def _deepseek_layer(cfg, i):
    """DeepseekV3DecoderLayer (V2's is the same): latent attention, then a dense MLP for the
    first first_k_dense_replace layers and every one off moe_layer_freq, else DeepseekV3MoE
    (a router weight, routed experts, one shared MLP of n_shared_experts x the expert width)."""
    h, heads, bias = cfg["hidden_size"], cfg["num_attention_heads"], bool(cfg.get("attention_bias"))
    nope, rope, vd, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    attn = nn.ModuleDict({"kv_a_proj_with_mqa": nn.Linear(h, r + rope, bias=bias), "kv_a_layernorm": nn.RMSNorm(r),
                          "kv_b_proj": nn.Linear(r, heads * (nope + vd), bias=False),
                          "o_proj": nn.Linear(heads * vd, h, bias=bias)})
    if cfg.get("q_lora_rank"):
        qr = cfg["q_lora_rank"]
        attn["q_a_proj"], attn["q_a_layernorm"] = nn.Linear(h, qr, bias=bias), nn.RMSNorm(qr)
        attn["q_b_proj"] = nn.Linear(qr, heads * (nope + rope), bias=False)
    else:
        attn["q_proj"] = nn.Linear(h, heads * (nope + rope), bias=False)
    layer = nn.ModuleDict({"self_attn": attn, "input_layernorm": nn.RMSNorm(h),
                           "post_attention_layernorm": nn.RMSNorm(h)})
    e, ef = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    if i >= cfg.get("first_k_dense_replace", 0) and i % cfg.get("moe_layer_freq", 1) == 0:
        gate = nn.Module()
        gate.weight = nn.Parameter(torch.empty(e, h))
        gate.register_buffer("e_score_correction_bias", torch.zeros(e))  # V3: moved by load, not trained
        layer["mlp"] = nn.ModuleDict({"gate": gate, "experts": nn.ModuleList(_mlp(h, ef) for _ in range(e)),
                                      "shared_experts": _mlp(h, ef * cfg["n_shared_experts"])})
    else:
        layer["mlp"] = _mlp(h, cfg["intermediate_size"])
    return layer


def _layer(cfg, i):
    t = cfg["model_type"]
    if t.startswith("deepseek"):
        return _deepseek_layer(cfg, i)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or _HEAD_DIM_DEFAULT.get(t) or h // heads
    attn_bias = bool(cfg.get("attention_bias"))
    qkv_bias = (t in _QKV_BIAS and cfg.get("qkv_bias", True) is not False) or attn_bias  # Qwen2MoeConfig's qkv_bias
    attn = nn.ModuleDict({"q_proj": nn.Linear(h, heads * d, bias=qkv_bias),
                          "k_proj": nn.Linear(h, kv * d, bias=qkv_bias),
                          "v_proj": nn.Linear(h, kv * d, bias=qkv_bias),
                          "o_proj": nn.Linear(heads * d, h, bias=attn_bias)})
    if t in _QK_NORM:
        attn["q_norm"], attn["k_norm"] = nn.RMSNorm(d), nn.RMSNorm(d)
    layer = nn.ModuleDict({"self_attn": attn, "input_layernorm": nn.RMSNorm(h),
                           "post_attention_layernorm": nn.RMSNorm(h)})
    if t in _SANDWICH:
        layer["pre_feedforward_layernorm"], layer["post_feedforward_layernorm"] = nn.RMSNorm(h), nn.RMSNorm(h)
    f = cfg["intermediate_size"]
    if t == "mixtral":  # MixtralSparseMoeBlock: gate + experts of w1, w2, w3 (ffn_dim = intermediate_size)
        e = cfg["num_local_experts"]
        layer["block_sparse_moe"] = nn.ModuleDict({
            "gate": nn.Linear(h, e, bias=False),
            "experts": nn.ModuleList(nn.ModuleDict({"w1": nn.Linear(h, f, bias=False),
                                                    "w2": nn.Linear(f, h, bias=False),
                                                    "w3": nn.Linear(h, f, bias=False)}) for _ in range(e))})
    elif t in ("qwen2_moe", "qwen3_moe") and _is_sparse(cfg, i):
        e, ef = cfg["num_experts"], cfg["moe_intermediate_size"]
        moe = nn.ModuleDict({"gate": nn.Linear(h, e, bias=False),
                             "experts": nn.ModuleList(_mlp(h, ef) for _ in range(e))})
        if t == "qwen2_moe":
            moe["shared_expert"] = _mlp(h, cfg["shared_expert_intermediate_size"])
            moe["shared_expert_gate"] = nn.Linear(h, 1, bias=False)
        layer["mlp"] = moe
    else:
        layer["mlp"] = _mlp(h, f, bool(cfg.get("mlp_bias")))
    return layer


def _falcon_model(cfg) -> nn.Module:
    """FalconForCausalLM's parameters (modeling_falcon.py), FalconConfig's defaults where a
    key is left out."""
    h, heads, v = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    d, bias = h // heads, cfg.get("bias", False)
    new, parallel = cfg.get("new_decoder_architecture", False), cfg.get("parallel_attn", True)
    if new:
        qkv = (2 * (cfg.get("num_kv_heads") or heads) + heads) * d
    elif cfg.get("multi_query", True):
        qkv = h + 2 * d
    else:
        qkv = 3 * h
    f = cfg.get("ffn_hidden_size") or 4 * h
    n_ln = cfg.get("num_ln_in_parallel_attn") or (2 if new else None)
    layers = nn.ModuleList()
    for _ in range(cfg["num_hidden_layers"]):
        layer = nn.ModuleDict({
            "self_attention": nn.ModuleDict({"query_key_value": nn.Linear(h, qkv, bias=bias),
                                             "dense": nn.Linear(h, h, bias=bias)}),
            "mlp": nn.ModuleDict({"dense_h_to_4h": nn.Linear(h, f, bias=bias),
                                  "dense_4h_to_h": nn.Linear(f, h, bias=bias)})})
        if not parallel:
            layer["input_layernorm"], layer["post_attention_layernorm"] = nn.LayerNorm(h), nn.LayerNorm(h)
        elif n_ln == 2:
            layer["ln_attn"], layer["ln_mlp"] = nn.LayerNorm(h), nn.LayerNorm(h)
        else:
            layer["input_layernorm"] = nn.LayerNorm(h)
        layers.append(layer)
    model = nn.ModuleDict({"word_embeddings": nn.Embedding(v, h), "h": layers, "ln_f": nn.LayerNorm(h),
                           "lm_head": nn.Linear(h, v, bias=False)})
    if cfg.get("tie_word_embeddings", True):
        model["lm_head"].weight = model["word_embeddings"].weight
    return model


def _gpt2_model(cfg) -> nn.Module:
    """GPT2LMHeadModel's parameters (Conv1D's weight is (in, out), its bias out)."""
    h, v, n = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]
    f = cfg.get("n_inner") or 4 * h
    blocks = nn.ModuleList(nn.ModuleDict({
        "ln_1": nn.LayerNorm(h), "ln_2": nn.LayerNorm(h),
        "attn": nn.ModuleDict({"c_attn": nn.Linear(h, 3 * h), "c_proj": nn.Linear(h, h)}),
        "mlp": nn.ModuleDict({"c_fc": nn.Linear(h, f), "c_proj": nn.Linear(f, h)})}) for _ in range(cfg["n_layer"]))
    model = nn.ModuleDict({"wte": nn.Embedding(v, h), "wpe": nn.Embedding(n, h), "h": blocks, "ln_f": nn.LayerNorm(h),
                           "lm_head": nn.Linear(h, v, bias=False)})
    model["lm_head"].weight = model["wte"].weight  # tied
    return model


def reference_model(cfg) -> nn.Module:
    """``<Family>ForCausalLM``'s parameters: embed_tokens, layers, norm, lm_head (the
    embedding's own weight when tied, counted once by ``parameters()``)."""
    if cfg["model_type"] == "falcon":
        return _falcon_model(cfg)
    if cfg["model_type"] == "gpt2":
        return _gpt2_model(cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    model = nn.ModuleDict({"embed_tokens": nn.Embedding(v, h),
                           "layers": nn.ModuleList(_layer(cfg, i) for i in range(cfg["num_hidden_layers"])),
                           "norm": nn.RMSNorm(h), "lm_head": nn.Linear(h, v, bias=False)})
    tied = cfg.get("tie_word_embeddings")
    if tied if tied is not None else cfg["model_type"] in _TIED_BY_DEFAULT:
        model["lm_head"].weight = model["embed_tokens"].weight
    return model


def _active_numel(model, cfg) -> int:
    """Parameters outside the routed experts a token is not sent to: every expert past the
    first top-k of each MoE block (which k does not change the count)."""
    k = cfg.get("num_experts_per_tok")
    total = 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if "experts" in parts and int(parts[parts.index("experts") + 1]) >= k:
            continue
        total += p.numel()
    return total


def _small(cfg, **changes):
    """The config with its dimensions scaled down, its structure (model type, grouping of the
    heads, head size apart from hidden / heads, tying, biases, experts per token, dense
    layers) kept."""
    if cfg["model_type"] == "gpt2":
        return dict(cfg, n_embd=48, n_layer=3, n_head=4, n_positions=40, vocab_size=96, **changes)
    out = dict(cfg, hidden_size=48, num_hidden_layers=4, vocab_size=96, max_position_embeddings=64)
    heads = cfg["num_attention_heads"]
    out["num_attention_heads"] = 4
    for key in ("num_key_value_heads", "num_kv_heads"):
        kv = cfg.get(key) or heads
        if key in cfg or key == "num_key_value_heads" and cfg["model_type"] != "falcon":
            out[key] = 4 if kv == heads else (1 if kv == 1 else 2)
    if "head_dim" in cfg:
        out["head_dim"] = 16 if cfg["head_dim"] * heads != cfg["hidden_size"] else 12
    for key, small in (("intermediate_size", 80), ("ffn_hidden_size", 72), ("moe_intermediate_size", 24),
                       ("shared_expert_intermediate_size", 40),
                       ("num_local_experts", 5), ("num_experts", 6), ("n_routed_experts", 7),
                       ("q_lora_rank", 20), ("kv_lora_rank", 16), ("qk_nope_head_dim", 8), ("qk_rope_head_dim", 4),
                       ("v_head_dim", 6)):
        if cfg.get(key) is not None:
            out[key] = small
    if "num_experts_per_tok" in cfg:
        out["num_experts_per_tok"] = 2
    out.update(changes)
    return out


FAMILIES = {
    "gpt2": (published.GPT2_124M, {}),
    "gpt2-n-inner": (published.GPT2_124M, {"n_inner": 72}),
    "llama-3-8b": (published.LLAMA3_8B, {}),
    "llama-biases": (published.LLAMA3_8B, {"attention_bias": True, "mlp_bias": True}),
    "mistral-7b": (published.MISTRAL_7B, {}),
    "qwen2-7b": (published.QWEN2_7B, {}),
    "qwen2.5-0.5b-tied": (published.QWEN25_05B, {}),
    "phi3-mini": (published.PHI3_MINI, {}),
    "gemma-2b": (published.GEMMA_2B, {}),
    "gemma-7b": (published.GEMMA_7B, {}),
    "llama-2-7b": (published.LLAMA2_7B, {}),
    "llama-3.1-70b": (published.LLAMA31_70B, {}),
    "qwen3-8b": (published.QWEN3_8B, {}),
    "qwen3-0.6b-tied": (published.QWEN3_06B, {}),
    "qwen3-attention-bias": (published.QWEN3_8B, {"attention_bias": True}),
    "gemma2-9b": (published.GEMMA2_9B, {}),
    "gemma2-27b": (published.GEMMA2_27B, {}),
    "gemma3-1b": (published.GEMMA3_1B, {}),
    "mixtral-8x7b": (published.MIXTRAL_8X7B, {}),
    "mixtral-8x22b": (published.MIXTRAL_8X22B, {}),
    "qwen1.5-moe": (published.QWEN15_MOE, {}),
    "qwen1.5-moe-sparse-step-2": (published.QWEN15_MOE, {"decoder_sparse_step": 2}),
    "qwen2-moe-no-qkv-bias": (published.QWEN15_MOE, {"qkv_bias": False}),
    "qwen3-30b-a3b": (published.QWEN3_30B_A3B, {}),
    "qwen3-moe-mlp-only-layers": (published.QWEN3_30B_A3B, {"mlp_only_layers": [0, 2]}),
    "qwen3-moe-tied": (published.QWEN3_235B_A22B, {"tie_word_embeddings": True}),
    "falcon-7b": (published.FALCON_7B, {}),
    "falcon-40b": (published.FALCON_40B, {}),
    "falcon-rw-1b": (published.FALCON_RW_1B, {}),
    "falcon-new-one-norm-untied": (published.FALCON_40B, {"num_ln_in_parallel_attn": 1, "ffn_hidden_size": 64,
                                                          "tie_word_embeddings": False}),
    "deepseek-v3": (published.DEEPSEEK_V3, {}),
    "deepseek-v2": (published.DEEPSEEK_V2, {}),
    "deepseek-v2-lite": (published.DEEPSEEK_V2_LITE, {}),
    "deepseek-every-other-layer-biases": (published.DEEPSEEK_V3, {"moe_layer_freq": 2, "first_k_dense_replace": 1,
                                                                  "attention_bias": True, "n_shared_experts": 2}),
    "falcon-defaults": ({"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4,
                         "num_hidden_layers": 2, "vocab_size": 64}, {}),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_count_matches_the_family_module(tmp_path, name):
    base, changes = FAMILIES[name]
    cfg = _small(base, **changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = from_hf_config(str(path))
    with torch.device("meta"):
        model = reference_model(cfg)
    assert count_params(spec) == sum(p.numel() for p in model.parameters()), cfg
    moe = "num_experts_per_tok" in cfg
    assert active_params(spec) == (_active_numel(model, cfg) if moe else count_params(spec))
    if moe:  # the scaled-down model still routes: fewer active than in all
        assert active_params(spec) < count_params(spec)
