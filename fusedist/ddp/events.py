"""The events a DDP gradient engine announces, for observers that watch it without changing it.

The engine (``reducer.py``) does its work -- readiness, bucket launches, finishing -- and tells
each registered :class:`EngineObserver` where it is. The reliability layer is such an observer
(``fusedist/reliability/engine_watch.py``): it counts steps, compares ranks and describes the
position for stall reports, and never touches a gradient. Observers are called in registration
order; an exception from one propagates (the reliability observer raises
``RankMismatchError`` on purpose).
"""

from __future__ import annotations


class EngineObserver:
    """Every event a no-op; subclasses override what they watch."""

    def forward_begins(self, engine) -> None:
        """A training forward (grad enabled) is about to run, before its first collective."""

    def backward_begins(self, engine) -> None:
        """The first gradient hook of a backward fired (``engine.sync``: synchronized or not)."""

    def buckets_launched(self, engine, unused: list) -> None:
        """A synchronized backward launched its last bucket collective: the same place in every
        rank's collective order. ``unused``: parameters that received no gradient."""

    def backward_ends(self, engine) -> None:
        """A backward completed (synchronized or not)."""

    def agreement_point(self, engine) -> None:
        """The engine is about to act on something the ranks must agree on (raise an error seen
        on this rank, or change its layout): an observer that knows of a disagreement between
        ranks raises it now, on every rank."""
