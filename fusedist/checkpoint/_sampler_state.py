"""What a ``Checkpointer`` saves of the data position, and the check that the ranks agree.

Note [one data position for the job]
    An :class:`~fusedist.checkpoint.ElasticDistributedSampler`'s position is the job's, not a
    rank's: the number of samples of the epoch all ranks consumed together, which is what
    lets a resume at another world size re-split the rest. It is one number only while every
    rank advances alike, and the Checkpointer saved rank 0's without looking at the others:
    a rank that skipped an ``advance`` (or advanced by another batch size, or sat in another
    epoch) had its data position silently replaced by rank 0's at the next resume --
    repeating or skipping samples, with nothing to say so. Now every save compares every
    rank's sampler state (in the snapshot exchange that a save makes anyway) and refuses,
    on every rank and before anything is written, naming the ranks and their values of each
    field that differs; so does a sampler of another kind (or none) on some ranks.

    Legitimately per rank: a ``ResumableDistributedSampler``'s offset into its own share,
    saved in each rank's file and restored at the same world size only, and the RNG states.
    Those are not compared.
"""

from __future__ import annotations

from typing import Optional

from .sampler import ElasticDistributedSampler


def position(sampler) -> tuple:
    """(the sampler's kind, its state when it must be the same on every rank, else None)."""
    if sampler is None:
        return ("None", None)
    if isinstance(sampler, ElasticDistributedSampler):
        return (type(sampler).__name__, sampler.state_dict())
    return (type(sampler).__name__, None)


def disagreement(positions: list) -> Optional[str]:
    """What differs between the ranks' :func:`position`, naming the ranks, or None."""
    kinds = _by_value([kind for kind, _ in positions], str)
    if len(kinds) > 1:
        return "the sampler passed to restore() is " + _ranks(kinds)
    states = [state for _, state in positions]
    if states[0] is None:
        return None
    keys = sorted(set().union(*(state.keys() for state in states)))
    fields = []
    for key in keys:
        values = _by_value([state.get(key) for state in states])
        if len(values) > 1:
            fields.append(f"{key} is " + _ranks(values))
    return "; ".join(fields) or None


def _by_value(values: list, show=repr) -> dict:
    ranks: dict = {}
    for rank, value in enumerate(values):
        ranks.setdefault(show(value), []).append(rank)
    return ranks


def _ranks(ranks: dict) -> str:
    return ", ".join(f"{value} on ranks {rs}" for value, rs in ranks.items())
