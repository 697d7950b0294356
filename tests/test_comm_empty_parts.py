"""Collectives through the gloo exchange where a rank's part is empty.

* Where one rank's part is empty and the other's is not (a shape that depends on the rank), every
  collective the exchange serves -- small all-reduce, reduce-scatter, all-gather, broadcast,
  gather, all-to-all -- raises a CollectiveError on both ranks, each naming its own part. Before,
  the empty rank returned as if it had succeeded and went on out of step, while the other waited
  out its timeout alone.
* Where every rank's part is empty, each collective still completes and equals torch's; a
  non-empty one still equals torch's afterwards.
"""

import time

import torch

from fusedist.testing import run_distributed

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "gather", "all_to_all")


def _collective(comm, kind, rank, world, m, x, async_op=False):
    """Launch ``kind`` with this rank's part ``x`` of ``m`` elements; returns (result, handle)."""
    kw = {"tag": "empty check", "async_op": async_op}
    if kind == "all_reduce":
        return x, comm.all_reduce(x, op="max", **kw)
    if kind == "reduce_scatter":
        out = torch.empty(m // world)
        return out, comm.reduce_scatter(out, x, op="sum", **kw)
    if kind == "all_gather":
        out = torch.empty(m * world)
        return out, comm.all_gather(out, x, **kw)
    if kind == "broadcast":
        return x, comm.broadcast(x, 0, **kw)
    if kind == "gather":
        out = torch.empty(m * world) if rank == 0 else None
        return (x if out is None else out), comm.gather(out, x, 0, **kw)
    out = torch.empty(m)
    return out, comm.all_to_all_single(out, x, **kw)


def _reference(kind, rank, world, m, x):
    import torch.distributed as dist

    if kind == "all_reduce":
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        return y
    if kind == "reduce_scatter":
        y = x.clone()
        dist.all_reduce(y)
        return y.view(world, -1)[rank].clone() if m else torch.empty(0)
    if kind == "all_gather":
        parts = [torch.empty(m) for _ in range(world)]
        dist.all_gather(parts, x)
        return torch.cat(parts)
    if kind == "broadcast":
        y = x.clone()
        dist.broadcast(y, 0)
        return y
    if kind == "gather":
        parts = [torch.empty(m) for _ in range(world)]
        dist.all_gather(parts, x)
        return torch.cat(parts) if rank == 0 else x
    y = torch.empty(m)
    dist.all_to_all_single(y, x.clone())
    return y


def _empty_parts(rank, world, seed):
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator

    gen = torch.Generator().manual_seed(seed * 10 + rank)
    mismatched, agreed = {}, []
    launched = []
    for kind in KINDS:
        # Each on a fresh group (a failed exchange leaves its group unusable, by design), all in
        # flight at once: they time out together.
        comm = get_communicator(dist.new_group(list(range(world))))
        m = 0 if rank == 1 else 4
        x = torch.rand(m, generator=gen)
        launched.append((kind, x, x.clone(), _collective(comm, kind, rank, world, m, x, async_op=True)[1]))
    start = time.monotonic()
    for kind, x, before, handle in launched:
        try:
            handle.wait()
            mismatched[kind] = ("no error", time.monotonic() - start, True)
        except CollectiveError as exc:
            mismatched[kind] = (str(exc), time.monotonic() - start, torch.equal(x, before))
    comm = get_communicator(None)
    for m in (0, 4, 0):  # empty on every rank, then not, then empty again: all stay in step
        for kind in KINDS:
            x = torch.rand(m, generator=gen)
            got, _ = _collective(comm, kind, rank, world, m, x.clone())
            want = _reference(kind, rank, world, m, x)
            agreed.append((kind, m, got.shape == want.shape and torch.equal(got, want)))
    return mismatched, agreed


def test_collectives_whose_parts_are_empty_on_one_rank_fail_on_every_rank():
    results = run_distributed(_empty_parts, 2, 3, timeout=120, env={"FUSEDIST_TIMEOUT_S": "1"})
    returned = [(rank, kind) for rank, (mismatched, _) in enumerate(results) for kind in KINDS
                if mismatched[kind][0] == "no error"]
    assert returned == [], returned  # the empty rank returned "successfully", its peer timed out alone
    for rank, (mismatched, agreed) in enumerate(results):
        for kind in KINDS:
            message, elapsed, untouched = mismatched[kind]
            size = 0 if rank == 1 else (2 if kind == "reduce_scatter" else 4)  # (a reduce-scatter: its output)
            part = f"[{size} x torch.float32 {'sent' if kind == 'all_to_all' else 'per rank'}"
            name = "all_to_all_single" if kind == "all_to_all" else kind
            assert f"{name} " in message and f"rank {rank} of 2" in message and part in message, (rank, kind, message)
            assert elapsed < 20, (rank, kind, elapsed)  # at its own timeout (1 s), not a peer's
            if kind in ("all_reduce", "broadcast"):
                assert untouched, (rank, kind)  # nothing half-written
        assert all(ok for _, _, ok in agreed), [a for a in agreed if not a[2]]
