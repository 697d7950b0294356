"""What ``fully_shard`` holds, for ``memory_stats()``: sharded bytes (at rest, per model),
gathered bytes (unsharded unit buffers: now and at peak) and scratch (gradient buffers on
their way through a reduce-scatter, the no-sync accumulators and cast copies: now and at
peak). Gathered and scratch bytes are counted process-wide: the peak is the peak of the
process, whichever models were running. A unit collected while it still holds gathered bytes
(a model dropped after a forward that kept its units: ``reshard_after_forward=False``, an int,
an exception) gives them back then: its buffers are freed with it; so do the gradient
accumulators and HSDP partial sums it held as scratch (Note [held gradient buffers of a dropped
model] in grads.py)."""

from __future__ import annotations

import dataclasses
import weakref


@dataclasses.dataclass
class Counters:
    gathered: int = 0
    peak_gathered: int = 0
    scratch: int = 0
    peak_scratch: int = 0
    #: id(owner) -> [gathered bytes it holds now], for the owners that passed themselves
    _held: dict = dataclasses.field(default_factory=dict, repr=False)

    def add_gathered(self, nbytes: int, owner=None) -> None:
        self.gathered += nbytes
        self.peak_gathered = max(self.peak_gathered, self.gathered)
        if owner is not None:
            held = self._held.get(id(owner))
            if held is None:
                held = self._held[id(owner)] = [0]
                weakref.finalize(owner, self._drop, id(owner))
            held[0] += nbytes

    def _drop(self, key: int) -> None:
        """``owner`` was collected: what it held is freed with it (its id is not reused before this)."""
        self.gathered -= self._held.pop(key)[0]

    def add_scratch(self, nbytes: int) -> None:
        self.scratch += nbytes
        self.peak_scratch = max(self.peak_scratch, self.scratch)

    def reset_peaks(self) -> None:
        self.peak_gathered, self.peak_scratch = self.gathered, self.scratch


COUNTERS = Counters()


def reset_peak_memory_stats() -> None:
    """Start the peaks of ``memory_stats()`` afresh from the current figures."""
    COUNTERS.reset_peaks()


def memory_stats(units, comm=None) -> dict:
    """Bytes held by ``units`` at rest and the process-wide gathered/scratch figures.

    * ``sharded_bytes``: the rank's parameter shards (what the optimizer steps);
    * ``sharded_grad_bytes``: the storage of the gradient shards the parameters hold now
      (each storage once: the pieces' ``.grad`` are views of one shard per unit);
    * ``unsharded_bytes``/``largest_unit_bytes``: one gathered copy of every unit, and of the largest;
    * ``gathered_bytes``/``peak_gathered_bytes``: unit buffers gathered now / at most at once
      (with the parts kept after forward under an int ``reshard_after_forward``);
    * ``post_forward_bytes``: those parts ``units`` hold now (Note [resharding to a smaller
      group after forward] in post_forward.py);
    * ``scratch_bytes``/``peak_scratch_bytes``: gradient reduce buffers, accumulators, casts;
    * ``comm_scratch_bytes``: what the communicator keeps for itself (landing buffers).
    """
    units = list(units)
    grad_bytes = 0
    seen = set()
    for u in units:
        for sp in u.sharded:
            g = sp.grad
            if g is None:
                continue
            storage = g.untyped_storage()
            key = (storage.data_ptr(), g.device) if storage.nbytes() else id(g)
            if key not in seen:
                seen.add(key)
                grad_bytes += storage.nbytes()
    return {
        "sharded_bytes": sum(u.sharded_bytes for u in units),
        "sharded_grad_bytes": grad_bytes,
        "unsharded_bytes": sum(u.unsharded_bytes for u in units),
        "largest_unit_bytes": max((u.unsharded_bytes for u in units), default=0),
        "post_forward_bytes": sum(u.post_forward_bytes for u in units),
        "gathered_bytes": COUNTERS.gathered,
        "peak_gathered_bytes": COUNTERS.peak_gathered,
        "scratch_bytes": COUNTERS.scratch,
        "peak_scratch_bytes": COUNTERS.peak_scratch,
        "comm_scratch_bytes": comm.scratch_bytes() if comm is not None else 0,
    }
