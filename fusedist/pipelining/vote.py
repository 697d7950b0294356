"""torch's set-up vote between a pipeline's stages, carrying each schedule's micro-batch count too, so that
schedules splitting the batch differently fail on every rank at once, before the step's first message.

Note [micro-batch counts that differ across ranks]
    Every rank builds its own schedule, ``n_microbatches`` included. A rank whose schedule splits the batch
    into another number of micro-batches than the others' (a per-rank config, a batch size derived from the
    rank's data) ran another number of forwards and backwards: the shape inference failed on the last stage
    with a size mismatch in the loss that names neither cause nor fix, or -- shapes given to the stages --
    the ranks waited on each other's missing messages until the process group's timeout, or (the
    micro-batch shapes agreeing) paired the messages of different micro-batches. torch's schedules run a
    vote across the stages at each set-up (stage 0 to the last, then back: whether every stage was given
    its shapes); here the vote carries the micro-batch count of stage 0's schedule and the first stage
    whose schedule differs, and every stage records the verdict. The set-up of the stages that follows,
    on every rank, raises it -- naming the stages, their ranks and counts -- before any message of the
    step: no message is left unmatched, the process group stays usable, and the step does not count as
    one that raised (Note [a step that raised] in step_failures.py). The vote's message is the
    stage's own (four integers, not torch's one): every stage of the pipeline is a fusedist stage.
    Each rank raising the refusal (or one of Note [stage counts that differ across ranks] in
    placement.py) first publishes it to its data-parallel peers, as a failure of the first step
    (Note [a first-step failure told to the data-parallel peers] in step_status.py): with pp x dp,
    the other pipelines waited in reductions the refusing one never issues until the collective timeout,
    and now raise the refusal about the divergence probe's delay later.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .step_failures import schedule_stepping


def _own_count(stage) -> int:
    """The micro-batch count of the schedule running this vote (0 where none is found: not checked)."""
    schedule = schedule_stepping(stage)
    return int(getattr(schedule, "_n_microbatches", 0) or 0)


def forward_vote(stage, has_backward: bool, received) -> torch.Tensor:
    """Stage 0 to the last: (every stage's vote for shapes given, stage 0's count, the first stage whose
    count differs + 1, its count)."""
    from torch.distributed.pipelining.stage import InferenceMode

    mine = 0 if InferenceMode.needs_dynamic(stage._user_meta, has_backward) else 1
    count = _own_count(stage)
    if stage.is_first:
        acc = torch.tensor([mine, count, 0, 0], dtype=torch.int64)
    else:
        if stage._is_same_rank(stage.stage_index - 1):
            acc = received.detach().cpu().clone()
        else:
            acc = torch.zeros(4, dtype=torch.int64, device=stage.device)
            dist.recv(acc, src=stage._resolve_peer_global_rank(stage.stage_index - 1), group=stage.group)
            acc = acc.cpu()
        acc[0] *= mine
        if int(acc[2]) == 0 and count and int(acc[1]) and count != int(acc[1]):
            acc[2], acc[3] = stage.stage_index + 1, count
    if not stage.is_last and not stage._is_same_rank(stage.stage_index + 1):
        dist.send(acc.to(stage.device), dst=stage._resolve_peer_global_rank(stage.stage_index + 1), group=stage.group)
    return acc


def backward_result(stage, received) -> torch.Tensor:
    """The last stage back to stage 0: the vote's outcome; records a count that differs on the stage, and
    returns torch's one-element vote (carrying the whole result to this rank's stage before)."""
    if stage.is_last or stage._is_same_rank(stage.stage_index + 1):
        result = getattr(received, "_fusedist_vote", received).detach().cpu().clone()
    else:
        result = torch.zeros(4, dtype=torch.int64, device=stage.device)
        dist.recv(result, src=stage._resolve_peer_global_rank(stage.stage_index + 1), group=stage.group)
        result = result.cpu()
    if not stage.is_first and not stage._is_same_rank(stage.stage_index - 1):
        dist.send(result.to(stage.device), dst=stage._resolve_peer_global_rank(stage.stage_index - 1),
                  group=stage.group)
    stage._counts_differ = _refusal(stage, result) if int(result[2]) else None
    vote = result[:1].to(torch.int32)  # what torch's schedule reads; the whole result for this rank's stage before
    vote._fusedist_vote = result
    return vote


def _refusal(stage, result: torch.Tensor) -> str:
    first, other, count = int(result[1]), int(result[2]) - 1, int(result[3])
    ranks = getattr(stage, "stage_index_to_group_rank", None) or {}
    return (f"fusedist.pipelining.PipelineStage: the pipeline's schedules split the batch into different numbers "
            f"of micro-batches: n_microbatches={first} at stage 0 (rank {ranks.get(0, '?')} of the pipeline's "
            f"group), n_microbatches={count} at stage {other} (rank {ranks.get(other, '?')}). Every stage runs one "
            "forward and one backward per micro-batch, so the ranks would wait on each other's missing messages "
            "or pair different micro-batches' activations. Build every rank's schedule with the same "
            "n_microbatches")
