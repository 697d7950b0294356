"""What a mixture-of-experts block keeps whole on every tensor-parallel rank (Note [routed tokens
under tensor parallelism]): the part of :func:`fusedist.plan.model.activation_bytes` that tensor
parallelism does not divide in an MoE block.

Note [routed tokens under tensor parallelism]
    Megatron-Core, whose sequence parallelism the planner's tensor parallelism follows, runs the
    router on each rank's sequence-parallel shard: the router's input, its fp32 probabilities,
    the top-k indices and weights are ``1/t`` of the tokens'. Its token dispatcher (allgather, or
    alltoall with ``t > 1``) then gathers the tensor-parallel group's tokens before the experts
    (``num_global_tokens = S/t · B · t · ep``), and each rank's experts, split by their MLP width
    (expert tensor parallelism), take every one of them: per token-expert pair the gathered copy
    (the first product's input), the expert's output (partial sums, reduce-scattered after the
    weighting) and its weight are whole on every rank, as are the two int64 sort indices of the
    pairs; only the SwiGLU's four ``expert_ffn``-wide tensors are split ``t`` ways. Per token
    ``k·(2h + 1)`` elements and ``16·k`` bytes stay whole: Mixtral-8x7B's 32 layers at ``t = 8``,
    ``s = 4096``, 4.3 GB of bf16 a rank where ``1/t`` of it was counted. The dispatch is counted as
    an all-gather of the group's tokens (load imbalance between experts is not modelled); the
    shared expert is a dense MLP under sequence parallelism, split as one.
"""

from __future__ import annotations


def routed_pair_bytes(spec, tokens: int, precision: str) -> int:
    """Bytes an MoE block keeps whole on each tensor-parallel rank for ``tokens`` tokens of the
    micro-batch (Note [routed tokens under tensor parallelism]): per token-expert pair the gathered
    copy, the expert's output and its weight in the activations' dtype, and the two int64 sort indices."""
    word = 4 if precision == "fp32" else 2
    return tokens * spec.experts_per_token * (word * (2 * spec.hidden + 1) + 16)


def router_bytes(spec) -> int:
    """Bytes the router keeps per token for backward (fusedist/plan/torch_model.py's Note [routed
    tokens]): its fp32 probabilities, the int64 top-k indices, the fp32 top-k weights and their sum."""
    k = spec.experts_per_token
    return 4 * spec.experts + 8 * k + 4 * k + 4
