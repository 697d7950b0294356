"""Parameter and activation counts of a decoder-only transformer, from its shape or from a
Hugging Face ``config.json`` (read by :mod:`fusedist.plan.hf_config`).

Three block shapes are counted exactly (what :mod:`fusedist.plan.measure` builds):

* ``gpt`` (GPT-2): learned position embeddings, LayerNorm with bias, biased projections,
  GELU MLP of ``ffn_hidden`` (default 4h), input embedding tied to the output layer.
  GPT-2 124M: 124,439,808 parameters.
* ``llama``: rotary positions (no parameters), RMSNorm without bias, bias-free projections,
  grouped-query attention (``kv_heads``), SwiGLU MLP (three matrices), untied output layer
  unless the config ties it. Llama-2-7B: 6,738,415,616 parameters. Variants the Hugging Face
  configs of this family use: a head size other than ``hidden / heads`` (``head_dim``:
  Gemma, Mistral-Nemo), biases on q/k/v (Qwen2), on the attention output (Llama's
  ``attention_bias``) and on the MLP (``mlp_bias``); an RMSNorm over each head's queries and
  keys (``qk_norm``: Qwen3, Gemma-3); norms after the attention and the MLP as well as
  before (``sandwich_norm``: Gemma-2/3); a mixture of experts in place of the MLP
  (``experts``: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3); multi-head latent attention
  (``kv_lora_rank``: DeepSeek-V2/V3, Note [latent attention]); a sliding attention window on
  some blocks (``sliding_window``, ``window_layers``: Mistral, Qwen2/3, Gemma-2/3, Note
  [sliding windows]).
* ``falcon`` (read from Falcon configs only): rotary positions, LayerNorm with bias, one
  fused q/k/v projection with multi-query or grouped key/value heads, GELU MLP of
  ``ffn_hidden`` (default 4h), biases where the config's ``bias`` says; attention and MLP
  side by side from the block's input (``parallel_attn``), through one shared LayerNorm
  (``shared_norm``: Falcon-7B) or one each (Falcon-40B/180B). Falcon-7B: 6,921,720,704.

Note [active parameters]
    A mixture-of-experts block holds ``experts`` SwiGLU MLPs of ``expert_ffn``, a router
    (``Linear(h, experts)``, no bias) and, in Qwen2-MoE, a shared expert of ``shared_ffn``
    with a ``Linear(h, 1)`` gate; each token goes through the router, ``experts_per_token``
    routed experts and the shared one. Memory and communication move every parameter
    (:func:`count_params`); the FLOPs of a token are those of the parameters it goes through
    (:func:`active_params`, which is what the model cards call "activated": Mixtral-8x7B,
    46.7B in all, 12.9B active), less its embedding lookups (Note [lookups are not products]).

Note [lookups are not products]
    The 6Ψ rule charges every parameter 2 forward and 4 backward FLOPs a token, which is what
    a weight in a matrix product costs. An embedding table is read by index: a token's row is
    copied forward and its gradient added back, no products. So the FLOPs count
    :func:`matmul_params`: the active parameters less an untied input embedding and gpt's
    position embedding. A tied table is also the output layer's weight and does that layer's
    2·V·h product a token: it is counted, once. Megatron-LM's FLOP count has the logit layer and
    no input embedding; nanoGPT's MFU estimate leaves the position embedding out. Counting the
    lookups overstated Llama-3-8B's FLOPs by 6.5% (525M of 8.03B) and a small model's by a
    fifth, so a measured MFU could pass 100% (fusedist/plan/measure.py).

Note [latent attention]
    DeepSeek-V2/V3's attention (DeepseekV3Attention in transformers) compresses keys and
    values through ``kv_lora_rank``: ``kv_a_proj_with_mqa`` (h -> kv_lora_rank + rope_head_dim,
    the rotary key part shared by all heads), an RMSNorm of kv_lora_rank, ``kv_b_proj``
    (kv_lora_rank -> heads x (nope + v_head_dim)); queries through ``q_lora_rank`` the same way
    (``q_a_proj``, an RMSNorm, ``q_b_proj`` to heads x head_dim) or one ``q_proj`` when it is
    null; ``o_proj`` from heads x v_head_dim. head_dim is the q/k head, nope + rope. The
    attention scores cost as for heads of head_dim, the product with V as for v_head_dim.
    V3's router bias (``e_score_correction_bias``) is a buffer moved by load statistics, not
    a trained parameter, and its multi-token-prediction layer is not part of the model
    transformers builds: neither is counted.

Note [the recomputed layer]
    Full recomputation (Korthikanti et al., Section 4.2; torch.utils.checkpoint around each
    block) stores only each block's input, ``2·s·b·h`` a layer -- the paper's figure, which
    is the stored part. Backward then reruns one block's forward and holds everything that
    block saves, as if it had not been checkpointed, beside the stored inputs, until its
    backward frees it; blocks are recomputed one at a time, so the peak adds the largest
    block's working set once. With the planner's unfused attention this is large: Llama-3-8B
    at s = 8192, b = 1 stores 2.1 GB of inputs and recomputes a 12 GB layer (about 1.4 GB
    with flash attention, which keeps no s x s tensor). The recomputed block's input is
    counted twice (stored and saved again); the same 2·s·b·h stands for the gradient of
    its output that backward holds meanwhile.

Note [sliding windows]
    A windowed block lets query ``i`` attend keys ``i - w < j <= i`` (transformers'
    ``sliding_window_overlay`` and causal mask in masking_utils.py; Mistral 7B,
    arXiv:2310.06825, Section 2), ``w`` keys at most. The planner charges a full-attention
    query all ``s`` keys, causal mask or not (PaLM, Appendix B: 2·s·d_q per token for QKᵀ,
    the same for the product with V); the same convention charges a windowed query the
    widest span it may attend, ``min(s, w)`` keys -- the causal triangle inside the first
    window counted as PaLM counts the whole one, which block-sparse kernels (FlashAttention-2's
    ``window_size``) skip only in part. A window ``>= s`` is full attention.
    Activation memory does not change: the planner's figure is Megatron's unfused attention
    (Korthikanti et al.), whose softmax, dropout mask and dropout output are ``a·s²·b``
    tensors however the mask is shaped (eager attention materialises the masked scores); a
    flash-style kernel stores neither, windowed or not (about the selective figure).

Note [soft-capping]
    Gemma-2 caps its attention scores before the softmax and its final logits before the
    loss with ``cap · tanh(x / cap)`` (``attn_logit_softcapping``, ``final_logit_softcapping``).
    The divisions and products by the constant keep nothing for backward; tanh keeps its
    output. That is one more ``a·s²·b`` tensor a layer in the activations' dtype beside
    Megatron's softmax and dropout ones (dropped with them under selective recomputation,
    held by the recomputed layer under full), and one more ``s·b·v`` tensor on the output
    side, the 16-bit logits' tanh beside the fp32 ones the loss keeps: at Gemma-2's vocabulary
    of 256,000, 0.5 MB a token in bf16. A flash kernel that caps inside (FlashAttention 2.6's
    ``softcap``) stores no score tensor, capped or not.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .errors import PlanError
from .latent_bytes import latent_projection_bytes
from .norm_bytes import block_norm_bytes, block_norm_weight_bytes, final_norm_bytes, final_norm_weight_bytes
from .routed_bytes import routed_pair_bytes, router_bytes
from .tp_style import gathered_block_inputs, gathered_output_input

ARCHS = ("gpt", "llama")  # the shape flags' --arch
BLOCKS = (*ARCHS, "falcon")  # and what a config.json may give


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
    qk_norm: bool = False  # llama: RMSNorm of head_size on q and on k (Qwen3, Gemma-3)
    sandwich_norm: bool = False  # llama: four norms a block, not two (Gemma-2/3)
    gemma_norm: bool = False  # llama: Gemma's RMSNorm, (1 + weight) in fp32 (Note [what a norm keeps])
    # mixture of experts (llama blocks; Note [active parameters]); experts None: dense MLPs
    experts: Optional[int] = None  # routed experts in an MoE block
    experts_per_token: Optional[int] = None  # routed experts each token goes through (top-k)
    expert_ffn: Optional[int] = None  # each routed expert's MLP width
    shared_ffn: int = 0  # the shared expert's MLP width, 0 for none (Qwen2-MoE)
    shared_gate: bool = False  # Linear(h, 1) gating the shared expert (Qwen2-MoE)
    dense_layers: int = 0  # blocks with a dense MLP of ffn among the MoE ones (Qwen-MoE's mlp_only_layers)
    parallel_attn: bool = False  # falcon: attention and MLP both from the block's input
    kv_lora_rank: Optional[int] = None  # latent attention (Note [latent attention]); None: q/k/v
    q_lora_rank: Optional[int] = None  # latent attention: the queries' rank, None for a full q_proj
    rope_head_dim: int = 0  # latent attention: the rotary part of head_dim
    v_head_dim: Optional[int] = None  # latent attention: the value head size
    shared_norm: bool = False  # falcon: one LayerNorm before both (parallel_attn only)
    dense_ids: Optional[tuple] = None  # which blocks are the dense_layers; None: the first ones (DeepSeek's)
    moe_layer_freq: Optional[int] = None  # DeepSeek's when not 1 (shown: transformers' DeepSeek classes ignore it)
    sliding_window: Optional[int] = None  # keys a windowed block's query attends (Note [sliding windows])
    window_layers: tuple = ()  # the blocks with that window; the others attend every earlier key
    attn_softcap: Optional[float] = None  # cap · tanh(scores / cap) before the softmax (Note [soft-capping])
    final_softcap: Optional[float] = None  # the same on the final logits (Gemma-2)
    params: Optional[int] = None  # given directly (--params)
    source: str = "shape"

    @property
    def has_shape(self) -> bool:
        return self.layers is not None

    @property
    def moe(self) -> bool:
        return self.experts is not None

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def dense_blocks(self) -> frozenset:
        """The blocks whose MLP is dense in a mixture of experts (Qwen-MoE's may be anywhere)."""
        if self.dense_ids is not None:
            return frozenset(self.dense_ids)
        return frozenset(range(self.dense_layers))

    def is_moe_block(self, i: int) -> bool:
        return self.moe and i not in self.dense_blocks

    def attention_keys(self, i: int, seq: int) -> int:
        """Keys a query of block ``i`` is charged for at sequence length ``seq`` (Note [sliding windows])."""
        if self.sliding_window is not None and i in self.window_layers:
            return min(seq, self.sliding_window)
        return seq

    def windowed_layers(self, seq: int) -> int:
        """Blocks whose window is shorter than ``seq``, so that it limits their attention."""
        return sum(1 for i in range(self.layers) if self.attention_keys(i, seq) < seq) if self.has_shape else 0

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
    def o_dim(self) -> int:
        """Width of the values and of the attention output (``q_dim`` but under latent attention)."""
        return self.heads * self.v_head_dim if self.v_head_dim is not None else self.q_dim

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
    if spec.arch not in BLOCKS:
        raise PlanError("--arch", f"unknown architecture {spec.arch!r} (choose {', '.join(ARCHS)})")
    if spec.moe:
        if spec.arch != "llama":
            raise PlanError("--arch", "mixtures of experts are counted with llama blocks")
        for name in ("experts", "experts_per_token", "expert_ffn"):
            if not (getattr(spec, name) or 0) > 0:
                raise PlanError(name, f"must be positive, got {getattr(spec, name)}")
        if spec.experts_per_token > spec.experts:
            raise PlanError("experts_per_token", f"{spec.experts_per_token} routed experts a token of "
                                                 f"{spec.experts} in all")
        if not 0 <= spec.dense_layers <= spec.layers:
            raise PlanError("dense_layers", f"{spec.dense_layers} of {spec.layers} layers")
    if spec.dense_ids is not None and (len(set(spec.dense_ids)) != spec.dense_layers
                                       or not all(0 <= i < spec.layers for i in spec.dense_ids)):
        raise PlanError("dense_ids", f"{spec.dense_ids} are not {spec.dense_layers} distinct blocks of {spec.layers}")
    if spec.sliding_window is not None and not spec.sliding_window > 0:
        raise PlanError("sliding_window", f"must be positive, got {spec.sliding_window}")
    for name in ("attn_softcap", "final_softcap"):
        if getattr(spec, name) is not None and not getattr(spec, name) > 0:
            raise PlanError(name, f"must be positive, got {getattr(spec, name)}")
    if not all(0 <= i < spec.layers for i in spec.window_layers):
        raise PlanError("window_layers", f"{spec.window_layers} are not blocks of {spec.layers}")


def _attention_params(spec: ModelSpec) -> int:
    h, q_dim, kv_dim = spec.hidden, spec.q_dim, spec.kv_dim
    if spec.arch == "gpt":
        return h * (q_dim + 2 * kv_dim) + (q_dim + 2 * kv_dim) + q_dim * h + h  # fused qkv + out, with biases
    if spec.kv_lora_rank is not None:  # Note [latent attention]
        r, qr, rope = spec.kv_lora_rank, spec.q_lora_rank, spec.rope_head_dim
        q = (h + 1 + q_dim) * qr + qr * spec.qkv_bias if qr else h * q_dim  # q_a, its norm, q_b; or q_proj
        kv = (h + spec.qkv_bias) * (r + rope) + r  # kv_a (the rotary key part too) and its norm
        kv += r * spec.heads * (spec.head_size - rope + spec.v_head_dim)  # kv_b: k's other part and v
        return q + kv + spec.o_dim * h + h * spec.out_bias
    attn = h * (q_dim + 2 * kv_dim) + q_dim * h  # q, k, v, o
    attn += (q_dim + 2 * kv_dim) * spec.qkv_bias + h * spec.out_bias
    return attn + 2 * spec.head_size * spec.qk_norm  # q_norm, k_norm: one weight of head_size each


def _swiglu_params(h: int, f: int, bias: bool = False) -> int:
    return 3 * h * f + (2 * f + h) * bias  # gate, up, down


def _moe_params(spec: ModelSpec, routed: int) -> int:
    """An MoE block's MLP with ``routed`` of its experts (Note [active parameters])."""
    h = spec.hidden
    shared = _swiglu_params(h, spec.shared_ffn) + h * spec.shared_gate if spec.shared_ffn else 0
    return h * spec.experts + routed * _swiglu_params(h, spec.expert_ffn) + shared


def layer_params(spec: ModelSpec, active: bool = False) -> int:
    """Parameters of one transformer block; of an MoE model, its MoE block (the largest), with
    only the experts a token goes through when ``active``."""
    h, f = spec.hidden, spec.ffn
    if spec.arch == "gpt":
        return _attention_params(spec) + h * f + f + f * h + h + 2 * 2 * h  # two LayerNorms, weight and bias
    if spec.arch == "falcon":
        mlp = 2 * h * f + (f + h) * spec.mlp_bias
        return _attention_params(spec) + mlp + (1 if spec.shared_norm else 2) * 2 * h  # LayerNorms with bias
    if spec.moe:
        mlp = _moe_params(spec, spec.experts_per_token if active else spec.experts)
    else:
        mlp = _swiglu_params(h, f, spec.mlp_bias)
    return _attention_params(spec) + mlp + (4 if spec.sandwich_norm else 2) * h  # RMSNorms, weight only


def expert_params(spec: ModelSpec) -> int:
    """Ψ_e: the routed experts' parameters, what expert parallelism splits. The router and a
    shared expert stay with the dense parameters, replicated on every rank of the expert
    group, as Megatron-Core's TopKRouter and SharedExpertMLP are."""
    if not spec.has_shape or not spec.moe:
        return 0
    return spec.moe_layers * spec.experts * _swiglu_params(spec.hidden, spec.expert_ffn)


def _all_layers(spec: ModelSpec, active: bool) -> int:
    total = spec.layers * layer_params(spec, active)
    if spec.moe and spec.dense_layers:  # those blocks' MLP is a dense one of ffn
        dense = _swiglu_params(spec.hidden, spec.ffn, spec.mlp_bias)
        total += spec.dense_layers * (dense - _moe_params(spec, spec.experts_per_token if active else spec.experts))
    return total


def embedding_params(spec: ModelSpec) -> int:
    """Input embedding, position embedding (gpt), final norm and an untied output layer."""
    h, v = spec.hidden, spec.vocab
    n = v * h
    if spec.arch == "gpt":
        n += spec.seq * h + 2 * h
    else:
        n += 2 * h if spec.arch == "falcon" else h  # LayerNorm with bias, or RMSNorm
    if not spec.tied_embeddings:
        n += v * h
    return n


def count_params(spec: ModelSpec) -> int:
    """Ψ: every trainable parameter, counted once (tied weights once)."""
    if not spec.has_shape:
        return int(spec.params)
    return _all_layers(spec, active=False) + embedding_params(spec)


def active_params(spec: ModelSpec) -> int:
    """The parameters one token goes through, which set its FLOPs: :func:`count_params` but for
    the routed experts it is not sent to (Note [active parameters])."""
    if not spec.has_shape:
        return int(spec.params)
    return _all_layers(spec, active=True) + embedding_params(spec)


def lookup_params(spec: ModelSpec) -> int:
    """Parameters a token reads by index, not through a matrix product: an untied input
    embedding and gpt's position embedding (Note [lookups are not products])."""
    if not spec.has_shape:
        return 0
    n = 0 if spec.tied_embeddings else spec.vocab * spec.hidden
    if spec.arch == "gpt":
        n += spec.seq * spec.hidden
    return n


def matmul_params(spec: ModelSpec) -> int:
    """The active parameters that multiply a token's activations, which set its FLOPs (6 a
    token in training): :func:`active_params` less :func:`lookup_params`. A model given by
    --params alone has no shape: all of them."""
    return active_params(spec) - lookup_params(spec)


def attention_flops_per_token(spec: ModelSpec, seq: int) -> int:
    """Forward FLOPs of the attention scores per token: QKᵀ and the product with V, each
    ``2·keys·d_q`` per layer with ``keys = s`` (PaLM, Appendix B; the second
    ``2·keys·heads·v_head_dim`` under latent attention), ``min(s, w)`` in a windowed block
    (Note [sliding windows]); 0 for a model without a shape."""
    if not spec.has_shape:
        return 0
    keys = sum(spec.attention_keys(i, seq) for i in range(spec.layers))
    return 2 * keys * (spec.q_dim + spec.o_dim)


def activation_bytes(spec: ModelSpec, micro_batch: int, seq: int, precision: str, recompute: str,
                     tp: int = 1, loss_parallel: bool = True, tp_style: str = "megatron") -> Optional[int]:
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
    * the two LayerNorms' inputs 4h (an RMSNorm keeps more: its fp32 rows, the normalised rows
      and an fp32 ``rstd``, Note [what a norm keeps] in fusedist/plan/norm_bytes.py).

    The same tensors for other blocks: with grouped-query attention K and V are ``kv_dim``
    wide and Q and the attention output ``q_dim`` (``heads · head_dim``); the MLP's are
    ``ffn`` wide; a SwiGLU MLP keeps four of them (gate, up, silu(gate) and the product,
    as autograd saves them for ``down(silu(gate) * up)``; a fused SwiGLU recomputes silu(gate)
    and keeps three) where GELU keeps two. For Megatron's GPT layer (``ffn = 4h``, MHA)
    this is exactly 34·s·b·h + 5·a·s²·b. Dropout masks are counted as in the paper, also for
    blocks trained without dropout.

    Selective recomputation (Section 4.2) drops the ``5·a·s²·b`` attention term; full
    recomputation stores the layer's input, ``2·s·b·h``, and at its peak also holds the one
    layer being recomputed, the largest block's figure without recomputation (Note [the
    recomputed layer]; :func:`recomputed_layer_bytes`). Output side (Section 4.3): the input
    embedding's dropout mask ``s·b·h``, the final norm's and output layer's inputs
    ``4·s·b·h``, fp32 logits ``4·s·b·v``. Everything divided by ``t`` under tensor parallelism
    *with* sequence parallelism (eq. 5; without it the norms' and dropouts' ``10·s·b·h``
    would not be divided), but for Gemma's fp32 ``1 + weight``, which each rank computes from
    its whole replicated norm weight (:func:`tp_share`), for a mixture's routed token-expert pairs
    (Note [routed tokens under tensor parallelism]) and, without ``loss_parallel`` (a vocabulary-
    parallel loss: Megatron's, torchtitan's ``loss_parallel``), for the logits, which each rank then
    holds whole (:func:`logit_bytes`), and under torchtitan's ``tp_style`` for the column-parallel layers'
    gathered inputs (Note [what a column-parallel layer keeps] in tp_style.py). fp32 activations: the 2-byte tensors
    double, the masks (and an RMSNorm's fp32 rows and rstd) stay.
    Unfused attention: with flash attention the ``5·a·s²·b`` term is not stored, about the
    selective figure without recomputation. Per token, a mixture-of-experts block keeps the
    router's fp32 probabilities, the routing's indices and weights and, for each routed
    expert it goes to, its copy of the input, the SwiGLU's four tensors and the expert's
    output (and the shared expert's four; :func:`_moe_mlp_tensors`); q/k norms, sandwich
    norms and latent attention's two norms keep what a norm keeps, Gemma's norms also an fp32
    ``1 + weight`` each a micro-batch; latent attention's up-projections keep their inputs,
    the normalised compressed queries and keys/values (Note [what latent attention keeps] in
    latent_bytes.py); soft-capping keeps tanh's output (Note [soft-capping]).
    """
    if not spec.has_shape:
        return None
    b, s = micro_batch, seq
    dense, moe = _block_bytes(spec, b, s, precision, recompute)
    layers = spec.layers * dense + (spec.moe_layers * (moe - dense) if spec.moe else 0)
    outside = input_side_bytes(spec, b, s) + output_side_bytes(spec, b, s, precision)
    whole = sum(block_whole_bytes(spec, i, b, s, precision, recompute, tp_style) for i in range(spec.layers))
    whole += output_whole_bytes(spec, b, s, precision, loss_parallel, tp_style)
    return (tp_share(layers + outside, whole, tp)
            + recomputed_layer_bytes(spec, b, s, precision, recompute, tp, tp_style))


def tp_share(nbytes: int, whole: int, tp: int) -> int:
    """A tensor-parallel rank's part of ``nbytes`` saved activations, of which ``whole`` every rank
    keeps in full: the rest is split ``tp`` ways (sequence-parallel norms and dropouts, heads and MLP
    columns), while a replicated norm weight's fp32 ``1 + weight`` is not (Note [what a norm keeps])."""
    return (nbytes - whole) // tp + whole


def block_whole_bytes(spec: ModelSpec, i: int, micro_batch: int, seq: int, precision: str, recompute: str,
                      tp_style: str = "megatron") -> int:
    """What block ``i`` keeps for backward that tensor parallelism does not split: Gemma's fp32
    ``1 + weight`` of each norm, a mixture's routed token-expert pairs (Note [routed tokens under
    tensor parallelism]) and what torchtitan's plans keep whole: the gathered inputs, latent attention's
    replicated down-projections and norms, the router on the gathered tokens (Note [what a column-parallel
    layer keeps] in tp_style.py); none stored under full recomputation, which keeps the block's input."""
    if recompute == "full":
        return 0
    pairs = routed_pair_bytes(spec, micro_batch * seq, precision) if spec.is_moe_block(i) else 0
    return block_norm_weight_bytes(spec) + pairs + gathered_block_inputs(spec, i, micro_batch, seq, precision,
                                                                                    tp_style)


def output_whole_bytes(spec: ModelSpec, micro_batch: int, seq: int, precision: str, loss_parallel: bool,
                       tp_style: str = "megatron") -> int:
    """What the last stage keeps whole on each tensor-parallel rank: Gemma's final fp32 ``1 + weight``,
    without a vocabulary-parallel loss the logits (:func:`logit_bytes`), and under torchtitan's style
    the output layer's gathered input (Note [what a column-parallel layer keeps] in tp_style.py)."""
    logits = 0 if loss_parallel else logit_bytes(spec, micro_batch, seq, precision)
    return final_norm_weight_bytes(spec) + logits + gathered_output_input(spec, micro_batch, seq, precision, tp_style)


def block_activation_bytes(spec: ModelSpec, i: int, micro_batch: int, seq: int, precision: str,
                           recompute: str) -> int:
    """What block ``i`` keeps for backward of one micro-batch (its share of :func:`activation_bytes`,
    before tensor parallelism): a pipeline stage holds its own blocks' (fusedist/plan/pipeline.py)."""
    dense, moe = _block_bytes(spec, micro_batch, seq, precision, recompute)
    return moe if spec.is_moe_block(i) else dense


def input_side_bytes(spec: ModelSpec, micro_batch: int, seq: int) -> int:
    """The input embedding's dropout mask, ``s·b·h`` bytes (Korthikanti et al., Section 4.3):
    the first pipeline stage's."""
    return seq * micro_batch * spec.hidden


def output_side_bytes(spec: ModelSpec, micro_batch: int, seq: int, precision: str) -> int:
    """The final norm's tensors, the output layer's input and the fp32 logits, ``4·s·b·h + 4·s·b·v``
    in 16-bit under a LayerNorm (Section 4.3; an RMSNorm keeps more, Note [what a norm keeps]):
    the last pipeline stage's."""
    word = 4 if precision == "fp32" else 2
    sb = seq * micro_batch
    once = final_norm_weight_bytes(spec)  # Gemma's fp32 1 + weight (Note [what a norm keeps])
    logits = logit_bytes(spec, micro_batch, seq, precision)
    return sb * (final_norm_bytes(spec, word) + word * spec.hidden) + logits + once


def logit_bytes(spec: ModelSpec, micro_batch: int, seq: int, precision: str) -> int:
    """The loss's fp32 logits, ``4·s·b·v``, and under soft-capping tanh's output in the activations'
    dtype (Note [soft-capping]): split by vocabulary under a vocabulary-parallel loss, whole on each
    tensor-parallel rank whose output layer gathers them (torchtitan without ``loss_parallel``)."""
    word = 4 if precision == "fp32" else 2
    capped = word if spec.final_softcap is not None else 0
    return seq * micro_batch * spec.vocab * (4 + capped)


def recomputed_layer_bytes(spec: ModelSpec, micro_batch: int, seq: int, precision: str, recompute: str,
                           tp: int = 1, tp_style: str = "megatron") -> int:
    """The part of :func:`activation_bytes` that is not stored: under full recomputation the
    working set of the one layer backward recomputes, the largest of the model's blocks as it
    keeps them without recomputation (Note [the recomputed layer]); 0 otherwise."""
    if recompute != "full" or not spec.has_shape:
        return 0
    dense, moe = _block_bytes(spec, micro_batch, seq, precision, "none")
    # the first block of each kind the model has: a mixture may have no dense block
    kinds = {spec.is_moe_block(i): i for i in reversed(range(spec.layers))}
    return max(tp_share(moe if is_moe else dense,
                        block_whole_bytes(spec, i, micro_batch, seq, precision, "none", tp_style), tp)
               for is_moe, i in kinds.items())


def _block_bytes(spec: ModelSpec, b: int, s: int, precision: str, kept: str) -> tuple:
    """Bytes one dense block and one mixture-of-experts block (None in a dense model) keep
    for backward with recomputation ``kept``; :func:`activation_bytes` says which tensors."""
    sb, h, a = s * b, spec.hidden, spec.heads
    word = 4 if precision == "fp32" else 2
    v_dim = spec.o_dim if spec.kv_lora_rank is not None else spec.kv_dim  # latent attention: V per head
    attn = h + spec.q_dim + spec.kv_dim + v_dim + spec.o_dim  # q/k/v input, Q, K, V and o's input
    norms = block_norm_bytes(spec, word)  # the norms' tensors, q/k norms' too (Note [what a norm keeps])
    norms += latent_projection_bytes(spec, word)  # q_b's and kv_b's inputs (Note [what latent attention keeps])
    once = block_norm_weight_bytes(spec)  # Gemma's fp32 1 + weight, once a forward (Note [what a norm keeps])
    masks = 2 * h  # attention output and MLP dropout masks, 1 byte each

    def per_layer(mlp, other=0):
        if kept == "full":
            return word * sb * h
        n = word * sb * (attn + mlp) + sb * (norms + masks + other) + once
        if kept != "selective":
            # softmax output, dropout output (2 bytes each in 16-bit), dropout mask (1 byte)
            n += (2 * word + 1) * a * s * s * b
            n += word * a * s * s * b * (spec.attn_softcap is not None)  # tanh's output (Note [soft-capping])
        return n

    dense = per_layer(h + (4 if spec.arch == "llama" else 2) * spec.ffn)  # SwiGLU keeps four, GELU two
    if not spec.moe:
        return dense, None
    return dense, per_layer(*_moe_mlp_tensors(spec))


def _moe_mlp_tensors(spec: ModelSpec) -> tuple:
    """What an MoE block's MLP keeps for backward per token (fusedist/plan/torch_model.py's Note
    [routed tokens], the tensors of Mixtral's and Megatron-Core's routing): elements of the
    activations' dtype, and bytes of fixed-width tensors (fp32 router probabilities, top-k
    weights and their sum; int64 top-k and sort indices)."""
    h, k = spec.hidden, spec.experts_per_token
    # the input; per token-expert pair its gathered copy, the SwiGLU's four, the expert's output
    # and its weight; the shared expert's four, and under a gate its output and the gate's sigmoid
    mlp = h + k * (2 * h + 4 * spec.expert_ffn + 1) + 4 * spec.shared_ffn
    mlp += (h + 1) * (spec.shared_gate and bool(spec.shared_ffn))
    return mlp, router_bytes(spec) + 16 * k  # and the pairs' two int64 sort indices
