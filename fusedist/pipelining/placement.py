"""The pipeline's stage counts and placement compared across its ranks at each set-up, before the set-up's
first message: a rank built with another ``num_stages`` fails every rank at once, naming each rank's view.

Note [stage counts that differ across ranks]
    Every rank builds its own stages, ``num_stages`` included, and each stage finds its neighbours' ranks
    from it. A rank given another count (a per-rank config, a count derived from the rank's model part) or
    stage indices another rank holds too sent its messages to ranks not waiting for them: torch's set-up vote
    then paired one stage's forward vote with another's backward result, and the ranks waited on each other
    until the process group's timeout (torch's own stage alike: 30 minutes by default, with an error naming
    no stage). At each set-up (first step, a switch between training and ``eval``) the rank's first stage
    in the vote gathers, over the pipeline's group, each rank's ``num_stages`` and its stages' indices (one
    small all-gather of a fixed width, room for ``_SLOTS`` indices a rank: a second, as wide as the most
    stages a rank holds, only where a rank holds more), before the vote's first message. Where the counts
    differ, or a stage index is held by no rank or by two, every rank raises the same message, naming each
    rank's count and stages: no message of the step is left unmatched, and the step does not count as one
    that raised (Note [a step that raised] in step_failures.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def check_placement(stage, stages: list) -> None:
    """Raise on every rank of ``stage``'s pipeline group where the ranks' stage counts or stage indices
    do not form one pipeline. ``stages``: this rank's stages in the schedule stepping."""
    mine = sorted(s.stage_index for s in stages)
    counts = {s.num_stages for s in stages}
    count = counts.pop() if len(counts) == 1 else _SEVERAL  # (told to the other ranks too, then raised)
    if stage.group_size == 1:
        held = {stage.group_rank: (count, mine)}
    else:
        rows = _gathered(stage, [count, len(mine)] + _padded(mine, _SLOTS))
        width = max(n for _, n, *_ in rows)
        indices = [row[2:] for row in rows] if width <= _SLOTS else _gathered(stage, _padded(mine, width))
        held = {r: (rows[r][0], [i for i in indices[r] if i >= 0]) for r in range(stage.group_size)}
    problem = _problem(held)
    if problem is not None:
        raise RuntimeError(_message(held, problem))


def _gathered(stage, values: list) -> list:
    """``values`` (integers, as many on every rank) of every rank of the stage's group, in rank order."""
    mine = torch.tensor(values, dtype=torch.int64, device=stage.device)
    every = [torch.empty_like(mine) for _ in range(stage.group_size)]
    dist.all_gather(every, mine, group=stage.group)
    return [t.cpu().tolist() for t in every]


def _padded(indices: list, width: int) -> list:
    """The indices in ``width`` slots, -1 in those left (all of them where there are more: gathered again)."""
    return indices + [-1] * (width - len(indices)) if len(indices) <= width else [-1] * width


#: the count a rank whose own stages were built with different ``num_stages`` gathers
_SEVERAL = -1
#: the stage indices a rank sends in the one all-gather of a set-up (interleaved schedules hold a few a rank)
_SLOTS = 8


def _problem(held: dict):
    """What keeps the ranks' views from forming one pipeline, or None."""
    counts = {count for count, _ in held.values()}
    if _SEVERAL in counts:
        return "the stages of one rank were built with different num_stages"
    if len(counts) > 1:
        return "the ranks were built with different num_stages"
    (count,) = counts
    indices = [i for _, mine in held.values() for i in mine]
    if sorted(indices) != list(range(count)):
        return f"the stage indices do not cover 0..{count - 1} once each"
    return None


def _message(held: dict, problem: str) -> str:
    views = "; ".join(f"rank {r}: num_stages={'several' if count == _SEVERAL else count}, stages {mine}"
                      for r, (count, mine) in sorted(held.items()))
    return (f"fusedist.pipelining.PipelineStage: the pipeline's stages do not agree: {problem} ({views}, ranks "
            "of the pipeline's group). Each stage sends to the ranks its num_stages places its neighbours on, so "
            "the ranks would wait on each other's messages until the group's timeout. Build every rank's stages "
            "with the same num_stages, each stage index on exactly one rank")
