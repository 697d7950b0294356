"""Which shape flags fit a ``config.json`` of a family the planner does not read: advised from the
config's own features, not one answer for all.

The refusal of an unknown ``model_type`` used to advise ``--arch llama`` whatever the config
held. An OPT config (LayerNorm with biases, learned positions, a two-matrix ReLU MLP of
``ffn_dim``) given llama's blocks counts a third matrix in every MLP and an untied output
layer: OPT-1.3B (1,315,758,080 parameters) counted as 1.82B, where ``--arch gpt`` is within
4,096 of it (the two offset rows of OPT's position table). So the config is read for the
features that tell the two block shapes apart, and the advice names the one they point to, the
values to give it, and what the count will leave out where the features disagree.
"""

from __future__ import annotations

# the first key present gives the value (Hugging Face's names, GPT-2's, OPT's, GPT-NeoX's, ...)
_VALUES = (
    ("layers", ("num_hidden_layers", "n_layer", "num_layers")),
    ("hidden", ("hidden_size", "n_embd", "d_model")),
    ("heads", ("num_attention_heads", "n_head", "num_heads")),
    ("kv-heads", ("num_key_value_heads",)),
    ("ffn-hidden", ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size")),
    ("vocab", ("vocab_size",)),
    ("seq", ("max_position_embeddings", "n_positions", "seq_length")),
)
_ROTARY = ("rope_theta", "rope_scaling", "rotary_dim", "rotary_pct", "rotary_emb_base", "partial_rotary_factor")
_GATED = ("silu", "swish", "swiglu", "geglu")
_BIAS_KEYS = ("enable_bias", "bias", "use_bias", "attention_bias", "add_bias_linear")


def _first(cfg: dict, keys) -> object:
    return next((cfg[k] for k in keys if cfg.get(k) is not None), None)


def features(cfg: dict) -> dict:
    """{feature: "gpt" or "llama"} for each feature the config shows: the norm, the positions, the
    MLP, the biases, grouped key/value heads."""
    found = {}
    if "rms_norm_eps" in cfg:
        found["RMSNorm"] = "llama"
    elif any(k in cfg for k in ("layer_norm_eps", "layer_norm_epsilon", "layernorm_epsilon")):
        found["LayerNorm"] = "gpt"
    if any(k in cfg for k in _ROTARY) or cfg.get("position_embedding_type") == "rotary":
        found["rotary positions"] = "llama"
    elif any(k in cfg for k in ("max_position_embeddings", "n_positions")):
        found["learned positions"] = "gpt"
    act = _first(cfg, ("hidden_act", "activation_function", "hidden_activation"))
    if isinstance(act, str):
        gated = any(g in act.lower() for g in _GATED)
        found[f"{'a gated' if gated else 'a two-matrix'} {act} MLP"] = "llama" if gated else "gpt"
    bias = _first(cfg, _BIAS_KEYS)
    if isinstance(bias, bool):
        found["biases" if bias else "no biases"] = "gpt" if bias else "llama"
    kv, heads = cfg.get("num_key_value_heads"), _first(cfg, ("num_attention_heads", "n_head"))
    if isinstance(kv, int) and isinstance(heads, int) and kv != heads:
        found[f"grouped key/value heads ({kv} of {heads})"] = "llama"
    return found


def shape_advice(cfg: dict) -> str:
    """The shape flags to give for this config instead, with the reason (its features)."""
    found = features(cfg)
    votes = {arch: [f for f, a in found.items() if a == arch] for arch in ("gpt", "llama")}
    if not found:
        return ("its features (norm, positions, MLP) are not in the config either; give the shape by hand "
                "(--arch gpt: LayerNorm, learned positions, a two-matrix MLP; --arch llama: RMSNorm, rotary "
                "positions, a gated MLP)")
    arch = "gpt" if len(votes["gpt"]) > len(votes["llama"]) else "llama"
    other = "llama" if arch == "gpt" else "gpt"
    flags = [f"--arch {arch}"]
    for flag, keys in _VALUES:
        if flag == "kv-heads" and arch == "gpt":
            continue
        value = _first(cfg, keys)
        flags.append(f"--{flag} {value if isinstance(value, int) else '?'}")
    text = (f"its blocks look like --arch {arch}'s ({', '.join(votes[arch])}): give the shape instead, "
            f"{' '.join(flags)}")
    if votes[other]:
        text += (f"; the count is approximate: {', '.join(votes[other])} "
                 f"{'is' if len(votes[other]) == 1 else 'are'} --arch {other}'s")
    if arch == "gpt" and cfg.get("tie_word_embeddings") is False:
        text += "; --arch gpt ties the output layer to the embedding, this config does not"
    return text
