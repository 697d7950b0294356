"""The communicator's deadlines, timeout errors, all_to_all_single and failed exchanges.

* One rule for ``wait(timeout)`` on every path: a collective ends at its launch + the
  communicator's timeout; a longer wait timeout does not extend it (torch's gloo work waited
  all of it, where the gloo exchange gave up at the deadline).
* Every timeout error names the collective, its tag, the rank, the peers and the duration,
  also when the process group's own (shorter) timeout fires first.
* ``all_to_all_single`` equals torch.distributed's, even and uneven splits, subgroups;
  disagreeing splits time out on every rank instead of terminating a process. So do gathers
  whose parts differ in size (gloo's own gather terminated the root, or left stale data).
* After a failed exchange, later collectives on the group say so instead of gloo's bare
  "Application timeout caused pair closure".
"""

import datetime
import re
import time

import pytest
import torch

from fusedist.testing import run_distributed


def _late_peer(rank, world_size):
    import torch.distributed as dist

    from fusedist.comm import CollectiveError
    from fusedist.comm.torch_comm import TorchCommunicator

    timeout = datetime.timedelta(seconds=2)
    # One group per path: the exchange's timeout closes its group's connections. The groups' own
    # timeout is the launch's (20 s): longer than fusedist's. The reference: torch's own all-reduce on a
    # group whose timeout is fusedist's.
    exchange = TorchCommunicator(dist.new_group([0, 1]), timeout=timeout, gloo_collectives="p2p")
    builtin = TorchCommunicator(dist.new_group([0, 1]), timeout=timeout, gloo_collectives="builtin")
    reference = dist.new_group([0, 1], timeout=timeout)
    dist.barrier()
    torch.manual_seed(rank)
    small, large, plain = torch.randn(4), torch.randn(1000), torch.randn(1000)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        # joins once rank 0's waits have ended (its deadline passed) and it reused its buffer
        store.wait(["rank 0 waited"], datetime.timedelta(seconds=60))
        sent, out = large.clone(), {}
        for path, late in (("exchange", lambda: exchange.all_reduce(small, tag="late small")),
                           ("builtin", lambda: builtin.all_reduce(large, tag="late large")),
                           ("torch", lambda: dist.all_reduce(plain, group=reference))):
            try:
                late()
                out[path] = "completed"
            except Exception as exc:  # noqa: BLE001 - torch's error is a RuntimeError
                out[path] = f"failed: {type(exc).__name__}: {exc}"
        out["large unchanged"] = torch.equal(large, sent)
        store.set("rank 1 tried", "yes")
        return out
    start = time.monotonic()
    handles = {"exchange": exchange.all_reduce(small, async_op=True, tag="late small"),
               "builtin": builtin.all_reduce(large, async_op=True, tag="late large")}
    ref_work = dist.all_reduce(plain, group=reference, async_op=True)
    out = {}
    for path, handle in handles.items():
        try:
            handle.wait(timeout=datetime.timedelta(seconds=10))
            out[path] = ("completed", time.monotonic() - start, "")
        except CollectiveError as exc:
            out[path] = ("failed", time.monotonic() - start, str(exc))
    with pytest.raises(RuntimeError):
        ref_work.wait()
    # Told the collective failed, the program reuses its buffer: nothing may write it from now on.
    large.fill_(7.0)
    store.set("rank 0 waited", "yes")
    store.wait(["rank 1 tried"], datetime.timedelta(seconds=60))
    out["large kept"] = bool((large == 7.0).all())
    return out


def test_wait_longer_than_the_timeout_ends_at_the_deadline_on_every_cpu_path():
    """Note [one deadline per collective]: the exchange and gloo's own all-reduce both give up
    at launch + the communicator's timeout, whatever longer timeout the wait names. After that a late
    peer's collective fails on every path, as torch's own does past its group's timeout: it neither
    pairs with the abandoned collective nor sums what this rank's reused buffer holds, and the
    abandoned collective never writes that buffer (Note [closing the connections of an abandoned
    collective] in fusedist/comm/torch_comm.py). Before, gloo's own all-reduce, queued until the
    group's longer timeout, paired with the late peer's: both ended "successfully" with rank 0's
    reused buffer in the sum."""
    results = run_distributed(_late_peer, 2, pg_timeout=20)
    for path, tag in (("exchange", "late small"), ("builtin", "late large")):
        state, elapsed, message = results[0][path]
        assert state == "failed", (path, elapsed)
        assert elapsed < 3.3, (path, elapsed)
        for words in ("all_reduce", repr(tag), "failed on rank 0 of 2", "timed out 2.0 s after its launch",
                      "collective timeout, 2 s", "[1]"):
            assert words in message, (path, words, message)
        assert "goes on" not in message, message  # the deadline has passed: a failure, not a short wait
    late = results[1]
    assert late["torch"].startswith("failed: "), late  # the reference
    for path in ("exchange", "builtin"):
        assert late[path].startswith("failed: CollectiveError: fusedist: "), (path, late)
    assert "all_reduce (tag 'late large', collective #0) failed on rank 1 of 2" in late["builtin"], late
    assert "Connection closed by peer" in late["builtin"], late
    assert late["large unchanged"] and results[0]["large kept"], (late, results[0])


def _group_timeout_first(rank, world_size):
    import torch.distributed as dist

    from fusedist.comm import CollectiveError
    from fusedist.comm.torch_comm import TorchCommunicator

    quick = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1.5))
    comm = TorchCommunicator(quick, timeout=datetime.timedelta(seconds=20), gloo_collectives="builtin")
    default = TorchCommunicator(None, timeout=datetime.timedelta(seconds=20), gloo_collectives="builtin")
    store = dist.distributed_c10d._get_default_store()
    out = {}
    if rank == 0:
        with pytest.raises(CollectiveError) as info:
            comm.all_reduce(torch.ones(1000), tag="alone")
        out["group"] = str(info.value)
        # A shorter wait that runs out: the message says how long it waited, and a later
        # wait gets the result.
        t = torch.ones(1000)
        handle = default.all_reduce(t, async_op=True, tag="short")
        with pytest.raises(CollectiveError) as info:
            handle.wait(datetime.timedelta(seconds=0.3))
        out["short"] = str(info.value)
        store.set("rank 0 waited", "yes")
        handle.wait()
        out["sum"] = t[0].item()
    else:  # joins once rank 0's group timeout has fired and its short wait has run out
        store.wait(["rank 0 waited"], datetime.timedelta(seconds=60))
        default.all_reduce(torch.ones(1000), tag="short")
    return out


def test_a_process_group_timeout_that_fires_first_is_named_with_its_duration():
    results = run_distributed(_group_timeout_first, 2, pg_timeout=30)
    message = results[0]["group"]
    for words in ("all_reduce (tag 'alone'", "failed on rank 0 of 2", "timed out 1.5 s after its launch",
                  "the process group's own timeout, 1.5 s", "collective timeout (20 s", "[1]"):
        assert words in message, (words, message)
    assert "shorter timeout (0.3 s) than the communicator's (20 s)" in results[0]["short"], results[0]["short"]
    assert results[0]["sum"] == 2.0


def _expected_all_to_all(inputs, in_splits, rank):
    """What rank ``rank`` receives: the parts the others address to it, in rank order."""
    parts = []
    for src, (x, splits) in enumerate(zip(inputs, in_splits)):
        start = sum(splits[:rank])
        parts.append(x[start:start + splits[rank]])
    return torch.cat(parts)


def _all_to_all(rank, world_size):
    import torch.distributed as dist

    from fusedist.comm import gloo_exchange
    from fusedist.comm.torch_comm import TorchCommunicator

    gloo_exchange.CHUNK_BYTES = 64  # several chunks per part
    comms = {mode: TorchCommunicator(None, gloo_collectives=mode) for mode in ("p2p", "builtin")}
    sub = dist.new_group([1, 2])
    sub_comm = TorchCommunicator(sub, gloo_collectives="p2p") if rank in (1, 2) else None
    gen = torch.Generator().manual_seed(7)
    bad = []
    for trial in range(3):
        splits = torch.randint(0, 4, (world_size, world_size), generator=gen)  # [i][j]: rows i sends j
        splits[0, 1] = 0  # a pair that exchanges nothing
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.complex64, torch.bool):
            inputs = []
            for src in range(world_size):
                g = torch.Generator().manual_seed(100 * trial + src)
                x = torch.randn(int(splits[src].sum()), 5, generator=g) * 10
                x = torch.complex(x, -x) if dtype.is_complex else x.to(dtype)
                inputs.append(x)
            expected = _expected_all_to_all(inputs, splits.tolist(), rank)
            ins, outs = splits[rank].tolist(), splits[:, rank].tolist()
            if dtype in (torch.float32, torch.int64):  # torch's own, as the reference
                ref = torch.empty_like(expected)
                dist.all_to_all_single(ref, inputs[rank], outs, ins)
                bad += [("torch differs", trial, str(dtype))] if not torch.equal(ref, expected) else []
            for mode, comm in comms.items():
                if mode == "builtin" and dtype in (torch.complex64, torch.bool):
                    continue  # gloo's own all-to-all: not fusedist's to test
                got = torch.zeros_like(expected)
                handle = comm.all_to_all_single(got, inputs[rank], outs, ins, async_op=trial == 1, tag=f"t{trial}")
                handle.wait()
                if not torch.equal(got, expected):
                    bad.append((mode, trial, str(dtype), got.tolist(), expected.tolist()))
        # even splits, 3-D rows
        x = torch.randn(world_size * 2, 2, 3, generator=gen) + rank
        ref, got = torch.empty_like(x), torch.empty_like(x)
        dist.all_to_all_single(ref, x)
        comms["p2p"].all_to_all_single(got, x, tag="even")
        bad += [("even", trial)] if not torch.equal(ref, got) else []
        if sub_comm is not None:  # a subgroup: group ranks, not global ones
            x = torch.randn(5) + rank
            ins = [2, 3] if rank == 1 else [1, 4]
            outs = [2, 1] if rank == 1 else [3, 4]
            ref, got = torch.empty(3 if rank == 1 else 7), torch.empty(3 if rank == 1 else 7)
            dist.all_to_all_single(ref, x, outs, ins, group=sub)
            sub_comm.all_to_all_single(got, x, outs, ins, tag="sub")
            bad += [("subgroup", trial, ref.tolist(), got.tolist())] if not torch.equal(ref, got) else []
    # gather goes through the exchange too: equal to torch's, any dtype, any root
    for dst in range(world_size):
        for dtype in (torch.float32, torch.int64, torch.complex64, torch.bool):
            x = (torch.randn(4, 3) + rank) * 5
            x = torch.complex(x, -x) if dtype.is_complex else x.to(dtype)
            got = torch.zeros(world_size * 4, 3, dtype=dtype) if rank == dst else None
            # (waited for before its output is read: an asynchronous one may still be landing)
            comms["p2p"].gather(got, x, dst, tag="gather", async_op=dst == 1).wait()
            everyone = [torch.empty_like(x) for _ in range(world_size)]
            dist.all_gather(everyone, x)
            if rank == dst and not torch.equal(got, torch.cat(everyone)):
                bad.append(("gather", dst, str(dtype)))
    # misuse is refused on the rank that makes it, before anything is sent
    comm = comms["p2p"]
    n = world_size
    self_heavy = [2 if j == rank else 1 for j in range(n)]  # sends itself 2 rows, receives 1
    refusals = {
        "world_size (3) non-negative": lambda: comm.all_to_all_single(torch.empty(3), torch.empty(3), [1, 2], [1, 2]),
        "summing": lambda: comm.all_to_all_single(torch.empty(3), torch.empty(3), [1] * n, [1, 1, 2]),
        "do not split evenly": lambda: comm.all_to_all_single(torch.empty(4), torch.empty(4)),
        "differ in size": lambda: comm.all_to_all_single(torch.empty(3, 2), torch.empty(3, 3)),
        "overlaps": lambda: (lambda t: comm.all_to_all_single(t[1:4], t[0:3]))(torch.empty(6)),
        "sends itself": lambda: comm.all_to_all_single(torch.empty(3), torch.empty(4), [1] * n, self_heavy),
        "0-dim": lambda: comm.all_to_all_single(torch.empty(()), torch.empty(())),
        "contiguous": lambda: comm.all_to_all_single(torch.empty(3, 3).t(), torch.empty(3, 3)),
    }
    refused = {}
    for words, call in refusals.items():
        with pytest.raises(ValueError, match=re.escape(words)):
            call()
        refused[words] = True
    ok = torch.arange(3.0) + 10 * rank
    got = torch.empty(3)
    comm.all_to_all_single(got, ok, tag="after refusals")  # still in step
    return bad, refused, got.tolist()


def test_all_to_all_single_matches_torch():
    results = run_distributed(_all_to_all, 3, pg_timeout=30)
    for rank, (bad, refused, after) in enumerate(results):
        assert bad == [], bad[:3]
        assert len(refused) == 8
        assert after == [10.0 * src + rank for src in range(3)]


def _disagreeing_splits(rank, world_size):
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator

    comm = get_communicator()
    out = {}
    # rank 0 sends rank 1 three rows; rank 1 expects two
    ins, outs = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [2, 2])
    start = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        comm.all_to_all_single(torch.empty(sum(outs), 2), torch.randn(sum(ins), 2), outs, ins, tag="experts")
    out["mismatch"] = (time.monotonic() - start, str(info.value))
    time.sleep(0.5)  # both ranks' exchanges have failed
    with pytest.raises(CollectiveError) as info:
        comm.all_reduce(torch.ones(2), tag="next step")
    out["next"] = str(info.value)
    with pytest.raises(CollectiveError) as info:
        get_communicator()
    out["lookup"] = str(info.value)
    # a new group works
    comm2 = get_communicator(dist.new_group([0, 1]))
    t = torch.full((2,), float(rank + 1))
    comm2.all_reduce(t, tag="new group")
    out["new"] = t.tolist()
    # a gather whose parts differ in size: an error on both ranks, where gloo's own gather
    # terminated the root (a larger part) or left stale data in its output (a smaller one)
    comm3 = get_communicator(dist.new_group([0, 1]))
    n = 2 if rank == 0 else 3
    with pytest.raises(CollectiveError) as info:
        comm3.gather(torch.zeros(2 * n) if rank == 0 else None, torch.ones(n), 0, tag="parts")
    out["gather"] = str(info.value)
    return out


def test_disagreeing_splits_fail_every_rank_and_later_collectives_say_why():
    results = run_distributed(_disagreeing_splits, 2, pg_timeout=30, env={"FUSEDIST_TIMEOUT_S": "2"})
    for rank, out in enumerate(results):
        elapsed, message = out["mismatch"]
        assert elapsed < 10, elapsed
        assert "all_to_all_single (tag 'experts'" in message and f"rank {rank} of 2" in message, message
        assert f"from rank {1 - rank}" in message or f"to rank {1 - rank}" in message, message
        assert "can no longer run collectives" in out["next"] and "all_to_all_single" in out["next"], out["next"]
        assert "[next step]" in out["next"] and "re-create the process group" in out["next"], out["next"]
        assert "all_to_all_single" in out["lookup"], out["lookup"]
        assert out["new"] == [3.0, 3.0]
        assert "gather (tag 'parts'" in out["gather"] and f"rank {rank} of 2" in out["gather"], out["gather"]
