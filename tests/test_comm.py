"""The torch.distributed communicator: exact values, async handles, misuse, timeouts."""

import datetime
import os
import time

import pytest
import torch

from fusedist.testing import run_distributed


def _collectives(rank, world_size):
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator

    comm = get_communicator()
    assert comm is get_communicator()  # cached
    out = {}
    # all_reduce: fill with rank + 1, the exact sum is known.
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        t = torch.full((7,), rank + 1, dtype=dtype)
        comm.all_reduce(t)
        out[f"ar_{dtype}"] = t.tolist()
    t = torch.full((5,), float(rank + 1))
    comm.all_reduce(t, op="max")
    out["ar_max"] = t.tolist()
    # async: launch two, wait in reverse order; wait twice is a no-op.
    a, b = torch.full((3,), 1.0), torch.full((1000,), float(rank))
    ha = comm.all_reduce(a, async_op=True, tag="a")
    hb = comm.all_reduce(b, async_op=True, tag="b")
    hb.wait(); ha.wait(); ha.wait()
    fired = []
    ha.add_done_callback(lambda: fired.append(1))
    out["async"] = (a.tolist(), b[:2].tolist(), fired)
    # reduce_scatter: rank r gets slice r of the sum.
    inp = torch.arange(world_size * 4, dtype=torch.float32) * (rank + 1)
    rs = torch.empty(4)
    comm.reduce_scatter(rs, inp)
    out["rs"] = rs.tolist()
    # all_gather: concatenation in rank order.
    ag = torch.empty(world_size * 2)
    comm.all_gather(ag, torch.full((2,), float(rank)))
    out["ag"] = ag.tolist()
    # A profiler sees each collective as a fusedist range; without one, no range is entered.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        comm.all_gather(ag, torch.full((2,), float(rank)))
        comm.all_reduce(torch.ones(2), async_op=True).wait()
    out["ranges"] = sorted({e.name for e in prof.events() if e.name.startswith("fusedist::")})
    # broadcast from the last rank.
    bc = torch.full((3,), float(rank))
    comm.broadcast(bc, src=world_size - 1)
    out["bc"] = bc.tolist()
    # gather to the last rank: rank order there, nothing elsewhere; the default (all-gather
    # based) implementation, for communicators without a rooted gather, gives the same.
    from fusedist.comm import Communicator
    from fusedist.comm.objects import all_gather_object, broadcast_object, gather_object

    dst = world_size - 1
    gathered = []
    for fallback in (False, True):
        if fallback:
            comm._gather = lambda o, i, d: Communicator._gather(comm, o, i, d)
        g = torch.empty(world_size * 2) if rank == dst else None
        comm.gather(g, torch.full((2,), float(rank)), dst, tag="gather")
        gathered.append(None if g is None else g.tolist())
    del comm._gather
    out["gather"] = gathered
    # an output of shape (world_size, n), as gather's docstring draws it (taken flat)
    g2 = torch.empty(world_size, 2) if rank == dst else None
    comm.gather(g2, torch.full((2,), float(rank)), dst, tag="gather 2-D")
    out["gather_2d"] = None if g2 is None else g2.flatten().tolist()
    # gloo's own reduce-scatter (FUSEDIST_GLOO_COLLECTIVES=builtin) takes a 2-D input flat, as the exchange does
    os.environ["FUSEDIST_GLOO_COLLECTIVES"] = "builtin"
    try:
        rs2 = torch.empty(4)
        comm.reduce_scatter(rs2, inp.view(1, -1), tag="builtin 2-D")
    finally:
        del os.environ["FUSEDIST_GLOO_COLLECTIVES"]
    out["rs_builtin_2d"] = rs2.tolist()
    # Python objects of different sizes, through the same collectives.
    out["objects"] = (all_gather_object(comm, {"rank": rank, "pad": "x" * 100 * rank}, tag="objects"),
                      gather_object(comm, ("r", rank), dst, tag="objects to dst"),
                      broadcast_object(comm, {"from": rank} if rank == dst else None, dst, tag="object from dst"))
    # misuse
    with pytest.raises(ValueError, match="pass an output on rank dst"):
        comm.gather(None if rank == dst else torch.empty(world_size), torch.empty(1), dst)
    with pytest.raises(ValueError, match="expected world_size"):
        comm.reduce_scatter(torch.empty(3), torch.empty(4))
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.empty(4, 4).t())
    with pytest.raises(ValueError, match="reduce op"):
        comm.all_reduce(torch.empty(4), op="prod")
    # timeout: only rank 0 enters a collective; it must raise, naming op, tag and rank.
    dist.barrier()
    if rank == 0:
        comm.timeout = datetime.timedelta(seconds=2)
        start = time.monotonic()
        with pytest.raises(CollectiveError) as info:
            comm.all_reduce(torch.ones(1), tag="lonely")
        out["timeout"] = (time.monotonic() - start, str(info.value))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_exact(world_size):
    results = run_distributed(_collectives, world_size, pg_timeout=10)
    total = sum(r + 1 for r in range(world_size))
    for rank, out in enumerate(results):
        for key in ("ar_torch.float32", "ar_torch.bfloat16", "ar_torch.float16", "ar_torch.int64"):
            assert out[key] == [total] * 7, key
        assert out["ar_max"] == [world_size] * 5
        a, b2, fired = out["async"]
        assert a == [world_size] * 3
        assert b2 == [sum(range(world_size))] * 2
        assert fired == [1]
        expected_rs = [(rank * 4 + i) * total for i in range(4)]
        assert out["rs"] == expected_rs
        assert out["ag"] == [float(r) for r in range(world_size) for _ in range(2)]
        assert out["bc"] == [float(world_size - 1)] * 3
        assert out["ranges"] == ["fusedist::all_gather", "fusedist::all_reduce"]
        expected_gather = [float(r) for r in range(world_size) for _ in range(2)] if rank == world_size - 1 else None
        assert out["gather"] == [expected_gather] * 2
        assert out["gather_2d"] == expected_gather
        assert out["rs_builtin_2d"] == expected_rs
        everyone, at_dst, broadcast = out["objects"]
        assert broadcast == {"from": world_size - 1}
        assert everyone == [{"rank": r, "pad": "x" * 100 * r} for r in range(world_size)]
        assert at_dst == ([("r", r) for r in range(world_size)] if rank == world_size - 1 else None)
    elapsed, message = results[0]["timeout"]
    assert elapsed < 15
    assert "all_reduce" in message and "lonely" in message and "rank 0" in message


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _destroyed_group_is_freed(rank, world_size):
    """Use the group as training does -- a builtin gloo collective, the exchange (its progress
    thread), a DDP model stepped by a torch optimizer -- then destroy it."""
    import threading
    import weakref

    import torch.distributed as dist

    import fusedist
    from fusedist.comm import get_communicator, release_destroyed_groups

    comm = get_communicator()
    comm.broadcast(torch.ones(3), src=0)
    comm.reduce_scatter(torch.empty(2), torch.ones(2 * world_size), async_op=True).wait()  # on the progress thread
    model = fusedist.DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # its first one imports torch._dynamo
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    progress = [t for t in threading.enumerate() if t.name == "fusedist-gloo-exchange"]
    group = weakref.ref(dist.group.WORLD)
    before = _native_threads()
    del comm, model, opt
    dist.destroy_process_group()
    held_by_cache = group() is not None
    released = release_destroyed_groups()
    for t in progress:
        t.join(timeout=10)
    return {
        "held_by_cache": held_by_cache,
        "released": released,
        "freed": group() is None,
        "progress_threads": len(progress),
        "progress_ended": not any(t.is_alive() for t in progress),
        "native_threads_ended": before - _native_threads(),
    }


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_destroyed_group_is_freed_before_interpreter_shutdown():
    """A destroyed gloo group must be freed while the interpreter runs: torch then joins its
    worker threads. Freed at interpreter shutdown instead, a worker that drops a finished
    work can abort the process (Note [releasing destroyed groups])."""
    for out in run_distributed(_destroyed_group_is_freed, 2):
        assert not out["held_by_cache"] and out["released"] == 0  # released by destroy_process_group itself
        assert out["freed"], "something else still holds the destroyed process group"
        assert out["progress_threads"] == 1 and out["progress_ended"]
        # At least gloo's two worker threads (joined when the group is freed) and the progress
        # thread.
        assert out["native_threads_ended"] >= 3, out


def _init_from_env(rank, world_size, init_file):
    import fusedist

    os.environ.update(MASTER_ADDR="127.0.0.1")
    info = fusedist.init_distributed(timeout=20)
    assert fusedist.init_distributed() == info  # idempotent
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return (info.rank, info.world_size, info.backend, info.device.type, t.item())


def test_init_distributed_from_torchrun_env():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = run_distributed(_init_from_env, 2, None, backend=None, env={"MASTER_PORT": str(port)})
    assert results == [(0, 2, "gloo", "cpu", 2.0), (1, 2, "gloo", "cpu", 2.0)]


def test_init_distributed_incomplete_env(monkeypatch):
    import fusedist

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="missing WORLD_SIZE, MASTER_ADDR, MASTER_PORT.*torchrun"):
        fusedist.init_distributed()


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_harness_reports_failing_rank():
    from fusedist.testing import DistributedRunError

    with pytest.raises(DistributedRunError, match="boom on purpose") as info:
        run_distributed(_raise_on_rank1, 2, backend=None)
    assert list(info.value.failures) == [1]


class _ClosedAt:
    """The explanations of closed connections, without a store: names the peer's error."""

    def explain(self, peer_where, global_peer):
        return f"{peer_where} closed the connection because its side of a collective failed first (its timeout)"

    def publish(self, reason):
        pass


def test_a_send_posted_after_the_peer_closed_names_the_peer(monkeypatch):
    # Note [connections a peer closed]: gloo's bare "Connection closed by peer" while the sends are posted
    # (the receives were posted at the launch, the peer gave up before the exchange was driven) is
    # explained as a failed wait is: the peer, its error.
    from fusedist.comm import given_up_exit
    from fusedist.comm.closed_connections import PeerClosedConnection

    # (the failed exchange would chain sys.exit in this test process, which later tests expect as Python's own)
    monkeypatch.setattr(given_up_exit, "watch_exit_requests", lambda: None)
    from fusedist.comm.exchange_progress import ExchangeWork

    def closed():
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234. This is typically caused by "
                           "a remote worker crashing.")

    work = ExchangeWork("all_gather [4 x torch.float32 per rank]", [], [(closed, 1, 3, 0)], ())
    work.closing = _ClosedAt()
    work.run()
    with pytest.raises(PeerClosedConnection) as raised:
        work.wait()
    message = str(raised.value)
    assert "posting the send of chunk 0 to rank 1 (global rank 3) failed: rank 1 (global rank 3) closed the " \
           "connection because its side of a collective failed first (its timeout) (gloo: [pair.cc:553] " \
           "Connection closed by peer [127.0.0.1]:1234)" in message, message
    assert "crashing" not in message, message


def test_out_of_step_collectives_rarely_share_a_tag():
    # Note [the label's width] in fusedist/comm/exchange_tags.py: two collectives ranks out of step issue at one
    # sequence number pair only where their messages' tags agree. With a 6-bit label, the tags of a training
    # step's collectives (SyncBatchNorm's gathers, ZeRO's buckets, the small all-reduces) agreed for about one
    # pair in 64 (79 of these 4950 pairs); 14 bits make it about one in 16384.
    from fusedist.comm.exchange_tags import message_tag

    labels = ([f"sync_batch_norm.stats [{2 * c + 7} x torch.float64]" for c in range(16, 528, 16)]
              + [f"zero2 bucket {i} [{4096 * (i + 1)} x torch.float32]" for i in range(34)]
              + [f"all_reduce {n} torch.float32 sum [{n} x torch.float32]" for n in range(1, 34)]
              + ["sync_batch_norm.check [1 x torch.int64]"])
    assert len(set(labels)) == 100
    tags = [message_tag("all_gather", 5, 0, label) for label in labels]
    shared = sum(a == b for i, a in enumerate(tags) for b in tags[i + 1:])
    assert shared <= 2, shared
