"""Parameter and activation counts of a decoder-only transformer, from its shape or from a
Hugging Face ``config.json``.

Two block shapes are counted exactly (what :mod:`fusedist.plan.measure` builds):

* ``gpt`` (GPT-2): learned position embeddings, LayerNorm with bias, biased projections,
  GELU MLP of ``ffn_hidden`` (default 4h), input embedding tied to the output layer.
  GPT-2 124M: 124,439,808 parameters.
* ``llama``: rotary positions (no parameters), RMSNorm without bias, bias-free projections,
  grouped-query attention (``kv_heads``), SwiGLU MLP (three matrices), untied output layer
  unless the config ties it. Llama-2-7B: 6,738,415,616 parameters. Variants the Hugging Face
  configs of this family use: a head size other than ``hidden / heads`` (``head_dim``:
  Gemma, Mistral-Nemo), biases on q/k/v (Qwen2), on the attention output (Llama's
  ``attention_bias``) and on the MLP (``mlp_bias``).

:func:`from_hf_config` counts only the ``model_type`` values it knows (:data:`HF_MODEL_TYPES`)
and refuses the rest, and mixture-of-experts configs, naming the field: a config of another
family read with these keys would give a count that looks right and is not.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from .errors import PlanError

ARCHS = ("gpt", "llama")

# Hugging Face model_type values counted here, with what their config classes default to
# where config.json may leave a key out (transformers' LlamaConfig, MistralConfig,
# Qwen2Config, Phi3Config, GemmaConfig, GPT2Config):
#   tie: tie_word_embeddings; qkv_bias: biases on q/k/v that the class always builds
#   (Qwen2Attention: q/k/v with bias, o without); head_dim: the class's default head size
#   (GemmaConfig: 256, whatever hidden / heads is); keys: the optional keys that change the
#   count and are read (anything else in the config does not change it).
HF_MODEL_TYPES = {
    "llama": {"tie": False, "keys": ("head_dim", "attention_bias", "mlp_bias")},
    "mistral": {"tie": False, "keys": ("head_dim",)},
    "qwen2": {"tie": False, "qkv_bias": True, "keys": ("head_dim",)},
    "phi3": {"tie": False, "keys": ()},
    "gemma": {"tie": True, "head_dim": 256, "keys": ("head_dim",)},
    "gpt2": {"tie": True, "keys": ()},
}
# Keys that make a config a mixture of experts (Mixtral, Qwen2-MoE, DeepSeek-V2/V3, ...).
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
             "n_shared_experts", "num_experts_per_tok")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model's shape. ``params`` alone (no shape) supports model-state and communication
    arithmetic but no activation estimate."""

    arch: str = "gpt"
    layers: Optional[int] = None
    hidden: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    seq: Optional[int] = None
    vocab: Optional[int] = None
    ffn_hidden: Optional[int] = None
    tied: Optional[bool] = None
    head_dim: Optional[int] = None  # llama: when not hidden / heads (Gemma)
    qkv_bias: bool = False  # llama: biases on q, k, v (Qwen2; Llama's attention_bias)
    out_bias: bool = False  # llama: bias on the attention output (Llama's attention_bias)
    mlp_bias: bool = False  # llama: biases on gate, up, down (Llama's mlp_bias)
    params: Optional[int] = None  # given directly (--params)
    source: str = "shape"

    @property
    def has_shape(self) -> bool:
        return self.layers is not None

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention output (``heads · head_size``)."""
        return self.heads * self.head_size

    @property
    def kv_dim(self) -> int:
        return self.kv * self.head_size

    @property
    def tied_embeddings(self) -> bool:
        return self.tied if self.tied is not None else self.arch == "gpt"


def validate(spec: ModelSpec) -> None:
    """Raise :class:`PlanError` naming the flag for a shape that cannot exist."""
    if spec.params is not None and spec.params <= 0:
        raise PlanError("--params", f"must be positive, got {spec.params:g}")
    if not spec.has_shape:
        return
    for flag, value in (("--layers", spec.layers), ("--hidden", spec.hidden), ("--heads", spec.heads),
                        ("--seq", spec.seq), ("--vocab", spec.vocab), ("--ffn-hidden", spec.ffn_hidden),
                        ("--kv-heads", spec.kv_heads), ("--head-dim", spec.head_dim)):
        if value is not None and value <= 0:
            raise PlanError(flag, f"must be positive, got {value}")
    if spec.head_dim is None and spec.hidden % spec.heads:
        raise PlanError("--heads", f"{spec.heads} heads do not divide --hidden {spec.hidden}")
    if spec.heads % spec.kv:
        raise PlanError("--kv-heads", f"{spec.kv} key/value heads do not divide --heads {spec.heads}")
    if spec.arch not in ARCHS:
        raise PlanError("--arch", f"unknown architecture {spec.arch!r} (choose {', '.join(ARCHS)})")


def layer_params(spec: ModelSpec) -> int:
    """Parameters of one transformer block."""
    h, f, q_dim, kv_dim = spec.hidden, spec.ffn, spec.q_dim, spec.kv_dim
    if spec.arch == "gpt":
        attn = h * (q_dim + 2 * kv_dim) + (q_dim + 2 * kv_dim) + q_dim * h + h  # fused qkv + out, with biases
        mlp = h * f + f + f * h + h
        norms = 2 * 2 * h  # two LayerNorms, weight and bias
    else:
        attn = h * (q_dim + 2 * kv_dim) + q_dim * h  # q, k, v, o
        attn += (q_dim + 2 * kv_dim) * spec.qkv_bias + h * spec.out_bias
        mlp = 3 * h * f  # gate, up, down (SwiGLU)
        mlp += (2 * f + h) * spec.mlp_bias
        norms = 2 * h  # two RMSNorms, weight only
    return attn + mlp + norms


def embedding_params(spec: ModelSpec) -> int:
    """Input embedding, position embedding (gpt), final norm and an untied output layer."""
    h, v = spec.hidden, spec.vocab
    n = v * h
    if spec.arch == "gpt":
        n += spec.seq * h + 2 * h
    else:
        n += h
    if not spec.tied_embeddings:
        n += v * h
    return n


def count_params(spec: ModelSpec) -> int:
    """Ψ: every trainable parameter, counted once (tied weights once)."""
    if not spec.has_shape:
        return int(spec.params)
    return spec.layers * layer_params(spec) + embedding_params(spec)


def attention_flops_per_token(spec: ModelSpec, seq: int) -> int:
    """Forward FLOPs of the attention scores per token: QKᵀ and the product with V, each
    ``2·s·d_q`` per layer (PaLM, Appendix B); 0 for a model without a shape."""
    if not spec.has_shape:
        return 0
    return spec.layers * 4 * seq * spec.q_dim


def activation_bytes(spec: ModelSpec, micro_batch: int, seq: int, precision: str, recompute: str,
                     tp: int = 1) -> Optional[int]:
    """Activation memory of one micro-batch held for the backward pass, in bytes.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198), Section 4.1: per layer ``s·b·h·(34 + 5·a·s/h)`` bytes with 16-bit
    activations and 1-byte dropout masks (eq. 1), from these tensors (per token, 2 bytes
    each unless a mask):

    * attention 11h: the q/k/v input h, Q h and K h (for QKᵀ), V h, the output projection's
      input h, its dropout mask (1 byte) h; plus per head ``5·a·s`` (softmax output 2, its
      dropout mask 1, the dropout's output 2);
    * MLP 19h: the first linear's input h, the GELU's input 4h, the second linear's input 4h,
      the dropout mask h;
    * the two LayerNorms' inputs 4h.

    The same tensors for other blocks: with grouped-query attention K and V are ``kv_dim``
    wide and Q and the attention output ``q_dim`` (``heads · head_dim``); the MLP's are
    ``ffn`` wide; a SwiGLU MLP keeps four of them (gate, up, silu(gate) and the product,
    as autograd saves them for ``down(silu(gate) * up)``; a fused SwiGLU recomputes silu(gate)
    and keeps three) where GELU keeps two. For Megatron's GPT layer (``ffn = 4h``, MHA)
    this is exactly 34·s·b·h + 5·a·s²·b. Dropout masks are counted as in the paper, also for
    blocks trained without dropout.

    Selective recomputation (Section 4.2) drops the ``5·a·s²·b`` attention term; full
    recomputation keeps the layer's input, ``2·s·b·h``. Output side (Section 4.3): the input
    embedding's dropout mask ``s·b·h``, the final norm's and output layer's inputs
    ``4·s·b·h``, fp32 logits ``4·s·b·v``. Everything divided by ``t`` under tensor parallelism
    *with* sequence parallelism (eq. 5; without it the norms' and dropouts' ``10·s·b·h``
    would not be divided). fp32 activations: the 2-byte tensors double, the masks stay.
    Unfused attention: with flash attention the ``5·a·s²·b`` term is not stored, about the
    selective figure without recomputation.
    """
    if not spec.has_shape:
        return None
    s, b, h, a, v = seq, micro_batch, spec.hidden, spec.heads, spec.vocab
    sb = s * b
    word = 4 if precision == "fp32" else 2
    f = spec.ffn
    attn = h + spec.q_dim + 2 * spec.kv_dim + spec.q_dim  # q/k/v input, Q, K and V, o's input
    mlp = h + (2 if spec.arch == "gpt" else 4) * f
    norms = 2 * h
    masks = 2 * h  # attention output and MLP dropout masks, 1 byte each
    if recompute == "full":
        per_layer = word * sb * h
    else:
        per_layer = word * sb * (attn + mlp + norms) + sb * masks
        if recompute != "selective":
            # softmax output, dropout output (2 bytes each in 16-bit), dropout mask (1 byte)
            per_layer += (2 * word + 1) * a * s * s * b
    outside = sb * h + 2 * word * sb * h + 4 * sb * v
    return (spec.layers * per_layer + outside) // tp


# ---------------------------------------------------------------- Hugging Face configs
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
    for key in _MOE_KEYS:
        if cfg.get(key):
            raise PlanError("--hf-config", f"{path}: {key!r} = {cfg[key]!r}: a mixture-of-experts model, which "
                                           "the planner does not count (its blocks hold several MLPs, of which "
                                           "each token uses some)")
    raw_type = cfg.get("model_type")
    if raw_type is None:
        raise PlanError("--hf-config", f"{path} has no 'model_type' (the planner counts "
                                       f"{', '.join(HF_MODEL_TYPES)})")
    model_type = str(raw_type).lower()
    family = HF_MODEL_TYPES.get(model_type)
    if family is None:
        raise PlanError("--hf-config", f"{path}: 'model_type' {raw_type!r} is not one the planner counts "
                                       f"({', '.join(HF_MODEL_TYPES)}); if its blocks are exactly llama's, "
                                       "give the shape instead (--arch llama --layers --hidden --heads "
                                       "--kv-heads --ffn-hidden --vocab --seq)")
    if model_type == "gpt2":
        keys = {"hidden": "n_embd", "layers": "n_layer", "heads": "n_head", "seq": "n_positions",
                "vocab": "vocab_size"}
        arch, ffn_key, kv_key = "gpt", "n_inner", None
    else:
        keys = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
                "seq": "max_position_embeddings", "vocab": "vocab_size"}
        arch, ffn_key, kv_key = "llama", "intermediate_size", "num_key_value_heads"
    values = {}
    for field, key in keys.items():
        values[field] = _positive_int(cfg, key, path, required=True)
    ffn = _positive_int(cfg, ffn_key, path, required=arch == "llama")
    kv = _positive_int(cfg, kv_key, path) if kv_key else None
    optional = family["keys"]
    head_dim = _positive_int(cfg, "head_dim", path) if "head_dim" in optional else None
    if head_dim is None:
        head_dim = family.get("head_dim")
    attention_bias = _flag(cfg, "attention_bias", path) if "attention_bias" in optional else False
    mlp_bias = _flag(cfg, "mlp_bias", path) if "mlp_bias" in optional else False
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        tied = family["tie"]
    elif not isinstance(tied, bool):
        raise PlanError("--hf-config", f"{path}: 'tie_word_embeddings' must be true or false, got {tied!r}")
    spec = ModelSpec(arch=arch, ffn_hidden=ffn, kv_heads=kv, tied=tied, head_dim=head_dim,
                     qkv_bias=bool(family.get("qkv_bias") or attention_bias), out_bias=attention_bias,
                     mlp_bias=mlp_bias, source=f"hf-config ({model_type})", **values)
    try:
        validate(spec)
    except PlanError as exc:
        raise PlanError("--hf-config", f"{path}: {exc}") from None
    return spec


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
