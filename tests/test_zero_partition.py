"""The flat partition (fusedist/zero/partition.py) in one process: every element of every
parameter is owned by exactly one rank, shards are equal and aligned, pieces tile the shard."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedist.ddp.layout import SHARD_ALIGN
from fusedist.zero.partition import FlatPartition, bucketize

DTYPES = [torch.float32, torch.bfloat16]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    dtype_picks=st.lists(st.integers(0, 1), min_size=12, max_size=12),
    group_picks=st.lists(st.integers(0, 2), min_size=12, max_size=12),
    world_size=st.integers(1, 5),
    cap=st.sampled_from([64, 400, 10_000]),
)
def test_every_element_owned_once(sizes, dtype_picks, group_picks, world_size, cap):
    params = [torch.zeros(n, dtype=DTYPES[d]) for n, d in zip(sizes, dtype_picks)]
    groups = group_picks[:len(params)]
    buckets = bucketize(params, [str(i) for i in range(len(params))], cap_bytes=cap, world_size=world_size)
    owned = [torch.zeros(p.numel(), dtype=torch.int32) for p in params]
    shard_sizes = None
    for rank in range(world_size):
        part = FlatPartition(buckets, params, groups, rank, world_size)
        sizes_here = dict(part.shard_numel)
        shard_sizes = shard_sizes or sizes_here
        assert sizes_here == shard_sizes, "every rank's shard has the same size"
        for bs in part.bucket_shards:
            assert bs.bucket.numel % (world_size * SHARD_ALIGN) == 0
            assert (bs.hi - bs.lo) * world_size == bs.bucket.numel
        for e in part.entries:
            owned[e.index][e.lo:e.hi] += 1
            assert e.group == groups[e.index] and e.dtype == params[e.index].dtype
            piece = part.piece_of(e)
            assert piece.group == e.group and piece.start <= e.pos and e.pos + e.numel <= piece.end
        for dtype, total in part.shard_numel.items():
            pieces = sorted((p for p in part.pieces if p.dtype == dtype), key=lambda p: p.start)
            assert pieces[0].start == 0 and pieces[-1].end == total
            assert all(a.end == b.start for a, b in zip(pieces, pieces[1:]))
            # Note [shards aliasing the parameters and gradients]: no piece crosses a bucket's slice
            ends = {bs.pos for bs in part.bucket_shards if bs.bucket.dtype == dtype} | {total}
            for piece in pieces:
                start = max(pos for pos in ends if pos <= piece.start)
                assert piece.end <= min(pos for pos in ends if pos > start), (piece, sorted(ends))
        assert part.padding_elements() >= 0
    assert all(bool((o == 1).all()) for o in owned), "each element owned by exactly one rank"
