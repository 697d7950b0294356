"""A step's batch that does not split into its schedule's micro-batches, refused on every rank at once.

Note [a batch smaller than n_microbatches]
    torch's schedules split the step's batch -- the first stage's inputs, the last stage's target -- into
    ``n_microbatches`` along dim 0, asserting that each tensor has at least that many rows. A smaller batch
    (the last, partial batch of an epoch read without ``drop_last``) raised there, in the schedule's ``step``
    before any message: on the rank of the first stage ("Tensor size 2 is smaller than num_chunks") and on the
    rank of the last, while a rank holding only middle stages waited for micro-batch 0's activations until the
    process group's timeout. The schedule's split of the inputs is now wrapped on the instance (at the first
    step the stage takes part in): a tensor with fewer rows than ``n_microbatches``, or a split that raised, is
    recorded instead, and the step goes on with empty micro-batches. The target is split by the schedule's
    ``step`` itself, right after the inputs, with the schedule's ``n_microbatches``: the wrapped split lends
    the schedule a count of one for it, so torch's split hands the whole target on, and the wrapper of
    ``_step_microbatches`` (Note [the targets a step was given] in schedule_step.py), the count put back,
    splits it with torch's own splitter, or -- a target with too few rows -- records it and gives every
    micro-batch the whole target. The stage that would take
    the batch -- the first stage its inputs, the last its target -- then refuses it where its forward of
    micro-batch 0 (or its shape inference) begins, naming the rows, ``n_microbatches``, the stage and its rank:
    a failure there is told to every rank of the pipeline as any other (Note [a first send that cannot be
    made] in inference.py, Note [a failure told at the step's end] in step_status.py), so
    every rank raises it at once. (The target was read from the frame of the schedule's ``step`` before; the
    count lent needs no frame.) A schedule whose ``step`` is not torch's own, or whose
    ``_step_microbatches`` takes no ``target_mbs``, keeps torch's split.

Note [inputs split along chunk specs]
    With ``args_chunk_spec`` or ``kwargs_chunk_spec`` given, the inputs' rows are not read here (a spec
    names its own dimension, or replicates): torch's split decides. A tensor shorter than
    ``n_microbatches`` along its chunk dimension does not make it raise: it hands back fewer micro-batches,
    and the schedule's check of their number ("Expecting 4 arg_mbs but got 2") raised on the first stage's
    rank alone, the others waiting for the process group's timeout -- with torch's own stage too. A split
    into another number than ``n_microbatches`` is now recorded as a short batch, and refused on every
    rank at once as above.

Note [a target of no rows]
    torch's split asserts at least one row per micro-batch, so a target of no rows (a batch of 0) raised
    ``AssertionError: Tensor size 0 is smaller than num_chunks`` on the last stage's rank, before any message,
    and the other ranks waited for the process group's timeout -- with torch's own stage too -- and no count
    lent to the split avoids that assertion. The schedule's ``step`` is wrapped on the instance where its
    split is (so from the second step the stage takes part in on): a target of no rows is recorded and a
    one-row stand-in of its dtype goes to torch's split in its place; the last stage refuses the step at
    micro-batch 0 as above, naming its rank, and every rank raises it at once. At the first step the wrapper
    is not yet in place (torch offers no hook when a schedule is built, and the ``step`` running then
    was looked up before the stage took part): there torch's assertion stands.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

_HEAD = "fusedist.pipelining.PipelineStage: "


def wrap_split(schedule) -> None:
    """Wrap the schedule's ``_split_inputs`` once (Note [a batch smaller than n_microbatches])."""
    if schedule.__dict__.get("_fusedist_split_wrapped", False):
        return
    original = schedule._split_inputs

    def splitting(args, kwargs=None):
        count = restore_count(schedule)
        schedule._fusedist_short = None
        short = _short_inputs(schedule, args, kwargs, count)
        if short is None:
            try:
                split = original(args, kwargs)
                short = _fewer_chunks(split, count)
            except Exception as e:  # noqa: BLE001 - told to every rank at micro-batch 0
                short = (f"the schedule could not split the step's inputs into n_microbatches={count} "
                         f"micro-batches: {type(e).__name__}: {e}")
        if short is not None:
            schedule._fusedist_short = ("inputs", short)
            split = [()] * count, [{}] * count
        if count and schedule.__dict__.get("_fusedist_targets_named") and _torch_step(schedule):
            schedule._fusedist_count, schedule._n_microbatches = count, 1  # (torch's split of the target next)
        return split

    schedule._split_inputs = splitting
    schedule._fusedist_split_wrapped = True
    if schedule.__dict__.get("_fusedist_targets_named") and _torch_step(schedule):
        _wrap_step_call(schedule)


def restore_count(schedule):
    """The schedule's own ``n_microbatches``, put back where its split of the target was lent a count of one."""
    count = schedule.__dict__.pop("_fusedist_count", None)
    if count is not None:
        schedule._n_microbatches = count
    return getattr(schedule, "_n_microbatches", None)


def split_targets(schedule, target_mbs):
    """The targets' list at the step's micro-batches, the count put back: the whole target torch's split handed
    on (a count of one lent) split into ``n_microbatches`` by torch's splitter; a target with fewer rows (or a
    stand-in for one of none) recorded and repeated up to the count (the last stage refuses the step at
    micro-batch 0 before reading any)."""
    lent = "_fusedist_count" in schedule.__dict__
    count = restore_count(schedule)
    empty = schedule.__dict__.pop("_fusedist_empty_target", None)
    if not lent or not count or not isinstance(target_mbs, list) or len(target_mbs) != 1:
        return target_mbs
    target = target_mbs[0]
    if empty is None and isinstance(target, torch.Tensor) and target.dim() > 0 and target.size(0) < count:
        empty = _rows_message("target", target, count)
    if empty is None:
        from torch.distributed.pipelining.microbatch import TensorChunkSpec, _split_tensor

        return list(_split_tensor(target, TensorChunkSpec(0), count))  # (torch's step: the target along dim 0)
    if schedule.__dict__.get("_fusedist_short") is None:
        schedule._fusedist_short = ("target", empty)
    return [target] * count


def refuse_short_batch(stage, kind: str, named: bool = True) -> None:
    """Raise, on the stage that takes it, the step's batch recorded as too short: ``kind`` "inputs" on the
    first stage, "target" on the last; ``named`` False where the message raised around it names the stage."""
    from .step_failures import last_schedule

    short = getattr(last_schedule(stage), "__dict__", {}).get("_fusedist_short")
    if short is None or short[0] != kind or not (stage.is_first if kind == "inputs" else stage.is_last):
        return
    where = f"stage {stage.stage_index} (rank {stage.group_rank} of the pipeline's group): " if named else ""
    raise RuntimeError(
        f"{_HEAD}{where}{short[1]}. Give "
        f"every step a batch of at least n_microbatches rows, divisible by it (with a DataLoader: "
        f"drop_last=True), or build the schedule with fewer micro-batches")


def _short_kind(schedule):
    short = schedule.__dict__.get("_fusedist_short")
    return None if short is None else short[0]


def _rows_message(what: str, tensor: torch.Tensor, count: int) -> str:
    return (f"the step's {what} (shape {tuple(tensor.shape)}) has {tensor.size(0)} rows, fewer than "
            f"n_microbatches={count}: torch's schedules split the batch along dim 0 into n_microbatches "
            "micro-batches of at least one row")


def _short_inputs(schedule, args, kwargs, count: int):
    """The message for an input tensor with fewer rows than ``count`` under torch's default split (dim 0 of
    every tensor), else None (other chunk specs: torch's split decides)."""
    if getattr(schedule, "_args_chunk_spec", None) is not None or getattr(schedule, "_kwargs_chunk_spec", None):
        return None
    for i, value in enumerate(args or ()):
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.size(0) < count:
                return _rows_message(f"input {i}", leaf, count)
    for name, value in (kwargs or {}).items():
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.size(0) < count:
                return _rows_message(f"input {name!r}", leaf, count)
    return None


def _fewer_chunks(split, count: int):
    """The message for a split of the inputs into another number of micro-batches than ``count``, else None
    (Note [inputs split along chunk specs])."""
    got = [len(part) for part in split if isinstance(part, (list, tuple))]
    if count and any(n != count for n in got):
        return (f"torch's split of the step's inputs along the schedule's chunk specs gave {min(got)} "
                f"micro-batches, not n_microbatches={count}: an input has fewer than n_microbatches rows "
                "along its chunk dimension")
    return None


def _torch_step(schedule) -> bool:
    """Whether the schedule's ``step`` is torch's own, which splits ``target`` with ``n_microbatches`` right after
    the inputs (an override may split it otherwise, or read the count for more)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    return type(schedule).step in (PipelineScheduleSingle.step, PipelineScheduleMulti.step)


def _wrap_step_call(schedule) -> None:
    """Wrap the schedule's ``step`` (``eval`` calls it) once: a target of no rows recorded, a one-row stand-in
    given to torch's split (Note [a target of no rows])."""
    original = schedule.step

    def step(*args, target=None, **kwargs):
        count = restore_count(schedule)
        if isinstance(target, torch.Tensor) and target.dim() > 0 and target.size(0) == 0 and count:
            schedule._fusedist_empty_target = _rows_message("target", target, count)
            target = target.new_zeros((1, *target.shape[1:]))
        try:
            return original(*args, target=target, **kwargs)
        finally:
            schedule.__dict__.pop("_fusedist_empty_target", None)

    schedule.step = step
