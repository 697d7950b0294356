"""The refusal of a BERT-style encoder's ``config.json``, with the shape that counts it.

The planner models decoders. An encoder's blocks are GPT-2's all the same (q/k/v and output
projections with biases, a GELU MLP of ``intermediate_size`` with biases, two LayerNorms with
biases, learned positions), so ``--arch gpt`` with the config's sizes counts them exactly; what
that shape lacks is named with its size, so the user knows what is left out: the token-type
embeddings (``type_vocab_size x hidden``) and the base model's pooler (``hidden² + hidden``).
The embeddings' LayerNorm stands where GPT-2's final one does (the same ``2·hidden``).
The generic refusal pointed every unknown family at ``--arch llama``, whose SwiGLU MLP has half
as many weights again as a GELU one and whose output layer is untied (bert-base: 160M for 109M).
"""

from __future__ import annotations

from .errors import PlanError
from .model import ModelSpec, count_params

#: model_type values of encoders laid out as BERT (RoBERTa and XLM-R: the same modules, one
#: token type, two more position rows for the padding offset -- in max_position_embeddings).
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
# BertConfig's default for the one key released configs may leave out.
_DEFAULT_TYPE_VOCAB = 2


def refuse_encoder(cfg: dict, path: str, model_type: str, positive_int) -> None:
    """Raise the :class:`PlanError` for an encoder config: the ``--arch gpt`` shape to give and
    the parameters it leaves out. ``positive_int(cfg, key, path, required)`` reads a key."""
    keys = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
            "ffn-hidden": "intermediate_size", "vocab": "vocab_size", "seq": "max_position_embeddings"}
    shape = {flag: positive_int(cfg, key, path, True) for flag, key in keys.items()}
    types = positive_int(cfg, "type_vocab_size", path, False) or _DEFAULT_TYPE_VOCAB
    h = shape["hidden"]
    flags = " ".join(f"--{flag} {value}" for flag, value in shape.items())
    counted = gpt_shape_params(**{k.replace("-", "_"): v for k, v in shape.items()})
    token_types, pooler = types * h, h * h + h
    raise PlanError("--hf-config", f"{path}: 'model_type' {model_type!r} is an encoder, which the planner does not "
                                   f"read from a config; its blocks are GPT-2's, so give the shape instead: "
                                   f"--arch gpt {flags}. That counts {counted:,} parameters; the base model adds "
                                   f"{token_types:,} of token-type embeddings (type_vocab_size x hidden) and "
                                   f"{pooler:,} of pooler (hidden^2 + hidden), {counted + token_types + pooler:,} "
                                   f"in all (--params {counted + token_types + pooler} plans its memory "
                                   "without activations)")


def gpt_shape_params(layers: int, hidden: int, heads: int, ffn_hidden: int, vocab: int, seq: int) -> int:
    """What ``--arch gpt`` counts for this shape (tied output layer), to quote in the refusal."""
    return count_params(ModelSpec(arch="gpt", layers=layers, hidden=hidden, heads=heads, ffn_hidden=ffn_hidden,
                                  vocab=vocab, seq=seq))
