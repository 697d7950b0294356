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

    Counted for dense attention and MLP blocks. torchtitan's mixture-of-experts and latent-attention
    plans gather more than these inputs (the router runs on the gathered tokens; latent attention's
    down-projections and norms are replicated), which is not counted: ``torchtitan`` refuses such models.
"""

from __future__ import annotations

from .errors import PlanError

TP_STYLES = ("megatron", "torchtitan")


def check_tp_style(spec, tp_style: str) -> None:
    """Raise :class:`PlanError` for a style the planner does not count for ``spec``."""
    if tp_style not in TP_STYLES:
        raise PlanError("--tp-style", f"unknown tensor-parallel style {tp_style!r} (choose {', '.join(TP_STYLES)})")
    if tp_style == "torchtitan" and spec.has_shape and (spec.moe or spec.kv_lora_rank is not None):
        what = "a mixture of experts" if spec.moe else "latent attention"
        raise PlanError("--tp-style", f"torchtitan's activations are counted for dense attention and MLP "
                                      f"blocks, not {what} (Note [what a column-parallel layer keeps]); "
                                      "use --tp-style megatron")


def gathered_block_inputs(spec, micro_batch: int, seq: int, precision: str, tp_style: str) -> int:
    """Bytes of a block's column-parallel inputs (the attention's, the MLP's) every tensor-parallel rank
    keeps whole: none under Megatron's convention, the gathered sequence under torchtitan's."""
    if tp_style == "megatron":
        return 0
    check_tp_style(spec, tp_style)
    return 2 * _word(precision) * seq * micro_batch * spec.hidden


def gathered_output_input(spec, micro_batch: int, seq: int, precision: str, tp_style: str) -> int:
    """Bytes of the output layer's input every tensor-parallel rank keeps whole (torchtitan's)."""
    if tp_style == "megatron":
        return 0
    check_tp_style(spec, tp_style)
    return _word(precision) * seq * micro_batch * spec.hidden


def _word(precision: str) -> int:
    return 4 if precision == "fp32" else 2
