"""Which tensor-parallel implementation the activation figures follow: Megatron-LM's or torchtitan's
(torch's ``parallelize_module``). They split the same tensors but for the inputs of the column-parallel
layers, which they keep differently for the weight gradient.

Note [what a column-parallel layer keeps]
    Under sequence parallelism a rank holds ``1/t`` of the sequence between the blocks' matrix
    products; a column-parallel layer (q/k/v, the MLP's up and gate, the output layer) needs all of it,
    so its input is all-gathered first. Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``
    gathers inside the layer and saves the rank's shard for the weight gradient, gathering it again in
    backward: ``1/t`` of the input kept (Korthikanti et al. 2022, sequence parallelism), the planner's default.
    torch's ``ColwiseParallel`` with a ``Shard(1)`` input (torchtitan's plans: ``PrepareModuleInput``
    from ``Shard(1)`` to ``Replicate()`` on the attention and the feed-forward, the output layer's own
    ``input_layouts=Shard(1)``) redistributes the input before the layer, and autograd saves the
    gathered tensor for the weight gradient: each rank keeps the whole sequence's input, ``s·b·h``, where
    Megatron keeps ``s·b·h / t``; the shard itself is then saved by nothing. So a rank keeps
    ``(t - 1) / t · s·b·h`` elements more for each of a block's two (the attention's and the MLP's) and
    for the output layer's. Full recomputation stores each block's input, a shard under both, and the
    block it recomputes keeps its gathered inputs again.

    torchtitan's DeepSeek-V3 and Llama-4 plans (``apply_non_moe_tp`` and ``apply_moe_ep_tp`` in
    torchtitan/models/{deepseek_v3,llama4}/infra/parallelize.py) keep more whole, per token:

    * latent attention: the attention's input is redistributed to ``Replicate`` once, before the
      module; the down-projections (``wq_a``, ``wkv_a``) and the norms of the compressed queries and
      keys/values (``q_norm``, ``kv_norm``) are ``NoParallel``, run by every rank on the whole
      sequence, and the up-projections (``wq_b``, ``wkv_b``) are ``ColwiseParallel`` on those
      whole rows. So the down-projections' input (``h``, as q/k/v's above), both norms' tensors,
      the up-projections' inputs and, in fp32, ``wkv_a``'s output (Note [what latent attention
      keeps] in latent_bytes.py) stay whole; Q, K, V and ``wo``'s input are split by heads.
    * a mixture of experts: the MoE module's input is all-gathered (``PrepareModuleInputOutput``,
      ``Shard(1)`` to ``Replicate``) and the router is ``NoParallel``: its input (``h``), fp32
      probabilities, top-k indices and weights are whole, where Megatron-Core routes the rank's
      ``1/t`` shard. The routed experts are split by their MLP width (``TensorParallel``, or
      ``ExpertTensorParallel`` over the ep x tp ranks when the experts are also split ``ep`` ways
      within the data-parallel ranks, as the planner's ``--ep`` does) on every gathered token: the
      token-expert pairs are whole as under Megatron-Core (Note [routed tokens under tensor
      parallelism] in routed_bytes.py). The shared expert is ``ColwiseParallel``/``RowwiseParallel``
      on the gathered input; the summed outputs are reduce-scattered back to ``Shard(1)``.

    Not counted, and refused under ``torchtitan``: a gated shared expert (Qwen2-MoE's sigmoid gate,
    which no torchtitan plan places: on gathered tokens its output and the shared expert's partial
    sums would be whole too). torchtitan's other expert-parallel layout, ``ep`` borrowing the
    tensor-parallel ranks (``ReordererSequenceParallel``: the routed pairs split across them), is not
    one the planner's layouts give (its ``ep`` lies within the data-parallel ranks).
"""

from __future__ import annotations

from .errors import PlanError
from .latent_bytes import latent_projection_bytes
from .norm_bytes import latent_norm_bytes
from .routed_bytes import router_bytes

TP_STYLES = ("megatron", "torchtitan")


def check_tp_style(spec, tp_style: str) -> None:
    """Raise :class:`PlanError` for a style the planner does not count for ``spec``."""
    if tp_style not in TP_STYLES:
        raise PlanError("--tp-style", f"unknown tensor-parallel style {tp_style!r} (choose {', '.join(TP_STYLES)})")
    if tp_style == "torchtitan" and spec.has_shape and spec.moe and spec.shared_gate and spec.shared_ffn:
        raise PlanError("--tp-style", "torchtitan's activations are not counted for a gated shared expert "
                                      "(Qwen2-MoE's shared_expert_gate: no torchtitan plan places it; Note [what a "
                                      "column-parallel layer keeps]); use --tp-style megatron")


def gathered_block_inputs(spec, i: int, micro_batch: int, seq: int, precision: str, tp_style: str) -> int:
    """Bytes of block ``i``'s tensors every tensor-parallel rank keeps whole under torchtitan's plans
    beyond Megatron's convention (Note [what a column-parallel layer keeps]): the attention's and the
    MLP's gathered inputs, latent attention's replicated down-projections and norms, a mixture's
    router on the gathered tokens; none under Megatron's."""
    if tp_style == "megatron":
        return 0
    check_tp_style(spec, tp_style)
    word = _word(precision)
    per_token = 2 * word * spec.hidden + latent_norm_bytes(spec, word) + latent_projection_bytes(spec, word)
    if spec.is_moe_block(i):
        per_token += router_bytes(spec)
    return seq * micro_batch * per_token


def gathered_output_input(spec, micro_batch: int, seq: int, precision: str, tp_style: str) -> int:
    """Bytes of the output layer's input every tensor-parallel rank keeps whole (torchtitan's)."""
    if tp_style == "megatron":
        return 0
    check_tp_style(spec, tp_style)
    return _word(precision) * seq * micro_batch * spec.hidden


def _word(precision: str) -> int:
    return 4 if precision == "fp32" else 2
