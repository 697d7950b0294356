"""A first send that cannot be made, told upstream too: the ranks holding the stages before the failing one
learn of it in place of micro-batch 0's gradient, instead of at the process group's timeout.

Note [a first send that cannot be made, told upstream]
    Note [a first send that cannot be made] (inference.py) tells the ranks after a failing stage
    (its status message travels ahead of micro-batch 0's activations). A rank holding the stage before it
    (rank 0 when stage 1 of a three-rank pipeline fails) waited for micro-batch 0's gradient -- or, first,
    for its sends of later micro-batches' activations to be taken (gloo's sends wait for their receive) --
    until the process group's timeout. So in a training step, micro-batch 0's gradient across each rank
    boundary travels behind a status message too (one per boundary and set-up, as the forward one). A
    stage whose forward of micro-batch 0 raised -- its own failure, not one told from before it; or the last
    stage's ``loss_fn`` on micro-batch 0, which the schedule computes after the stage's forward -- takes
    the activations the stage before it will still send this step (receives posted for every micro-batch
    not yet received, so that its sends complete) and sends the failure's message and zeros of the
    gradient's shapes in place of micro-batch 0's gradient. The rank before reads it at micro-batch 0's
    backward, sends zeros for the activations it has not sent yet (the receives posted for them are waiting),
    raises the same message, and passes it on the same way to the rank before it. Every message of the step
    is matched: every rank fails at once, naming the stage and its exception, and the process group stays
    usable. The step counts as one that raised (Note [a step that raised] in step_failures.py):
    every later step is refused, the fix is a restart. Armed where every stage is on a rank of its own
    (``ScheduleGPipe``, ``Schedule1F1B``, ...); with several stages on a rank a failure is told at the step's
    end (Note [a failure told at the step's end, several stages per rank] in schedule_step.py). As
    the forward notice, it covers micro-batch 0 of the first training step after a set-up (with shape
    inference, that step's failures are the inference's: Note [a shape inference that fails on one rank]);
    a failure at a later micro-batch or step, in a backward, or in a forward-only step is told at the step's
    end (Note [a failure told at the step's end] in step_status.py).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .inference import (
    _FAILED, _SENT, NOTICE_BYTES, NOTICE_WAIT_S, _notice, failure_message, notice_failure)


class PeerFailedFirstSendAfter(Exception):
    """A failure notice received in place of micro-batch 0's gradient from the next stage."""


def arm_back(stage, has_backward: bool) -> None:
    """After the schedule set the stage up: whether micro-batch 0's gradient across a rank boundary
    travels behind a status message (shapes given, a training step, every stage on a rank of its own)."""
    mode = getattr(stage, "_inference_mode", None)
    ranks = getattr(stage, "stage_index_to_group_rank", None) or {}
    here = stage.group_rank
    armed = (getattr(mode, "value", None) == "static" and has_backward
             and len(set(ranks.values())) == len(ranks) == stage.num_stages)
    stage._back_notice_to = armed and not stage.is_first and ranks.get(stage.stage_index - 1, here) != here
    stage._back_notice_from = armed and not stage.is_last and ranks.get(stage.stage_index + 1, here) != here
    stage._back_notice_buffer, stage._back_armed = None, armed
    stage._fwd_recvs_made, stage._fwd_sends_made = set(), set()


def back_recv_ops(stage, chunk: int) -> list:
    """The receive of the status ahead of micro-batch 0's gradient, when armed."""
    if chunk != 0 or not getattr(stage, "_back_notice_from", False):
        return []
    stage._back_notice_buffer = torch.zeros(NOTICE_BYTES, dtype=torch.uint8, device=stage.device)
    peer = stage._resolve_peer_global_rank(stage.stage_index + 1)
    return [dist.P2POp(dist.irecv, stage._back_notice_buffer, peer, stage.group)]


def back_send_ops(stage, chunk: int) -> list:
    """The status ahead of micro-batch 0's gradient, when armed: sent."""
    if chunk != 0 or not getattr(stage, "_back_notice_to", False):
        return []
    stage._back_notice_to = False
    peer = stage._resolve_peer_global_rank(stage.stage_index - 1)
    return [dist.P2POp(dist.isend, _notice(stage, _SENT, ""), peer, stage.group)]


def read_back_notice(stage, chunk: int) -> None:
    """Raise the failure the next stage's rank sent in place of micro-batch 0's gradient."""
    buffer = getattr(stage, "_back_notice_buffer", None) if chunk == 0 else None
    if buffer is None or not getattr(stage, "_back_notice_from", False):
        return
    stage._back_notice_from, stage._back_notice_buffer = False, None
    failure = notice_failure(buffer)
    if failure is not None:
        raise PeerFailedFirstSendAfter(failure)


def tell_upstream(stage, chunk: int, message: str, told: bool) -> None:
    """After the stage's step failed at micro-batch 0 -- its own forward (``told``: False), or the next
    stage's rank told it so (True): complete what the next stage's rank waits for from this one (zeros for
    the activations not sent yet), then tell the stage before, when its rank waits on this one."""
    works = []
    if told:
        works += _zeros_for_unsent_activations(stage)
    if chunk == 0 and getattr(stage, "_back_notice_to", False):
        stage._back_notice_to = False
        works += _take_coming_activations(stage)
        peer = stage._resolve_peer_global_rank(stage.stage_index - 1)
        sends = [_notice(stage, _FAILED, message), *_gradient_zeros(stage)]
        works += [dist.isend(t, peer, group=stage.group) for t in sends]
    stage._back_works = works  # (kept alive with their tensors until taken)
    try:  # bounded: a process ending at once would drop them unsent
        for work in works:
            if work is not None and getattr(work, "_fusedist_wait", True):
                work.wait(timeout=datetime.timedelta(seconds=NOTICE_WAIT_S))
    except Exception:  # noqa: BLE001 - the failure being told of is the error to raise
        pass


def guard_first_loss(schedule) -> None:
    """The last stage's loss, when it raises, told upstream at micro-batch 0 (Note [a first send that cannot be
    made, told upstream]) or to every rank at the step's end (Note [a failure told at the step's end] in
    step_status.py): the schedule computes it after the stage's forward, outside the stage's passes."""
    if schedule.__dict__.get("_fusedist_loss_guarded", False):
        return
    original = schedule._maybe_compute_loss

    def computing(stage, output, target_mbs, mb_index, *args, **kwargs):
        try:
            return original(stage, output, target_mbs, mb_index, *args, **kwargs)
        except Exception as e:
            if mb_index != 0 or not getattr(stage, "_back_notice_to", False):
                from .step_status import told_at_step_end

                told = told_at_step_end(stage, mb_index, e, "'s loss", False)
                if told is None:  # Note [a failure told at the step's end] (step_status.py)
                    raise
                raise told from e
            from .step_status import publish_first_step_failure, put_back_buffers

            put_back_buffers(stage)  # Note [the buffers a failed step puts back] (step_failures.py)
            message = failure_message(stage, 0, e, "'s loss")
            publish_first_step_failure(stage, message)  # Note [a first-step failure told to the data-parallel peers]
            tell_upstream(stage, 0, message, told=False)
            raise RuntimeError(message) from e

    schedule._maybe_compute_loss = computing
    schedule._fusedist_loss_guarded = True


class _Posted:
    """A receive posted for the peer's sends to complete; not waited for here (the peer may send fewer)."""

    _fusedist_wait = False

    def __init__(self, work, buffer):
        self.work, self.buffer = work, buffer


def _take_coming_activations(stage) -> list:
    """Receives for every micro-batch whose activations this stage has not received yet: the stage before
    sends them (as many as its schedule runs before its first backward), and its sends wait to be taken."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    posted = []
    for chunk in range(stage.chunks or 0):
        if chunk in stage._fwd_recvs_made:
            continue
        for op in _PipelineStageBase.get_fwd_recv_ops(stage, chunk):
            posted.append(_Posted(dist.irecv(op.tensor, op.peer, group=op.group), op.tensor))
    return posted


def _zeros_for_unsent_activations(stage) -> list:
    """Zeros in place of the activations of the micro-batches this stage has not sent: the next stage's
    rank posted receives for them (Note [a first send that cannot be made, told upstream])."""
    meta = stage._stage_meta.outputs or ()
    works = []
    for chunk in range(stage.chunks or 0):
        if chunk in stage._fwd_sends_made:
            continue
        stage._fwd_sends_made.add(chunk)
        for idx, out in enumerate(meta):
            for dst in stage.act_send_info.get(idx, ()):
                if dst is not None:
                    zeros = torch.zeros(out.shape, dtype=out.dtype, device=stage.device)
                    works.append(dist.isend(zeros, stage._resolve_peer_global_rank(dst), group=stage.group))
    return works


def _gradient_zeros(stage) -> list:
    """Zeros of the shapes of the input gradients this stage sends (and the stage before receives into),
    as torch's stage decides which to send."""
    zeros = []
    for idx, info in enumerate(stage.args_recv_info[0]):
        if getattr(info, "is_root_arg", False):
            continue
        meta = stage._get_grad_send_meta(idx)
        if meta is not None:
            zeros.append(torch.zeros(meta.shape, dtype=meta.dtype, device=stage.device))
    return zeros
