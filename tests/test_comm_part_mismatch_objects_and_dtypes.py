"""Communicator probes against torch.distributed (gloo): parts that differ across ranks, objects
that cannot be pickled on one rank, small all-reduces of parameters."""

import time

import pytest
import torch

from fusedist.testing import run_distributed
from phased_launches import launch_phase
from shared_rank_launch import results_of, under_env


def _parts_that_differ(rank, world_size, kind):
    from fusedist.comm import CollectiveError, get_communicator

    comm = get_communicator()
    m = 3 + rank  # a shape that depends on the rank
    start = time.monotonic()
    try:
        if kind == "all_reduce_op":  # the same tensor size everywhere, but max here and sum there
            values = torch.randn(3, generator=torch.Generator().manual_seed(time.time_ns() % 2**31 + rank))
            agreed, reference = values.clone(), values.clone()
            comm.all_reduce(agreed, op="max", tag="same op")  # (12 bytes: the gloo exchange)
            torch.distributed.all_reduce(reference, op=torch.distributed.ReduceOp.MAX)
            assert torch.equal(agreed, reference), (agreed, reference)
            start = time.monotonic()
            comm.all_reduce(values, op="max" if rank == 0 else "sum", tag="ops differ")
        elif kind == "probed all_gather":  # as DDP / ZeRO / fully_shard run theirs: monitored, asynchronous
            from fusedist.reliability import attach_monitor

            assert attach_monitor(comm).probe_delay_s == 0.3
            comm.all_gather(torch.empty(m * world_size), torch.randn(m), tag="uneven", async_op=True).wait()
        elif kind == "reduce_scatter":
            comm.reduce_scatter(torch.empty(m), torch.randn(m * world_size), tag="uneven")
        else:
            comm.all_gather(torch.empty(m * world_size), torch.randn(m), tag="uneven")
        return "no error", time.monotonic() - start
    except CollectiveError as exc:
        return str(exc), time.monotonic() - start


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_parts_that_differ_across_ranks_time_out_naming_each_part(kind):
    """The exchange paired messages of different sizes: gloo terminated the rank whose receive
    was smaller, and the other went on with garbage past the peer's part."""
    results = run_distributed(_parts_that_differ, 2, kind, env={"FUSEDIST_TIMEOUT_S": "2"}, expect_failure=True)
    for rank, (status, value) in enumerate(results):
        assert status == "ok", value
        message, elapsed = value
        assert f"{kind} [{3 + rank} x torch.float32 per rank]" in message, (rank, message)
        assert f"rank {rank} of 2" in message and elapsed < 15


def test_parts_that_differ_fail_every_rank_soon_after_the_probes_delay_with_a_monitor():
    """Note [divergence probe] in fusedist/reliability/divergence.py: the ranks wait in the same
    collective (sequence number and op) with parts of different sizes, which never pair; that ended
    only at the collective timeout, where the parts' sizes now end it about a second past the delay."""
    env = {"FUSEDIST_TIMEOUT_S": "4", "FUSEDIST_DIVERGENCE_PROBE_S": "0.3", "FUSEDIST_STALL_REPORT_S": "0.5"}
    results = run_distributed(_parts_that_differ, 2, "probed all_gather", env=env, expect_failure=True)
    for rank, (status, value) in enumerate(results):
        assert status == "ok", value
        message, elapsed = value
        assert "they wait in the same collective with parts of different sizes -- ranks [0] in all_gather " \
               "(collective #0, 3 x torch.float32 per rank); ranks [1] in all_gather (collective #0, 4 x " \
               "torch.float32 per rank)" in message, (rank, message)
        assert "Stall report" in message and elapsed < 3.5, (rank, elapsed, message)


def test_small_all_reduces_with_different_ops_across_ranks_time_out_instead_of_differing():
    """A small all-reduce with ``max`` on one rank and ``sum`` on another paired on the exchange
    (labelled by size and dtype only): each rank folded with its own op and the ranks went on with
    different results, silently (rank 0 the max, rank 1 the sum; torch's gloo pairs them too)."""
    results = run_distributed(_parts_that_differ, 2, "all_reduce_op", env={"FUSEDIST_TIMEOUT_S": "2"},
                              expect_failure=True)
    timed_out = []
    for rank, (status, value) in enumerate(results):
        assert status == "ok", value
        message, elapsed = value
        assert "all_reduce (tag 'ops differ', collective #1)" in message, (rank, message)
        assert f"rank {rank} of 2" in message and elapsed < 15
        # The rank whose deadline passes first closes the connections; a peer still waiting then reads
        # gloo's "Connection closed by peer" instead of its own timeout (whichever comes first: a race).
        assert "timed out" in message or "Connection closed by peer" in message, (rank, message)
        timed_out.append("timed out" in message)
    assert any(timed_out), results


def _unpicklable_on_one_rank(rank, world_size):
    from fusedist.comm import CollectiveError, get_communicator
    from fusedist.comm.objects import all_gather_object, broadcast_object, gather_object

    comm = get_communicator()
    value = torch.randn(3)
    out = {}
    calls = {
        "all_gather_object": lambda obj: all_gather_object(comm, obj, tag="probe all"),
        "gather_object": lambda obj: gather_object(comm, obj, 0, tag="probe gather"),
        "broadcast_object": lambda obj: broadcast_object(comm, obj, 1, tag="probe broadcast"),
    }
    for name, call in calls.items():
        start = time.monotonic()
        try:
            call((lambda: 0) if rank == 1 else value)  # a lambda does not pickle
            first = "no error"
        except CollectiveError as exc:
            first = str(exc)
        except Exception as exc:  # noqa: BLE001 - the pickling error itself
            first = f"{type(exc).__name__}: {exc}"
        # The group is still in step: the next exchange pairs as it should.
        out[name] = (first, time.monotonic() - start, all_gather_object(comm, value, tag=f"after {name}"))
    return out


def test_an_object_that_does_not_pickle_on_one_rank_raises_on_every_rank_at_once(launched):
    """The rank whose pickling failed raised before the header exchange: the others waited for
    it (its next exchange then paired with their header as a different exchange)."""
    results = results_of(launched, "unpicklable on one rank")
    values = [results[r]["all_gather_object"][2][r] for r in range(2)]
    for rank, out in enumerate(results):
        for name, (first, elapsed, after) in out.items():
            if rank == 1:
                assert "pickle" in first and "local object" in first, (name, first)
            else:
                assert "the object of rank(s) [1] could not be pickled" in first, (name, first)
            assert elapsed < 5, (rank, name, elapsed)
            assert all(torch.equal(a, b) for a, b in zip(after, values))


def _parameter_all_reduce(rank, world_size):
    import torch.distributed as dist

    from fusedist.comm import get_communicator

    comm = get_communicator()
    values = torch.randn(5, generator=torch.Generator().manual_seed(time.time_ns() % 2**31 + rank))
    out = {}
    for op, torch_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
        ours, theirs = torch.nn.Parameter(values.clone()), torch.nn.Parameter(values.clone())
        comm.all_reduce(ours, op=op)  # 20 bytes: the gloo exchange's small all-reduce
        dist.all_reduce(theirs, op=torch_op)
        out[op] = (ours.detach(), theirs.detach())
    return out


def test_small_all_reduce_of_a_parameter_writes_it_as_torch_does(launched):
    """The small all-reduce copied its result into the tensor under autograd: a parameter
    outside no_grad failed after the exchange ("a view of a leaf Variable that requires grad
    is being used in an in-place operation") where torch's all-reduce writes it."""
    for out in results_of(launched, "parameter all-reduce"):
        for op, (ours, theirs) in out.items():
            assert torch.equal(ours, theirs), op


@pytest.fixture(scope="module")
def launched(request):
    """The scenarios that leave the group in step, in one launch (those that time out a
    collective on purpose keep a launch each: their ranks' exchanges no longer pair after)."""
    return launch_phase(request, {
        "test_small_all_reduce_of_a_parameter_writes_it_as_torch_does": {
            "parameter all-reduce": (_parameter_all_reduce, ())},
        "test_an_object_that_does_not_pickle_on_one_rank_raises_on_every_rank_at_once": {
            "unpicklable on one rank": (under_env, ({"FUSEDIST_TIMEOUT_S": "20"}, _unpicklable_on_one_rank))},
    }, 2, timeout=120)


class _RecordingNccl:
    """Stands in for the extension's NCCL communicator: records what each launch asks NCCL."""

    def __init__(self):
        self.calls = []

    def broadcast(self, send, recv, count, dtype, src, stream, what):
        self.calls.append((what, count, dtype))

    def all_gather(self, send, recv, count, dtype, stream, what):
        self.calls.append((what, count, dtype))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float8_e4m3fn, torch.complex64, torch.int16, torch.bfloat16])
def test_nccl_broadcast_and_all_gather_move_any_dtype(dtype):
    """DDP broadcasts bool buffers and float8 weights, which torch's NCCL backend moves: the
    direct-NCCL communicator refused them with TypeError (no NCCL code for the dtype)."""
    from fusedist.comm._nccl_types import NCCL_DTYPES
    from fusedist.comm.nccl_comm import NcclCommunicator

    comm = NcclCommunicator.__new__(NcclCommunicator)  # no GPU here: only the launch arguments
    comm._comm = _RecordingNccl()
    comm._enqueue = lambda op, tensors, count, launch: launch("stream")
    n = int(torch.randint(1, 9, ()))
    tensor = torch.zeros(n, dtype=dtype)
    comm._broadcast(tensor, 0)
    comm._all_gather(torch.zeros(2 * n, dtype=dtype), tensor)
    expected = ((n, NCCL_DTYPES[dtype]) if dtype in NCCL_DTYPES
                else (n * tensor.element_size(), NCCL_DTYPES[torch.uint8]))
    assert comm._comm.calls == [("broadcast", *expected), ("all_gather", *expected)]
