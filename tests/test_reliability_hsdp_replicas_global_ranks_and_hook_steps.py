"""Reliability on subgroups and inside the backward: the replicas of an HSDP mesh are compared
(Note [replica check] in fusedist/reliability/sharded_watch.py; on a (replicas, 1) mesh the whole
step check runs over the replicas), stall reports over a subgroup
name the global ranks, and a DDP model's optimizer stepped from a gradient hook is refused at
every backward (Note [a step inside the backward] in fusedist/reliability/optimizer_guard.py)."""

from __future__ import annotations

import os

import torch
from torch import nn

from fusedist.testing import run_distributed


def _outcome(fn) -> str:
    import fusedist

    try:
        fn()
        return "ok"
    except fusedist.RankMismatchError as exc:
        return f"mismatch: {exc}"


def _hsdp_worker(rank, world_size):
    """A 2 x 2 (replicate, shard) mesh: clean AdamW steps checked every step, then rank 2 changes
    one element of its piece and the period-2 check must tell every rank."""
    import fusedist
    from fusedist.comm.base import global_ranks
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["FUSEDIST_PARAM_CHECK_EVERY"] = "1"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fusedist.fully_shard(model[0], mesh=mesh)
    fusedist.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    out = {"shard ranks": global_ranks(model[0]._fs_state().unit.comm)}

    def steps(n, corrupt_at=None):
        for step in range(n):
            g = torch.Generator().manual_seed(100 * step + rank)
            model(torch.randn(5, 8, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == corrupt_at and rank == 2:
                with torch.no_grad():
                    next(model.parameters()).view(-1)[3] += 1e-3
        model.check_consistency()

    out["clean"] = _outcome(lambda: steps(3))
    model._fs_state().ctx.watch.param_every = 2
    out["corrupt"] = _outcome(lambda: steps(4, corrupt_at=0))
    return out


def test_hsdp_replicas_that_differ_raise_on_every_rank_naming_the_parameter_and_ranks():
    results = run_distributed(_hsdp_worker, 4, timeout=120)
    for rank, out in enumerate(results):
        assert out["clean"] == "ok", out["clean"]
        text = out["corrupt"]
        assert text.startswith("mismatch:") and "replicas of a shard" in text, text
        assert "synchronized backward #4" in text, text  # the first due check after the change
        if rank in (0, 2):
            assert "parameter '0.weight'" in text and "ranks [0] | ranks [2] hold different values" in text, text
    assert results[2]["shard ranks"] == [2, 3] and results[0]["shard ranks"] is None


def test_stall_report_names_the_global_ranks_of_a_subgroup():
    from fusedist.reliability.stall_report import render

    entry = {"kind": "failure", "host": "h", "pid": 7, "error": "timed out", "global_rank": 2,
             "waiting_on": {"op": "all_reduce", "tag": "t", "seq": 3, "age_s": 1.0}}
    report = render({0: entry}, 2, 1.0, 0, [2, 3])
    assert "Stall report (rank 0 (global rank 2)," in report, report
    assert "rank 1 (global rank 3): did not report" in report, report
    assert "ranks [0] (global rank 2) reached all_reduce" in report, report
    assert "ranks [1] (global rank 3) did not report" in report, report
    plain = render({0: dict(entry, global_rank=0)}, 2, 1.0, 0)
    assert "rank 1: did not report" in plain and "global" not in plain, plain


def _hook_step_worker(rank, world_size):
    """A gradient hook that steps the optimizer, registered after normal steps, with .grad zeroed
    in place or set to None; then optimizers applied in backward still train."""
    import fusedist
    from torch.distributed.optim import _apply_optimizer_in_backward

    out = {}
    for mode in ("zeros", "none"):
        torch.manual_seed(0)
        model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        handle = None
        try:
            for step in range(3):
                if step == 2:
                    handle = next(model.parameters()).register_post_accumulate_grad_hook(lambda p: opt.step())
                g = torch.Generator().manual_seed(10 * step + rank)
                model(torch.randn(3, 4, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=(mode == "none"))
            out[mode] = "ok"
        except RuntimeError as exc:
            out[mode] = str(exc)
        handle.remove()
        weight = next(model.parameters()).detach().clone()
        both = [torch.empty_like(weight) for _ in range(world_size)]
        torch.distributed.all_gather(both, weight)
        out[mode + " same"] = torch.equal(both[0], both[1])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    _apply_optimizer_in_backward(torch.optim.SGD, net.parameters(), {"lr": 0.1})
    model = fusedist.DistributedDataParallel(net)
    for step in range(2):
        model(torch.randn(3, 4)).square().mean().backward()
    out["in backward"] = "ok"
    out.update(_replicas_only(rank))
    return out


def _replicas_only(rank) -> dict:
    """fully_shard on a (2, 1) mesh: whole parameters on every rank, the replicas compared; rank 1
    skips a step, then (a fresh model) changes a weight."""
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["FUSEDIST_PARAM_CHECK_EVERY"] = "1"
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    out = {}
    for fault in ("skip", "change"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        fusedist.fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def steps():
            for step in range(3):
                g = torch.Generator().manual_seed(10 * step + rank)
                model(torch.randn(3, 4, generator=g)).square().mean().backward()
                if not (fault == "skip" and rank == 1 and step == 0):
                    opt.step()
                opt.zero_grad()
                if fault == "change" and rank == 1 and step == 0:
                    with torch.no_grad():
                        model[2].bias.view(-1)[1] *= -1
            model.check_consistency()

        out[fault] = _outcome(steps)
    return out


def test_ddp_step_from_a_gradient_hook_is_refused_and_replicas_only_meshes_are_checked():
    for out in run_distributed(_hook_step_worker, 2, timeout=90):
        for mode in ("zeros", "none"):
            assert "from inside a backward pass" in out[mode], out[mode]
            assert "_apply_optimizer_in_backward" in out[mode], out[mode]
            assert out[mode + " same"]
        assert out["in backward"] == "ok"
        assert out["skip"].startswith("mismatch:") and "optimizer_steps: ranks [0]: 1; ranks [1]: 0" in out["skip"]
        text = out["change"]
        assert text.startswith("mismatch:") and "parameter '2.bias'" in text, text
        assert "ranks [0] | ranks [1] hold different values" in text, text
