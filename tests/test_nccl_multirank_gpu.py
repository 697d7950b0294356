"""GPU tier at world size 2: fusedist's direct-NCCL path across ranks, against torch's NCCL in
the same run (auto-skipped without enough CUDA devices).

On a machine with one GPU run it with ``FUSEDIST_TEST_RANKS_PER_GPU=2`` (Note [several ranks
on one GPU] in fusedist/testing/shared_gpu.py): both ranks then share the GPU over NCCL's
socket transport, fusedist's communicator and torch's alike. ``benchmarks/gpu/run_checks.sh``
does that in its multi-rank stage.

Numbers are integer-valued floats wherever two implementations are compared exactly: NCCL may
pick different algorithms for the two communicators, and float sums in another order differ
in rounding (sums of small integers do not).
"""

import datetime
import threading
import time

import pytest
import torch

import fusedist
from fusedist.testing import device_for_rank, rank_slots, ranks_per_gpu_setting, run_distributed

pytestmark = pytest.mark.gpu

WORLD = 2


def _slots() -> int:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return rank_slots(count, ranks_per_gpu_setting())


needs_two_ranks = pytest.mark.skipif(
    _slots() < WORLD,
    reason=f"needs room for {WORLD} ranks: 2 GPUs, or 1 with FUSEDIST_TEST_RANKS_PER_GPU=2")


def _require_ext():
    assert fusedist.cuda_ext_available(), f"fusedist._C did not load: {fusedist.cuda_ext_error()}"


def _device(rank):
    return torch.device("cuda", device_for_rank(rank))


def _ints(n, dtype, gen, device, nonneg=False):
    """Small integers as ``dtype``: every sum, max, min and average of two is exact."""
    values = torch.randint(0 if nonneg or dtype == torch.uint8 else -8, 9, (n,), generator=gen)
    return values.to(dtype).to(device)


# ------------------------------------------------------------------ collectives vs torch's NCCL
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8)
ALL_SIZES = (1, 17 * 257, 65537, 0)


def _collectives(rank, world_size, dtypes=ALL_DTYPES, sizes=ALL_SIZES):
    from fusedist.comm import TorchCommunicator, get_communicator
    from fusedist.comm.nccl_comm import NcclCommunicator

    device = _device(rank)
    ours = get_communicator(device=device)
    assert isinstance(ours, NcclCommunicator), type(ours)
    assert ours.device == device
    theirs = TorchCommunicator()
    gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
    checked = 0
    for dtype in dtypes:
        for n in sizes:
            ops = ("sum", "max", "min") + (("avg",) if dtype.is_floating_point else ())
            for op in ops:
                x = _ints(n, dtype, gen, device)
                a, b = x.clone(), x.clone()
                ours.all_reduce(a, op=op)
                theirs.all_reduce(b, op=op)
                assert torch.equal(a, b), (dtype, n, op)
                checked += 1
            x = _ints(n * world_size, dtype, gen, device, nonneg=True)
            out_a, out_b = torch.empty(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)
            ours.reduce_scatter(out_a, x.clone())
            theirs.reduce_scatter(out_b, x.clone())
            assert torch.equal(out_a, out_b), ("reduce_scatter", dtype, n)
            # In place: the output is this rank's slice of the input (nonzero offset on rank 1).
            inplace = x.clone()
            ours.reduce_scatter(inplace[rank * n:(rank + 1) * n], inplace)
            assert torch.equal(inplace[rank * n:(rank + 1) * n], out_b), ("reduce_scatter in place", dtype, n)
            y = _ints(n, dtype, gen, device, nonneg=True)
            ga = torch.empty(n * world_size, dtype=dtype, device=device)
            gb = torch.empty_like(ga)
            ours.all_gather(ga, y)
            theirs.all_gather(gb, y)
            assert torch.equal(ga, gb) and torch.equal(ga[rank * n:(rank + 1) * n], y), ("all_gather", dtype, n)
            gc = torch.zeros_like(ga)
            gc[rank * n:(rank + 1) * n] = y
            ours.all_gather(gc, gc[rank * n:(rank + 1) * n])
            assert torch.equal(gc, gb), ("all_gather in place", dtype, n)
            for src in range(world_size):
                a, b = y.clone(), y.clone()
                ours.broadcast(a, src=src)
                theirs.broadcast(b, src=src)
                assert torch.equal(a, b), ("broadcast", dtype, n, src)
            checked += 5
    # Every element known: ranks fill with rank + 1.
    t = torch.full((1 << 20,), float(rank + 1), device=device)
    ours.all_reduce(t)
    assert bool((t == sum(range(1, world_size + 1))).all())
    return checked


@needs_two_ranks
def test_ws2_communicator_equals_torch_nccl():
    _require_ext()
    results = run_distributed(_collectives, WORLD, backend="nccl", timeout=400)
    assert results[0] == results[1] > 0


MOVED_DTYPES = (torch.bool, torch.int16, torch.complex64, torch.float8_e4m3fn)


def _bits(rank, n, dtype):
    """Rank ``rank``'s data for dtype: random bytes viewed as it (no arithmetic: NaN bit patterns
    are compared as bytes)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    width = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * width,), generator=gen, dtype=torch.uint8).view(dtype)


def _moved_dtypes(rank, world_size):
    """Broadcast and all-gather of dtypes NCCL has no code for travel as bytes (DDP broadcasts
    bool buffers and float8 weights through them); expected results built from every rank's data."""
    from fusedist.comm import get_communicator
    from fusedist.comm.nccl_comm import NcclCommunicator

    device = _device(rank)
    comm = get_communicator(device=device)
    assert isinstance(comm, NcclCommunicator), type(comm)
    for dtype in MOVED_DTYPES:
        n = 1027
        mine = _bits(rank, n, dtype).to(device)
        gathered = torch.empty(n * world_size, dtype=dtype, device=device)
        comm.all_gather(gathered, mine)
        want = torch.cat([_bits(r, n, dtype) for r in range(world_size)])
        assert torch.equal(gathered.cpu().view(torch.uint8), want.view(torch.uint8)), ("all_gather", dtype)
        for src in range(world_size):
            t = _bits(rank, n, dtype).to(device)
            comm.broadcast(t, src=src)
            assert torch.equal(t.cpu().view(torch.uint8), _bits(src, n, dtype).view(torch.uint8)), ("broadcast", dtype)
    return len(MOVED_DTYPES)


@needs_two_ranks
def test_ws2_broadcast_and_all_gather_move_dtypes_nccl_has_no_code_for():
    _require_ext()
    assert run_distributed(_moved_dtypes, WORLD, backend="nccl", timeout=300) == [len(MOVED_DTYPES)] * WORLD


# World size 4: four ranks on one GPU (FUSEDIST_TEST_RANKS_PER_GPU=4), or two on each of two.
# The cheapest parity check, on a subset of dtypes and sizes (each collective over loopback
# sockets costs milliseconds at 4 ranks); benchmarks/gpu/run_checks.sh runs it when time allows.
@pytest.mark.skipif(_slots() < 4, reason="needs room for 4 ranks: e.g. 1 GPU with FUSEDIST_TEST_RANKS_PER_GPU=4")
def test_ws4_communicator_equals_torch_nccl():
    _require_ext()
    results = run_distributed(_collectives, 4, backend="nccl", timeout=300,
                              dtypes=(torch.float32, torch.bfloat16, torch.int64), sizes=(1, 17 * 257, 0))
    # per dtype and size: 4 reductions (3 for int64) + 5 (reduce-scatter and all-gather, each
    # also in place, and broadcast)
    assert len(set(results)) == 1 and results[0] == 3 * (9 + 9 + 8), results


# ------------------------------------------------------------------ first launch, peer late
# #24 finding 3: NCCL >= 2.22 connects lazily inside the first launch of each algorithm, so a
# peer that is late blocks the launch. Note [launches without the GIL]: other Python threads
# must keep running meanwhile. Whether the launch returns at once depends on eager connection;
# either way the watchdog watches it from before the launch call, so the failure is bounded by
# the timeout and names it: with lazy connection (NCCL's default) the watchdog's abort ends the
# stuck launch, which raises the timeout, not NCCL's "internal error" (seen on an H200 with
# NCCL 2.28); with NCCL_RUNTIME_CONNECT=0 (connect at init) the launch returns at once and the
# next collective raises it.
LATE_S, TIMEOUT_S = 12.0, 4.0


def _comm_with_timeout(rank):
    """This rank's communicator with the tests' short timeout, and a tensor to reduce."""
    from fusedist.comm import get_communicator

    device = _device(rank)
    comm = get_communicator(device=device)
    comm.timeout = datetime.timedelta(seconds=TIMEOUT_S)
    x = torch.ones(1 << 16, device=device)
    torch.cuda.synchronize(device)
    return comm, x


def _late_peer(rank, world_size):
    from fusedist.comm import CollectiveError

    comm, x = _comm_with_timeout(rank)
    if rank == 1:
        time.sleep(LATE_S)
        try:
            comm.all_reduce(x, tag="late")
        except CollectiveError as exc:
            return {"late_error": str(exc)}
        return {"late_error": None}
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    start = time.monotonic()
    launched, error = None, None
    try:
        handle = comm.all_reduce(x, async_op=True, tag="first")  # may block: lazy connection
        launched = time.monotonic() - start
        handle.wait()  # stream-ordered: returns at once unless the watchdog already gave up
        x.sum().item()  # blocks until the collective completes or the watchdog aborts it
        comm.all_reduce(x, tag="next")  # FUSEDIST_NCCL_WATCHDOG=raise: raises the failure
    except CollectiveError as exc:
        error = str(exc)
    if launched is None:  # the launch itself raised
        launched = time.monotonic() - start
    ticks_during_launch = sum(1 for t in ticks if start <= t <= start + launched)
    stop.set()
    return {"launch_s": launched, "ticks_during_launch": ticks_during_launch,
            "ended_s": time.monotonic() - start, "error": error}


def _late_peer_run(env):
    env = dict(env, FUSEDIST_NCCL_WATCHDOG="raise")  # rank 0 reports what it saw, then exits
    out = run_distributed(_late_peer, WORLD, backend="nccl", timeout=240, env=env, expect_failure=True)
    assert out[0][0] == "ok", out[0][1]
    r0 = out[0][1]
    print(f"rank 0: launch took {r0['launch_s']:.2f} s ({r0['ticks_during_launch']} ticks of another "
          f"thread meanwhile), ended after {r0['ended_s']:.2f} s, error: {r0['error']}")
    return r0


@needs_two_ranks
def test_ws2_late_peer_does_not_stop_other_threads():
    _require_ext()
    r0 = _late_peer_run({"FUSEDIST_TIMEOUT_S": str(TIMEOUT_S)})
    if r0["launch_s"] > 1.0:  # the launch blocked (lazy connect): without the GIL, as it must
        assert r0["ticks_during_launch"] >= 10 * (r0["launch_s"] - 0.5), r0
    # Either way the failure names the collective and the timeout, within the timeout.
    assert r0["error"] is not None and "all_reduce (tag 'first'" in r0["error"], r0
    assert "did not complete within 4 s" in r0["error"], r0
    assert r0["ended_s"] < TIMEOUT_S + 5, r0


@needs_two_ranks
def test_ws2_late_peer_bounded_with_eager_connect():
    _require_ext()
    r0 = _late_peer_run({"FUSEDIST_TIMEOUT_S": str(TIMEOUT_S), "NCCL_RUNTIME_CONNECT": "0"})
    assert r0["launch_s"] < 2.0, r0
    assert r0["error"] is not None and "did not complete within" in r0["error"], r0
    assert r0["ended_s"] < TIMEOUT_S + 5, r0


# ------------------------------------------------------------------ #24 finding 7
# Note [stream-ordered waits and the watchdog]: a peer that skips a collective. wait() must not
# block the host; with FUSEDIST_NCCL_WATCHDOG=raise the watchdog aborts at the deadline (from
# launch), which releases a host blocked on the GPU, and the next collective raises naming the
# skipped one. (The default, exit, is what the fault matrix on NCCL runs.)
def _skipped_collective(rank, world_size):
    from fusedist.comm import CollectiveError

    comm, x = _comm_with_timeout(rank)
    # A step both ranks run first: it connects the algorithm (NCCL connects lazily, in the
    # first launch of each), so what follows is a skipped collective, not a late peer.
    comm.all_reduce(x, tag="bucket 1")
    torch.cuda.synchronize(x.device)
    if rank == 1:
        time.sleep(TIMEOUT_S + 6)  # never joins "bucket 2"
        return {}
    start = time.monotonic()
    handle = comm.all_reduce(x, async_op=True, tag="bucket 2")
    handle.wait()
    wait_s = time.monotonic() - start
    (x * 2).sum().item()  # a host read behind the collective: released by the abort
    released_s = time.monotonic() - start
    try:
        comm.all_reduce(x, tag="bucket 1 of the next step")
        error = None
    except CollectiveError as exc:
        error = (str(exc), exc.tag, exc.seq)
    return {"wait_s": wait_s, "released_s": released_s, "error": error}


@needs_two_ranks
def test_ws2_skipped_collective_ends_through_the_watchdog():
    _require_ext()
    out = run_distributed(_skipped_collective, WORLD, backend="nccl", timeout=240,
                          env={"FUSEDIST_NCCL_BLOCKING_WAIT": "0", "FUSEDIST_NCCL_WATCHDOG": "raise"})
    r0 = out[0]
    print(f"rank 0: wait() {r0['wait_s'] * 1e3:.1f} ms, host released after {r0['released_s']:.1f} s, "
          f"error: {r0['error']}")
    assert r0["wait_s"] < 0.5, r0  # stream-ordered: no host block in wait()
    assert r0["released_s"] < TIMEOUT_S + 10, r0
    message, tag, _ = r0["error"]
    assert tag == "bucket 2" and "did not complete within 4 s of its launch" in message, message


# ------------------------------------------------------------------ DDP and ZeRO vs torch
def _ddp_and_zero(rank, world_size):
    import copy

    from torch import nn

    from fusedist.comm import get_communicator
    from fusedist.comm.nccl_comm import NcclCommunicator

    device = _device(rank)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(device)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[device.index])
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), device_ids=[device.index], bucket_cap_mb=0.01)
    assert isinstance(get_communicator(device=device), NcclCommunicator)
    zero_models = {stage: fusedist.DistributedDataParallel(copy.deepcopy(base), device_ids=[device.index],
                                                           bucket_cap_mb=0.01) for stage in (1, 2)}
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    zero_opts = {stage: fusedist.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2)
                 for stage, m in zero_models.items()}
    gen = torch.Generator().manual_seed(10 + rank)
    grads_equal = []
    for _ in range(6):
        x, y = torch.randn(16, 32, generator=gen).to(device), torch.randn(16, 8, generator=gen).to(device)
        pairs = [(ref, opt_ref), (ours, opt_ours)] + [(zero_models[s], zero_opts[s]) for s in (1, 2)]
        for model, opt in pairs:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if model is ours:
                grads_equal.append(max((a.grad - b.grad).abs().max().item()
                                       for a, b in zip(ref.parameters(), ours.parameters())))
            opt.step()
    for opt in zero_opts.values():
        opt.wait_for_params()
    diffs = {name: max((a - b).abs().max().item() for a, b in zip(ref.parameters(), m.parameters()))
             for name, m in (("ddp", ours), ("zero1", zero_models[1]), ("zero2", zero_models[2]))}
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()]).cpu()
    return max(grads_equal), diffs, flat


@needs_two_ranks
def test_ws2_ddp_and_zero_match_torch_ddp():
    _require_ext()
    results = run_distributed(_ddp_and_zero, WORLD, backend="nccl", timeout=400)
    for grad_diff, diffs, _ in results:
        # Averaged fp32 gradients: the two NCCL paths may sum in another order (a few ulps).
        assert grad_diff < 1e-6, grad_diff
        assert all(d < 1e-5 for d in diffs.values()), diffs
    assert torch.equal(results[0][2], results[1][2])  # replicas identical across ranks


# ------------------------------------------------------------------ #24 finding 4
def _zero_group_rebuilt(rank, world_size, init_files):
    import gc

    import torch.distributed as dist
    from torch import nn

    from fusedist.comm import get_communicator, nccl_setup, release_destroyed_groups

    device = _device(rank)
    torch.cuda.set_device(device)
    allocated, comms, streams = [], [], []
    for i, init_file in enumerate(init_files):
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=60))
        model = fusedist.DistributedDataParallel(nn.Linear(256, 256).to(device), device_ids=[device.index])
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2,
                                               overlap_param_gather=True)
        model(torch.randn(8, 256, device=device)).sum().backward()
        opt.step()
        comms.append(get_communicator(device=device))
        kept = list(model.module.parameters())  # outlive the group and its communicator
        del model, opt
        dist.destroy_process_group()
        gc.collect()
        del kept  # freed after the comm stream's owner went: the allocator must not touch its handle
        gc.collect()
        torch.cuda.synchronize(device)
        allocated.append(torch.cuda.memory_allocated(device))
        streams.append(len(nccl_setup._streams_created))
    release_destroyed_groups()
    # Note [comm streams live as long as the process]: one stream reused by every rebuilt
    # group's communicator; each NCCL communicator freed once its group was destroyed.
    return allocated, [c.closed for c in comms], streams


@needs_two_ranks
def test_ws2_zero_params_outlive_a_destroyed_group(tmp_path):
    _require_ext()
    files = [str(tmp_path / f"rdzv{i}") for i in range(5)]
    for allocated, closed, streams in run_distributed(_zero_group_rebuilt, WORLD, files, backend=None, timeout=400):
        assert allocated[-1] <= allocated[1] + (1 << 20), allocated  # no growth per rebuilt group
        assert all(closed), closed
        assert streams == [1] * len(files), streams


# ------------------------------------------------------------------ #24 finding 5 (two GPUs)
def _bind_to_named_device(rank, world_size):
    from fusedist.comm import get_communicator

    torch.cuda.set_device(0)
    comm = get_communicator(device="cuda:1")
    assert comm.device == torch.device("cuda", 1) and get_communicator(device="cuda:0") is not comm
    t = torch.ones(8, device="cuda:1")
    comm.all_reduce(t)
    return t.sum().item()


@pytest.mark.skipif(torch.cuda.device_count() < 2 if torch.cuda.is_available() else True,
                    reason="needs 2 CUDA devices (binding to a device that is not current)")
def test_communicator_binds_to_the_named_device():
    _require_ext()
    assert run_distributed(_bind_to_named_device, 1, backend="nccl", timeout=120) == [8.0]
