"""Bytes a model's norms keep for backward, per token (Note [what a norm keeps]): the part of
:func:`fusedist.plan.model.activation_bytes` that differs between LayerNorm and RMSNorm.

Note [what a norm keeps]
    RMSNorm as transformers writes it for Llama, Mistral, Qwen and DeepSeek (and as the model
    ``--measure`` trains has it, fusedist/plan/torch_model.py's ``RMSNorm``): the rows upcast
    to fp32, ``x · rsqrt(mean(x²) + eps)``, cast back to the activations' dtype, times the
    weight. Autograd keeps the fp32 rows (for the square and the product; in fp32 the upcast
    is the input itself), the fp32 ``rstd`` of each row, and the normalised rows in the
    activations' dtype (for the weight's gradient): ``(4 + word)·width + 4`` bytes a row,
    ``6·h + 4`` a token in bf16 and ``8·h + 4`` in fp32, where the LayerNorm of Korthikanti et
    al. keeps its ``word·h`` input. A q/k norm normalises each head's row: ``heads`` rows a
    token. DeepSeek-V2/V3's latent attention normalises its compressed rows too: an RMSNorm of
    ``q_lora_rank`` (where the queries are compressed) and one of ``kv_lora_rank``, a row of each
    a token (in fp32 the latter's rows are a slice of ``kv_a_proj_with_mqa``'s output, whose
    rotary columns stay with them: Note [what latent attention keeps] in latent_bytes.py).

    Gemma's RMSNorm (transformers' GemmaRMSNorm, and Gemma-2's and Gemma-3's, the same code)
    normalises the fp32 rows, multiplies them by ``1 + weight`` in fp32 and only then casts back:
    autograd keeps the fp32 rows, the fp32 ``rstd`` and the fp32 normalised rows, ``8·width + 4``
    bytes a row in bf16 as in fp32 (``2·h`` more than Llama's in bf16). The product also keeps
    its other factor, the fp32 ``1 + weight`` (``weight.float()`` and the sum keep nothing):
    ``4·width`` bytes each time a norm runs, whatever the tokens, so one copy a norm for each
    micro-batch in flight, counted per block and for the final norm apart from the per-token
    bytes. Tensor parallelism leaves it whole: Megatron's and torch's sequence parallelism
    (``SequenceParallel``) shard the norm's rows by sequence, the q/k norms' by head, and
    replicate its weight, so each of the ``t`` ranks keeps ``4·width`` a norm where the rows are
    ``1/t`` of the tokens' (:func:`fusedist.plan.model.tp_share`).

    torch's ``nn.RMSNorm`` is not what is counted, nor used by --measure: on CUDA it runs a
    fused kernel that keeps the input and ``rstd`` (``2·h + 4`` in bf16), elsewhere its
    composite keeps the fp32 rows, ``rstd`` and the fp32 normalised rows (``8·h + 4`` in bf16
    and fp32), so what it keeps depends on the device.

    LayerNorm (``native_layer_norm`` on every device) keeps its input and a mean and an
    ``rstd`` per row. The two per-row statistics are left out, as the paper leaves them out:
    their width depends on the device (fp32 on CUDA, the input's dtype on CPU) and they are
    8 bytes a token against the input's ``2·h``.
"""

from __future__ import annotations

_FP32 = 4


def rms_norm_bytes(width: int, rows: int, word: int, gemma: bool = False) -> int:
    """Bytes an RMSNorm keeps per token over ``rows`` rows of ``width`` (Note [what a norm keeps]);
    ``gemma``: Gemma's, whose normalised rows stay fp32."""
    kept = _FP32 if gemma else word
    return rows * ((_FP32 + kept) * width + _FP32)


def layer_norm_bytes(width: int, word: int) -> int:
    """Bytes a LayerNorm keeps per token: its input (the per-row statistics left out)."""
    return word * width


def block_norm_bytes(spec, word: int) -> int:
    """Bytes one block's norms keep per token: the two before attention and MLP (one when
    Falcon-7B shares it), Gemma's two after them, the q/k norms over each head and latent
    attention's norms of its compressed queries and keys/values."""
    h = spec.hidden
    count = 4 if spec.sandwich_norm else 1 if spec.shared_norm else 2
    if spec.arch != "llama":
        return count * layer_norm_bytes(h, word)
    gemma = spec.gemma_norm
    n = count * rms_norm_bytes(h, 1, word, gemma)
    if spec.qk_norm:
        n += (rms_norm_bytes(spec.head_size, spec.heads, word, gemma)
              + rms_norm_bytes(spec.head_size, spec.kv, word, gemma))
    return n + latent_norm_bytes(spec, word)


def latent_norm_bytes(spec, word: int) -> int:
    """Bytes latent attention's norms of its compressed keys/values and queries keep per token
    (Note [latent attention] in model.py); 0 without latent attention."""
    if spec.kv_lora_rank is None:
        return 0
    return rms_norm_bytes(spec.kv_lora_rank, 1, word) + (rms_norm_bytes(spec.q_lora_rank, 1, word)
                                                          if spec.q_lora_rank else 0)


def final_norm_bytes(spec, word: int) -> int:
    """Bytes the final norm keeps per token."""
    if spec.arch == "llama":
        return rms_norm_bytes(spec.hidden, 1, word, spec.gemma_norm)
    return layer_norm_bytes(spec.hidden, word)


def block_norm_weight_bytes(spec) -> int:
    """Bytes one block's Gemma norms keep once a forward, not per token: each one's fp32
    ``1 + weight`` (Note [what a norm keeps]); 0 for other norms."""
    if spec.arch != "llama" or not spec.gemma_norm:
        return 0
    count = 4 if spec.sandwich_norm else 2
    return _FP32 * (count * spec.hidden + 2 * spec.head_size * spec.qk_norm)


def final_norm_weight_bytes(spec) -> int:
    """Bytes the final norm keeps once a forward: Gemma's fp32 ``1 + weight``, else nothing."""
    return _FP32 * spec.hidden if spec.arch == "llama" and spec.gemma_norm else 0
