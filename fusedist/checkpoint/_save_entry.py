"""A save that some rank never joined says that a save is a collective.

Note [a save called on some ranks only]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.save`` is called on rank 0 only (``if rank == 0: torch.save(...)``); a fusedist save is a
collective, and that habit left rank 0 in the save's first collective (its start exchange, or the
step check of a DDP model) until the peer's own collective failed or the timeout ran out. The error
then named a collective tag, or ``check_consistency()``, and never the cause. Whatever ends the
save's entry -- its step check or its first exchange -- as a collective failure now begins with the
ranks that did not join (from the stall report, when it tells) and says that every rank must call
the save, then goes on with the collective's own error; it keeps its type (code that catches a failed
collective still does). Nothing is exchanged for it: the healthy path is unchanged.

The rank that did not call the save fails in its own next collective (a backward's bucket), at the
same timeout. Its stall report shows where the saving ranks wait; their step check's collectives
carry the save's name for it (Note [a step check inside a save] in step_check.py).
"""

from __future__ import annotations

import contextlib
import re

from ..comm.base import CollectiveError
from ..reliability.step_check import inside_call

#: A stall report's summary line: ``  ranks [0, 2] (global ranks ...) reached all_gather [tag] (collective #3)``.
_REACHED = re.compile(r"^\s*ranks \[([\d, ]*)\][^\n]*? reached (\S+) \[([^\]\n]*)\]", re.MULTILINE)


def _ranks_at(report: str, tag: str) -> list:
    """The ranks the report shows at the collective tagged ``tag``."""
    joined: list = []
    for ranks, _op, found in _REACHED.findall(report or ""):
        if found == tag:
            joined += [int(r) for r in ranks.split(",") if r.strip()]
    return sorted(joined)


#: A stall report's line for one rank of the group: ``  rank 1 on host pid 42: ...``.
_RANK_LINE = re.compile(r"^  rank (\d+)\b", re.MULTILINE)


def missing_ranks(exc: CollectiveError) -> list:
    """The ranks of the group that did not reach ``exc``'s collective, as far as its stall report
    tells (empty when it does not)."""
    report = getattr(exc, "report", None) or ""
    joined = _ranks_at(report, exc.tag)
    if not joined or exc.rank not in joined:
        return []
    return sorted({int(r) for r in _RANK_LINE.findall(report)} - set(joined))


def not_joined_words(what: str, exc: CollectiveError) -> str:
    """What a save whose first collective failed says before that collective's error: which ranks
    did not join, and what to do."""
    missing = missing_ranks(exc)
    who = (f"rank(s) {missing} did not join it" if missing
           else "some rank of the group did not join it, or is in another collective")
    return (f"{what}: rank {exc.rank}'s save could not start: {who}. A save is a collective: every rank of the "
            f"group must call it, with the same arguments -- not only rank 0, as with torch.save; remove any "
            f"'if rank == 0:' around it (each rank writes its own part, rank 0 the manifest). If every rank did "
            f"call it, a peer failed, left, or runs a step this rank skipped: see the error of the save's first "
            f"collective, '{exc.tag}', and its stall report. That error: ")


@contextlib.contextmanager
def entered_by_every_rank(what: str):
    """Make a collective failure of the save's entry say who did not join it. The error keeps its
    type (a ``CollectiveError``, or a ``StallError`` with its report), so code that catches a failed
    collective still does. Its step check (a DDP or fully_shard model's) is tagged with ``what``, so
    that a rank that did not call the save, failing in its own next collective, reads in its stall
    report that its peers are inside it (Note [a step check inside a save] in step_check.py)."""
    try:
        with inside_call(what):
            yield
    except CollectiveError as exc:
        if exc.rank >= 0 and exc.args and isinstance(exc.args[0], str):
            exc.args = (not_joined_words(what, exc) + exc.args[0],) + exc.args[1:]
        raise
