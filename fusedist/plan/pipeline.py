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
      memory estimator, ``theoretical_memory_usage.py``). The last stage holds one micro-batch,
      with the output layer's inputs and fp32 logits.
    * GPipe (all forwards, then all backwards; torch's ``ScheduleGPipe``): every stage holds all
      ``m`` micro-batches, its blocks' and its side's (embedding mask, or output layer).

    The figure is the largest stage's. Under full recomputation a stage stores its blocks' inputs
    per micro-batch in flight and recomputes one block at a time, whose working set is added once.
    The interleaved (virtual-stage) schedule, which holds ``1 + (p - 1) / (p·v)`` times 1F1B's, is
    not modelled.
"""

from __future__ import annotations

from typing import Optional

from .model import (ModelSpec, block_activation_bytes, input_side_bytes, output_side_bytes,
                    recomputed_layer_bytes)

SCHEDULES = ("1f1b", "gpipe")


def in_flight(stage: int, pp: int, micro_batches: int, schedule: str) -> int:
    """Micro-batches whose activations stage ``stage`` of ``pp`` holds at once."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(pp - stage, micro_batches)
    raise ValueError(f"unknown pipeline schedule {schedule!r} (one of {', '.join(SCHEDULES)})")


def stage_blocks(layers: int, pp: int, stage: int) -> range:
    """The blocks of stage ``stage``: contiguous runs, as even as ``layers`` allows."""
    return range(layers * stage // pp, layers * (stage + 1) // pp)


def stage_activation_bytes(spec: ModelSpec, micro_batch: int, seq: int, precision: str, recompute: str,
                           tp: int, pp: int, micro_batches: int, schedule: str, stage: int) -> int:
    """Bytes stage ``stage`` keeps for backward at its peak (Note [activations under pipeline
    parallelism]); divided by ``tp`` as :func:`fusedist.plan.model.activation_bytes`."""
    b, s = micro_batch, seq
    one = sum(block_activation_bytes(spec, i, b, s, precision, recompute) for i in stage_blocks(spec.layers, pp, stage))
    if stage == 0:
        one += input_side_bytes(spec, b, s)
    if stage == pp - 1:
        one += output_side_bytes(spec, b, s, precision)
    held = one * in_flight(stage, pp, micro_batches, schedule)
    return held // tp + recomputed_layer_bytes(spec, b, s, precision, recompute, tp)


def pipeline_activation_bytes(spec: ModelSpec, micro_batch: int, seq: int, precision: str, recompute: str,
                              tp: int = 1, pp: int = 1, micro_batches: int = 1,
                              schedule: str = "1f1b") -> Optional[int]:
    """The activation bytes of the fullest of ``pp`` stages running ``micro_batches`` micro-batches a
    step under ``schedule``; None without the model's shape. ``pp == 1`` is
    :func:`fusedist.plan.model.activation_bytes` (one micro-batch at a time)."""
    if not spec.has_shape:
        return None
    pp = max(1, min(pp, spec.layers))
    if pp == 1:
        return stage_activation_bytes(spec, micro_batch, seq, precision, recompute, tp, 1, 1, "1f1b", 0)
    return max(stage_activation_bytes(spec, micro_batch, seq, precision, recompute, tp, pp, micro_batches,
                                      schedule, stage) for stage in range(pp))
