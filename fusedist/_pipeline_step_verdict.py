"""The per-step check of a DDP stage module read at the pipeline step's end, before any optimizer step.

Note [the step check's verdict read at the step's end]
    DDP's per-step check (Note [step check] in fusedist/reliability/step_check.py) is read at the next training
    forward. Under a pipeline schedule that is the next step's first micro-batch: a divergence of a stage's
    data-parallel peers in a step (a rank ran an extra forward of the stage module, or skipped one) was named
    only after every rank had applied that step's optimizer step on gradients averaged across ranks at
    different points. Where the last gradient bucket carried the check (Note [the check carried by the last
    bucket] in fusedist/reliability/carried_check.py: the host, the default all-reduce), its verdict is already
    on this rank once the step's last backward returns -- that backward waited for the bucket -- so the step's
    end (``perform_reduce_grad``) reads it: no collective more, and the same reading the next forward would
    have done (a few list comparisons), moved earlier. Every data-parallel peer of the stage reads it at the
    same point of its program, so a mismatch raises on each of them, with the check's own all-gather of the
    details. Their pipelines' other ranks learn of it through the status exchange of Note [a failure told at
    the step's end] (_pipeline_step_status.py): every rank raises, no step ends, no optimizer step follows.
    Where the check runs its own all-reduce (``fully_shard``, ZeRO's strategies, a communication hook, CUDA,
    whose copy to the host would make the host wait) or the pipeline has no exchange to tell the others (a
    schedule not armed, ``FUSEDIST_CHECKS=0``), the verdict is read at the next forward, as before.
"""

from __future__ import annotations

from typing import Optional

from ._consistency import RankMismatchError


def carried_check_of(module):
    """The step check of a fusedist DDP stage module (or a ``fusedist.replicate`` one), None for any other."""
    from ._pipeline_sync_switch import ddp_engine_of

    carrier = getattr(getattr(ddp_engine_of(module), "reducer", None), "check_carrier", None)
    return getattr(carrier, "step_check", None)


def divergence_at_step_end(stage) -> Optional[Exception]:
    """The mismatch the stage module's carried check found in this step (read now, on every data-parallel
    peer alike), or None: none found, or the verdict is not carried (read at the next forward). Any other
    error of the reading is returned too: the pipeline's other ranks wait in the step's exchange for this one."""
    check = carried_check_of(stage.submod)
    if check is None:
        return None
    try:
        check.settle_carried(f"the end of the pipeline step (stage {stage.stage_index}), before any optimizer step")
    except Exception as e:  # noqa: BLE001 - told to every rank of the pipeline, then raised here
        return e
    return None


def told_message(stage, error: Exception) -> str:
    """What the pipeline's other ranks raise: which stage's peers diverged, and the check's text."""
    if not isinstance(error, RankMismatchError):
        return (f"fusedist.pipelining.PipelineStage: reading the data-parallel step check of stage "
                f"{stage.stage_index} at the step's end failed (no rank's step ends): {type(error).__name__}: {error}")
    return (f"fusedist.pipelining.PipelineStage: the data-parallel replicas of stage {stage.stage_index} diverged "
            f"in this step (found at the step's end, before any optimizer step; no rank's step ends): {error}")
