"""The point-to-point reduce-scatter / all-gather on gloo against torch's builtin collectives.

Oracles, on fresh random inputs (the seed is drawn per run and printed on failure):
* the same rank-order fold computed locally from every rank's input (gathered with gloo's
  builtin all-gather): must match bit for bit, on every rank (Note [exchange determinism]);
* torch's builtin ``reduce_scatter_tensor`` / ``all_gather_into_tensor``: all-gather exactly,
  reduce-scatter exactly for integers, max/min and two ranks (a + b is commutative), within a
  few ulps of the dtype otherwise (gloo sums three or more ranks in another order).

The chunk size is shrunk to 64 bytes inside the workers, so tensors of a few dozen elements
cross many chunks, with sizes that are and are not multiples of the chunk.
"""

import datetime
import os
import random
import threading
import time

import pytest
import torch

from fusedist.testing import run_distributed

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8)
OPS = ("sum", "avg", "max", "min")
CHUNK_BYTES = 64
# (the report's window: rank 1 never reports, however long rank 0 waits for it)
FAST_FAILURE = {"FUSEDIST_TIMEOUT_S": "2", "FUSEDIST_STALL_REPORT_S": "1"}


def _random(shape_numel, dtype, gen):
    if dtype.is_floating_point:
        return torch.randn(shape_numel, generator=gen, dtype=torch.float64).to(dtype)
    high = 50 if dtype == torch.uint8 else 1000  # uint8 sums of 3 ranks stay below 256
    return torch.randint(0, high, (shape_numel,), generator=gen, dtype=torch.int64).to(dtype)


def _rank_order_fold(parts, op, world_size):
    """The exchange's documented arithmetic: ((c_0 op c_1) op c_2) ..., in the dtype."""
    combine = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = combine(acc, p)
    if op == "avg":
        acc = acc / world_size
    return acc


def _builtin_tolerance(dtype, op, world_size):
    """Tolerance against gloo's own reduce-scatter (atol, rtol)."""
    if not dtype.is_floating_point or op in ("max", "min") or world_size <= 2:
        return 0.0, 0.0  # exact: integer arithmetic, selection, or a commutative a + b
    # Three standard-normal summands, each add rounded in the dtype, in another order: a few
    # ulps of the largest partial sum (|sum| <~ 6).
    eps = torch.finfo(dtype).eps
    return 8 * eps * 6, 4 * eps


def _exchange_checks(rank, world_size, seed):
    import torch.distributed as dist

    from fusedist.comm import get_communicator, gloo_exchange
    from fusedist.comm.torch_comm import _all_gather_flat, _reduce_scatter_flat

    comm = get_communicator()
    assert comm.exchange is not None, "gloo CPU tensors must use the exchange by default"
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    failures = []

    # The production chunk size: one full chunk and a partial one per slice (~4 MiB messages).
    m = gloo_exchange.CHUNK_BYTES // 4 + 1000
    inp = torch.randn(world_size * m, generator=gen)
    everyone = torch.empty(world_size * world_size * m)
    _all_gather_flat(everyone, inp)
    parts = [p.view(world_size, m)[rank] for p in everyone.view(world_size, -1)]
    big = torch.empty(m)
    comm.reduce_scatter(big, inp)
    if not torch.equal(big, _rank_order_fold(parts, "sum", world_size)):
        failures.append("reduce_scatter at the default chunk size differs from the rank-order sum")
    gathered = torch.empty(world_size * m)
    comm.all_gather(gathered, inp[:m])
    if not torch.equal(gathered, torch.cat([p.view(world_size, m)[0] for p in everyone.view(world_size, -1)])):
        failures.append("all_gather at the default chunk size differs from the concatenation")

    gloo_exchange.CHUNK_BYTES = CHUNK_BYTES

    def check(name, got, want, atol=0.0, rtol=0.0):
        if got.dtype != want.dtype or got.shape != want.shape:
            failures.append(f"{name}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
        elif atol == 0 and rtol == 0:
            if not torch.equal(got, want):
                failures.append(f"{name}: not bit-identical, max diff {(got.double() - want.double()).abs().max()}")
        elif not torch.allclose(got.double(), want.double(), atol=atol, rtol=rtol):
            failures.append(f"{name}: max diff {(got.double() - want.double()).abs().max()} > atol {atol}")

    for dtype in DTYPES:
        per_chunk = max(1, CHUNK_BYTES // torch.empty((), dtype=dtype).element_size())
        # Slices of 1 element, exactly 3 chunks, and 3 chunks + a remainder; and empty.
        for m in (1, 3 * per_chunk, 3 * per_chunk + 5, 0):
            inp = _random(world_size * m, dtype, gen)
            everyone = torch.empty(world_size * world_size * m, dtype=dtype)
            _all_gather_flat(everyone, inp)
            parts = [p.view(world_size, m)[rank] for p in everyone.view(world_size, -1)]
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue  # refused, as by gloo: checked below
                name = f"reduce_scatter {op} {dtype} m={m}"
                out = torch.full((m,), 7, dtype=dtype)
                if m == 3 * per_chunk:  # any contiguous shape: 2-D output and input
                    comm.reduce_scatter(out.view(3, -1), inp.clone().view(3 * world_size, -1), op=op)
                else:
                    comm.reduce_scatter(out, inp.clone(), op=op)
                check(name + " vs rank-order fold", out, _rank_order_fold(parts, op, world_size))
                want = torch.empty(m, dtype=dtype)
                _reduce_scatter_flat(want, inp.clone(), op=getattr(dist.ReduceOp, op.upper()))
                check(name + " vs gloo", out, want, *_builtin_tolerance(dtype, op, world_size))
                # In place: the output is this rank's slice of the input.
                work = inp.clone()
                comm.reduce_scatter(work[rank * m:(rank + 1) * m], work, op=op)
                check(name + " in place", work[rank * m:(rank + 1) * m], out)
            # all_gather, out of place and in place: a concatenation, exact.
            shard = _random(m, dtype, gen)
            gathered = torch.empty(world_size * m, dtype=dtype)
            comm.all_gather(gathered, shard)
            want = torch.empty(world_size * m, dtype=dtype)
            _all_gather_flat(want, shard)
            check(f"all_gather {dtype} m={m}", gathered, want)
            buf = torch.zeros(world_size * m, dtype=dtype)
            buf[rank * m:(rank + 1) * m] = shard
            comm.all_gather(buf, buf[rank * m:(rank + 1) * m])
            check(f"all_gather in place {dtype} m={m}", buf, want)

    # all_gather moves any dtype; a complex one goes as its real view (as dist.isend sends it).
    shard = torch.complex(_random(5, torch.float32, gen), _random(5, torch.float32, gen))
    gathered = torch.empty(world_size * 5, dtype=torch.complex64)
    comm.all_gather(gathered, shard)
    want = torch.empty_like(gathered)
    _all_gather_flat(want, shard)
    check("all_gather complex64", gathered, want)

    # Several collectives in flight at once, interleaved with all_reduce, waited in reverse
    # order: integer-valued floats, so every result is exact.
    m = 3 * (CHUNK_BYTES // 4) + 2
    handles, expect = [], []
    for i in range(4):
        rs_in = torch.arange(world_size * m, dtype=torch.float32) * (rank + 1) + i
        rs_out = torch.empty(m)
        handles.append(comm.reduce_scatter(rs_out, rs_in, async_op=True, tag=f"rs {i}"))
        total = sum(r + 1 for r in range(world_size))
        expect.append((f"rs {i}", rs_out, ((torch.arange(m) + rank * m) * total + i * world_size).float()))
        ar = torch.full((m,), float(rank + i))
        handles.append(comm.all_reduce(ar, async_op=True, tag=f"ar {i}"))
        expect.append((f"ar {i}", ar, torch.full((m,), float(sum(range(world_size)) + world_size * i))))
        ag_out = torch.empty(world_size * m)
        handles.append(comm.all_gather(ag_out, torch.full((m,), float(10 * rank + i)), async_op=True, tag=f"ag {i}"))
        expect.append((f"ag {i}", ag_out,
                       torch.tensor([float(10 * r + i) for r in range(world_size)]).repeat_interleave(m)))
    # Every collective completes without anyone waiting (the exchanges on their progress
    # thread, Note [exchange progress]): is_completed() turns True by itself.
    deadline = time.monotonic() + 60
    while not all(h.is_completed() for h in handles):
        assert time.monotonic() < deadline, [h.tag for h in handles if not h.is_completed()]
        time.sleep(0.01)
    for h in reversed(handles):
        h.wait()
    assert all(h.is_completed() for h in handles)
    for name, got, want in expect:
        check(f"in flight {name}", got, want)

    # A subgroup that leaves out rank 1 (at world size 3: group rank 1 is global rank 2):
    # messages must go to global ranks.
    members = [r for r in range(world_size) if r != 1]
    sub = dist.new_group(members)
    if rank in members:
        sc = get_communicator(sub)
        assert sc.exchange is not None and sc.world_size == len(members)
        me = members.index(rank)
        inp = torch.arange(len(members) * 5, dtype=torch.float64) + 100 * rank
        out = torch.empty(5, dtype=torch.float64)
        sc.reduce_scatter(out, inp)
        check("subgroup reduce_scatter", out,
              sum(torch.arange(len(members) * 5, dtype=torch.float64) + 100 * r for r in members)[me * 5:me * 5 + 5])
        gathered = torch.empty(len(members) * 2)
        sc.all_gather(gathered, torch.full((2,), float(rank)))
        check("subgroup all_gather", gathered, torch.tensor([float(r) for r in members]).repeat_interleave(2))

    # Misuse, refused before anything is sent: an output overlapping another rank's slice of
    # the input (or an input overlapping another rank's slice of the output), integer avg.
    if world_size > 1:
        buf = torch.zeros(world_size * 4)
        other = (rank + 1) % world_size
        with pytest.raises(ValueError,
                           match=rf"output overlaps input other than at this rank's own slice \(rank {rank}\)"):
            comm.reduce_scatter(buf[other * 4:other * 4 + 4], buf)
        with pytest.raises(ValueError, match="input overlaps output"):
            comm.all_gather(buf, buf[1:5])  # misaligned: never exactly this rank's slice
    with pytest.raises(ValueError, match="op='avg' needs a floating-point tensor, got torch.int32"):
        comm.reduce_scatter(torch.empty(2, dtype=torch.int32), torch.ones(2 * world_size, dtype=torch.int32), op="avg")
    for n in (3, 300):  # the small all-reduces' exchange path and gloo's own: refused alike
        with pytest.raises(ValueError, match="all_reduce: op='avg' needs a floating-point tensor, got torch.int64"):
            comm.all_reduce(torch.ones(n, dtype=torch.int64), op="avg")
    out = torch.empty(3)
    comm.reduce_scatter(out, torch.ones(3 * world_size))  # still in step after refusals
    check("after refusals", out, torch.full((3,), float(world_size)))
    # The builtin collectives stay selectable, by environment or per communicator.
    from fusedist.comm import TorchCommunicator

    os.environ["FUSEDIST_GLOO_COLLECTIVES"] = "builtin"
    try:
        builtin = TorchCommunicator()
    finally:
        del os.environ["FUSEDIST_GLOO_COLLECTIVES"]
    assert builtin.exchange is None
    assert TorchCommunicator(gloo_collectives="builtin").exchange is None
    with pytest.raises(ValueError, match="gloo_collectives must be one of"):
        TorchCommunicator(gloo_collectives="ring")
    out = torch.empty(2)
    builtin.reduce_scatter(out, torch.ones(2 * world_size))
    check("builtin reduce_scatter", out, torch.full((2,), float(world_size)))
    if world_size > 1:  # the in-place rule holds for every backend (NCCL and gloo define only it)
        buf = torch.zeros(world_size * 4)
        other = (rank + 1) % world_size
        with pytest.raises(ValueError, match=r"output overlaps input other than at this rank's own slice"):
            builtin.reduce_scatter(buf[other * 4:other * 4 + 4], buf)
        with pytest.raises(ValueError, match="input overlaps output"):
            builtin.all_gather(buf, buf[1:5])
    assert builtin.scratch_bytes() == 0

    # Scratch memory (Note [in-place fold]): a reduce-scatter into a separate output keeps
    # (N-2)/N of its input as landing buffer, one in place (N-1)/N; both stay pooled after.
    fresh = TorchCommunicator()
    held = [fresh.scratch_bytes()]
    fresh.reduce_scatter(torch.empty(1000), torch.ones(1000 * world_size))
    held.append(fresh.scratch_bytes())
    x = torch.ones(1000 * world_size)
    fresh.reduce_scatter(x[rank * 1000:(rank + 1) * 1000], x)
    held.append(fresh.scratch_bytes())
    separate, in_place = 4000 * max(world_size - 2, 0), 4000 * (world_size - 1)
    if held != [0, separate, separate + in_place]:
        failures.append(f"scratch bytes {held}, expected {[0, separate, separate + in_place]}")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_exchange_matches_builtin_and_rank_order(world_size):
    seed = random.randrange(1 << 30)
    results = run_distributed(_exchange_checks, world_size, seed, timeout=240)
    for rank, failures in enumerate(results):
        assert not failures, f"seed {seed}, rank {rank}:\n" + "\n".join(failures)


def test_mode_from_env(monkeypatch):
    from fusedist.comm import gloo_exchange

    monkeypatch.delenv("FUSEDIST_GLOO_COLLECTIVES", raising=False)
    assert gloo_exchange.mode_from_env() == "p2p"
    monkeypatch.setenv("FUSEDIST_GLOO_COLLECTIVES", "BUILTIN")
    assert gloo_exchange.mode_from_env() == "builtin"
    monkeypatch.setenv("FUSEDIST_GLOO_COLLECTIVES", "ring")
    with pytest.raises(ValueError, match="FUSEDIST_GLOO_COLLECTIVES must be one of.*'ring'"):
        gloo_exchange.mode_from_env()


def test_tags_stay_in_their_range():
    from fusedist.comm import exchange_tags as gx

    labels = [lab for lab in ("", "zero2 bucket 0", "zero2 bucket 1", "blocks.0", "blocks.1")]
    assert len({gx.label_bits(lab) for lab in labels}) == len(labels)  # these differ
    tags = {gx.message_tag(kind, seq, chunk, label) for kind in ("reduce_scatter", "all_gather")
            for seq in (0, 1, (1 << gx.SEQ_BITS) - 1) for chunk in (0, 1, (1 << gx.CHUNK_BITS) - 1)
            for label in labels}
    assert len(tags) == 2 * 3 * 3 * len(labels)
    assert all((1 << 30) <= t < (1 << 31) for t in tags)
    assert gx.SEQ_BITS >= 13


def _failures(rank, world_size):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from fusedist.comm import CollectiveError, TorchCommunicator
    from fusedist.reliability import StallError
    from fusedist.reliability.monitor import attach_monitor

    out = {}
    # 1. Ranks out of step: at the same position rank 0 reduce-scatters while rank 1
    # all-gathers, with messages of the same size. The tags differ in kind: both time out,
    # neither pairs wrongly.
    comm = TorchCommunicator(dist.new_group([0, 1]), timeout=datetime.timedelta(seconds=2))
    comm.all_reduce(torch.ones(1))  # connections up, seq 0 used on both ranks
    start = time.monotonic()
    try:
        if rank == 0:
            comm.reduce_scatter(torch.empty(4), torch.ones(8), tag="mismatch")
        else:
            comm.all_gather(torch.empty(8), torch.ones(4), tag="mismatch")
        out["mismatch"] = ("completed", time.monotonic() - start)
    except CollectiveError as exc:
        out["mismatch"] = (str(exc), time.monotonic() - start)

    # 1b. A rank that skipped a collective: at the same position both ranks all-gather the same
    # size, for different units (seq and kind agree, the tags do not): both time out. (A new
    # group: gloo closes a pair after a receive timed out.)
    comm = TorchCommunicator(dist.new_group([0, 1]), timeout=datetime.timedelta(seconds=2))
    comm.all_reduce(torch.ones(1))
    start = time.monotonic()
    try:
        comm.all_gather(torch.empty(8), torch.ones(4), tag="blocks.0" if rank == 0 else "blocks.1")
        out["skipped"] = ("completed", time.monotonic() - start)
    except CollectiveError as exc:
        out["skipped"] = (str(exc), time.monotonic() - start)

    # 1c. A wait shorter than the communicator's timeout, for a peer that joins only once that
    # wait is over: it raises at its own timeout, as a torch gloo work's does (it had waited
    # for the peer).
    store = distributed_c10d._get_default_store()
    late = TorchCommunicator(dist.new_group([0, 1]), timeout=datetime.timedelta(seconds=20))
    late.all_reduce(torch.ones(1))
    if rank == 0:
        start = time.monotonic()
        handle = late.all_gather(torch.empty(8), torch.ones(4), async_op=True, tag="late")
        try:
            handle.wait(timeout=datetime.timedelta(seconds=1))
            out["late"] = ("completed", time.monotonic() - start)
        except CollectiveError as exc:
            out["late"] = (str(exc), time.monotonic() - start)
        store.set("late waited", "yes")
    else:
        store.wait(["late waited"], datetime.timedelta(seconds=60))
        try:
            late.all_gather(torch.empty(8), torch.ones(4), tag="late")
        except CollectiveError:
            pass  # (not expected: rank 0's short wait leaves its exchange going, and this one completes it)

    # 2. A rank that never joins: rank 0's reduce_scatter times out with a stall report.
    lonely = TorchCommunicator(dist.new_group([0, 1]))
    monitor = attach_monitor(lonely)
    assert monitor is not None
    lonely.all_reduce(torch.ones(1), tag="warm-up")
    if rank == 0:
        start = time.monotonic()
        try:
            lonely.reduce_scatter(torch.empty(4), torch.ones(8), tag="lonely")
            out["lonely"] = ("completed", None, time.monotonic() - start)
        except StallError as exc:
            out["lonely"] = (str(exc), exc.report, time.monotonic() - start)
        store.set("lonely done", "yes")
    else:  # alive, but in no collective, until rank 0 is done waiting
        store.wait(["lonely done"], datetime.timedelta(seconds=60))
    return out


def test_failures_time_out_naming_op_tag_rank():
    start = time.monotonic()
    results = run_distributed(_failures, 2, env=FAST_FAILURE, timeout=90)
    assert time.monotonic() - start < 60
    for rank, out in enumerate(results):
        message, elapsed = out["mismatch"]
        op = "reduce_scatter" if rank == 0 else "all_gather"
        assert f"{op} (tag 'mismatch'" in message and f"rank {rank} of 2" in message, message
        assert "did not complete" in message and "rank" in message
        assert elapsed < 15
        message, elapsed = out["skipped"]
        assert f"all_gather (tag 'blocks.{rank}'" in message and "did not complete" in message, message
        assert elapsed < 15
    message, elapsed = results[0]["late"]
    assert "all_gather (tag 'late'" in message and "receiving chunk" in message and elapsed < 2.5, (message, elapsed)
    message, report, elapsed = results[0]["lonely"]
    assert "reduce_scatter (tag 'lonely'" in message and "rank 0 of 2" in message, message
    assert "receiving chunk 0 from rank 1" in message
    assert "ranks [0] reached reduce_scatter [lonely]" in report, report
    assert "rank 1: did not report" in report, report
    assert elapsed < 15


def test_landing_pool_reuses_the_smallest_fitting_buffer():
    from fusedist.comm.exchange_fold import LandingPool as _LandingPool

    pool = _LandingPool(slots=2)
    a, b = pool.take(100, torch.float32), pool.take(10, torch.float32)
    assert a.numel() == 100 and b.numel() == 10
    pool.give_back(a)
    pool.give_back(b)
    assert pool.take(8, torch.float32).data_ptr() == b.data_ptr()  # smallest that fits
    assert pool.take(8, torch.float64).dtype == torch.float64  # never across dtypes
    assert pool.take(50, torch.float32).data_ptr() == a.data_ptr()
    assert pool.take(50, torch.float32).data_ptr() != a.data_ptr()  # a is in use: a new one
    for n in (1, 2, 3):
        pool.give_back(torch.empty(n))
    assert sorted(t.numel() for t in pool._free[torch.float32]) == [2, 3]  # at most 2 kept
    small = _LandingPool(slots=4, max_bytes=40)
    for n in (4, 5, 6):
        small.give_back(torch.empty(n))  # 16, 20, 24 bytes
    assert sorted(t.numel() for t in small._free[torch.float32]) == [6]  # 40 bytes at most
    small.give_back(torch.empty(11))  # 44 bytes: larger than the whole budget, not kept
    assert small.idle_bytes() == 0


def test_landing_pool_counts_what_it_holds():
    from fusedist.comm.exchange_fold import LandingPool as _LandingPool

    pool = _LandingPool()
    a, b = pool.take(100, torch.float32), pool.take(10, torch.float64)
    assert pool.held_bytes() == 400 + 80  # both lent out
    pool.give_back(a)
    assert pool.held_bytes() == 480 and pool.idle_bytes() == 400  # a idle, b still lent
    pool.drop(b)  # its exchange failed: not coming back, no longer counted
    assert pool.held_bytes() == 400


class _FakeWork:
    """Stands in for a torch ``Work``: records whether the exchange already said it was done
    when the last reference to it went away."""

    def __init__(self, exchange_box, log, fail=False):
        self._box, self._log, self._fail = exchange_box, log, fail

    def wait(self, timeout=None):
        if self._fail:
            raise RuntimeError("connection closed by peer")
        return True

    def __del__(self):
        self._log.append(self._box[0].is_completed())


@pytest.mark.parametrize("fail", [False, True], ids=["completes", "fails"])
def test_works_are_released_before_completion_is_signalled(fail):
    # Note [work references]: once is_completed() is True the caller may return and the
    # interpreter may shut down, so no gloo work may be left for the driving thread to release.
    from fusedist.comm.gloo_exchange import ExchangeWork

    box, log = [None], []
    receives = [(_FakeWork(box, log, fail=fail), 1, 1, 0, None), (_FakeWork(box, log), 1, 1, 1, None)]
    sends = [(lambda: _FakeWork(box, log), 1, 1, chunk) for chunk in (0, 1)]
    box[0] = work = ExchangeWork("all_gather", receives, sends, ())
    del receives, sends
    worker = threading.Thread(target=work.run)
    worker.start()
    worker.join()
    assert work.is_completed()
    assert log == [False] * 4, log  # every work released before the flag was set
    if fail:
        with pytest.raises(RuntimeError, match="receiving chunk 0 from rank 1 did not complete: connection closed"):
            work.wait()
