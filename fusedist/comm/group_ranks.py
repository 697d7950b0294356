"""Group positions and the global ranks behind them, for the messages and reports that name ranks."""

from __future__ import annotations

from typing import Optional

import torch


def global_ranks(comm) -> Optional[list]:
    """The global rank of each position in ``comm``'s group where they differ from the
    positions (a subgroup: ``new_group([2, 3])``, an HSDP mesh's shard or replicate group),
    else None -- also where they cannot be looked up (the default group itself, a destroyed
    one): an error message or a report never fails for want of them."""
    group = getattr(comm, "group", None)
    if group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:
        ranks = [torch.distributed.get_global_rank(group, r) for r in range(comm.world_size)]
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    return ranks if ranks != list(range(comm.world_size)) else None


def global_note(ranks: list, named: Optional[list]) -> str:
    """' (global rank N)' / ' (global ranks [...])' to follow group positions ``ranks`` where
    ``named`` (:func:`global_ranks`) says they differ, else '': on a subgroup "rank 1" alone
    reads as global rank 1, a process of another group, not the one a user's logs and
    launcher name."""
    if not named:
        return ""
    mapped = [named[r] for r in ranks if r < len(named)]
    if mapped == list(ranks):
        return ""
    return f" (global rank {mapped[0]})" if len(ranks) == 1 else f" (global ranks {mapped})"
