"""A stage that fails anywhere in a step completes the step's messages and tells every rank at the step's end,
instead of leaving the other ranks waiting until the process group's timeout.

Note [a failure told at the step's end]
    The notices ahead of micro-batch 0's activations and gradient (Note [a first send that cannot be made] in
    inference.py, Note [a first send that cannot be made, told upstream] in notice_back.py)
    cover a failure at micro-batch 0 of the first training step after a set-up. A failure anywhere else -- a
    stage's forward, the last stage's ``loss_fn`` or a stage's backward at a later micro-batch or in a later
    step, or any failure in an ``eval()`` step -- left the other ranks blocked in a receive (or their sends
    untaken: gloo's sends wait for their receive) until the process group's timeout. A notice per micro-batch
    would tell them at once, but costs a message (and a read on the host) per micro-batch and boundary on every
    step; a failure only has to be learned of before any rank applies the step. So:
    - the failing stage completes every message the step still owes or is owed across its boundaries: it
      posts the receives of the activations and gradients it has not received yet, and sends zeros of the
      shapes the peers receive into in place of the activations and gradients it has not sent (a status
      notice ahead of micro-batch 0's, where one is due, says "sent"). Every posted operation goes in one
      batch, so a backend that orders a pair's messages (NCCL) cannot block on their order. The other ranks'
      steps run to their end on the zeros: a failure one of them meets on them (a loss comparing shapes) is
      told the same way;
    - at each step's end (``perform_reduce_grad``, before the step counts as ended) every rank of the
      pipeline takes part in one all-reduce of one integer: which failing rank's message to tell, or none
      (Note [the failure told, of several]). Only after a failure, that rank broadcasts its message: every
      rank raises the same ``RuntimeError`` naming the stage, its rank, the micro-batch (and whether its
      loss or backward) and the exception; the failing rank's chains its own exception. A stage's
      data-parallel peers that diverged in the step are told the same way: the step check's verdict rides
      on the exchange (Note [the step check's verdict read at the step's end] in step_verdict.py).
    No rank's step ends: each counts as one that raised (Note [a step that raised] in
    step_failures.py), so no optimizer step follows on any rank, and each rank's next step is
    refused. Every stage module's buffers are put back as the step found them on every rank (a BatchNorm's
    running statistics and batch count: the forwards before the failure and those on the zeros moved them;
    Note [the buffers a failed step puts back] in step_failures.py). A stage module no one reduces
    gets its gradients back as the step found them (the zeros were backpropagated too); a ``fully_shard`` or
    DDP stage keeps the sums it reduced, as after any step that raised. Every message of the failed step is
    matched, so the process group stays usable.
    The cost on a step that does not fail: one all-reduce of one integer per step and rank, read on the host
    (on an accelerator: the host waits for the step's work before the step returns; on gloo, two CPU ranks,
    ~0.25 ms a step); ``FUSEDIST_CHECKS=0`` (on every rank) turns it off, and such a failure then reaches the
    other ranks at the group's timeout. Armed for the schedules with one stage per rank that end their steps
    in ``perform_reduce_grad`` (``ScheduleGPipe``, ``Schedule1F1B`` and their subclasses) over a group whose
    every rank holds a stage, driven by the schedule's ``step``/``eval`` (not by hand). With several stages
    per rank (interleaved, looped, V, zero-bubble schedules) the rank's schedule step completes the messages
    and exchanges, once per rank (Note [a failure told at the step's end, several stages per rank] in
    schedule_step.py). A failure in the step's own communication, or outside the stage's forward,
    loss and backward (the schedule's own code), is not covered; a shape inference that fails in a set-up,
    ``eval`` included, is told by the set-up itself (Note [a shape inference that fails on one rank] in
    inference.py).

Note [the failure told, of several]
    A failing stage sends zeros in place of its messages, and a stage receiving them may fail on them too
    (a check of its inputs, a loss refusing a degenerate batch). The exchange told the lowest failing rank's
    message, which could be the one failing on the zeros: with one stage per rank a stage after the cause
    raised in the backward direction, with several stages per rank (stages 1 and 2 on ranks 1 and 0) in
    either. So each failing rank also says whether the received inputs of the pass that failed (the
    activations of its micro-batch; for a backward, or the gradients) were all zeros, and the integer
    all-reduced (MAX) is ``size + (size - rank)`` for a failure on other inputs, ``size - rank`` for one on
    all zeros, 0 for none: the lowest rank that failed on real inputs is told, else the lowest failing one.
    A stage whose real inputs were all zeros counts as failing on zeros; that matters only where another
    rank failed too. Read only after a failure: a step that does not fail reads nothing more.

Note [a pipeline's failure told to its data-parallel peers]
    With data parallelism across pipelines (a mesh ``pp x dp``, each stage module under fusedist DDP or
    ``fully_shard`` over ``dp``), a failing stage's rank waits in its pipeline's exchange while the same
    stage's ranks of the other pipelines wait in a data-parallel reduction it never issues; their pipelines
    wait for their gradients, and the failing pipeline's other ranks for those reductions: every rank waited
    out the process group's timeout (a cycle across groups the divergence probe could not see: it reads
    waits in fusedist's collectives only). So while a failing rank waits in the exchange it publishes its
    message as a failure entry in each of its monitored groups (Note [a failure outside the group's
    collectives] in fusedist/reliability/failed_elsewhere.py); a peer's wait blocked past
    ``FUSEDIST_DIVERGENCE_PROBE_S`` then fails, that peer's pass fails, and its stage tells its pipeline
    the failure it read (not its own wait's), so every rank of every pipeline raises the first failure's
    message about a second past the probe's delay. The entries are withdrawn once the exchange completes.
    The message names the rank in the pipeline's group and, where it differs, the global rank. Where the
    probe is off (``FUSEDIST_DIVERGENCE_PROBE_S=0`` or ``FUSEDIST_CHECKS=0``), such a failure still
    reaches the other ranks at the group's timeout.

Note [a first-step failure told to the data-parallel peers]
    A failure at micro-batch 0 of the first training step after a set-up is told along the pipeline by notices
    -- the shape inference's, where the step infers the stages' shapes (Note [a shape inference that fails on
    one rank] in inference.py), else the first sends' (Note [a first send that cannot be made] there,
    Note [a first send that cannot be made, told upstream] in notice_back.py) -- and each rank of the
    pipeline raises at once, with no exchange to wait in. Their data-parallel peers waited in reductions those
    ranks never issue until the failing process ended (its crash entry), or, where the user caught the error and
    kept the process alive, until the group's timeout. So each rank raising there (the failing one and those
    told by a notice) first publishes the message as a failure entry in its monitored groups, as above: every
    peer's blocked wait fails about the probe's delay later, its pipeline is told the message read (its own
    notices, or the exchange at the step's end), and every rank of every pipeline raises the first failure's
    message. Nothing waits here for the peers to read the entries, so each is kept -- a peer that read one has
    given the group up -- until this rank launches its next collective in that group (then it waits in one
    again, and a peer still waiting for it pairs with it: Note [a failure entry withdrawn at the next launch]
    in fusedist/reliability/failed_elsewhere.py), or a failure of the group's own collectives or the process's
    end writes its entry in its place. After the first sends' notices every later step of the pipeline is
    refused (Note [a step that raised] in step_failures.py); a failed shape inference counts as ended
    and the next step may run: its reductions withdraw the entries, so a later wait of the peers blocked past
    the probe's delay (a rank saving a checkpoint, a slow data loader) is no longer told of the old failure.
    Not withdrawn at the next step's beginning: a peer that passes the delay before that step's first
    reduction would then go on waiting, unwarned, for a reduction of another step. That step's beginning
    waits instead until the peers were told, so that its reductions cannot pair with theirs of the failed
    step (Note [the next step waits until the peers were told] in told_peers.py).

Note [a one-rank pipeline's failure told to its data-parallel peers]
    A pipeline of one rank (``pp=1``: every stage on one rank, the rank's data-parallel peers running pipelines
    of their own) tells no other rank of its failures: no notice, no exchange. A stage's forward, loss or
    backward that raised in a scheduled step (or its shape inference) left the peers waiting in a reduction
    this rank never issues until the process's end or, where the error was caught, the group's timeout. The
    rank now publishes the failure's message as above before it raises its own error, once a step: the peers'
    waits fail about the probe's delay later, naming it, and the entries go at this rank's next launch in
    each group.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

from .inference import (
    _FAILED, NOTICE_BYTES, NOTICE_WAIT_S, _notice, failure_message, notice_failure, notice_send_ops)
from .notice_back import back_send_ops
from .step_failures import last_schedule, put_back_gradients, told_every_rank
from .told_peers import count_failed_step, count_published, with_the_failure_told_before
from ..reliability import failed_elsewhere


def status_armed(stage) -> bool:
    """Whether the stage's step ends with the status exchange (the same answer on every rank of the
    pipeline: Note [a failure told at the step's end]), one stage per rank or several."""
    return single_armed(stage) or several_armed(stage)


def single_armed(stage) -> bool:
    """Armed, one stage per rank: the stage completes its own messages, the exchange is at its
    ``perform_reduce_grad``."""
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    from ..reliability.config import checks_enabled

    if not checks_enabled():  # (FUSEDIST_CHECKS=0, set alike on every rank: no per-step exchange)
        return False
    schedule = last_schedule(stage)
    if not isinstance(schedule, (ScheduleGPipe, Schedule1F1B)) or stage.group_size < 2:
        return False
    ranks = getattr(stage, "stage_index_to_group_rank", None) or {}
    return len(set(ranks.values())) == len(ranks) == stage.num_stages == stage.group_size


def several_armed(stage) -> bool:
    """Armed, several stages per rank (a schedule run from its list of actions, interleaved, looped, V or
    zero-bubble): the rank's schedule step completes its messages and exchanges once (Note [a failure told at
    the step's end, several stages per rank] in schedule_step.py)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from ..reliability.config import checks_enabled

    if not checks_enabled():
        return False
    schedule = last_schedule(stage)
    if not isinstance(schedule, _PipelineScheduleRuntime) or stage.group_size < 2:
        return False
    if not schedule.__dict__.get("_fusedist_step_wrapped", False):
        return False
    ranks = getattr(stage, "stage_index_to_group_rank", None) or {}
    return len(ranks) == stage.num_stages and set(ranks.values()) == set(range(stage.group_size))


def micro_batches(stage) -> int:
    """The step's micro-batch count: the schedule's (``stage.chunks`` is set by training steps only; an eval
    step before any counted as ended at its first forward)."""
    return int(getattr(last_schedule(stage), "_n_microbatches", 0) or stage.chunks or 0)


def began(stage, scheduled: bool) -> None:
    """At a step's beginning: nothing sent or received yet, nothing failed; passes driven by hand (not
    ``scheduled``) tell nobody."""
    stage._fwd_recvs_made, stage._fwd_sends_made = set(), set()
    stage._bwd_recvs_made, stage._bwd_sends_made = set(), set()
    stage._status_told = not scheduled
    stage._reduce_held = None  # (a division held back for the exchange: several stages per rank)
    stage._published_elsewhere = None  # (Note [a first-step failure told to the data-parallel peers])


def fails_here(stage) -> bool:
    """The stage's step failed here and the status exchange tells the others (once per step)."""
    if getattr(stage, "_status_told", False) or not status_armed(stage):
        return False
    stage._status_told = True
    return True


def told_at_step_end(stage, chunk: int, error: Exception, where: str, backward: bool):
    """The error a stage's pass raises where its failure is told at the step's end (the others learn
    of it there); None where it is not, and the pass's own error stands."""
    if not fails_here(stage):
        if stage.group_size == 1 and not getattr(stage, "_status_told", True):  # (a scheduled step)
            # Note [a one-rank pipeline's failure told to its data-parallel peers]
            publish_failure(stage, failed_elsewhere.failure_told(error) or failure_message(stage, chunk, error, where))
        return None
    # Note [a pipeline's failure told to its data-parallel peers]: a wait that failed because a peer of a
    # data-parallel group failed in its pipeline tells that failure, not the wait's
    message = failed_elsewhere.failure_told(error) or failure_message(stage, chunk, error, where)
    message = with_the_failure_told_before(stage, message)  # Note [the next step waits until the peers were told]
    return RuntimeError(fail_step(stage, message, received_zeros(stage, chunk, backward)))


@contextlib.contextmanager
def backward_failure_told(stage, chunk: int):
    """Around a backward pass of micro-batch ``chunk`` (full, input or weight): where it fails and the failure is
    told at the step's end, the error every rank raises; else the pass's own."""
    try:
        yield
    except Exception as e:
        told = told_at_step_end(stage, chunk, e, "'s backward", True)
        if told is None:
            raise
        raise told from e


def fail_step(stage, message: str, on_zeros: bool = False) -> str:
    """After the stage's forward, loss or backward raised: complete the step's messages, tell every rank;
    the message every rank raises. ``on_zeros``: the inputs it failed on were all zeros (Note [the failure
    told, of several]). With several stages per rank the rank's schedule step does both, once."""
    if several_armed(stage):
        last_schedule(stage)._fusedist_failure = (message, on_zeros)
        return message
    works = _complete(stage)
    failure = exchange(stage, message, on_zeros)
    put_back(stage)
    wait_bounded(stage, works)
    return failure or message


def wait_bounded(stage, works: list) -> None:
    """Wait for the posted messages, bounded: a peer elsewhere may never take them."""
    try:
        for work in works:
            work.wait(timeout=datetime.timedelta(seconds=NOTICE_WAIT_S))
    except Exception:  # noqa: BLE001 - the failure being told of is the error to raise
        stage._status_works = works  # (kept alive with their tensors)


def step_end_failure(stage, verdicts=None):
    """At the step's end: the failure a rank told of (``verdicts``: this rank's pending step-check verdicts,
    Note [the step check's verdict read at the step's end] in step_verdict.py), or None (and None
    where not armed, or where the rank's schedule step exchanges: several stages per rank)."""
    if getattr(stage, "_status_told", False) or not single_armed(stage):
        return None
    failure = exchange(stage, None if verdicts is None else verdicts.message(), verdicts=verdicts)
    if failure is not None:
        put_back(stage)
    return failure


def put_back(stage) -> None:
    """The stage module's buffers as the failed step found them, every kind of stage module (Note [the
    buffers a failed step puts back] in step_failures.py); a stage module no one reduces gets its
    gradients back too (one fusedist or torch reduces keeps its sums, as does a step accumulating under the
    user's own switch: Note [a step that raised] there)."""
    step = getattr(stage, "_step", None)
    told_every_rank(stage)  # Note [a refusal after a failure every rank raised] (step_failures.py)
    put_back_buffers(stage)
    if step is not None and step.backwards and getattr(stage, "_plain_stage", False) and not step.held_over:
        put_back_gradients(stage, step)


def put_back_buffers(stage) -> None:
    """A pipeline over several ranks: the stage module's buffers as the failed step found them, now (the next
    step is refused; on one rank the next step puts them back: Note [a step that raised])."""
    step = getattr(stage, "_step", None)
    if step is not None and step.buffers is not None and stage.group_size > 1:
        step.buffers.put_back()
        step.buffers = None


def publish_first_step_failure(stage, message: str) -> None:
    """Before a rank raises a failure told by the first step's notices (or its own shape inference's, on a
    one-rank pipeline): the message published to its data-parallel peers, once a step (Note [a first-step
    failure told to the data-parallel peers])."""
    told_every_rank(stage)  # Note [a refusal after a failure every rank raised] (step_failures.py)
    if stage.group_size > 1 or not getattr(stage, "_status_told", True):  # (one rank: a scheduled step)
        publish_failure(stage, message)


def publish_failure(stage, message: str) -> None:
    """``message`` published to the rank's data-parallel peers, once a step; withdrawn by the rank's next
    collective in each group (Note [a failure entry withdrawn at the next launch] in
    fusedist/reliability/failed_elsewhere.py)."""
    if not getattr(stage, "_published_elsewhere", None):
        stage._published_elsewhere = failed_elsewhere.publish(message) or None
        count_published(stage._published_elsewhere or [], stage)  # Note [the next step waits until the peers were told]


def exchange(stage, message, on_zeros: bool = False, verdicts=None):
    """Every rank of the pipeline: the message of the failure to tell, or None where none failed. One
    integer, the MAX over the ranks: 0 where none failed, else the rank's priority (Note [the failure
    told, of several]). ``verdicts``: the rank's pending step-check verdicts, whose flag counts as a
    failure on real inputs and which are read only after a failure (Note [the step check's verdict read
    at the step's end] in step_verdict.py)."""
    size, me = stage.group_size, stage.group_rank
    priority = 0 if message is None else (size - me) + (0 if on_zeros else size)
    flag = torch.tensor([priority], dtype=torch.int64, device=stage.device)
    if verdicts is not None and verdicts.flag is not None:  # (on the device: the host waits for nothing here)
        flag = torch.maximum(flag, (verdicts.flag != 0).to(torch.int64) * (2 * size - me))
    # Note [a pipeline's failure told to its data-parallel peers]
    published = [] if message is None else failed_elsewhere.publish(message)
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=stage.group)
    finally:
        failed_elsewhere.withdraw(published)
    top = int(flag.item())
    if top == 0:
        return None
    count_failed_step(stage)  # (a peer waiting on this rank: Note [the next step waits until the peers were told])
    if verdicts is not None:  # every rank with a flag reads its verdicts here, before the broadcast
        found = verdicts.read()
        message = message or found
    src = 2 * size - top if top > size else size - top
    if src == me and message is None:  # (a flag whose verdict then read as agreeing: cannot happen)
        message = (f"fusedist.pipelining.PipelineStage: rank {me}'s step check flagged a divergence its reading "
                   "did not confirm (no rank's step ends)")
    buffer = (_notice(stage, _FAILED, message) if src == me
              else torch.zeros(NOTICE_BYTES, dtype=torch.uint8, device=stage.device))
    dist.broadcast(buffer, group_src=src, group=stage.group)
    return notice_failure(buffer)


def received_zeros(stage, chunk: int, backward: bool) -> bool:
    """Whether the received tensors a failing pass of micro-batch ``chunk`` read were all zeros -- what a
    failing peer sends in place of its messages (Note [the failure told, of several]); read only after a
    failure."""
    groups = [(getattr(stage, "args_recv_info", None) or {}).get(chunk, ())]
    if backward and not stage.is_last:
        groups.append((getattr(stage, "grad_recv_info", None) or {}).get(chunk, ()))
    return any(_all_zeros(group) for group in groups)


def _all_zeros(infos) -> bool:
    """Received tensors (torch's receive descriptors; a model input is none) that are all zeros."""
    buffers = [getattr(i.buffer, "_local_tensor", i.buffer) for i in infos
               if not getattr(i, "is_root_arg", True) and isinstance(getattr(i, "buffer", None), torch.Tensor)]
    try:
        return bool(buffers) and not any(bool(b.any()) for b in buffers if b.numel())
    except Exception:  # noqa: BLE001 - a buffer that cannot be read counts as real input
        return False


def _complete(stage) -> list:
    """Post every receive and send (zeros) of the step that the stage has not made, in one batch."""
    n = micro_batches(stage)
    ops = [op for c in range(n) if c not in stage._fwd_recvs_made for op in stage.get_fwd_recv_ops(c)]
    ops += [op for c in range(n) if c not in stage._fwd_sends_made for op in zero_activations(stage, c)]
    if stage.has_backward:
        ops += [op for c in range(n) if c not in stage._bwd_recvs_made for op in stage.get_bwd_recv_ops(c)]
        ops += [op for c in range(n) if c not in stage._bwd_sends_made for op in zero_gradients(stage, c)]
    return dist.batch_isend_irecv(ops) if ops else []


def zero_activations(stage, chunk: int) -> list:
    """What the stage's sends of micro-batch ``chunk``'s activations would be, as zeros."""
    stage._fwd_sends_made.add(chunk)
    ops = notice_send_ops(stage, chunk)
    for idx, meta in enumerate(stage._stage_meta.outputs or ()):
        for dst in stage.act_send_info.get(idx, ()):
            if dst is not None and meta is not None:
                zeros = torch.zeros(meta.shape, dtype=meta.dtype, device=stage.device)
                ops.append(dist.P2POp(dist.isend, zeros, stage._resolve_peer_global_rank(dst), stage.group))
    return ops


def zero_gradients(stage, chunk: int) -> list:
    """What the stage's sends of micro-batch ``chunk``'s input gradients would be, as zeros (as torch's stage
    decides which to send)."""
    stage._bwd_sends_made.add(chunk)
    if stage.is_first:
        return []
    ops = back_send_ops(stage, chunk)
    if stage.grad_send_info is None:
        stage.grad_send_info = stage._create_grad_send_info(stage.args_recv_info[0])
    for idx, dst in enumerate(stage.grad_send_info):
        if dst is None:
            continue
        try:
            meta = stage._get_grad_send_meta(idx)
        except Exception:  # noqa: BLE001 - torch's stage sends nothing there either
            meta = None
        if meta is not None:
            zeros = torch.zeros(meta.shape, dtype=meta.dtype, device=stage.device)
            ops.append(dist.P2POp(dist.isend, zeros, stage._resolve_peer_global_rank(dst), stage.group))
    return ops
