"""``static_graph=True``: parameters whose gradient arrives more than once per backward.

Note [gradients that arrive twice]
    Under reentrant activation checkpointing (``checkpoint(..., use_reentrant=True)``), a
    module called twice in one forward computes its parameters' gradient in two nested
    backward passes, and each accumulates into ``.grad`` and fires the gradient hook. A
    reducer that launches a bucket once every parameter has reported in would launch it
    after the first arrival and miss the second (torch DDP without ``static_graph`` does
    exactly that and trains silently wrong: measured 2.6e-5 off the single-process
    reference after three SGD steps). So, as torch's ``static_graph=True`` does:

    * the first synchronized backward launches every bucket at its end (no overlap, once)
      and counts each parameter's arrivals; a parameter that arrived more than once gets
      that count as its expected number of arrivals;
    * later backwards count a bucket ready only once all expected arrivals are in, and a
      bucket holding such a parameter folds no division into the copies (the second
      gradient is added in place onto the first, already divided, Note [division folded
      into the copy] in strategy.py): the whole bucket is divided at launch;
    * a parameter that arrives more often than it did in the first backward, or less
      often, means the graph is not static: an error names it.

    Without ``static_graph=True`` a second arrival raises at once, naming the parameter and
    the option, instead of reducing half a gradient. Only the rare paths live here: the
    per-parameter hook calls :func:`arrived_again` once it sees a second arrival.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .unused import late_arrival

if TYPE_CHECKING:
    from .grad_hook import ParamEntry
    from .reducer import Reducer


class ArrivalCounts:
    """The expected arrivals of the parameters that receive their gradient more than once
    per backward, learned in the first synchronized backward (Note [gradients that arrive
    twice])."""

    def __init__(self):
        self.learned = False
        self.learning = False
        self.expected: dict = {}  # parameter -> arrivals per backward (> 1 only)
        self.now: dict = {}  # parameter -> arrivals so far in this backward (second and later)
        self.extra_per_bucket: dict[int, int] = {}  # bucket index -> sum(expected - 1)
        # Note [the used map of a static graph] (unused.py): every rank's, and this rank's own.
        self.used_anywhere: Optional[list] = None
        self.local_used: Optional[list] = None

    def forget_used(self) -> None:
        """The parameters or the trainable set changed: the next backward learns the map again."""
        self.used_anywhere = self.local_used = None

    def begin(self, sync: bool) -> bool:
        """A backward begins; True if it is the one that learns (launches deferred)."""
        self.now = {}
        self.learning = sync and not self.learned
        return self.learning

    def refresh(self, reducer: "Reducer") -> None:
        """Recount the extra arrivals per bucket (the layout or the inactive set changed)."""
        extra: dict[int, int] = {}
        slots, inactive = reducer.layout.slots, reducer.inactive
        for p, count in self.expected.items():
            slot = slots.get(p)
            if slot is not None and p not in inactive:
                extra[slot.bucket.index] = extra.get(slot.bucket.index, 0) + count - 1
        self.extra_per_bucket = extra

    def finish_learning(self, reducer: "Reducer") -> None:
        self.learning, self.learned = False, True
        self.expected = {p: 1 + n for p, n in self.now.items()}
        self.refresh(reducer)

    def under_arrived(self) -> list:
        """Parameters expected more than once that arrived fewer times in this backward."""
        return [p for p, count in self.expected.items() if 1 + self.now.get(p, 0) < count]


def arrived_again(reducer: "Reducer", entry: "ParamEntry", p) -> bool:
    """A parameter's gradient arrived again in the same synchronized backward. Returns
    whether this arrival counts down its bucket (False while learning: the launches wait
    for the end of backward anyway). Raises where a second arrival is not expected."""
    if reducer.marked_unused and p in reducer.marked_unused:  # (unused.py)
        return late_arrival(reducer, entry, p)
    counts = reducer.arrivals
    name = reducer.names[entry.index]
    if counts is None:
        raise RuntimeError(
            f"fusedist DDP (rank {reducer.comm.rank}): parameter '{name}' received its gradient twice in one "
            "backward (a module called twice under reentrant activation checkpointing, or a second backward "
            "through the same graph). Pass static_graph=True to DistributedDataParallel if every iteration "
            "runs the same graph (as torch DDP requires for this), or use checkpoint(..., use_reentrant=False)"
        )
    seen = counts.now[p] = counts.now.get(p, 0) + 1
    if counts.learning:
        return False
    expected = counts.expected.get(p, 1)
    if 1 + seen > expected:
        raise RuntimeError(
            f"fusedist DDP (rank {reducer.comm.rank}): parameter '{name}' received its gradient {1 + seen} times "
            f"in this backward, {expected} in the first one; with static_graph=True every iteration must run "
            "the same graph"
        )
    return True


def check_all_arrived(reducer: "Reducer") -> None:
    """End of a synchronized backward with static_graph: every parameter that arrived more
    than once in the first backward arrived as often in this one."""
    short = reducer.arrivals.under_arrived()
    if short:
        names = [reducer.names[reducer.index_of[p]] for p in short]
        raise RuntimeError(
            f"fusedist DDP (rank {reducer.comm.rank}): parameter(s) {names[:10]} received their gradient fewer "
            "times in this backward than in the first one; with static_graph=True every iteration must run "
            "the same graph"
        )
