"""GPU tier of the CUDA/NCCL extension (auto-skipped without a CUDA device).

NCCL refuses two ranks on one GPU, so these run with world size 1 against torch's own NCCL
backend in the same process; multi-rank behaviour of the interface is covered by the gloo
tests. Each check runs in a spawned process (fresh CUDA context, so an aborted communicator or
a failed kernel cannot leak into other tests).
"""

import datetime
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import fusedist
from fusedist.testing import run_distributed

pytestmark = pytest.mark.gpu


def _report(name, values):
    """Leave a measurement for benchmarks/gpu/run_checks.sh's summary table (when it asks)."""
    folder = os.environ.get("FUSEDIST_GPU_REPORT_DIR")
    if folder:
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(values, f)


def _require_ext():
    assert fusedist.cuda_ext_available(), f"fusedist._C did not load: {fusedist.cuda_ext_error()}"


def _random(n, dtype, gen):
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen) * 3).to(dtype).cuda()
    return torch.randint(0, 100, (n,), generator=gen).to(dtype).cuda()


def _parity_with_torch_nccl(rank, world_size):
    from fusedist.comm import CollectiveError, TorchCommunicator, get_communicator
    from fusedist.comm.nccl_comm import NcclCommunicator

    ours = get_communicator(device="cuda")
    assert isinstance(ours, NcclCommunicator), type(ours)
    theirs = TorchCommunicator()
    gen = torch.Generator().manual_seed(1234)
    checked = 0
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8)
    for dtype in dtypes:
        for n in (1, 17 * 257, 65537, 0):
            for op in ("sum", "avg", "max", "min"):
                x = _random(n, dtype, gen)
                a, b = x.clone(), x.clone()
                ours.all_reduce(a, op=op)
                theirs.all_reduce(b, op=op)
                assert torch.equal(a, b), (dtype, n, op)
                checked += 1
            x = _random(n * world_size, dtype, gen)
            out_a, out_b = torch.empty(n, dtype=dtype, device="cuda"), torch.empty(n, dtype=dtype, device="cuda")
            ours.reduce_scatter(out_a, x.clone())
            theirs.reduce_scatter(out_b, x.clone())
            assert torch.equal(out_a, out_b), ("reduce_scatter", dtype, n)
            y = _random(n, dtype, gen)
            ga = torch.empty(n * world_size, dtype=dtype, device="cuda")
            gb = torch.empty_like(ga)
            ours.all_gather(ga, y)
            theirs.all_gather(gb, y)
            assert torch.equal(ga, gb) and torch.equal(ga[:n], y), ("all_gather", dtype, n)
            a, b = y.clone(), y.clone()
            ours.broadcast(a, src=0)
            theirs.broadcast(b, src=0)
            assert torch.equal(a, b), ("broadcast", dtype, n)
            checked += 3
    # Stream ordering without host blocking: the producer writes `src` behind a long kernel,
    # the collective must wait for that write (ordering 1), and the consumer must read `dst`
    # only after the copy (ordering 2) although wait() does not block the host here.
    blocking, ours.blocking_wait = ours.blocking_wait, False
    src = torch.zeros(16 << 20, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda._sleep(50_000_000)
    src.fill_(5.0)
    h = ours.all_gather(dst, src, async_op=True, tag="ordering")
    h.wait()
    h.wait()  # idempotent
    assert bool((dst == 5.0).all()), "consumer read the all_gather output before it was written"
    ours.blocking_wait = blocking
    # Misuse is explained.
    with pytest.raises(CollectiveError, match="NCCL does not support torch.complex64"):
        ours.all_reduce(torch.zeros(4, dtype=torch.complex64, device="cuda"))
    with pytest.raises(CollectiveError, match="works on cuda:0 .* got a tensor on cpu"):
        ours.all_reduce(torch.zeros(4))
    # close() tears NCCL down; later collectives say so instead of touching freed state.
    ours.close()
    ours.close()  # idempotent
    with pytest.raises(CollectiveError, match="destroyed"):
        ours.all_reduce(torch.zeros(4, device="cuda"))
    return checked


def test_world1_communicator_equals_torch_nccl():
    _require_ext()
    (checked,) = run_distributed(_parity_with_torch_nccl, 1, backend="nccl", timeout=300)
    assert checked == 6 * 4 * 7


def _overlap(rank, world_size):
    from fusedist.comm import get_communicator

    comm = get_communicator(device="cuda")
    src = torch.randn(64 << 20, device="cuda")  # 256 MiB: world-size-1 all_gather is a copy
    dst = torch.empty_like(src)
    torch.cuda.synchronize()

    def timed(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def comm_only(k):
        def run():
            handles = [comm.all_gather(dst, src, async_op=True) for _ in range(k)]
            for h in handles:
                h.wait()
        return run

    k = 4
    while timed(comm_only(k)) < 20 and k < 4096:  # enough comm work to measure (>= 20 ms)
        k *= 2
    t_comm = min(timed(comm_only(k)) for _ in range(3))
    cycles = 1 << 20
    while timed(lambda: torch.cuda._sleep(cycles)) < t_comm:
        cycles *= 2
    t_compute = min(timed(lambda: torch.cuda._sleep(cycles)) for _ in range(3))

    def both():
        # The collectives are enqueued first (they wait only for work already on the current
        # stream), then the compute kernel: the DDP pattern of reducing bucket i while the
        # backward of bucket i+1 runs.
        handles = [comm.all_gather(dst, src, async_op=True) for _ in range(k)]
        torch.cuda._sleep(cycles)
        for h in handles:
            h.wait()

    t_both = min(timed(both) for _ in range(3))
    return t_comm, t_compute, t_both, k


def test_comm_stream_overlaps_compute():
    _require_ext()
    ((t_comm, t_compute, t_both, k),) = run_distributed(_overlap, 1, backend="nccl", timeout=300)
    serial = t_comm + t_compute
    _report("overlap", {"comm_ms": t_comm, "compute_ms": t_compute, "together_ms": t_both,
                        "hidden_fraction_of_shorter": (serial - t_both) / min(t_comm, t_compute)})
    print(f"comm {t_comm:.1f} ms ({k} all_gathers), compute {t_compute:.1f} ms, together {t_both:.1f} ms, "
          f"serial would be {serial:.1f} ms")
    # Serial execution would take t_comm + t_compute; full overlap max(t_comm, t_compute).
    # Require at least a third of the shorter phase to be hidden.
    assert t_both < serial - min(t_comm, t_compute) / 3, (t_comm, t_compute, t_both)


def _timeout(rank, world_size, blocking):
    from fusedist.comm import CollectiveError, get_communicator

    comm = get_communicator(device="cuda")
    assert comm.blocking_wait is blocking  # FUSEDIST_NCCL_BLOCKING_WAIT, default 0
    comm.timeout = datetime.timedelta(seconds=0.5)
    x = torch.ones(1024, device="cuda")
    # The producer stream is busy for ~seconds, so the collective (ordered after it) cannot
    # finish within the timeout: it must be given up, NCCL aborted, and op, tag and rank named.
    torch.cuda._sleep(4_000_000_000)
    handle = comm.all_reduce(x, async_op=True, tag="grad-bucket-7")
    if blocking:
        with pytest.raises(CollectiveError) as info:
            handle.wait()
        timed_out = "did not complete within 0.5 s"
    else:
        # Note [stream-ordered waits and the watchdog], FUSEDIST_NCCL_WATCHDOG=raise: wait()
        # returns at once; the watchdog aborts at the deadline and the next collective raises,
        # naming the one that failed.
        start = time.perf_counter()
        handle.wait()
        assert time.perf_counter() - start < 0.2, "a stream-ordered wait blocked the host"
        deadline = time.monotonic() + 30
        while comm.watchdog.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert comm.watchdog.failure is not None, "the watchdog did not fire within 30 s"
        torch.cuda.synchronize()  # the aborted collective's kernels ended: no hang here
        with pytest.raises(CollectiveError) as info:
            comm.all_reduce(x, tag="next-bucket")
        timed_out = "did not complete within 0.5 s of its launch"
    message = str(info.value)
    for needle in ("all_reduce", "grad-bucket-7", "rank 0 of 1", timed_out, "abort"):
        assert needle in message, message
    assert info.value.op == "all_reduce" and info.value.tag == "grad-bucket-7" and info.value.rank == 0
    with pytest.raises(CollectiveError, match="abort"):
        comm.all_reduce(x, tag="after-abort")
    return message


@pytest.mark.parametrize("blocking", [False, True], ids=["watchdog-raise", "blocking-wait"])
def test_wait_timeout_aborts_and_names_the_collective(blocking):
    _require_ext()
    env = {"FUSEDIST_NCCL_BLOCKING_WAIT": "1" if blocking else "0", "FUSEDIST_NCCL_WATCHDOG": "raise"}
    (message,) = run_distributed(_timeout, 1, blocking, backend="nccl", timeout=300, env=env)
    print(message)


_EXIT_SCRIPT = """
import datetime, sys, time, torch, torch.distributed as dist
from fusedist.comm import get_communicator
dist.init_process_group("nccl", init_method="file://" + sys.argv[1], rank=0, world_size=1)
comm = get_communicator(device="cuda")
comm.timeout = datetime.timedelta(seconds=0.5)
x = torch.ones(1024, device="cuda")
torch.cuda._sleep(8_000_000_000)  # the collective cannot finish within the timeout
comm.all_reduce(x, async_op=True, tag="grad-bucket-7").wait()
print("WAIT RETURNED", flush=True)
value = x.sum().item()  # blocks behind the collective: the watchdog reports and exits first
print("READ", value, flush=True)
"""


def test_watchdog_reports_and_exits_before_a_result_can_be_read(tmp_path):
    """FUSEDIST_NCCL_WATCHDOG=exit (the default): the rank prints the error naming the
    collective and exits with status 1 while the host is still blocked on the result, so
    nothing read behind the failed collective reaches the program (no abort first: it would
    block until the queued work ran, releasing the read)."""
    _require_ext()
    script = tmp_path / "exit_on_timeout.py"
    script.write_text(_EXIT_SCRIPT)
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "rdzv")], capture_output=True,
                         text=True, timeout=240, env={k: v for k, v in os.environ.items()
                                                      if k != "FUSEDIST_NCCL_WATCHDOG"})
    print(out.stdout[-2000:], out.stderr[-3000:])
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    assert "WAIT RETURNED" in out.stdout and "READ" not in out.stdout.replace("WAIT RETURNED", "")
    for needle in ("CollectiveError: fusedist: all_reduce (tag 'grad-bucket-7', collective #",
                   "failed on rank 0 of 1", "did not complete within 0.5 s of its launch"):
        assert needle in out.stderr, out.stderr[-3000:]
    assert time.monotonic() - start < 120
