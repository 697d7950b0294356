"""Bytes latent attention keeps for backward per token beyond Megatron's attention tensors
(Note [what latent attention keeps]): the part of :func:`fusedist.plan.model.activation_bytes`
that only DeepSeek-V2/V3's projections add.

Note [what latent attention keeps]
    DeepseekV3Attention in transformers (V2's is the same) compresses its keys and values, and
    its queries when ``q_lora_rank`` is set, before projecting them to the heads (Note [latent
    attention] in model.py). Beside Megatron's tensors (the projections' shared input, Q, K, V
    and the output projection's input) and the two RMSNorms' own (Note [what a norm keeps] in
    norm_bytes.py), autograd keeps, per token:

    * ``q_b_proj``'s input, the normalised compressed queries: ``q_lora_rank`` elements in the
      activations' dtype (none when one ``q_proj`` takes the block's normalised input, which
      Megatron's figure already holds);
    * ``kv_b_proj``'s input, the normalised compressed keys/values: ``kv_lora_rank`` elements;
    * in fp32 only, the rotary columns of ``kv_a_proj_with_mqa``'s output: the norm's upcast is
      then no copy, and the rows it keeps are a slice of that output, whose storage, rotary key
      part (``rope_head_dim``) included, stays until backward: ``4·rope_head_dim`` bytes. In
      16-bit the norm keeps its own fp32 copy and nothing holds that output.
"""

from __future__ import annotations

_FP32 = 4


def latent_projection_bytes(spec, word: int) -> int:
    """Bytes latent attention's projections keep per token in one block beyond Megatron's
    tensors and the norms' (Note [what latent attention keeps]); 0 without latent attention."""
    if spec.kv_lora_rank is None:
        return 0
    inputs = word * (spec.kv_lora_rank + (spec.q_lora_rank or 0))
    rotary = _FP32 * spec.rope_head_dim if word == _FP32 else 0
    return inputs + rotary
