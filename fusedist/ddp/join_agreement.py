"""Every rank under one join context averages the same way: ``divide_by_initial_world_size`` compared.

Note [the join's divisor agreed across ranks]
    ``model.join(divide_by_initial_world_size=...)`` (and torch's ``Join(..., divide_by_initial_world_size=)``)
    is an argument of each rank's own call. Ranks that passed different values averaged with different divisors
    once a rank had joined -- the initial world size on some, the number of ranks still training on others --
    and nothing said so: torch's DDP divides each rank's contribution by its own divisor before the sum, so
    every rank stepped with a mix that neither setting gives. The join state all-reduce (Note [joined ranks] in
    join.py), which every rank, training or joined, runs at each iteration, now carries one more row: a 1 at each
    rank that divides by the initial world size. Every rank reads the same sum, so all of them raise together at
    the first forward under the context, naming the ranks of each value, before any gradient is averaged.
    Costs ``world_size`` int64 values in a collective that runs anyway.
"""

from __future__ import annotations

import torch


def with_divisor_row(state: torch.Tensor, ddp) -> torch.Tensor:
    """``state`` (the join state, int64) followed by this rank's row: 1 at its own rank where it divides by the
    initial world size."""
    row = torch.zeros(ddp.world_size, dtype=state.dtype, device=state.device)
    row[ddp.rank] = int(_divides_by_initial_world_size(ddp))
    return torch.cat([state, row])


def check_divisors(ddp, row: list) -> None:
    """Raise, on every rank alike, where the summed ``row`` says the ranks passed different
    ``divide_by_initial_world_size`` values (Note [the join's divisor agreed across ranks])."""
    dividing = [r for r, flag in enumerate(row) if flag]
    if 0 < len(dividing) < ddp.world_size:
        others = [r for r in range(ddp.world_size) if r not in dividing]
        raise RuntimeError(
            f"fusedist.DistributedDataParallel (rank {ddp.rank}) under join: the ranks passed different "
            f"divide_by_initial_world_size values: True on ranks {dividing}, False on ranks {others} (this rank: "
            f"{_divides_by_initial_world_size(ddp)}). Once a rank joins they would average gradients with different "
            "divisors (the initial world size on some, the ranks still training on others); pass the same value to "
            "join() (or Join(..., divide_by_initial_world_size=)) on every rank")


def _divides_by_initial_world_size(ddp) -> bool:
    state = getattr(ddp, "_join_state", None)
    return bool(getattr(state, "divide_by_initial_world_size", True))
