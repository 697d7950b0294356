"""Activation memory of a pipeline-parallel stage: its share of the layers times the micro-batches
whose activations it holds at once under the schedule.

Note [activations under pipeline parallelism]
    Without pipelining, gradient accumulation runs one micro-batch's forward and backward at a
    time: one micro-batch's activations. A pipeline of ``p`` stages (contiguous, equal runs of
    the ``L`` blocks: ``L / p`` each) keeps several micro-batches in flight on a stage, each
    holding what the stage's blocks save for backward until its backward runs:

    * 1F1B (PipeDream-Flush; Megatron-LM's and torch's ``Schedule1F1B``): stage ``i`` runs
      ``p - i - 1`` warm-up forwards, then alternates one forward and one backward, so it holds
      ``min(p - i, m)`` of the ``m`` micro-batches. The first stage holds the most: ``p`` micro-
      batches of ``L / p`` blocks, as much as the whole model's blocks for one micro-batch
      (Korthikanti et al. 2022, arXiv:2205.05198, Section 4.2.3), plus ``p`` copies of the input
      embedding's dropout mask; with fewer micro-batches than stages, ``m / p`` of it (Megatron's
      memory estimator, ``theoretical_memory_usage.py``), which torch's ``Schedule1F1B`` refuses
      to run (a ValueError: :func:`schedule_refusal`), so the layout search skips it. The last
      stage holds one micro-batch, with the output layer's inputs and fp32 logits.
    * GPipe (all forwards, then all backwards; torch's ``ScheduleGPipe``): every stage holds all
      ``m`` micro-batches, its blocks' and its side's (embedding mask, or output layer).

    * Interleaved 1F1B (torch's ``ScheduleInterleaved1F1B``, ``v`` stages a rank): the chunks a
      rank holds at its peak follow torch's own order (Note [interleaved 1F1B as torch runs it]
      in interleaved.py), the first rank about ``1 + (p - 1) / (p·v)`` times 1F1B's.

    The figure is the largest stage's. Under full recomputation a stage stores its blocks' inputs
    per micro-batch in flight and recomputes one block at a time, whose working set is added once.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional

from . import interleaved
from .memory import param_bytes
from .model import (ModelSpec, block_activation_bytes, block_whole_bytes, input_side_bytes, output_side_bytes,
                    output_whole_bytes, recomputed_layer_bytes)

SCHEDULES = ("1f1b", "gpipe", "interleaved")


def in_flight(stage: int, pp: int, micro_batches: int, schedule: str, virtual: int = 1) -> int:
    """Micro-batches whose activations stage ``stage`` of ``pp`` holds at once; interleaved: the
    chunks (a micro-batch on one of its ``virtual`` stages) rank ``stage`` holds."""
    if schedule == "interleaved":
        return interleaved.in_flight(stage, pp, virtual, micro_batches)
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(pp - stage, micro_batches)
    raise ValueError(f"unknown pipeline schedule {schedule!r} (one of {', '.join(SCHEDULES)})")


def stage_blocks(layers: int, pp: int, stage: int) -> range:
    """The blocks of stage ``stage``: contiguous runs, as even as ``layers`` allows."""
    return range(layers * stage // pp, layers * (stage + 1) // pp)


def _chunk_bytes(spec: ModelSpec, b: int, s: int, precision: str, recompute: str, stages: int, stage: int,
                 tp: int, loss_parallel: bool = True, tp_style: str = "megatron") -> Fraction:
    """What stage ``stage`` of ``stages`` saves for one micro-batch on one of ``tp`` tensor-parallel
    ranks: its blocks and its side, split as :func:`fusedist.plan.model.tp_share` splits them
    (exactly: a rank's peak sums several micro-batches before the one rounding)."""
    blocks = stage_blocks(spec.layers, stages, stage)
    one = sum(block_activation_bytes(spec, i, b, s, precision, recompute) for i in blocks)
    whole = sum(block_whole_bytes(spec, i, b, s, precision, recompute, tp_style) for i in blocks)
    if stage == 0:
        one += input_side_bytes(spec, b, s)
    if stage == stages - 1:
        one += output_side_bytes(spec, b, s, precision)
        whole += output_whole_bytes(spec, b, s, precision, loss_parallel, tp_style)
    return Fraction(one - whole, tp) + whole


def stage_activation_bytes(spec: ModelSpec, micro_batch: int, seq: int, precision: str, recompute: str,
                           tp: int, pp: int, micro_batches: int, schedule: str, stage: int, virtual: int = 1,
                           loss_parallel: bool = True, tp_style: str = "megatron") -> int:
    """Bytes stage ``stage`` (interleaved: rank ``stage``, its ``virtual`` stages) keeps for backward
    at its peak (Note [activations under pipeline parallelism]) on one of ``tp`` tensor-parallel
    ranks, split as :func:`fusedist.plan.model.activation_bytes` splits them."""
    b, s = micro_batch, seq
    if schedule == "interleaved":
        def chunk(local: int) -> Fraction:
            return _chunk_bytes(spec, b, s, precision, recompute, pp * virtual, local * pp + stage, tp, loss_parallel,
                                tp_style)
        held = interleaved.peak_held(stage, pp, virtual, micro_batches, chunk)
    else:
        held = (_chunk_bytes(spec, b, s, precision, recompute, pp, stage, tp, loss_parallel, tp_style)
                * in_flight(stage, pp, micro_batches, schedule))
    return math.floor(held) + recomputed_layer_bytes(spec, b, s, precision, recompute, tp, tp_style)


def pipeline_activation_bytes(spec: ModelSpec, micro_batch: int, seq: int, precision: str, recompute: str,
                              tp: int = 1, pp: int = 1, micro_batches: int = 1,
                              schedule: str = "1f1b", virtual: int = 1, loss_parallel: bool = True,
                              tp_style: str = "megatron") -> Optional[int]:
    """The activation bytes of the fullest of ``pp`` stages running ``micro_batches`` micro-batches a
    step under ``schedule`` (``virtual`` stages a rank, interleaved); None without the model's shape. ``pp == 1`` is
    :func:`fusedist.plan.model.activation_bytes` (one micro-batch at a time)."""
    if not spec.has_shape:
        return None
    pp = max(1, min(pp, spec.layers))
    if pp == 1:
        return stage_activation_bytes(spec, micro_batch, seq, precision, recompute, tp, 1, 1, "1f1b", 0,
                                      loss_parallel=loss_parallel, tp_style=tp_style)
    return max(stage_activation_bytes(spec, micro_batch, seq, precision, recompute, tp, pp, micro_batches,
                                      schedule, stage, virtual, loss_parallel, tp_style) for stage in range(pp))


def pipeline_schedule(spec: ModelSpec, micro_batch: int, seq: int, precision: str, tp: int, pp: int,
                      micro_batches: int, schedule: str, virtual: int = 1) -> dict:
    """The suggested pipeline as its schedule runs it: the first rank's micro-batches (interleaved:
    chunks) in flight, the bubble over the compute time and as a share of the step, and the
    point-to-point sends a step (Note [interleaved 1F1B as torch runs it] in interleaved.py; 1F1B
    and GPipe are its ``v = 1``). A message is one micro-batch's hidden states, split ``tp`` ways
    by sequence parallelism."""
    v = virtual if schedule == "interleaved" else 1
    ratio = interleaved.bubble_ratio(pp, v, micro_batches)
    sends = interleaved.p2p_sends(pp, v, micro_batches)
    message = (micro_batch * seq * spec.hidden * param_bytes(precision) // tp) if spec.has_shape else None
    return {"schedule": schedule, "virtual_stages": v, "stages": pp * v, "micro_batches": micro_batches,
            "first_rank_in_flight": in_flight(0, pp, micro_batches, schedule, v),
            "bubble_ratio": ratio, "bubble_fraction": ratio / (1 + ratio),
            "p2p_sends_per_step": sends["total"], "p2p_sends_busiest_rank": sends["busiest_rank"],
            "p2p_sends_more_than_1f1b": sends["total"] - interleaved.p2p_sends(pp, 1, micro_batches)["total"],
            "p2p_message_bytes": message}


def schedule_refusal(schedule: str, pp: int, micro_batches: int, virtual: int = 1,
                     layers: Optional[int] = None) -> Optional[str]:
    """Why torch's schedule does not run ``micro_batches`` a step on ``pp`` ranks (a ValueError
    when it is built), or None: ``Schedule1F1B`` needs at least as many micro-batches as stages,
    ``ScheduleInterleaved1F1B`` a multiple of its rounds and (here) a block for each stage;
    ``ScheduleGPipe`` runs any."""
    if pp <= 1:
        return None
    if schedule == "1f1b" and micro_batches < pp:
        return (f"{micro_batches} micro-batch{'es' if micro_batches > 1 else ''} a step, fewer than the {pp} stages "
                "torch's Schedule1F1B needs")
    if schedule == "interleaved":
        if layers is not None and pp * virtual > layers:
            return f"{pp} ranks x {virtual} virtual stages = {pp * virtual} stages, more than the {layers} blocks"
        return interleaved.refusal(pp, micro_batches)
    return None
