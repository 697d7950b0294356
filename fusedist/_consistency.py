"""Cross-rank agreement checks that fail on *every* rank with the same readable message.

torch's checks raise on the rank that notices and leave the others blocked in the next
collective ("connection closed by peer"). Here each rank all-gathers a small description
(a fingerprint), every rank compares all of them, so every rank reaches the same verdict
and raises the same error naming the first difference and the ranks involved.
"""

from __future__ import annotations

from typing import Any, Sequence

from .comm import Communicator
from .comm.objects import all_gather_object


class RankMismatchError(RuntimeError):
    """Ranks disagree about something that must be identical (model, layout, step...)."""


def gather_objects(obj: Any, comm: Communicator, op: str) -> list[Any]:
    """Every rank's ``obj`` through the monitored path: a rank that never joins becomes a
    StallError naming ``op`` and the absent rank, not a raw backend timeout."""
    return all_gather_object(comm, obj, tag=op)


def describe_difference(entries_by_rank: Sequence[Sequence[Any]], label) -> str | None:
    """Find the first index where the ranks' entry lists differ; return a message or None.

    ``label(entry)`` renders one entry for the message (e.g. "weight: (4, 3) float32").
    """
    reference = entries_by_rank[0]
    lengths = [len(e) for e in entries_by_rank]
    for index in range(max(lengths)):
        values = [e[index] if index < len(e) else None for e in entries_by_rank]
        if all(v == values[0] for v in values):
            continue
        groups: dict[str, list[int]] = {}
        for rank, v in enumerate(values):
            groups.setdefault("<missing>" if v is None else label(v), []).append(rank)
        detail = "; ".join(f"ranks {ranks}: {text}" for text, ranks in groups.items())
        return f"first difference at entry #{index}: {detail}"
    if len(set(lengths)) > 1:  # pragma: no cover - caught above via <missing>
        return f"entry counts differ across ranks: {lengths} (rank 0 has {len(reference)})"
    return None


def check_same_across_ranks(entries: Sequence[Any], what: str, label=str, *, comm: Communicator, op: str,
                            hint: str = "") -> None:
    """Raise :class:`RankMismatchError` on every rank unless all ranks pass equal ``entries``.
    ``op`` names the exchange in errors and stall reports (e.g. "... construction: model check")."""
    raise_if_different(gather_objects(list(entries), comm, op), comm.rank, what, label, hint)


def raise_if_different(entries_by_rank: Sequence[Sequence[Any]], rank: int, what: str, label=str,
                       hint: str = "") -> None:
    """The :class:`RankMismatchError` of :func:`check_same_across_ranks`, raised on ``rank`` unless
    every rank's entries (already exchanged, e.g. one part of an exchange that carried several)
    are equal."""
    difference = describe_difference(entries_by_rank, label)
    if difference is None:
        return
    counts = ", ".join(f"rank {r}: {len(e)}" for r, e in enumerate(entries_by_rank))
    try:  # (an extra to the message: it must never replace the error itself)
        unshared = describe_unshared(entries_by_rank, label) if len(set(map(len, entries_by_rank))) > 1 else None
    except Exception:  # noqa: BLE001
        unshared = None
    raise RankMismatchError(
        f"fusedist: {what} differs across ranks (this is rank {rank}); "
        f"{difference}. Entry counts: {counts}.{(' ' + hint) if hint else ''}"
        f"{(' Not on every rank: ' + unshared + '.') if unshared else ''}"
    )


def describe_unshared(entries_by_rank: Sequence[Sequence[Any]], label, limit: int = 3) -> str | None:
    """The entries some ranks hold and others do not, grouped by rank (at most ``limit`` shown
    per group), or None when every rank holds the same ones in other orders.

    Why: when the counts differ, the first difference by position pairs one rank's extra entry
    with whatever the others hold there -- a model with one layer more on rank 1 read as
    ``ranks [0]: find_unused_parameters=False; ranks [1]: param 'extra.weight'``, a settings
    difference that is not there. Naming what is only on some ranks points at the extra layer.
    """
    labelled = [[label(v) for v in entries] for entries in entries_by_rank]
    everywhere = set(labelled[0]).intersection(*labelled[1:])
    groups: dict[tuple, list[int]] = {}
    for rank, labels in enumerate(labelled):
        own = tuple(text for text in labels if text not in everywhere)
        groups.setdefault(own, []).append(rank)
    parts = []
    for own, ranks in groups.items():
        if own:
            shown = ", ".join(own[:limit]) + (f", ... ({len(own)} in all)" if len(own) > limit else "")
            parts.append(f"ranks {ranks} hold {shown}")
    return "; ".join(parts) or None
