"""Reading a Hugging Face ``config.json`` into a :class:`~fusedist.plan.model.ModelSpec`.

Only the ``model_type`` values in :data:`HF_MODEL_TYPES` are counted; the rest are refused
naming the field: a config of another family read with these keys would give a count that
looks right and is not (Falcon-7B read as llama blocks: 11.16B instead of 6.92B).
"""

from __future__ import annotations

import json
import re
from typing import Optional

from .arch_advice import shape_advice
from .encoders import ENCODER_TYPES, refuse_encoder
from .errors import PlanError
from .model import ModelSpec, validate

# Hugging Face model_type values counted here, with what their config classes default to
# where config.json may leave a key out (transformers' LlamaConfig, MistralConfig,
# Qwen2Config, Phi3Config, GemmaConfig, GPT2Config, Qwen3Config, Gemma2Config,
# Gemma3TextConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig):
#   tie: tie_word_embeddings; qkv_bias: biases on q/k/v that the class builds by default
#   (Qwen2Attention always, Qwen2MoeAttention unless the config's qkv_bias is false: q/k/v with
#   bias, o without); head_dim: the class's
#   default head size (Gemma's: 256, whatever hidden / heads is), "required" where the
#   released configs all give it and the default is not hidden / heads; qk_norm,
#   sandwich_norm, gemma_norm: see ModelSpec; moe: where the experts' keys are (Note [active parameters]
#   in model.py); keys: the optional keys that change the count and are read (anything else
#   in the config does not change it); window: which blocks a sliding_window applies to and
#   the class's default window (Note [sliding windows] in model.py, _window below); softcap: the
#   class's default attn_logit_softcapping and final_logit_softcapping (Note [soft-capping]).
HF_MODEL_TYPES = {
    "llama": {"tie": False, "keys": ("head_dim", "attention_bias", "mlp_bias")},
    "mistral": {"tie": False, "keys": ("head_dim",), "window": ("all", 4096)},
    "qwen2": {"tie": False, "qkv_bias": True, "keys": ("head_dim",), "window": ("qwen", 4096)},
    "phi3": {"tie": False, "keys": (), "window": ("all", None)},
    "gemma": {"tie": True, "head_dim": 256, "gemma_norm": True,
              "keys": ("head_dim", "attention_bias")},  # GemmaAttention reads it
    "gpt2": {"tie": True, "keys": ()},
    "qwen3": {"tie": False, "head_dim": "required", "qk_norm": True, "keys": ("head_dim", "attention_bias"),
              "window": ("qwen", 4096)},
    "gemma2": {"tie": True, "head_dim": 256, "sandwich_norm": True, "gemma_norm": True,
               "keys": ("head_dim", "attention_bias"), "window": ("gemma2", 4096), "softcap": (50.0, 30.0)},
    "gemma3_text": {"tie": True, "head_dim": 256, "sandwich_norm": True, "qk_norm": True, "gemma_norm": True,
                    "keys": ("head_dim", "attention_bias"), "window": ("gemma3", 4096), "softcap": (None, None)},
    "mixtral": {"tie": False, "moe": "mixtral", "keys": ("head_dim",), "window": ("all", None)},
    "qwen2_moe": {"tie": False, "qkv_bias": True, "moe": "qwen2_moe", "keys": ("qkv_bias",),
                  "window": ("qwen2_moe", 4096)},
    "qwen3_moe": {"tie": False, "head_dim": "required", "qk_norm": True, "moe": "qwen3_moe",
                  "keys": ("head_dim", "attention_bias"), "window": ("qwen3_moe", 4096)},
    "falcon": {"tie": True, "keys": ()},  # its own keys: _falcon
    # latent attention (Note [latent attention] in model.py): its own head keys, not head_dim
    "deepseek_v2": {"tie": False, "latent": True, "moe": "deepseek", "keys": ("attention_bias",)},
    "deepseek_v3": {"tie": False, "latent": True, "moe": "deepseek", "keys": ("attention_bias",)},
}
# Keys that make a config a mixture of experts (Mixtral, Qwen2-MoE, DeepSeek-V2/V3, ...),
# refused in any family not counted as one.
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
             "n_shared_experts", "num_experts_per_tok")
# The most blocks the planner models (``--layers`` too): checked before the per-block walks
# below (which blocks are experts, which windowed), which for a billion layers took minutes and
# gigabytes before the bound the command line applies afterwards was reached.
MAX_LAYERS = 100_000
# Families seen in the wild whose blocks are not llama's, with why, for the refusal.
_NOT_COUNTED = {
    "gemma3": "a multimodal config (a vision tower besides text_config); a config.json of its text_config "
              "with model_type gemma3_text is counted",
}


def from_hf_config(path: str) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face ``config.json`` of a model type in
    :data:`HF_MODEL_TYPES` (llama-style keys, or GPT-2's ``n_embd``/``n_layer``/``n_head``/
    ``n_positions``/``n_inner``). Anything else is a :class:`PlanError` naming the field."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as exc:
        raise PlanError("--hf-config", f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError("--hf-config", f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise PlanError("--hf-config", f"{path} does not hold a JSON object")
    raw_type = cfg.get("model_type")
    model_type = str(raw_type).lower() if raw_type is not None else None
    family = HF_MODEL_TYPES.get(model_type)
    if model_type in _NOT_COUNTED:
        raise PlanError("--hf-config", f"{path}: 'model_type' {raw_type!r}: {_NOT_COUNTED[model_type]}, "
                                       "which the planner does not count")
    if family is None or "moe" not in family:
        moe_types = ", ".join(k for k, v in HF_MODEL_TYPES.items() if "moe" in v)
        for key in _MOE_KEYS:
            if cfg.get(key):
                raise PlanError("--hf-config", f"{path}: {key!r} = {cfg[key]!r}: a mixture-of-experts model "
                                               f"of model_type {raw_type!r}, which the planner does not count "
                                               f"(it counts {moe_types})")
    if raw_type is None:
        raise PlanError("--hf-config", f"{path} has no 'model_type' (the planner counts "
                                       f"{', '.join(HF_MODEL_TYPES)})")
    if model_type in ENCODER_TYPES:
        refuse_encoder(cfg, path, raw_type, _positive_int)
    if family is None:
        raise PlanError("--hf-config", f"{path}: 'model_type' {raw_type!r} is not one the planner counts "
                                       f"({', '.join(HF_MODEL_TYPES)}); {shape_advice(cfg)}")
    if model_type == "falcon":
        return _checked(ModelSpec(**_falcon(cfg, path)), path, _FALCON_KEYS)
    if model_type == "gpt2":
        keys, arch, ffn_key, kv_key = _GPT2_KEYS, "gpt", "n_inner", None
    else:
        keys, arch, ffn_key, kv_key = _LLAMA_KEYS, "llama", "intermediate_size", "num_key_value_heads"
    values = {}
    for field, key in keys.items():
        values[field] = _positive_int(cfg, key, path, required=True)
    _layers_within_bounds(values["layers"], keys["layers"])
    optional = family["keys"]
    values["ffn_hidden"] = _positive_int(cfg, ffn_key, path, required=arch == "llama")
    values["kv_heads"] = _positive_int(cfg, kv_key, path) if kv_key else None
    default_head = family.get("head_dim")
    head_dim = _positive_int(cfg, "head_dim", path, required=default_head == "required") \
        if "head_dim" in optional else None
    values["head_dim"] = head_dim if head_dim is not None else default_head
    attention_bias = _flag(cfg, "attention_bias", path) if "attention_bias" in optional else False
    qkv_bias = family.get("qkv_bias", False)  # Qwen2MoeConfig's qkv_bias (default true) switches it off
    if "qkv_bias" in optional and cfg.get("qkv_bias") is not None:
        qkv_bias = _flag(cfg, "qkv_bias", path)
    mlp_bias = _flag(cfg, "mlp_bias", path) if "mlp_bias" in optional else False
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        tied = family["tie"]
    elif not isinstance(tied, bool):
        raise PlanError("--hf-config", f"{path}: 'tie_word_embeddings' must be true or false, got {tied!r}")
    if family.get("latent"):
        values.update(_latent(cfg, path))
    if "moe" in family:
        values.update(_experts(cfg, path, family["moe"], values["layers"], values["ffn_hidden"]))
    if "window" in family:
        values.update(_window(cfg, path, *family["window"], values["layers"]))
    if "softcap" in family:
        values.update(_softcaps(cfg, path, *family["softcap"]))
    spec = ModelSpec(arch=arch, tied=tied, qkv_bias=bool(qkv_bias or attention_bias),
                     out_bias=attention_bias, mlp_bias=mlp_bias, qk_norm=family.get("qk_norm", False),
                     sandwich_norm=family.get("sandwich_norm", False), gemma_norm=family.get("gemma_norm", False),
                     source=f"hf-config ({model_type})",
                     **values)
    return _checked(spec, path, dict({f"--{k.replace('_', '-')}": v for k, v in keys.items()},
                                     **{"--ffn-hidden": ffn_key, "--kv-heads": kv_key},
                                     **_EXPERT_KEYS.get(family.get("moe"), {})))


# ModelSpec fields -> the keys they are read from (the required ones; ffn and kv besides)
_GPT2_KEYS = {"hidden": "n_embd", "layers": "n_layer", "heads": "n_head", "seq": "n_positions", "vocab": "vocab_size"}
_LLAMA_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
               "seq": "max_position_embeddings", "vocab": "vocab_size"}
# validate()'s flags and fields -> the config keys they were read from, for its refusals
_COMMON_KEYS = {"--head-dim": "head_dim", "sliding_window": "sliding_window"}
_FALCON_KEYS = {"--layers": "num_hidden_layers", "--hidden": "hidden_size", "--heads": "num_attention_heads",
                "--vocab": "vocab_size", "--seq": "max_position_embeddings", "--ffn-hidden": "ffn_hidden_size",
                "--kv-heads": "num_kv_heads"}
_EXPERT_KEYS = {"mixtral": {"experts": "num_local_experts", "experts_per_token": "num_experts_per_tok",
                            "expert_ffn": "intermediate_size"},
                "qwen2_moe": {"experts": "num_experts", "experts_per_token": "num_experts_per_tok",
                              "expert_ffn": "moe_intermediate_size"},
                "qwen3_moe": {"experts": "num_experts", "experts_per_token": "num_experts_per_tok",
                              "expert_ffn": "moe_intermediate_size"},
                "deepseek": {"experts": "n_routed_experts", "experts_per_token": "num_experts_per_tok",
                             "expert_ffn": "moe_intermediate_size"}}


def config_key(spec: ModelSpec, field: str) -> str:
    """The config.json key a field of a spec read by :func:`from_hf_config` came from, for the
    refusals that name it (``field`` itself where the spec did not come from a config)."""
    model_type = spec.source[len("hf-config ("):-1] if spec.source.startswith("hf-config (") else None
    if model_type is None:
        return field
    if model_type == "falcon":
        keys = _FALCON_KEYS
    else:
        gpt2 = model_type == "gpt2"
        keys = {f"--{k}": v for k, v in (_GPT2_KEYS if gpt2 else _LLAMA_KEYS).items()}
        keys.update({"--ffn-hidden": "n_inner" if gpt2 else "intermediate_size",
                     "--kv-heads": None if gpt2 else "num_key_value_heads"})
    keys = dict(_COMMON_KEYS, **keys, **_EXPERT_KEYS.get(HF_MODEL_TYPES.get(model_type, {}).get("moe"), {}))
    return keys.get(f"--{field.replace('_', '-')}") or keys.get(field) or field


def _layers_within_bounds(layers: int, key: str) -> None:
    """Refuse more blocks than :data:`MAX_LAYERS` before anything walks them, naming the
    config's ``key`` as the planner's other bounds on a config do."""
    if layers > MAX_LAYERS:
        raise PlanError("--hf-config", f"{key!r} {layers} is beyond what the planner models (at most {MAX_LAYERS})")


def _checked(spec: ModelSpec, path: str, keys: dict) -> ModelSpec:
    """``spec`` unless :func:`validate` refuses it; the refusal names the config's keys
    (``keys``: validate's flag or field -> the key), not the flags of a shape the user never
    typed ("--kv-heads: 5 key/value heads do not divide --heads 32" for num_key_value_heads)."""
    try:
        validate(spec)
    except PlanError as exc:
        keys = dict(_COMMON_KEYS, **{k: v for k, v in keys.items() if v})
        body = str(exc)[len(exc.flag) + 2:] if exc.flag else str(exc)
        body = re.sub(r"--[a-z-]+", lambda m: repr(keys[m.group()]) if m.group() in keys else m.group(), body)
        field = repr(keys[exc.flag]) if exc.flag in keys else exc.flag
        raise PlanError("--hf-config", f"{path}: {field}: {body}; correct it in the config") from None
    return spec


def _falcon(cfg: dict, path: str) -> dict:
    """FalconConfig's keys, as transformers' FalconAttention and FalconDecoderLayer read them:
    q/k/v of ``(heads + 2 kv) x head_dim`` with kv = ``num_kv_heads`` under
    ``new_decoder_architecture``, 1 under ``multi_query``, else every head; with
    ``parallel_attn``, LayerNorms ``ln_attn`` and ``ln_mlp`` when ``num_ln_in_parallel_attn``
    is 2 (its default under the new architecture), else one ``input_layernorm`` for both;
    without, ``input_layernorm`` and ``post_attention_layernorm``. Left-out keys take
    FalconConfig's defaults (multi-query, parallel attention, no biases, 2048 positions, tied)."""
    values = {"hidden": _positive_int(cfg, "hidden_size", path, required=True),
              "layers": _positive_int(cfg, "num_hidden_layers", path, required=True),
              "heads": _positive_int(cfg, "num_attention_heads", path, required=True),
              "vocab": _positive_int(cfg, "vocab_size", path, required=True),
              "seq": _positive_int(cfg, "max_position_embeddings", path) or 2048,
              "ffn_hidden": _positive_int(cfg, "ffn_hidden_size", path)}
    new = _flag(cfg, "new_decoder_architecture", path)
    multi_query = _flag(cfg, "multi_query", path) if "multi_query" in cfg else True
    parallel = _flag(cfg, "parallel_attn", path) if "parallel_attn" in cfg else True
    bias = _flag(cfg, "bias", path)
    if new:
        values["kv_heads"] = _positive_int(cfg, "num_kv_heads", path) or values["heads"]
    elif multi_query:
        values["kv_heads"] = 1
    norms = _positive_int(cfg, "num_ln_in_parallel_attn", path) or (2 if new else 1)
    tied = cfg.get("tie_word_embeddings", True)
    if not isinstance(tied, bool):
        raise PlanError("--hf-config", f"{path}: 'tie_word_embeddings' must be true or false, got {tied!r}")
    return dict(values, arch="falcon", tied=tied, qkv_bias=bias, out_bias=bias, mlp_bias=bias,
                parallel_attn=parallel, shared_norm=parallel and norms != 2,
                source="hf-config (falcon)")


def _latent(cfg: dict, path: str) -> dict:
    """DeepSeek-V2/V3's attention keys (Note [latent attention] in model.py); every head has
    its own keys and values after ``kv_b_proj``."""
    nope = _positive_int(cfg, "qk_nope_head_dim", path, required=True)
    rope = _positive_int(cfg, "qk_rope_head_dim", path, required=True)
    return {"kv_lora_rank": _positive_int(cfg, "kv_lora_rank", path, required=True),
            "q_lora_rank": _positive_int(cfg, "q_lora_rank", path), "rope_head_dim": rope,
            "v_head_dim": _positive_int(cfg, "v_head_dim", path, required=True), "head_dim": nope + rope,
            "kv_heads": None}


def _experts(cfg: dict, path: str, kind: str, layers: int, ffn: int) -> dict:
    """The ModelSpec fields of a mixture of experts. Mixtral: every block, experts of
    ``intermediate_size``. Qwen2/3-MoE: the block ``i`` is sparse unless ``i`` is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step`` (as their decoder layers decide),
    experts of ``moe_intermediate_size``; Qwen2-MoE adds a gated shared expert. DeepSeek: the
    block ``i`` is sparse when ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``,
    with ``n_shared_experts`` ungated shared experts of ``moe_intermediate_size`` (one MLP of
    their summed width, as DeepseekV3MoE builds it).

    Note [moe_layer_freq]
        DeepSeek's own modeling code (shipped with its checkpoints) applies ``moe_layer_freq``;
        transformers' DeepseekV2/V3 decoder layers ignore it (sparse wherever ``i >=
        first_k_dense_replace``). Every released config says 1, where the two agree. A config
        with another value is counted by DeepSeek's rule, the one that wrote such weights, and
        the plan says so (``moe_layer_freq`` in its model, and its model line), so that neither
        reading is given silently."""
    if kind == "mixtral":
        return {"experts": _positive_int(cfg, "num_local_experts", path, required=True),
                "experts_per_token": _positive_int(cfg, "num_experts_per_tok", path, required=True),
                "expert_ffn": ffn}
    if kind == "deepseek":
        expert_ffn = _positive_int(cfg, "moe_intermediate_size", path, required=True)
        first = cfg.get("first_k_dense_replace") or 0
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise PlanError("--hf-config", f"{path}: 'first_k_dense_replace' must be a whole number, "
                                           f"got {first!r}")
        freq = _positive_int(cfg, "moe_layer_freq", path) or 1
        return {"experts": _positive_int(cfg, "n_routed_experts", path, required=True),
                "experts_per_token": _positive_int(cfg, "num_experts_per_tok", path, required=True),
                "expert_ffn": expert_ffn,
                "shared_ffn": expert_ffn * (_positive_int(cfg, "n_shared_experts", path) or 0),
                **({"moe_layer_freq": freq} if freq != 1 else {}),  # said in the plan: Note [moe_layer_freq]
                **_dense_ids([i for i in range(layers) if i < first or i % freq])}
    out = {"experts": _positive_int(cfg, "num_experts", path, required=True),
           "experts_per_token": _positive_int(cfg, "num_experts_per_tok", path, required=True),
           "expert_ffn": _positive_int(cfg, "moe_intermediate_size", path, required=True)}
    step = _positive_int(cfg, "decoder_sparse_step", path) or 1
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise PlanError("--hf-config", f"{path}: 'mlp_only_layers' must be a list of layer numbers, got {only!r}")
    out.update(_dense_ids([i for i in range(layers) if i in only or (i + 1) % step]))
    if kind == "qwen2_moe":
        out["shared_ffn"] = _positive_int(cfg, "shared_expert_intermediate_size", path, required=True)
        out["shared_gate"] = True
    return out


def _softcaps(cfg: dict, path: str, attn_default: Optional[float], final_default: Optional[float]) -> dict:
    """Gemma-2/3's logit soft-caps (Note [soft-capping] in model.py): a left-out key takes the
    config class's default, a null one caps nothing."""
    caps = {}
    for field, key, default in (("attn_softcap", "attn_logit_softcapping", attn_default),
                                ("final_softcap", "final_logit_softcapping", final_default)):
        value = cfg.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise PlanError("--hf-config", f"{path}: {key!r} must be a positive number or null, got {value!r}")
        caps[field] = None if value is None else float(value)
    return caps


_LAYER_TYPES = ("sliding_attention", "full_attention")


def _window(cfg: dict, path: str, rule: str, default: Optional[int], layers: int) -> dict:
    """The sliding window and the blocks it applies to, as transformers decides (a null window,
    or none by default, is full attention everywhere): MistralAttention, MixtralAttention and
    Phi3Attention hand ``config.sliding_window`` to every block; Qwen2Config, Qwen3Config,
    Qwen2MoeConfig and Qwen3MoeConfig null the window without ``use_sliding_window``; the first
    three default ``layer_types`` by ``max_window_layers`` (Qwen2MoeConfig by the parity of ``i``
    too), while transformers 5's Qwen3MoeConfig has neither key and its attention and masks (as
    Mixtral's) give the window to every block; Gemma2Config and Gemma3TextConfig pick by
    ``(i + 1) % 2`` and ``(i + 1) % sliding_window_pattern``:

    * ``all`` (Mistral, Mixtral, Phi-3): every block, ``sliding_window``;
    * ``qwen`` (Qwen2/3): only with ``use_sliding_window`` (default false, as in every released
      Qwen config), the blocks ``i >= max_window_layers`` (default 28);
    * ``qwen3_moe``: only with ``use_sliding_window``, every block (``max_window_layers`` and
      ``layer_types`` are not read);
    * ``qwen2_moe``: only with ``use_sliding_window``, the even blocks below ``max_window_layers``
      (``(i + 1) % 2 and i < max_window_layers``, Qwen2MoeConfig's default ``layer_types`` in
      transformers 5, which Qwen2MoeAttention and the model's masks follow block by block);
    * ``gemma2``: the even blocks (``(i + 1) % 2``), the odd ones global;
    * ``gemma3``: the blocks with ``(i + 1) % sliding_window_pattern`` (default 6), every
      sixth global.

    A ``layer_types`` list (newer Qwen and Gemma configs) names each block's attention and
    takes precedence over the pattern, as in those classes (Qwen3-MoE's aside)."""
    window = cfg["sliding_window"] if "sliding_window" in cfg else default
    if rule in ("qwen", "qwen2_moe", "qwen3_moe") and not _flag(cfg, "use_sliding_window", path):
        window = None
    if window is None:
        return {}
    window = _positive_int(cfg, "sliding_window", path) if "sliding_window" in cfg else window
    if rule in ("all", "qwen3_moe"):
        ids = range(layers)
    elif cfg.get("layer_types") is not None:
        ids = _layer_types(cfg, path, layers)
    elif rule == "qwen":
        first = _whole(cfg, "max_window_layers", path, 28)
        ids = range(first, layers)
    elif rule == "qwen2_moe":
        below = _whole(cfg, "max_window_layers", path, 28)
        ids = [i for i in range(min(below, layers)) if (i + 1) % 2]
    elif rule == "gemma2":
        ids = range(0, layers, 2)
    else:
        pattern = _positive_int(cfg, "sliding_window_pattern", path) or 6
        ids = [i for i in range(layers) if (i + 1) % pattern]
    return {"sliding_window": window, "window_layers": tuple(ids)}


def _layer_types(cfg: dict, path: str, layers: int) -> list:
    types = cfg["layer_types"]
    if not isinstance(types, list) or len(types) != layers or not all(t in _LAYER_TYPES for t in types):
        raise PlanError("--hf-config", f"{path}: 'layer_types' must list {' or '.join(map(repr, _LAYER_TYPES))} "
                                       f"for each of the {layers} layers, got {types!r}")
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def _whole(cfg: dict, key: str, path: str, default: int) -> int:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanError("--hf-config", f"{path}: {key!r} must be a whole number, got {value!r}")
    return value


def _dense_ids(ids: list) -> dict:
    return {"dense_layers": len(ids), "dense_ids": tuple(ids)}


def _positive_int(cfg: dict, key: str, path: str, required: bool = False) -> Optional[int]:
    value = cfg.get(key)
    if value is None:
        if required:
            raise PlanError("--hf-config", f"{path} has no {key!r}")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError("--hf-config", f"{path}: {key!r} must be a positive integer, got {value!r}")
    return value


def _flag(cfg: dict, key: str, path: str) -> bool:
    value = cfg.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise PlanError("--hf-config", f"{path}: {key!r} must be true or false, got {value!r}")
    return value
