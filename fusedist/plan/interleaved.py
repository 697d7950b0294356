"""The interleaved 1F1B pipeline schedule (torch's ``ScheduleInterleaved1F1B``): which of its
combinations run, how many chunks a rank holds at once, its bubble and its messages.

Note [interleaved 1F1B as torch runs it]
    Each of the ``p`` ranks runs ``v`` virtual stages (stage ``s`` on rank ``s % p``, ``p·v``
    stages of about ``L / (p·v)`` blocks). torch groups the ``m`` micro-batches into
    ``r = max(1, m // p)`` rounds of ``k = m // r`` and refuses ``m`` that is not a multiple
    of ``r`` (a ValueError when the schedule is built). Rank ``i`` runs ``w_i = min((v - 1)·k
    + 2·(p - 1 - i), m·v)`` warm-up forwards, ``k`` at a time on each of its stages in turn,
    then alternates one forward and one backward, so it holds ``min(w_i + 1, m·v)`` chunks at
    its peak: the first rank ``v·p + p - 1`` of ``L / (p·v)`` blocks when ``k = p``, Megatron's
    ``1 + (p - 1) / (p·v)`` times 1F1B's ``p`` stages' worth. Which of its stages those chunks
    are on repeats every ``v·k`` operations, so the peak in bytes (the first stage also keeps
    the embedding's side, the last the output layer's) is the largest over one period.

    The bubble, from the schedule's own order with each forward and backward waiting for its
    neighbour stage: ``(p - 1) / (v·m)`` of the ideal compute time for ``m >= p``; with fewer
    micro-batches than ranks each round of stages waits for the last micro-batch to cross the
    ranks too, ``((p - 1) + (v - 1)·(p - m)) / (v·m)``. (1F1B and GPipe: ``v = 1``.)

    Messages: each micro-batch crosses ``p·v - 1`` stage boundaries, each between two ranks,
    forward and backward: ``2·m·(p·v - 1)`` sends a step over the pipeline, ``2·m·p·(v - 1)``
    more than 1F1B's; a rank in the middle sends ``2·m·v``, the first and last ``m·(2v - 1)``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Callable, Optional, Union


def rounds(pp: int, micro_batches: int) -> tuple[int, int]:
    """(rounds, micro-batches a round) as torch's ScheduleInterleaved1F1B groups them."""
    r = max(1, micro_batches // pp)
    return r, micro_batches // r


def refusal(pp: int, micro_batches: int) -> Optional[str]:
    """Why torch's ScheduleInterleaved1F1B refuses ``micro_batches`` on ``pp`` ranks, or None."""
    r, _ = rounds(pp, micro_batches)
    if micro_batches % r:
        runs = sorted({m for m in (micro_batches // r * r, (micro_batches // r + 1) * r) if m > 0})
        return (f"{micro_batches} micro-batches a step are not a multiple of the {r} rounds "
                f"(max(1, micro-batches // pp {pp})) torch's ScheduleInterleaved1F1B needs "
                f"(e.g. {' or '.join(str(m) for m in runs)})")
    return None


def warmup_forwards(rank: int, pp: int, virtual: int, micro_batches: int) -> int:
    """Forwards rank ``rank`` runs before its first backward."""
    _, per_round = rounds(pp, micro_batches)
    return min((virtual - 1) * per_round + 2 * (pp - 1 - rank), micro_batches * virtual)


def in_flight(rank: int, pp: int, virtual: int, micro_batches: int) -> int:
    """Chunks (a micro-batch on one of the rank's stages) whose activations ``rank`` holds at its peak."""
    return min(warmup_forwards(rank, pp, virtual, micro_batches) + 1, micro_batches * virtual)


def _done(ops: int, local: int, virtual: int, per_round: int) -> int:
    """Of the first ``ops`` operations that visit the stages ``per_round`` at a time in turn,
    those on local stage ``local``."""
    whole, rest = divmod(ops, virtual * per_round)
    return whole * per_round + min(max(rest - local * per_round, 0), per_round)


def peak_held(rank: int, pp: int, virtual: int, micro_batches: int,
              chunk_bytes: Callable[[int], Union[int, Fraction]]) -> Union[int, Fraction]:
    """The most bytes ``rank`` holds at once: ``chunk_bytes(local)`` for each micro-batch alive on
    its local stage ``local``, after each forward over one period of the schedule; exact (a Fraction
    where the chunks are: a tensor-parallel rank's share is rounded once, after the sum)."""
    _, per_round = rounds(pp, micro_batches)
    warm = warmup_forwards(rank, pp, virtual, micro_batches)
    sizes = [chunk_bytes(local) for local in range(virtual)]
    last = min(micro_batches * virtual, warm + virtual * per_round)
    best = 0
    for op in range(max(warm - 1, 0), last):
        backwards = max(op - warm, 0)
        held = sum(size * (_done(op + 1, local, virtual, per_round)
                           - _done(backwards, virtual - 1 - local, virtual, per_round))
                   for local, size in enumerate(sizes))
        best = max(best, held)
    return best


def bubble_ratio(pp: int, virtual: int, micro_batches: int) -> float:
    """Idle time of a rank over its compute time in a step (Note [interleaved 1F1B as torch runs it])."""
    if pp <= 1:
        return 0.0
    m = micro_batches
    waits = (pp - 1) + (virtual - 1) * max(pp - m, 0)
    return waits / (virtual * m)


def p2p_sends(pp: int, virtual: int, micro_batches: int) -> dict:
    """Activation and gradient sends a step: over the whole pipeline and from the busiest rank."""
    if pp <= 1:
        return {"total": 0, "busiest_rank": 0}
    m = micro_batches
    busiest = 2 * m * virtual if pp > 2 else m * (2 * virtual - 1)
    return {"total": 2 * m * (pp * virtual - 1), "busiest_rank": busiest}
