"""Communicator timeouts at the edges: ``datetime.timedelta.max`` ("no timeout"), negative or NaN
wait timeouts, and a timeout changed after the communicator was made.

One launch of two ranks runs every test's scenario (Note in tests/shared_rank_launch.py); the
ranks initialize themselves with ``fusedist.init_distributed(timeout=timedelta.max)``, so the
first scenario reads how that went. Results are compared with torch.distributed's own
collectives on the same random inputs: exact (a sum of two float32 addends, or a gather, is the
same bits on either path).
"""

from __future__ import annotations

import datetime
import socket
import time
import traceback

import pytest
import torch

from fusedist.testing import run_distributed
from shared_rank_launch import _run_in_turn, results_of

LONG = datetime.timedelta.max


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(fn_name: str, tensor: torch.Tensor, group=None) -> torch.Tensor:
    """torch.distributed's own ``fn_name`` of ``tensor`` (flat)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if fn_name == "all_reduce":
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out
    if fn_name == "all_gather":
        out = torch.empty(tensor.numel() * world, dtype=tensor.dtype)
        dist.all_gather_into_tensor(out, tensor, group=group)
        return out
    out = torch.empty(tensor.numel() // world, dtype=tensor.dtype)
    dist.reduce_scatter_tensor(out, tensor, group=group)
    return out


def _init_state(rank, world, init):
    """What ``init_distributed(timeout=timedelta.max)`` did (see _ranks), and an all-reduce
    through fusedist's default communicator on that group against torch's."""
    import torch.distributed as dist

    from fusedist.comm import get_communicator
    from fusedist.distributed import collective_timeout

    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(300, generator=gen)  # over the exchange's small-all-reduce size: gloo's own
    got = x.clone()
    get_communicator().all_reduce(got, tag="after-init")
    pg = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    return init, collective_timeout(), pg, torch.equal(got, _reference("all_reduce", x))


def _collectives(comm, group, rank: int, seed: int) -> list:
    """Each collective through ``comm`` (synchronous, and waited for with every "no timeout"
    spelling) against torch's on the same inputs: [(what, equal)]."""
    world = comm.world_size
    gen = torch.Generator().manual_seed(seed + rank)
    out = []
    for n in (8, 1000):  # through the exchange (p2p) / gloo's own all-reduce
        x = torch.randn(n, generator=gen)
        got = x.clone()
        comm.all_reduce(got, tag=f"sync {n}")
        out.append((f"all_reduce {n}", torch.equal(got, _reference("all_reduce", x, group))))
        for spelling in (None, LONG, float("inf"), datetime.timedelta(seconds=60), 1e12):
            got = x.clone()
            comm.all_reduce(got, async_op=True, tag=f"async {n}").wait(spelling)
            out.append((f"all_reduce {n} wait({spelling!r})", torch.equal(got, _reference("all_reduce", x, group))))
    x = torch.randn(6, generator=gen)
    got = torch.empty(6 * world)
    comm.all_gather(got, x, tag="ag")
    out.append(("all_gather", torch.equal(got, _reference("all_gather", x, group))))
    x = torch.randn(4 * world, generator=gen)
    got = torch.empty(4)
    comm.reduce_scatter(got, x, async_op=True, tag="rs").wait(LONG)
    out.append(("reduce_scatter", torch.equal(got, _reference("reduce_scatter", x, group))))
    return out


def _unbounded_communicators(rank, world):
    """``TorchCommunicator(timeout=timedelta.max)``, ``comm.timeout = timedelta.max`` and
    ``TorchCommunicator(timeout=float("inf"))``, on both gloo paths, on the whole group and on a
    one-rank group."""
    import torch.distributed as dist

    from fusedist.comm.torch_comm import TorchCommunicator

    singles = [dist.new_group([r]) for r in range(world)]  # (every rank makes every group)
    out = {}
    for group, name in ((None, "world"), (singles[rank], "alone")):
        for mode in ("p2p", "builtin"):
            for how in ("constructor", "attribute", "inf"):
                if how != "attribute":
                    comm = TorchCommunicator(group, timeout=LONG if how == "constructor" else float("inf"),
                                             gloo_collectives=mode)
                else:
                    comm = TorchCommunicator(group, timeout=datetime.timedelta(seconds=30), gloo_collectives=mode)
                    comm.timeout = LONG
                try:
                    out[(name, mode, how)] = (comm.timeout, _collectives(comm, group, rank, seed=7))
                except Exception:  # noqa: BLE001 - the test shows it
                    out[(name, mode, how)] = (comm.timeout, traceback.format_exc()[-1500:])
    return out


def _negative_waits(rank, world):
    """A negative or NaN ``wait(timeout)`` is refused up front, on each gloo path, and the
    collective goes on: a later ``wait()`` returns torch's result."""
    import torch.distributed as dist

    from fusedist.comm.torch_comm import TorchCommunicator

    out = {}
    gen = torch.Generator().manual_seed(300 + rank)
    # (a group with a finite timeout: a wait that broke gloo's connections fails the test, not hangs it)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
    for mode in ("p2p", "builtin"):
        comm = TorchCommunicator(group, timeout=datetime.timedelta(seconds=20), gloo_collectives=mode)
        for n in (8, 1000):
            x = torch.randn(n, generator=gen)
            got = x.clone()
            if rank == 1:
                time.sleep(0.3)  # rank 0's collective is still running when it is waited for
            handle = comm.all_reduce(got, async_op=True, tag=f"neg {n}")
            errors = []
            for bad in (datetime.timedelta(seconds=-1), -0.5, float("nan")):
                try:
                    handle.wait(bad)
                    errors.append(None)
                except ValueError as exc:
                    errors.append(str(exc))
                except Exception as exc:  # noqa: BLE001 - the wrong kind of refusal: the test shows it
                    errors.append(f"{type(exc).__name__}: {exc}")
            handle.wait()
            try:
                handle.wait(datetime.timedelta(seconds=-1))  # finished: refused all the same
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
            out[(mode, n)] = (errors, torch.equal(got, _reference("all_reduce", x, group)))
    return out


def _timeout_raised_after_creation(rank, world):
    """A communicator made with a 0.5 s timeout, then given 30 s: rank 1 joins its exchange
    collectives 1.5 s late, and they complete (the exchange counted from its own copy, 0.5 s)."""
    import torch.distributed as dist

    from fusedist.comm.torch_comm import TorchCommunicator

    comm = TorchCommunicator(timeout=datetime.timedelta(seconds=0.5), gloo_collectives="p2p")
    comm.timeout = datetime.timedelta(seconds=30)
    gen = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(5, generator=gen)
    dist.barrier()
    if rank == 1:
        time.sleep(1.5)
    got = torch.empty(5 * world)
    start = time.monotonic()
    try:
        comm.all_gather(got, x, tag="late peer")
        outcome = "ok"
    except Exception as exc:  # noqa: BLE001 - the test shows it
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, time.monotonic() - start, torch.equal(got, _reference("all_gather", x))


def _diverged_into_exchanges(rank, world):
    """On a group made with a 2 s timeout, rank 0 all-gathers while rank 1 reduce-scatters (it
    caught an error and went on): both go through the exchange, whose collectives never pair.
    torch's own gloo collectives on such a group end at 2 s; so must these, although the
    communicator's timeout is 30 s."""
    import torch.distributed as dist

    from fusedist.comm.base import CollectiveError
    from fusedist.comm.torch_comm import TorchCommunicator

    quick = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    comm = TorchCommunicator(quick, timeout=datetime.timedelta(seconds=30), gloo_collectives="p2p")
    comm.all_reduce(torch.ones(1), tag="in step")
    start = time.monotonic()
    try:
        if rank == 0:
            comm.all_gather(torch.empty(2 * 16), torch.ones(16), tag="gather")
        else:
            comm.reduce_scatter(torch.empty(16), torch.ones(32), tag="scatter")
        outcome = "completed"
    except CollectiveError as exc:
        outcome = str(exc)
    return outcome, time.monotonic() - start


def _ranks(rank, world, todo):
    """Initialize with ``init_distributed(timeout=timedelta.max)`` (falling back to torch's own
    init, so that the other scenarios still run if it is refused), then run the scenarios."""
    import torch.distributed as dist

    import fusedist

    try:
        fusedist.init_distributed(timeout=LONG)
        init = "ok"
    except Exception:  # noqa: BLE001 - the first scenario reports it
        init = traceback.format_exc()[-1500:]
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    todo = [(name, fn, (init,) if fn is _init_state else args) for name, fn, args in todo]
    return _run_in_turn(rank, world, todo)


SCENARIOS = {
    "test_init_distributed_takes_timedelta_max": {"init": (_init_state, ())},
    "test_communicators_take_timedelta_max": {"unbounded": (_unbounded_communicators, ())},
    "test_negative_wait_timeouts_are_refused_and_the_collective_goes_on": {"negative": (_negative_waits, ())},
    "test_a_timeout_raised_after_creation_bounds_the_exchange": {"raised": (_timeout_raised_after_creation, ())},
    "test_exchange_collectives_end_at_the_group_timeout": {"diverged": (_diverged_into_exchanges, ())},
}


@pytest.fixture(scope="module")
def launched(request):
    wanted = {getattr(item, "originalname", item.name) for item in request.session.items
              if item.module is request.module}
    todo = [(name, fn, args) for test, scenarios in SCENARIOS.items() if test in wanted
            for name, (fn, args) in scenarios.items()]
    per_rank = run_distributed(_ranks, 2, todo, backend=None, timeout=150,
                               env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    return {name: [results[name] for results in per_rank] for name, _, _ in todo}


def test_init_distributed_takes_timedelta_max(launched):
    """timedelta.max is a timeout (the usual "none"): it was refused as not "positive, finite";
    handed to torch's gloo as it is, init fails ("timeout.count() >= 0. Invalid timeout")."""
    from fusedist.distributed import LONGEST_TIMEOUT_S

    longest = datetime.timedelta(seconds=LONGEST_TIMEOUT_S)
    for init, fusedist_timeout, group_timeout, equal in results_of(launched, "init"):
        assert init == "ok", init
        assert fusedist_timeout == longest
        assert group_timeout == longest
        assert equal


def test_communicators_take_timedelta_max(launched):
    """Every wait of a communicator with timeout timedelta.max raised OverflowError (deadline
    arithmetic in timedelta), and ``timeout=float("inf")`` was refused; either is kept as
    LONGEST_TIMEOUT_S, and every collective matches torch's."""
    from fusedist.distributed import LONGEST_TIMEOUT_S

    for per_rank in results_of(launched, "unbounded"):
        assert len(per_rank) == 12
        for key, (timeout, checks) in per_rank.items():
            assert timeout == datetime.timedelta(seconds=LONGEST_TIMEOUT_S), key
            assert isinstance(checks, list), f"{key}: {checks}"
            assert checks and all(equal for _, equal in checks), (key, checks)


def test_negative_wait_timeouts_are_refused_and_the_collective_goes_on(launched):
    """Before: torch's gloo work waited anyway (no error), the exchange gave up at once with a
    "timed out" error; now every path refuses it with a ValueError naming the collective."""
    for per_rank in results_of(launched, "negative"):
        assert len(per_rank) == 4
        for (mode, n), (errors, equal) in per_rank.items():
            assert equal, (mode, n)
            assert len(errors) == 4
            for error in errors:
                assert error is not None, (mode, n, errors)
                assert f"all_reduce (tag 'neg {n}'" in error and "wait(timeout) must be >= 0" in error, error
                assert "wait() again for its result" in error


def test_a_timeout_raised_after_creation_bounds_the_exchange(launched):
    outcome, waited, equal = results_of(launched, "raised")[0]
    assert outcome == "ok", outcome
    assert equal and waited > 1.0
    assert results_of(launched, "raised")[1][2]


def test_exchange_collectives_end_at_the_group_timeout(launched):
    """They waited for fusedist's timeout (30 s here; 600 s by default) where gloo's own would
    have failed at the group's 2 s: diverged ranks stayed blocked for minutes."""
    results = results_of(launched, "diverged")
    for rank, (outcome, waited) in enumerate(results):
        op = "all_gather" if rank == 0 else "reduce_scatter"
        assert outcome.startswith(f"fusedist: {op} (tag "), outcome
        assert waited < 12, waited
    # The rank that launched first times out; the other may learn of it sooner, from gloo closing the
    # connection to it (a busy machine can start one rank's collective a while after the other's).
    timed_out = [outcome for outcome, waited in results if "the process group's own timeout, 2 s" in outcome]
    assert timed_out and all(waited > 1.5 for outcome, waited in results if outcome in timed_out), results


def test_timeout_values_are_checked_and_bounded():
    """In process: what a communicator's and init_distributed's timeouts accept."""
    from fusedist.distributed import LONGEST_TIMEOUT_S, bounded_timeout, wait_timeout

    longest = datetime.timedelta(seconds=LONGEST_TIMEOUT_S)
    assert bounded_timeout(LONG, "t") == longest
    assert bounded_timeout(5e13, "t") == longest
    for unbounded in (float("inf"), "inf", "1e20", 10 ** 400, LONGEST_TIMEOUT_S):  # as wait(float("inf")) takes it
        assert bounded_timeout(unbounded, "t") == longest, unbounded
    assert bounded_timeout(datetime.timedelta(seconds=3), "t") == datetime.timedelta(seconds=3)
    assert bounded_timeout("2.5", "t") == datetime.timedelta(seconds=2.5)
    for bad in (float("nan"), "nan", -1, 0, -float("inf"), -10 ** 400, datetime.timedelta(seconds=-2), "x", None):
        with pytest.raises(ValueError, match="t must be a positive"):
            bounded_timeout(bad, "t")
    default = datetime.timedelta(seconds=9)
    what = lambda: "all_reduce (tag 'x', collective #3) on rank 0"  # noqa: E731
    assert wait_timeout(None, default, what) == default
    assert wait_timeout(0, default, what) == default
    assert wait_timeout(datetime.timedelta(microseconds=10), default, what) == default
    assert wait_timeout(float("inf"), default, what) == longest
    assert wait_timeout(2.5, default, what) == datetime.timedelta(seconds=2.5)
    # bounded where it is read, as a number is (before: timedelta.max came back, and each caller bounded it)
    assert wait_timeout(LONG, default, what) == longest
    assert wait_timeout(datetime.timedelta(seconds=LONGEST_TIMEOUT_S * 2), default, what) == longest
    for bad in (-1e-9, float("nan"), datetime.timedelta(microseconds=-1)):
        with pytest.raises(ValueError, match=r"all_reduce \(tag 'x', collective #3\) on rank 0: wait\(timeout\)"):
            wait_timeout(bad, default, what)
    with pytest.raises(TypeError, match="all_reduce"):
        wait_timeout("5", default, what)
