"""The model's parameter tensors one by one, in registration order (what DDP's buckets, ZeRO's
pieces and the optimizer's param groups are made of), where :mod:`fusedist.plan.model` counts
their sum, and what one tensor-parallel rank holds of each.

Note [what tensor parallelism splits]
    Megatron-LM's layers and torchtitan's plans for torch's ``parallelize_module`` split the
    matrices that carry heads or MLP columns and leave the rest whole on every rank:

    * split ``t`` ways: the input embedding (by vocabulary rows, ``RowwiseParallel``) and the
      output layer (``ColwiseParallel``); the q/k/v, MLP-up and latent attention's up-projections
      (``q_b_proj``, ``kv_b_proj``, or a full ``q_proj``) by output columns, their biases with
      them; the attention output and MLP-down projections by input rows; a mixture's stacked
      experts and its shared expert;
    * whole (``Replicate``): every norm's weight and bias (``SequenceParallel`` splits a norm's
      rows, not its parameters; the q/k norms see the heads their rank holds, with the whole
      weight), the biases of the row-split projections (added once, after the reduction), GPT's
      position embedding (Megatron's ``LanguageModelEmbedding``), latent attention's
      down-projections and their norms (``wq_a``, ``wkv_a``, ``q_norm``, ``kv_norm``:
      ``NoParallel`` in torchtitan's DeepSeek-V3 plan, ``duplicated`` in Megatron-Core), a
      mixture's router (``NoParallel``; Megatron-Core's TopKRouter) and Qwen2-MoE's one-column
      shared-expert gate.

    A rank's parameters are then ``(Ψ - Ψ_whole) / t + Ψ_whole``. DeepSeek-V3's whole ones (its
    down-projections, their norms and its routers) are 1.03B of its 671B: ``Ψ / t`` left 0.90B of
    them out of each of 8 ranks, 14.4 GB of mixed-precision Adam's 16 bytes a parameter; a dense
    model's norms and biases are a few MB.
"""

from __future__ import annotations


class Vector(int):
    """The elements of a one-dimensional parameter (a norm's weight, a bias): the tensors the usual
    no-weight-decay param group holds (:func:`param_tensors`)."""

    __slots__ = ()  # no instance dict, so that :class:`WholeVector` may derive from it and Whole


class Whole(int):
    """The elements of a parameter every tensor-parallel rank holds whole (Note [what tensor
    parallelism splits])."""

    __slots__ = ()


class WholeVector(Whole, Vector):
    """A one-dimensional parameter every tensor-parallel rank holds whole: a norm's weight or bias,
    a row-split projection's bias."""

    __slots__ = ()


def on_tp_rank(elements: int, tp: int) -> int:
    """Elements of a parameter tensor the fullest of ``tp`` ranks holds: the first ranks of an
    uneven split hold one row more (torch's ``Shard``), a :class:`Whole` one all of it."""
    return int(elements) if isinstance(elements, Whole) else -(-elements // tp)


def split_elements(tensors, tp: int) -> float:
    """What one of ``tp`` ranks holds of ``tensors`` together, the split ones' share exactly
    (the fullest rank's one row more left out, as ``Ψ / t`` leaves it out)."""
    whole = sum(int(t) for t in tensors if isinstance(t, Whole))
    return (sum(int(t) for t in tensors) - whole) / tp + whole


def param_tensors(spec, ep: int = 1) -> list:
    """Elements of each parameter tensor, in the order fusedist/plan/torch_model.py registers
    them: DDP's gradient buckets take them last to first, and a bucket closes only once it
    reaches its cap, the tensor that crosses it included (Note [buckets close as torch's do] in
    fusedist/ddp/layout.py), so the buckets' sizes follow from this list and the cap. A mixture
    of experts' routed experts are stacked, one gate-and-up and one down tensor a block (as
    torch_model.py and transformers 5 hold them; ``experts / ep`` of them on a rank), not a
    tensor per expert (transformers 4): a stacked tensor is a bucket of its own, 1.9 GB of
    bf16 gradients a Mixtral-8x7B layer, which one expert's tensors counted as 0.23 GB. The
    one-dimensional tensors are :class:`Vector` s, those tensor parallelism leaves whole
    :class:`Whole` s (Note [what tensor parallelism splits])."""
    out = root_tensors(spec, before_blocks=True)
    for i in range(spec.layers):
        out += block_tensors(spec, i, ep)
    return out + root_tensors(spec, before_blocks=False)


def root_tensors(spec, before_blocks: bool) -> list:
    """The tensors outside the blocks: the embeddings registered before them, or the final norm
    and an untied output layer after them."""
    h = spec.hidden
    if before_blocks:
        return [spec.vocab * h] + ([Whole(spec.seq * h)] if spec.arch == "gpt" else [])
    return _norm(spec) + ([] if spec.tied_embeddings else [spec.vocab * h])


def _norm(spec) -> list:
    """RMSNorm: weight; LayerNorm: weight and bias."""
    n = WholeVector(spec.hidden)
    return [n] if spec.arch == "llama" else [n, n]


# how tensor parallelism splits a projection: by output columns (its bias too), by input rows (its bias
# whole), or not at all
_COLUMNS, _ROWS, _WHOLE = "columns", "rows", "whole"


def _linear(fan_in: int, fan_out: int, bias: bool, split: str) -> list:
    weight = Whole(fan_in * fan_out) if split == _WHOLE else fan_in * fan_out
    if not bias:
        return [weight]
    return [weight, Vector(fan_out) if split == _COLUMNS else WholeVector(fan_out)]


def block_tensors(spec, i: int, ep: int = 1) -> list:
    """Block ``i``'s tensors in torch_model.Block's order (norms, attention, experts, MLP)."""
    h, f, gpt = spec.hidden, spec.ffn, spec.arch == "gpt"
    norm = _norm(spec)
    t = (norm * (1 if spec.shared_norm else 2) + norm * 2 * spec.sandwich_norm
         + [WholeVector(spec.head_size)] * 2 * spec.qk_norm)
    if spec.kv_lora_rank is not None:  # Note [latent attention] in model.py
        r, qr, rope = spec.kv_lora_rank, spec.q_lora_rank, spec.rope_head_dim
        t += (_linear(h, qr, spec.qkv_bias, _WHOLE) + [WholeVector(qr)] + _linear(qr, spec.q_dim, False, _COLUMNS)
              if qr else _linear(h, spec.q_dim, False, _COLUMNS))
        t += _linear(h, r + rope, spec.qkv_bias, _WHOLE) + [WholeVector(r)]
        t += _linear(r, spec.heads * (spec.head_size - rope + spec.v_head_dim), False, _COLUMNS)
    else:
        t += _linear(h, spec.q_dim + 2 * spec.kv_dim, gpt or spec.qkv_bias, _COLUMNS)
    t += _linear(spec.o_dim, h, gpt or spec.out_bias, _ROWS)
    moe = spec.is_moe_block(i)
    if moe:
        e, fe = spec.experts // ep, spec.expert_ffn
        # stacked gate-and-up and down, then the router: a module's own parameters come before its children's
        t += [e * h * 2 * fe, e * fe * h, Whole(h * spec.experts)]
        t += [h * 2 * spec.shared_ffn, spec.shared_ffn * h] if spec.shared_ffn else []
        t += [Whole(h)] if spec.shared_gate else []
    if spec.arch != "llama":
        t += _linear(h, f, gpt or spec.mlp_bias, _COLUMNS) + _linear(f, h, gpt or spec.mlp_bias, _ROWS)
    elif not moe:
        t += _linear(h, 2 * f, spec.mlp_bias, _COLUMNS) + _linear(f, h, spec.mlp_bias, _ROWS)
    return t
