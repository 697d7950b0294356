"""DistributedDataParallel settings that decide a backward's collectives, different on one rank
(Note [reduction settings across ranks] in fusedist/ddp/agreement.py): each is a
RankMismatchError on every rank naming the setting and its values, before any bucket
collective -- instead of a stall at the first backward (find_unused_parameters), or gloo
terminating a process with "Received data size doesn't match" (an fp16 hook on one rank).
torch's DDP fails the same cases with a hang or "Connection closed by peer". Settings that
agree, a hook included, train as before (the same gradients as torch's DDP with that hook).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model):
    model(torch.randn(4, 6)).square().mean().backward()


def _worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import fusedist
    from fusedist import RankMismatchError

    out = {}

    def expect_mismatch(name, build, run=lambda model: None):
        try:
            run(build())
        except RankMismatchError as exc:
            out[name] = str(exc)
        else:
            out[name] = None

    # Constructor settings: at construction.
    for setting in ("find_unused_parameters", "static_graph", "broadcast_buffers"):
        expect_mismatch(setting, lambda: fusedist.DistributedDataParallel(_net(), **{setting: rank == 1}))
    # A hook on one rank only: at the first synchronized training forward.

    def fp16_on_rank_1():
        model = fusedist.DistributedDataParallel(_net())
        if rank == 1:
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return model

    expect_mismatch("fp16 hook", fp16_on_rank_1, _step)

    def zero_stages_differ():
        model = fusedist.DistributedDataParallel(_net())
        fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=1 + rank, lr=1e-2)
        return model

    expect_mismatch("ZeRO stage", zero_stages_differ, _step)

    # Agreeing settings with a hook: trains as torch's DDP with the same hook.
    torch.manual_seed(1 + rank)
    x = torch.randn(4, 6)
    ours, ref = fusedist.DistributedDataParallel(_net()), nn.parallel.DistributedDataParallel(_net())
    for model in (ours, ref):
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        model(x).square().mean().backward()
    grads = [(a.grad - b.grad).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters())]
    dist.barrier()
    return out, max(grads)


@pytest.mark.parametrize("world", [2])
def test_settings_that_differ_across_ranks_are_named(world):
    results = run_distributed(_worker, world, timeout=180, pg_timeout=60)
    for rank, (out, grad_err) in enumerate(results):
        for name, message in out.items():
            assert message is not None, f"rank {rank}: {name} differing across ranks was not reported"
        for setting in ("find_unused_parameters", "static_graph", "broadcast_buffers"):
            assert f"{setting}=True" in out[setting] and f"{setting}=False" in out[setting], (rank, out[setting])
        assert "communication hook" in out["fp16 hook"] and "fp16_compress_hook" in out["fp16 hook"], out["fp16 hook"]
        assert "gradient reduction" in out["ZeRO stage"] or "stage" in out["ZeRO stage"], out["ZeRO stage"]
        # fp16 rounding of the bucket on both sides, the same operations on gradients below 1:
        # an fp16 ulp (2^-11 relative) at most.
        assert grad_err <= 2.0 ** -11, (rank, grad_err)
