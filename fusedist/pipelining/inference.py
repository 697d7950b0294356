"""The shape inference torch's schedules run through a pipeline stage, kept from leaving a trace and
failing on every rank at once; the checks of micro-batches against the shapes it inferred (or the user
gave), and a first send that cannot be made failing on the receiving rank too.

Note [shape inference leaves the stage as it was]
    torch's schedules learn the shapes a stage sends and receives by running its module once
    before the first step (and again when a schedule turns from training steps to ``eval``
    steps or back): the first stage on micro-batch 0, every later stage on uninitialized
    tensors (``torch.empty`` of the shapes received). Whatever that forward updated in place
    stayed: a BatchNorm's running statistics took micro-batch 0 once more on the first stage
    and garbage (inf or nan) on the others, and counted one batch more -- silently, torch's
    own stage alike: an ``eval()`` of the model then normalized by inf. (torch forks the random
    generators around the inference itself.) Here the inference runs over copies of the
    module's buffers (a transient copy, once per schedule switch), the module's own put back
    after it, so training starts from the statistics the user left.

Note [micro-batches of another shape]
    torch's stages receive each micro-batch's activations into buffers allocated once, at the
    first step, from micro-batch 0's shapes. A batch that ``n_microbatches`` does not divide
    (``tensor_split`` makes micro-batches of 3, 3, 2, 2 rows), or a later batch of another
    size, then failed far from its cause: gloo aborted the receiving process ("Received data
    size doesn't match expected size"), or a smaller micro-batch landed in the first rows of a
    larger buffer and the last stage's loss failed ("size of tensor a (3) must match b (2)")
    -- or, with a loss that broadcasts, trained on the stale rows silently. Only the sender
    can see the mismatch: the first stage checks each micro-batch's inputs (it is given them),
    and any stage whose next stage is on another rank checks its outputs against the buffers
    there, before they are sent. Later stages see only their fixed buffers; they learn of the
    error when the first stage's process ends (gloo: "Connection closed by peer"), or at the
    group's timeout. In a first step the buffers are sized from micro-batch 0, the largest of an
    uneven split: the first smaller micro-batch is refused, the ones before it already sent.
    Either way the step raised before its end with the other ranks in it: the next step on the
    refusing rank is refused too (Note [a step that raised] in step_failures.py).

Note [uneven micro-batches on one rank]
    A pipeline whose stages are all on one rank passes tensors as they are, so a later batch of
    another size (another sequence length) is right there and left alone. A batch that
    ``n_microbatches`` does not divide is not: torch's schedules ran it, and divided the sum of
    the micro-batches' gradients by ``n_microbatches``, weighting each micro-batch's loss alike
    -- with a mean loss the rows of the smaller micro-batches counted more than the others', a
    gradient the unpipelined model on that batch does not give (by ~lr-sized amounts), and a
    batch the same pipeline over several ranks refuses. The first stage of such a pipeline
    refuses, in a step with backward, a micro-batch whose inputs differ in shape from the
    step's micro-batch 0 (a forward-only step computes no gradient and is left alone). It can
    only see one micro-batch at a time, so the micro-batches before it have run: the next step
    drops what they left (Note [a step that raised] in step_failures.py). A schedule
    built with ``scale_grads=False`` divides nothing: with a loss that sums (what torch's schedules
    document for it) the micro-batches' gradients add up to the batch's, evenly split or not, so
    its steps are not refused (they were, though torch's stage gives the batch's gradient there).

Note [a shape inference that fails on one rank]
    torch's shape inference passes each stage's output metadata to the next stage's rank
    (and, before a training step, the input gradients' metadata back). A stage whose inference
    raised -- its module returned something other than tensors, which a stage cannot send, or
    its forward failed -- raised on its own rank only: the ranks waiting for its metadata
    waited until the process group's timeout (30 minutes by default), in torch's own stage
    alike. Here a stage whose inference raises before sending sends a failure notice in place
    of its metadata to each rank waiting on this rank, and a rank receiving one raises the
    same message, naming the stage where it began, and passes it on the same way: every rank
    of the pipeline fails at once, and no message is left unmatched (the process group stays
    usable, and the next step -- on a batch the module takes, say -- runs the inference again:
    Note [a step that raised] in step_failures.py does not count it as a step that raised). Who
    waits is known from the stages' placement: the ranks process their stages in ascending
    order (backward inference in descending order), so after stage ``k`` fails a rank holding a
    stage at or after ``k`` waits at its first such stage for the stage before it, and any other
    rank waits at its last stage for the one after it; after a failure in the backward inference
    at stage ``k`` every rank holding a stage before ``k`` waits at its last such stage. Each rank
    waits for one message, from one rank. A forward-only (``eval``) set-up has no backward
    inference to wait in: a rank all of whose stages were before ``k`` went on into the step and
    waited there, on activations sent to a rank that had raised, until the group's timeout. So an
    eval set-up ends with an acknowledgement from the end of the pipeline back: each rank, at its
    last stage, waits for one (a small object message) from the rank of the stage after it, which
    sends it once its own inference (and acknowledgement) succeeded -- or the failure notice in its
    place. (A rank all of whose stages are after ``k``, failing backward, still waits in the step,
    which counts as one that raised, on every rank.)

Note [a first send that cannot be made]
    With shapes given to the stages (``input_args``/``output_args`` on every stage: torch's
    schedules then skip the shape inference), a stage module returning something a stage cannot
    send -- a dict, None, a tuple holding a non-tensor, more or fewer tensors than its
    ``output_args`` -- failed at its first forward on its own rank only (torch's stage: an
    ``AttributeError`` of ``detach`` from inside the send), while the next stage's rank waited for
    the activations until the process group's timeout. Here the stage checks what it is about to
    send against its ``output_args``, and in the first step after the schedule sets the stages up
    (its first, or the first after a switch between training steps and ``eval``), micro-batch 0's
    activations across each rank boundary travel behind a small status message (one per
    boundary and set-up, ``NOTICE_BYTES``). A stage whose forward of that micro-batch raised
    sends, in their place, the failure's message and zeros of the shapes the receiver expects, so
    that the receive completes (waiting up to ``NOTICE_WAIT_S`` for it to be taken: a process
    ending right after the error would drop them unsent); the receiving rank raises the same
    message, naming the stage and what it returned against what was expected, and passes it on
    the same way to the next rank boundary. The step counts as one that raised (Note [a step that
    raised] in step_failures.py): other messages of the step may be left unmatched, so every later
    step is refused and the fix is a restart. Later micro-batches and steps are checked on the
    sender only (as after a shape inference): a module whose output changes kind after its first
    micro-batch still leaves the receiver waiting for the timeout. A rank holding only stages
    before the failing one (rank 0 when stage 1 of a three-rank pipeline fails) waits for
    gradients: it is told in place of micro-batch 0's gradient (Note [a first send that cannot be
    made, told upstream] in notice_back.py).

Note [a loss without a target]
    A schedule built with a ``loss_fn`` calls it on the last stage's output of each micro-batch and
    that micro-batch's target, in ``eval`` steps too (the losses are returned through ``losses=``).
    ``eval(x)`` on the last stage's rank without ``target=`` raised torch's ``TypeError: 'NoneType' object
    is not subscriptable`` from the schedule's own code (told to every rank: Note [a failure told at the
    step's end] in step_status.py), which names neither the cause nor the fix. The last stage
    checks that a schedule with a ``loss_fn`` got a target (recorded from the schedule's step: Note
    [the targets a step was given] in schedule_step.py) in its shape inference and at its
    forward of micro-batch 0, and raises there, naming both; every rank learns of it at once (Note [a shape
    inference that fails on one rank], or at the step's end).

Note [examples that need no gradient]
    torch's stage given its shapes (``input_args`` and ``output_args``: no shape inference) takes
    from each example whether a gradient crosses the stage boundary for that tensor: an
    ``output_args`` example that does not require a gradient made the stage expect none back, a
    later stage's ``input_args`` example like it made that stage send none. Examples made the usual
    way (``torch.zeros(shape)``) thus broke the first training step: the stage's backward failed on
    its rank ("grad can be implicitly created only for scalar outputs") while the next stage's rank
    waited for its activations -- or, the two sides' examples disagreeing, a rank waited for a
    gradient never sent until the group's timeout. torch's shape inference makes every
    floating-point activation between stages carry a gradient in a training step; with shapes given
    the stage does the same, on both sides of every boundary (the examples' shapes and dtypes are
    kept), so the two sides agree and training gives the unpipelined model's gradients. An
    activation its stage makes without a gradient (a frozen stage's output) still works, as under
    shape inference: the gradient sent back for it is dropped. Gradient examples given too
    (``output_grads``/``input_grads``, which DTensors need) decide for their side, as in torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from typing import Optional

import torch
import torch.distributed as dist

# The status message ahead of a first send (Note [a first send that cannot be made]): one status
# byte, then the failure's message, UTF-8, cut to fit.
NOTICE_BYTES = 2048
_SENT, _FAILED = 1, 2
# How long a failing stage waits for the receiver to take its notice before raising anyway.
NOTICE_WAIT_S = 10.0


def activations_carry_gradients(stage) -> None:
    """With shapes given (static set-up): every floating-point example crossing a stage boundary needs a
    gradient, as torch's shape inference decides (Note [examples that need no gradient]); eval steps
    still receive without one (torch reads ``has_backward`` at each receive)."""
    from torch.distributed.pipelining._utils import _TensorMeta

    def needing(metas):
        return tuple(dataclasses.replace(m, requires_grad=True) if type(m) is _TensorMeta and not m.requires_grad
                     and m.dtype.is_floating_point else m for m in metas)

    meta = stage._user_meta
    if not stage.is_last and meta.outputs is not None and meta.output_grads is None:
        meta.outputs = needing(meta.outputs)
    if not stage.is_first and meta.inputs is not None and meta.input_grads is None:
        meta.inputs = needing(meta.inputs)


@contextlib.contextmanager
def over_copied_buffers(module: torch.nn.Module):
    """Run the block over copies of the module's buffers (Note [shape inference leaves the
    stage as it was]). The originals are put back untouched: the inference's graph, which
    torch's backward inference runs later, holds the copies (a BatchNorm saves its running
    statistics for its backward)."""
    saved = [(owner, name, buf) for owner in module.modules() for name, buf in owner._buffers.items()
             if buf is not None]
    try:
        for owner, name, buf in saved:
            owner._buffers[name] = buf.detach().clone()
        yield
    finally:
        for owner, name, buf in saved:
            owner._buffers[name] = buf


class InferenceFailed:
    """The notice a stage sends in place of its metadata when its shape inference raised."""

    def __init__(self, origin: int, backward: bool, has_backward: bool, message: str):
        self.origin, self.backward, self.has_backward, self.message = origin, backward, has_backward, message


class PeerInferenceFailed(Exception):
    """A notice received in place of a peer stage's metadata."""

    def __init__(self, notice: InferenceFailed):
        super().__init__(notice.message)
        self.notice = notice


def check_stage_outputs(stage, outputs) -> None:
    """Refuse a stage module's output a pipeline cannot send, naming the stage and the type (and, on
    the last stage, a step without the target its loss needs: Note [a loss without a target])."""
    if stage.is_last:
        check_target_given(stage)
    sequence = isinstance(outputs, (tuple, list))
    for i, value in enumerate(outputs if sequence else (outputs,)):
        if isinstance(value, torch.Tensor):
            continue
        what = (f"a {type(outputs).__name__} whose output {i} is {type(value).__name__}" if sequence
                else type(value).__name__)
        raise RuntimeError(
            f"fusedist.pipelining.PipelineStage: stage {stage.stage_index}'s module returned {what}, not a tensor: "
            "pipeline stages pass tensors only (a tensor, or a tuple or list of tensors) to the next stage. Return "
            "tensors; pass other values as keyword arguments of schedule.step(...)")


def check_target_given(stage) -> None:
    """Refuse a step without ``target=`` of a schedule with a ``loss_fn`` (Note [a loss without a target]),
    from the last stage's shape inference or its forward of micro-batch 0, where the failure reaches
    every rank."""
    from .schedule_step import targets_given
    from .step_failures import last_schedule

    schedule = last_schedule(stage)
    targets = targets_given(schedule)  # Note [the targets a step was given] (schedule_step.py)
    if targets is None or targets[0] is not None or getattr(schedule, "_loss_fn", None) is None:
        return  # (None: not in a schedule's step -- the stage driven by hand)
    call = "step" if getattr(schedule, "_has_backward", False) else "eval"
    raise RuntimeError(
        f"fusedist.pipelining.PipelineStage: stage {stage.stage_index} (the last, rank {stage.group_rank} of the "
        f"pipeline's group): schedule.{call}(...) was given no target, but the schedule was built with a loss_fn, "
        f"which the last stage calls on each micro-batch's output and target. Pass target= to schedule.{call} on "
        "the last stage's rank, or (to run forward only, without losses) build the schedule without loss_fn")


def check_sent_outputs(stage, chunk: int, outputs) -> None:
    """Refuse outputs a stage cannot send to the next stage (Note [a first send that cannot be
    made]), naming the stage, the micro-batch, what the module returned and what was expected."""
    meta = getattr(stage, "_stage_meta", None)
    expected = None if meta is None else meta.outputs
    values = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    bad = next(((i, v) for i, v in enumerate(values) if not isinstance(v, torch.Tensor)), None)
    if bad is None and (expected is None or len(values) == len(expected)):
        return
    if bad is not None and not isinstance(outputs, (tuple, list)):
        got = f"its module returned {_kind(outputs)}"
    elif bad is not None:
        got = f"output {bad[0]} of the {type(outputs).__name__} its module returned is {_kind(bad[1])}"
    else:
        got = f"its module returned {len(values)} tensors"
    source = ("the stage's output_args" if getattr(getattr(stage, "_inference_mode", None), "value", None) == "static"
              else "as inferred")
    wanted = ("tensors" if expected is None else
              f"{len(expected)} tensor{'s' if len(expected) != 1 else ''} ("
              + ", ".join(f"{tuple(m.shape)} {m.dtype}" for m in expected) + f", {source})")
    raise RuntimeError(
        f"fusedist.pipelining.PipelineStage: stage {stage.stage_index} (rank {stage.group_rank} of the pipeline's "
        f"group), micro-batch {chunk}: {got}, expected {wanted} to send to stage {stage.stage_index + 1}: pipeline "
        "stages pass tensors only (a tensor, or a tuple or list of tensors) to the next stage. Return those "
        "tensors; pass other values as keyword arguments of schedule.step(...)")


def _kind(value) -> str:
    name = type(value).__name__
    return "None" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class PeerFailedFirstSend(Exception):
    """A failure notice received in place of a previous stage's first activations."""


def arm_first_sends(stage) -> None:
    """After the schedule set the stage up: whether its next first send, and first receive, across
    a rank boundary carry a status message (shapes given by the user: no inference ran)."""
    mode = getattr(stage, "_inference_mode", None)
    static = getattr(mode, "value", None) == "static"
    ranks = getattr(stage, "stage_index_to_group_rank", None) or {}
    here = stage.group_rank
    stage._notice_to = static and not stage.is_last and ranks.get(stage.stage_index + 1, here) != here
    stage._notice_from = static and not stage.is_first and ranks.get(stage.stage_index - 1, here) != here
    stage._notice_buffer = None


def notice_recv_ops(stage, chunk: int) -> list:
    """The receive of the status ahead of micro-batch 0's activations, when armed."""
    if chunk != 0 or not getattr(stage, "_notice_from", False):
        return []
    stage._notice_buffer = torch.zeros(NOTICE_BYTES, dtype=torch.uint8, device=stage.device)
    peer = stage._resolve_peer_global_rank(stage.stage_index - 1)
    return [dist.P2POp(dist.irecv, stage._notice_buffer, peer, stage.group)]


def notice_send_ops(stage, chunk: int) -> list:
    """The status ahead of micro-batch 0's activations, when armed: sent."""
    if chunk != 0 or not getattr(stage, "_notice_to", False):
        return []
    stage._notice_to = False
    peer = stage._resolve_peer_global_rank(stage.stage_index + 1)
    return [dist.P2POp(dist.isend, _notice(stage, _SENT, ""), peer, stage.group)]


def read_notice(stage, chunk: int) -> None:
    """Raise the failure a previous stage's rank sent in place of micro-batch 0's activations (or, on the
    last stage, a step without the target its loss needs)."""
    if chunk == 0 and stage.is_last:  # (the first hook of the last stage's step: Note [a loss without a target])
        check_target_given(stage)
    buffer = getattr(stage, "_notice_buffer", None) if chunk == 0 else None
    if buffer is None or not getattr(stage, "_notice_from", False):
        return
    stage._notice_from, stage._notice_buffer = False, None
    failure = notice_failure(buffer)
    if failure is not None:
        raise PeerFailedFirstSend(failure)


def notice_failure(buffer: torch.Tensor):
    """The failure message a received status notice carries, or None where it says "sent"."""
    data = buffer.cpu()
    return bytes(data[1:].tolist()).rstrip(b"\0").decode("utf-8", "replace") if int(data[0]) == _FAILED else None


def failure_message(stage, chunk: int, error: Exception, where: str = "") -> str:
    """The message every rank raises: the stage, its rank, the micro-batch (``where``: "'s loss", "'s
    backward") and the exception that began it; a stage's own refusal, which names them, as it is."""
    text = str(error)
    if text.startswith("fusedist.pipelining.PipelineStage: "):
        return text
    me = dist.get_rank() if dist.is_initialized() else stage.group_rank
    rank = f"rank {stage.group_rank} of the pipeline's group" + (f", global rank {me}" if me != stage.group_rank
                                                                  else "")
    return (f"fusedist.pipelining.PipelineStage: stage {stage.stage_index} ({rank}) failed at micro-batch "
            f"{chunk}{where}: {_root_cause(error)}")


def send_failure(stage, chunk: int, error: Exception, message: Optional[str] = None) -> str:
    """After the stage's forward of micro-batch 0 raised: tell the next stage's rank (the message and
    zeros of the shapes it receives into) when its receive waits on this send; the message (``message``: the
    one to tell, else made from ``error``)."""
    if message is None:
        message = str(error) if isinstance(error, PeerFailedFirstSend) else failure_message(stage, chunk, error)
    if chunk != 0 or not getattr(stage, "_notice_to", False):
        return message
    stage._notice_to = False
    peer = stage._resolve_peer_global_rank(stage.stage_index + 1)
    zeros = [torch.zeros(m.shape, dtype=m.dtype, device=stage.device) for m in stage._stage_meta.outputs or ()]
    works = [dist.isend(t, peer, group=stage.group) for t in [_notice(stage, _FAILED, message), *zeros]]
    try:  # (a process ending at once would drop them unsent); bounded: a receiver elsewhere never takes them
        for work in works:
            work.wait(timeout=datetime.timedelta(seconds=NOTICE_WAIT_S))
    except Exception:  # noqa: BLE001 - the failure being told of is the error to raise
        stage._notice_works = works  # (kept alive with their tensors until taken)
    return message


def _root_cause(error: Exception) -> str:
    """The exception that began it: torch's stage wraps a module's exception in a RuntimeError listing
    the arguments' shapes, whose own message does not say what failed."""
    root = error
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    return f"{type(root).__name__}: {root}"


def _notice(stage, status: int, message: str) -> torch.Tensor:
    text = message.encode("utf-8")[:NOTICE_BYTES - 1]
    data = torch.zeros(NOTICE_BYTES, dtype=torch.uint8)
    data[0] = status
    data[1:1 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    return data.to(stage.device)


def _stages_by_rank(placement: dict) -> dict:
    """Each rank of the pipeline's group -> the indices of the stages it holds."""
    by_rank: dict = {}
    for s, r in placement.items():
        by_rank.setdefault(r, []).append(s)
    return by_rank


def notify_waiting_ranks(stage, notice: InferenceFailed) -> bool:
    """Send ``notice`` to each rank waiting on this rank's metadata after the failure it tells
    of (Note [a shape inference that fails on one rank]); whether every rank of the pipeline
    learns of it (none has gone on into the step)."""
    placement = stage.stage_index_to_group_rank
    me, k = stage.group_rank, notice.origin
    by_rank = _stages_by_rank(placement)
    everyone = all(any(s >= k for s in stages) if not notice.backward else any(s <= k for s in stages)
                   for stages in by_rank.values()) or not notice.backward
    for r, stages in sorted(by_rank.items()):
        if r == me:
            continue
        later = [s for s in stages if s >= k]
        if later and not notice.backward:  # waiting at its first stage from k on, for the stage before
            first = min(later)
            if first > k and placement.get(first - 1) == me:
                stage._send_meta(notice, first)
            continue
        earlier = [s for s in stages if s < k]
        if earlier:  # waiting at its last stage before k (an eval set-up: for the acknowledgement)
            last = max(earlier)
            if placement.get(last + 1) == me:
                stage._send_meta(notice, last)
    return everyone


def failing_inference(stage, run, backward: bool, has_backward: bool, told=None):
    """``run()`` (one of torch's shape inference passes); if it raises before this stage sent its
    metadata, the ranks waiting on this one are told, and a notice received is raised here;
    ``told()`` runs when every rank of the pipeline learns of the failure, none left in a step."""
    stage._fusedist_meta_sent = False
    try:
        result = run()
        if not backward and not has_backward:  # an eval set-up
            acknowledge_inference(stage)
        return result
    except PeerInferenceFailed as e:
        _publish(stage, e.notice.message)
        if _tell(stage, e.notice) and told is not None:
            told()
        raise RuntimeError(e.notice.message) from None
    except Exception as e:
        if stage._fusedist_meta_sent:  # (a failure of the send itself: the peer's state is unknown)
            raise
        where = "backward" if backward else "forward"
        notice = InferenceFailed(stage.stage_index, backward, has_backward, _told_elsewhere(e) or (
            f"fusedist.pipelining.PipelineStage: the pipeline's shape inference ({where}) failed at stage "
            f"{stage.stage_index} (rank {stage.group_rank} of the pipeline's group): {_described(e)}"))
        _publish(stage, notice.message)
        if _tell(stage, notice) and told is not None:
            told()
        raise RuntimeError(notice.message) from e


def _publish(stage, message: str) -> None:
    """The failure published to the rank's data-parallel peers before it is raised (Note [a first-step failure
    told to the data-parallel peers] in step_status.py)."""
    from .step_status import publish_first_step_failure

    publish_first_step_failure(stage, message)


def _told_elsewhere(error: Exception):
    """The failure a data-parallel peer published, where ``error`` is a wait it ended; else None."""
    from ..reliability import failed_elsewhere

    return failed_elsewhere.failure_told(error)


_INFERRED = "fusedist.pipelining: shapes inferred"


def acknowledge_inference(stage) -> None:
    """At a rank's last stage of an eval set-up: wait for the next rank's acknowledgement that the
    inference succeeded from there on (a failure notice is raised, as PeerInferenceFailed), then
    acknowledge to each rank whose last stage sends to this rank (Note [a shape inference that
    fails on one rank])."""
    placement = getattr(stage, "stage_index_to_group_rank", None) or {}
    me = stage.group_rank
    by_rank = _stages_by_rank(placement)
    if stage.stage_index != max(by_rank.get(me, [stage.stage_index])):
        return
    following = stage.stage_index + 1
    if placement.get(following, me) != me:
        received = stage._recv_meta(following)
        if received != _INFERRED:
            raise RuntimeError(
                f"fusedist.pipelining.PipelineStage: stage {stage.stage_index} (rank {me} of the pipeline's group) "
                f"received {type(received).__name__} from stage {following} in place of the acknowledgement that "
                "the eval set-up's shape inference succeeded: the ranks run different schedules or set-ups")
    for r, stages in sorted(by_rank.items()):
        if r != me and placement.get(max(stages) + 1) == me:
            stage._send_meta(_INFERRED, max(stages))


def _tell(stage, notice: InferenceFailed) -> bool:
    try:
        return notify_waiting_ranks(stage, notice)
    except Exception:  # noqa: BLE001 - the failure being told of is the error to raise
        return False


def _described(error: Exception) -> str:
    text = str(error)
    prefix = "fusedist.pipelining.PipelineStage: "
    return text[len(prefix):] if text.startswith(prefix) else f"{type(error).__name__}: {text}"


def next_on_another_rank(stage) -> bool:
    ranks = getattr(stage, "stage_index_to_group_rank", None)
    return ranks is not None and ranks.get(stage.stage_index + 1, stage.group_rank) != stage.group_rank


def check_shapes(stage, chunk: int, kind: str, metas, values) -> None:
    """Refuse a micro-batch whose tensors differ from the shapes the receive buffers were made
    for (Note [micro-batches of another shape]), naming the stage, the micro-batch and both shapes."""
    if metas is None:
        return
    values = values if isinstance(values, (tuple, list)) else (values,)
    for i, (meta, value) in enumerate(zip(metas, values)):
        if meta is None or not isinstance(value, torch.Tensor):
            continue
        local = getattr(value, "_local_tensor", value)  # a DTensor's metadata is its local shard's
        if tuple(local.shape) == tuple(meta.shape) and local.dtype == meta.dtype:
            continue
        if kind == "input":
            fix = (f"Give each step a batch of the same size, divisible by n_microbatches ({stage.chunks}) (with a "
                   "DataLoader: drop_last=True, so the last batch is not smaller)")
        else:
            fix = "Make the stage's outputs keep their shapes from micro-batch to micro-batch (pad or trim them)"
        raise RuntimeError(
            f"fusedist.pipelining.PipelineStage: stage {stage.stage_index}, micro-batch {chunk}: {kind} {i} has "
            f"shape {tuple(local.shape)} ({local.dtype}), expected {tuple(meta.shape)} ({meta.dtype}): the "
            "pipeline's stages receive into buffers sized from micro-batch 0 of its first step, so every "
            f"micro-batch of every step must have that shape. {fix}")


def check_even_split(stage, chunk: int, args) -> None:
    """Refuse a micro-batch of another shape than the step's micro-batch 0 (Note [uneven
    micro-batches on one rank]), naming the stage, the micro-batch and both shapes."""
    args = args if isinstance(args, (tuple, list)) else (args,)
    shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args]
    if chunk == 0:
        stage._first_shapes = shapes
        return
    first = getattr(stage, "_first_shapes", None)
    for i, (shape, expected) in enumerate(zip(shapes, first or ())):
        if shape is None or expected is None or shape == expected:
            continue
        raise RuntimeError(
            f"fusedist.pipelining.PipelineStage: stage {stage.stage_index}, micro-batch {chunk}: input {i} has shape "
            f"{shape}, micro-batch 0 of this step {expected}: the step's batch does not split into {stage.chunks} "
            "equal micro-batches. torch's schedules divide the micro-batches' summed gradients by n_microbatches, "
            "weighting every micro-batch's loss alike, so with a mean loss the rows of the smaller micro-batches "
            "would count more than the others' and the gradient would not be the batch's. Give each step a batch "
            f"divisible by n_microbatches ({stage.chunks}) (with a DataLoader: drop_last=True), or, with a loss that "
            "sums, build the schedule with scale_grads=False. The micro-batches before this one have run: the next "
            "step drops their losses and puts the gradients back as this step found them (a stage module that "
            "fusedist or torch reduces, once backpropagated, refuses the next step)")
