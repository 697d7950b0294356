"""What a fusedist stage adds around its schedule's step: the targets the step was given, read by the last
stage's check of a loss without a target, and -- several stages per rank -- a failure anywhere in the step
told to every rank at the step's end.

Note [the targets a step was given]
    The last stage refuses a step without ``target=`` of a schedule with a ``loss_fn`` (Note [a loss without
    a target] in inference.py). It read the targets from the ``target_mbs`` local of the schedule's
    frame running the step: had torch renamed that local, the check would have found no frame and turned
    itself off, silently. The schedule's ``_step_microbatches`` is now wrapped on the instance (at the first
    step the stage takes part in), and the wrapper records the ``target_mbs`` argument it is called with
    for the call's duration; a ``_step_microbatches`` whose signature has no ``target_mbs`` is refused
    there, naming it, where the schedule has a ``loss_fn`` (the check cannot turn off unseen).

Note [a failure told at the step's end, several stages per rank]
    Note [a failure told at the step's end] (step_status.py) armed the schedules with one stage
    per rank only: with several (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
    ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``: torch runs them from
    a list of actions per rank, sends and receives included) a failure in a stage's forward, backward or
    the last stage's ``loss_fn`` left the other ranks waiting until the process group's timeout. A stage
    cannot complete its messages alone there: a rank's stages share each pair of ranks' messages, whose
    order the list fixes. So the wrapper of the step does it for the rank: after a stage's pass raised
    (recorded by the stage), it goes on through the rest of the rank's list without computing -- posting
    each receive not made yet, and zeros in place of each send not made -- in the list's order, in one
    batch, and waits (bounded) for them and for the receives posted before the failure. Then, as on every
    rank at the end of every step, the one-integer all-reduce of Note [a failure told at the step's end]
    (once per rank, not per stage); every rank raises the same message, and no stage's step ends: each
    refuses the next step. Every stage's buffers are put back as the step found them; a stage module no one
    reduces gets its gradients back too, and its division by the micro-batch count (its
    ``perform_reduce_grad``, a division only) waits for the exchange, so that a failed step divides
    nothing. A stage fusedist or torch reduces reduces at its place in the list, as before, and keeps the
    sums after a failure (as after any step that raised). Armed where every rank of the group holds a
    stage; ``FUSEDIST_CHECKS=0`` turns it off, as for one stage per rank. A failure in the schedule's own
    code, or in its communication, is not covered.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist

from .small_batch import restore_count, split_targets
from .step_status import (
    exchange, put_back, several_armed, wait_bounded, zero_activations, zero_gradients)
from .step_verdict import StepVerdicts, raise_told


def wrap_step(schedule) -> None:
    """Wrap the schedule's ``_step_microbatches`` once (Note [the targets a step was given], Note [a
    failure told at the step's end, several stages per rank])."""
    if schedule.__dict__.get("_fusedist_step_wrapped", False):
        return
    original = schedule._step_microbatches
    signature = inspect.signature(original)
    named = schedule._fusedist_targets_named = "target_mbs" in signature.parameters
    if not named and getattr(schedule, "_loss_fn", None) is not None:
        raise RuntimeError(
            f"fusedist.pipelining.PipelineStage: {type(schedule).__name__}._step_microbatches takes "
            f"{tuple(signature.parameters)}, no 'target_mbs': the last stage's check that a schedule with a "
            "loss_fn was given target= reads that argument, and would be off. Use a torch release fusedist "
            "supports, or name the targets' parameter target_mbs in the schedule's _step_microbatches")

    def stepping(*args, **kwargs):
        if named:  # (a target too short to split: Note [a batch smaller than n_microbatches])
            bound = signature.bind(*args, **kwargs)
            if "target_mbs" in bound.arguments:
                bound.arguments["target_mbs"] = split_targets(schedule, bound.arguments["target_mbs"])
            args, kwargs = bound.args, bound.kwargs
            schedule._fusedist_targets = (bound.arguments.get("target_mbs"),)
        else:
            restore_count(schedule)
        schedule._fusedist_failure = None
        schedule._fusedist_step_raised = True  # (Note [a stage that ended in a step that raised])
        try:
            result = _run(schedule, original, args, kwargs)
            schedule._fusedist_step_raised = False
            for stage in [getattr(schedule, "_stage", None), *getattr(schedule, "_stages", ())]:
                step = getattr(stage, "_step", None)
                if step is not None:  # (what a step that raised puts back: none to keep)
                    step.set_aside = step.ended_buffers = None
            return result
        finally:
            schedule.__dict__.pop("_fusedist_targets", None)
            schedule.__dict__.pop("_fusedist_failure", None)
            schedule.__dict__.pop("_fusedist_short", None)

    schedule._step_microbatches = stepping
    schedule._fusedist_step_wrapped = True


def targets_given(schedule):
    """The step's micro-batch targets, as a one-tuple, while the schedule runs a step; else None."""
    return None if schedule is None else schedule.__dict__.get("_fusedist_targets")


def _run(schedule, original, args, kwargs):
    stages = list(getattr(schedule, "_stages", ()))
    if not stages or not all(several_armed(stage) for stage in stages):
        return original(*args, **kwargs)
    try:
        result = original(*args, **kwargs)
    except Exception as e:
        failed = schedule.__dict__.get("_fusedist_failure")
        if failed is None:  # not a stage's pass: the schedule's own code, or a message
            raise
        message, on_zeros = failed
        works = _complete(schedule)
        told = exchange(stages[0], message, on_zeros)
        for stage in stages:
            put_back(stage)
        wait_bounded(stages[0], works)
        raise RuntimeError(told or message) from (e.__cause__ or e)
    # Note [the step check's verdict read at the step's end] (step_verdict.py): every stage's, in order
    verdicts = StepVerdicts(stages)
    told = exchange(stages[0], verdicts.message(), verdicts=verdicts)
    if told is not None:
        for stage in stages:
            put_back(stage)
        raise_told(told, verdicts)
    for stage in stages:
        stage._step_told_ended()
    return result


def _complete(schedule) -> list:
    """The rest of the rank's list of actions, without computing: each receive not made yet posted, zeros
    sent in place of each send not made, in the list's order, one batch; with the receives posted before
    the failure and not waited for."""
    from torch.distributed.pipelining.schedules import RECV_B, RECV_F, SEND_B, SEND_F

    by_index = {stage.stage_index: stage for stage in schedule._stages}
    ops = []
    for action in schedule.pipeline_order_with_comms[schedule.rank]:
        for each in getattr(action, "sub_actions", None) or (action,):
            kind, stage, chunk = each.computation_type, by_index.get(each.stage_index), each.microbatch_index
            if stage is None or chunk is None:
                continue
            if kind == RECV_F and chunk not in stage._fwd_recvs_made:
                ops += stage.get_fwd_recv_ops(chunk)
            elif kind == SEND_F and chunk not in stage._fwd_sends_made:
                ops += zero_activations(stage, chunk)
            elif kind == RECV_B and stage.has_backward and chunk not in stage._bwd_recvs_made:
                ops += stage.get_bwd_recv_ops(chunk)
            elif kind == SEND_B and stage.has_backward and chunk not in stage._bwd_sends_made:
                ops += zero_gradients(stage, chunk)
    posted = [work for pending in (schedule.fwd_recv_ops, schedule.bwd_recv_ops) for works in pending.values()
              for work in works]
    schedule.fwd_recv_ops.clear()
    schedule.bwd_recv_ops.clear()
    return posted + (dist.batch_isend_irecv(ops) if ops else [])
