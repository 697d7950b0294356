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
    ``step`` itself, right after the inputs: a target the ``step`` call was given (its public ``target``
    argument) with too few rows is recorded too, and split into one micro-batch for the schedule's count's
    duration, the count restored and the targets' list filled up to it where the step's micro-batches begin
    (Note [the targets a step was given] in _pipeline_schedule_step.py wraps them). The stage that would take
    the batch -- the first stage its inputs, the last its target -- then refuses it where its forward of
    micro-batch 0 (or its shape inference) begins, naming the rows, ``n_microbatches``, the stage and its rank:
    a failure there is told to every rank of the pipeline as any other (Note [a first send that cannot be
    made] in _pipeline_inference.py, Note [a failure told at the step's end] in _pipeline_step_status.py), so
    every rank raises it at once. A target of no rows, and a ``step`` override without a ``target`` argument,
    are left to torch's split.
"""

from __future__ import annotations

import sys

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
            except Exception as e:  # noqa: BLE001 - told to every rank at micro-batch 0
                short = (f"the schedule could not split the step's inputs into n_microbatches={count} "
                         f"micro-batches: {type(e).__name__}: {e}")
        if short is not None:
            schedule._fusedist_short = ("inputs", short)
            split = [()] * count, [{}] * count
        _note_short_target(schedule, sys._getframe(1), count)
        return split

    schedule._split_inputs = splitting
    schedule._fusedist_split_wrapped = True


def restore_count(schedule):
    """The schedule's own ``n_microbatches``, put back where a short target lent it another for its split."""
    count = schedule.__dict__.pop("_fusedist_count", None)
    if count is not None:
        schedule._n_microbatches = count
    return getattr(schedule, "_n_microbatches", None)


def fill_targets(schedule, target_mbs):
    """The targets' list at the step's micro-batches: the count restored, a short target's one micro-batch
    repeated up to it (the last stage refuses the step at micro-batch 0 before reading any)."""
    count = restore_count(schedule)
    if count and isinstance(target_mbs, list) and 0 < len(target_mbs) < count and _short_kind(schedule):
        return target_mbs + [target_mbs[-1]] * (count - len(target_mbs))
    return target_mbs


def refuse_short_batch(stage, kind: str, named: bool = True) -> None:
    """Raise, on the stage that takes it, the step's batch recorded as too short: ``kind`` "inputs" on the
    first stage, "target" on the last; ``named`` False where the message raised around it names the stage."""
    from ._pipeline_step_failures import last_schedule

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


def _note_short_target(schedule, frame, count: int) -> None:
    """Record the ``target`` of the schedule's ``step`` call (``frame``) if it has fewer rows than ``count``
    (but some), and lend the schedule a count of one for torch's split of it."""
    if frame is None or frame.f_locals.get("self") is not schedule or "target" not in frame.f_code.co_varnames:
        return
    target = frame.f_locals.get("target")
    if not isinstance(target, torch.Tensor) or target.dim() == 0 or not 0 < target.size(0) < count:
        return
    if schedule._fusedist_short is None:
        schedule._fusedist_short = ("target", _rows_message("target", target, count))
    schedule._fusedist_count = count
    schedule._n_microbatches = 1
