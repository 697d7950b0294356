"""The per-step check carried by the last gradient bucket's all-reduce (host/gloo only).

Note [the check carried by the last bucket]
    On the host, the check's own small all-reduce (Note [step check] in step_check.py) is one more
    round of messages per step: the peers' event loops and the exchange's progress thread wake up
    once more, about 2 ms on a 2-core machine (``benchmarks/bench_ddp_step_overhead.py``), more
    than a tiny model's whole step. The last bucket's all-reduce is already a round every rank
    makes at the same point, so where it can, the check rides on it: the bucket's message gets a
    tail of ``world_size`` rows, one per rank, each rank writing its check values into its own row
    and zeros elsewhere. The all-reduce sums them, so every rank receives every rank's values
    exactly -- each value as four 16-bit pieces, and a sum of one piece and zeros is that piece in
    float32 or float64 -- and from those rows reads the same ``max(v)`` / ``min(v)`` the check's
    own all-reduce would give, and reaches the same verdict, raised at the same point with the
    same error (a mismatch still exchanges the details in the check's own all-gather). The
    bucket's gradients are copied next to the tail and back, which is why only a small last
    bucket carries the check (``MAX_BUCKET_ELEMENTS``): a larger model's step hides the check's
    own round anyway.

    Every rank must agree on whether a backward's last bucket carries a tail, or the bucket
    messages differ in size: so the choice depends only on what the ranks agree on -- the
    strategy (the default all-reduce, no communication hook), the last bucket's size and wire
    dtype (float32/64), the device (the host) and the world size (``MAX_WORLD``) -- never on a
    counter the check compares. A last bucket small enough to go through the gloo exchange
    (``SMALL_ALL_REDUCE_BYTES``, Note [small all-reduces through the exchange] in
    fusedist/comm/torch_comm.py) does not carry it: with the tail it would take gloo's own
    all-reduce, where ranks that diverged into collectives of different sizes end the processes
    instead of timing out with a report. A joined rank (Note [joined ranks]) carries a row of ``JOINED``.
    The last bucket is launched only at the end of the backward, once the values are known (the
    gradient hooks hold it back); it is the bucket whose gradients arrive last, so little overlap
    is lost. Everywhere else -- ``check_consistency()``, a communication hook, ZeRO's
    strategies, CUDA -- the check's own all-reduce runs, as before.
"""

from __future__ import annotations

import torch

from ..comm.torch_comm import SMALL_ALL_REDUCE_BYTES

#: Pieces per value and their width: a piece below 2**16 and a sum with zeros are exact in float32.
PIECES = 4
PIECE_BITS = 16
#: Largest last bucket (elements) that carries the check: copying it next to the tail and back
#: costs a few microseconds at this size.
MAX_BUCKET_ELEMENTS = 1 << 16
#: Largest world: the tail is ``world_size x fields x 4`` elements.
MAX_WORLD = 64
DTYPES = (torch.float32, torch.float64)


def can_carry(engine, comm) -> bool:
    """Whether ``engine``'s last bucket carries the step check (every rank decides alike:
    Note [the check carried by the last bucket])."""
    from ..ddp.strategy import AllReduceAverage

    buckets = engine.layout.buckets
    if type(engine.strategy) is not AllReduceAverage or not buckets or comm.device.type != "cpu":
        return False
    last = buckets[-1]
    dtype = engine.config.reduce_dtype or last.dtype
    return (dtype in DTYPES and SMALL_ALL_REDUCE_BYTES < last.numel * dtype.itemsize
            and last.numel <= MAX_BUCKET_ELEMENTS and 1 < comm.world_size <= MAX_WORLD)


def tail_numel(fields: int, world_size: int) -> int:
    return world_size * fields * PIECES


def encode(values: list[int], rank: int, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The tail this rank sends: its values' pieces in its row, zeros elsewhere (built as a list:
    a few torch operations on 40 numbers cost more on the host than the Python does)."""
    mask, shifts = (1 << PIECE_BITS) - 1, range(0, PIECES * PIECE_BITS, PIECE_BITS)
    pieces = [((v & 0xFFFFFFFFFFFFFFFF) >> s) & mask for v in values for s in shifts]
    row = [0] * (len(pieces) * world_size)
    row[rank * len(pieces):(rank + 1) * len(pieces)] = pieces
    return torch.tensor(row, dtype=dtype)


def agree(tail: torch.Tensor, world_size: int) -> bool:
    """Whether every rank sent the same row (the common case, read without decoding; rows that
    differ -- a divergence, or a joined rank's -- are decoded and compared field by field)."""
    pieces = tail.tolist()
    n = len(pieces) // world_size
    first = pieces[:n]
    return all(pieces[r * n:(r + 1) * n] == first for r in range(1, world_size))


def decode(tail: torch.Tensor, world_size: int, fields: int) -> list[list[int]]:
    """Every rank's values from the summed tail (rank order)."""
    rows = tail.view(world_size, fields, PIECES).to(torch.int64).tolist()
    table = []
    for row in rows:
        values = []
        for pieces in row:
            u = sum(p << (PIECE_BITS * i) for i, p in enumerate(pieces))
            values.append(u - (1 << 64) if u >= 1 << 63 else u)
        table.append(values)
    return table


def bounds(table: list[list[int]], joined: int) -> list[int]:
    """``[max(v), max(-v)]`` over the ranks, as the check's own all-reduce gives them: a joined
    rank's value ``joined`` (below any ``v`` or ``-v``) is neutral in both halves."""
    fields = len(table[0])
    high = [max(row[i] for row in table) for i in range(fields)]
    low = [max((-row[i] if row[i] != joined else joined) for row in table) for i in range(fields)]
    return high + low
