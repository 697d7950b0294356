"""GPU tier at world size 2 over NCCL: CUDA paths changed lately whose own tests run on gloo only,
each against torch (or the unsharded model) in the same run. Auto-skipped without room for two
ranks: two GPUs, or one shared through ``FUSEDIST_TEST_RANKS_PER_GPU=2`` (Note [several ranks on
one GPU] in fusedist/testing/shared_gpu.py), as benchmarks/gpu/run_checks.sh runs its multi-rank
tier. The one-process ones: tests/test_gpu_pending_paths.py.

* **ZeRO-Offload of complex64 parameters** (Note [complex parameters offloaded] in
  fusedist/zero/offload.py): on a GPU the host masters and gradients are pinned complex64 buffers
  filled and read by non-blocking copies, and the host Adam steps their real pairs. Stages 1
  (FusedAdamW inside) and 2 (torch AdamW inside) over fusedist's DDP (complex buckets reduced as
  real pairs by the direct-NCCL communicator), against torch DDP + torch AdamW: the reductions
  are exact at world size 2 (one addition, a halving); the host kernel and torch's CUDA AdamW
  differ in rounding order, a few ulps per step: ``1e-5`` after 4 steps (the tolerance of
  tests/test_gpu_tier_ws2.py's ZeRO-Offload section).
* **``full_tensor()`` of fully_shard's state-dict entries** (Note [whole entries] in
  fusedist/fsdp/whole_entry.py): two all-gathers over the direct-NCCL communicator per entry.
  Odd sizes (pieces cut elsewhere than FSDP2's chunks, a one-row weight) and a unit sharded on
  dim 1 (boxes instead of ranges). Before any step: equal bit for bit to the unsharded parameter
  and to FSDP2's ``DTensor.full_tensor()``; after one AdamW step on both: FSDP2's within
  ``rtol=1e-5, atol=1e-6`` (fp32, reductions in another order; as test_gpu_tier_ws2.py's stage-3
  section).
* **The divergence probe on direct-NCCL collectives** (Note [probing stream-ordered waits for
  divergence] in fusedist/comm/watchdog.py): rank 0 launches an all-reduce where rank 1 launches
  a broadcast. Neither wait blocks the host on NCCL, so the watchdog probes them; both must fail
  within seconds, well before the 30 s collective timeout, with the "different collectives"
  verdict. Rank 1's broadcast is queued behind a GPU sleep longer than the verdict takes: two
  mismatched NCCL kernels may complete on one side (a broadcast's receiver takes the all-reduce's
  first chunk), which leaves only one rank blocked -- not the case the probe decides -- so
  neither kernel is allowed to meet the other while the probe runs.
"""

from __future__ import annotations

import copy
import random
import time
import traceback

import pytest
import torch
from conftest import requires_rank_slots
from test_fully_shard_dtensor_entries import _Net as _OddNet  # (its flat pieces are not FSDP2's chunks)
from torch import nn

from fusedist.testing import device_for_rank, run_distributed

WORLD = 2
pytestmark = [pytest.mark.gpu, requires_rank_slots(WORLD)]


def _device(rank: int) -> torch.device:
    return torch.device("cuda", device_for_rank(rank)) if torch.cuda.is_available() else torch.device("cpu")


def _ddp_kw(device):
    return dict(device_ids=[device.index]) if device.type == "cuda" else {}


# ------------------------------------------------------------------ sections of one launch
def _zero_offload_complex(rank, world_size, device, seed):
    import fusedist
    from fusedist.optim import FusedAdamW
    from test_ddp_zero_complex_parameters import MixedNet

    torch.manual_seed(seed)
    model = MixedNet(torch.complex64).to(device)
    gen = torch.Generator().manual_seed(seed + 1 + rank)  # different data per rank
    data = [(torch.randn(8, 6, generator=gen).to(device), torch.randn(8, 2, generator=gen).to(device))
            for _ in range(4)]
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), **_ddp_kw(device))
    runs = {"torch": (ref, torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1))}
    for stage, inner in ((1, FusedAdamW), (2, torch.optim.AdamW)):
        ddp = fusedist.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1e-4, **_ddp_kw(device))
        runs[f"stage {stage}, {inner.__name__}"] = (ddp, fusedist.ZeroRedundancyOptimizer(
            ddp.parameters(), inner, stage=stage, lr=0.05, weight_decay=0.1, offload="cpu"))
    for x, y in data:
        for model_, opt in runs.values():
            opt.zero_grad()
            (model_(x) - y).pow(2).mean().backward()
            opt.step()
    want = [p.detach().cpu() for p in ref.parameters()]
    out = {}
    for name, (model_, opt) in runs.items():
        if name == "torch":
            continue
        opt.wait_for_params()
        got = [p.detach().cpu() for p in model_.parameters()]
        host = opt._offload  # Note [offload pipeline]: the host buffers of each parameter dtype
        out[name] = dict(
            diff=max((a - b).abs().max().item() for a, b in zip(got, want)),
            dtypes=[str(p.dtype) for p in got], complex_kept=all(a.dtype == b.dtype for a, b in zip(got, want)),
            host={str(dt): (str(t.dtype), t.is_pinned(), str(g.dtype), g.is_pinned())
                  for dt, t in host.masters.items() for g in (host.host_grads[dt],)},
            flat=torch.cat([torch.view_as_real(p).reshape(-1) if p.is_complex() else p.reshape(-1) for p in got]))
    return out


def _full_tensor(rank, world_size, device, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Shard

    import fusedist

    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(seed)
    base = _OddNet().to(device)
    unsharded = {k: v.detach().clone() for k, v in base.state_dict().items()}
    models = {}
    for name, shard in (("ours", fusedist.fully_shard), ("fsdp2", torch_fully_shard)):
        m = copy.deepcopy(base)
        shard(m.c, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
        shard(m, mesh=mesh)
        models[name] = m

    def whole(m):  # every rank reads the entries in the same order: each is a collective
        return {k: v.full_tensor().detach().clone() for k, v in m.state_dict().items()}

    before = {name: whole(m) for name, m in models.items()}
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed + 1 + rank)).to(device)
    for m in models.values():
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(x).square().mean().backward()
        opt.step()
    after = {name: whole(m) for name, m in models.items()}
    return dict(
        devices={v.device.type for v in before["ours"].values()},
        shapes={k: (tuple(before["ours"][k].shape), tuple(v.shape)) for k, v in unsharded.items()},
        unsharded={k: torch.equal(before["ours"][k], v) for k, v in unsharded.items()},
        fsdp2_before={k: torch.equal(before["ours"][k], v) for k, v in before["fsdp2"].items()},
        fsdp2_after={k: (after["ours"][k].cpu(), v.cpu()) for k, v in after["fsdp2"].items()},
        moved=max((after["ours"][k] - v).abs().max().item() for k, v in unsharded.items()))


SECTIONS = {"zero_offload_complex": _zero_offload_complex, "full_tensor": _full_tensor}


def _sections(rank, world_size, seed):
    device = _device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = {}
    for name, section in SECTIONS.items():
        try:
            out[name] = ("ok", section(rank, world_size, device, seed))
        except Exception:  # noqa: BLE001 - the section's test reports it
            out[name] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def launched():
    seed = random.randrange(2**20)
    return seed, run_distributed(_sections, WORLD, seed, backend="nccl", timeout=300)


def _section(launched, name):
    seed, results = launched
    for rank, res in enumerate(results):
        status, value = res[name]
        assert status == "ok", f"{name}, seed {seed}, rank {rank}:\n{value}"
    return seed, [res[name][1] for res in results]


def test_zero_offload_steps_complex64_on_pinned_host_buffers_as_torch(launched):
    seed, per_rank = _section(launched, "zero_offload_complex")
    for rank, out in enumerate(per_rank):
        assert len(out) == 2, out
        for name, r in out.items():
            where = f"seed {seed}, rank {rank}, {name}: {r['diff']}, {r['host']}"
            assert r["diff"] < 1e-5, where
            assert r["complex_kept"] and "torch.complex64" in r["dtypes"], where
            # complex64 shards: complex64 host masters and gradients; every host buffer pinned
            assert r["host"]["torch.complex64"] == ("torch.complex64", True, "torch.complex64", True), where
            assert all(pinned and grads_pinned for _, pinned, _, grads_pinned in r["host"].values()), where
    for name in per_rank[0]:
        assert torch.equal(per_rank[0][name]["flat"], per_rank[1][name]["flat"]), (seed, name)


def test_full_tensor_of_entries_over_nccl_is_the_unsharded_parameter(launched):
    seed, per_rank = _section(launched, "full_tensor")
    for rank, out in enumerate(per_rank):
        where = f"seed {seed}, rank {rank}"
        assert out["devices"] == {"cuda"}, (where, out["devices"])
        assert all(a == b for a, b in out["shapes"].values()), (where, out["shapes"])
        assert all(out["unsharded"].values()), (where, out["unsharded"])
        assert all(out["fsdp2_before"].values()), (where, out["fsdp2_before"])
        assert out["moved"] > 1e-4, where  # the step changed the weights: the second reads are not the first
        for k, (ours, theirs) in out["fsdp2_after"].items():
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{where}, {k}: {m}")


# ------------------------------------------------------------------ divergence probe, own launch
PROBE_S, TIMEOUT_S = 0.3, 30.0
# Rank 1's broadcast waits behind this much GPU sleep (~4-5 s at an H100's or H200's clock): the
# verdict takes the delay and a confirmation a quarter second later, about a second in all.
GATE_CYCLES = 8_000_000_000


def _diverged(rank, world_size):
    from fusedist.comm import CollectiveError, get_communicator
    from fusedist.comm.nccl_comm import NcclCommunicator
    from fusedist.reliability import attach_monitor

    device = _device(rank)
    torch.cuda.set_device(device)
    comm = get_communicator(device=device)
    assert isinstance(comm, NcclCommunicator), type(comm)
    assert attach_monitor(comm).probe_delay_s == PROBE_S
    x = torch.ones(1 << 12, device=device)
    # Both ranks run each algorithm once first: NCCL connects lazily inside the first launch of
    # each, which would block the diverging launches on the peer.
    comm.all_reduce(x.clone(), tag="warm all_reduce")
    comm.broadcast(x.clone(), src=0, tag="warm broadcast")
    torch.cuda.synchronize(device)
    seq = comm.last_seq + 1  # the diverging collectives' number, the same on both ranks
    start = time.monotonic()
    if rank == 0:
        handle = comm.all_reduce(x, async_op=True, tag="A")
    else:
        torch.cuda._sleep(GATE_CYCLES)
        handle = comm.broadcast(x, src=0, async_op=True, tag="B")
    handle.wait()  # stream-ordered: returns at once
    waited = time.monotonic() - start
    while comm.watchdog.failure is None and time.monotonic() - start < TIMEOUT_S + 10:
        time.sleep(0.02)
    failed_after = time.monotonic() - start
    try:
        comm.all_reduce(torch.ones(4, device=device), tag="after")
        error = None
    except CollectiveError as exc:
        error = (str(exc), exc.op, exc.tag, exc.rank)
    return dict(waited=waited, failed_after=failed_after, error=error, seq=seq)


def test_direct_nccl_ranks_in_different_collectives_fail_soon_after_the_probe_delay():
    env = {"FUSEDIST_TIMEOUT_S": str(TIMEOUT_S), "FUSEDIST_DIVERGENCE_PROBE_S": str(PROBE_S),
           "FUSEDIST_STALL_REPORT_S": "0.5", "FUSEDIST_NCCL_WATCHDOG": "raise", "FUSEDIST_NCCL_BLOCKING_WAIT": "0"}
    results = run_distributed(_diverged, WORLD, backend="nccl", timeout=240, env=env)
    for rank, r in enumerate(results):
        print(f"rank {rank}: wait() {r['waited'] * 1e3:.1f} ms, failed after {r['failed_after']:.2f} s: {r['error']}")
        assert r["waited"] < 0.5, (rank, r)  # no host block in wait()
        assert r["failed_after"] < 4.0, (rank, r)  # the delay and a confirmation; never the 30 s timeout
        assert r["error"] is not None, (rank, r)
        message, op, tag, err_rank = r["error"]
        assert (op, tag, err_rank) == (("all_reduce", "A", 0) if rank == 0 else ("broadcast", "B", 1)), (rank, r)
        assert "cannot complete on this rank" in message and "they wait in different collectives" in message, message
        assert r["seq"] == results[0]["seq"], (rank, r)
        assert f"ranks [0] in all_reduce (collective #{r['seq']})" in message, message
        assert f"ranks [1] in broadcast (collective #{r['seq']})" in message, message
