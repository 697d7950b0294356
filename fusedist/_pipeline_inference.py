"""The shape inference torch's schedules run through a pipeline stage, kept from leaving a trace and
failing on every rank at once; and the checks of micro-batches against the shapes it inferred.

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
    refusing rank is refused too (Note [a step that raised] in pipelining.py).

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
    drops what they left (Note [a step that raised] in pipelining.py).

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
    Note [a step that raised] in pipelining.py does not count it as a step that raised). Who
    waits is known from the stages' placement: the ranks process their stages in ascending
    order (backward inference in descending order), so after stage ``k`` fails a rank holding a
    stage at or after ``k`` waits at its first such stage for the stage before it, and any other
    rank (in a step with backward) waits at its last stage for the one after it; after a failure
    in the backward inference at stage ``k`` every rank holding a stage before ``k`` waits at its
    last such stage. Each rank waits for one message, from one rank. A rank all of whose stages
    are before ``k`` in a forward-only step (or after it, failing backward) does not wait in the
    inference: it waits in the step, and that step counts as one that raised, on every rank.
"""

from __future__ import annotations

import contextlib

import torch


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
    """Refuse a stage module's output a pipeline cannot send, naming the stage and the type."""
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


def notify_waiting_ranks(stage, notice: InferenceFailed) -> bool:
    """Send ``notice`` to each rank waiting on this rank's metadata after the failure it tells
    of (Note [a shape inference that fails on one rank]); whether every rank of the pipeline
    learns of it (none has gone on into the step)."""
    placement = stage.stage_index_to_group_rank
    me, k = stage.group_rank, notice.origin
    by_rank: dict = {}
    for s, r in placement.items():
        by_rank.setdefault(r, []).append(s)
    everyone = all(any(s >= k for s in stages) if not notice.backward else any(s <= k for s in stages)
                   for stages in by_rank.values()) or (notice.has_backward and not notice.backward)
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
        if earlier and (notice.backward or notice.has_backward):  # waiting at its last stage before k
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
        return run()
    except PeerInferenceFailed as e:
        if _tell(stage, e.notice) and told is not None:
            told()
        raise RuntimeError(e.notice.message) from None
    except Exception as e:
        if stage._fusedist_meta_sent:  # (a failure of the send itself: the peer's state is unknown)
            raise
        where = "backward" if backward else "forward"
        notice = InferenceFailed(stage.stage_index, backward, has_backward, (
            f"fusedist.pipelining.PipelineStage: the pipeline's shape inference ({where}) failed at stage "
            f"{stage.stage_index} (rank {stage.group_rank} of the pipeline's group): {_described(e)}"))
        if _tell(stage, notice) and told is not None:
            told()
        raise RuntimeError(notice.message) from e


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
            f"divisible by n_microbatches ({stage.chunks}) (with a DataLoader: drop_last=True). The micro-batches "
            "before this one have run: the next step drops their losses and puts the gradients back as this step "
            "found them (a stage module that fusedist or torch reduces, once backpropagated, refuses the next step)")
