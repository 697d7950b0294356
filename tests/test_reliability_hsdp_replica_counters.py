"""On a 2-D (replicate, shard) mesh the replicas of a shard compare their step counters too, not
only their parameters (Note [replica check] in fusedist/reliability/sharded_watch.py): a whole
shard group that skips a backward or an optimizer step agrees with itself, so the step check over
the shard group never sees it, and the replicate all-reduce averages gradients of different steps."""

from __future__ import annotations

import os

import torch
from torch import nn

from fusedist.testing import run_distributed


def _model(mesh):
    import fusedist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fusedist.fully_shard(model[0], mesh=mesh)
    fusedist.fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _run(rank, model, opt, steps, skip_backward_at=None, skip_step_at=None) -> str:
    """``steps`` iterations; the shard group of ranks 2 and 3 skips the backward (and step) or
    only the step at the given iteration, then catches up, so every collective still pairs."""
    import fusedist

    late = rank >= 2
    try:
        for step in range(steps + (late and skip_backward_at is not None)):
            g = torch.Generator().manual_seed(100 * step + rank)
            loss = model(torch.randn(5, 8, generator=g)).square().mean()
            if late and step == skip_backward_at:
                continue
            loss.backward()
            if not (late and step == skip_step_at):
                opt.step()
            opt.zero_grad()
        model.check_consistency()
        return "ok"
    except fusedist.RankMismatchError as exc:
        return f"mismatch: {exc}"


def _worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    os.environ["FUSEDIST_PARAM_CHECK_EVERY"] = "2"
    # a forward without its backward: the parameters stay equal, only the counters tell
    out["forward only"] = _run(rank, *_model(mesh), steps=5, skip_backward_at=1)
    out["no step"] = _run(rank, *_model(mesh), steps=4, skip_step_at=0)
    os.environ["FUSEDIST_PARAM_CHECK_EVERY"] = "100"  # found by check_consistency() at the end
    out["no step, at the end"] = _run(rank, *_model(mesh), steps=3, skip_step_at=1)
    return out


def test_hsdp_replicas_that_ran_different_steps_raise_on_every_rank_naming_the_counters_and_ranks():
    results = run_distributed(_worker, 4, timeout=120)
    expected = {"forward only": ("synchronized backward #2", "training forwards: ranks [{r}]: 3; ranks [{l}]: 4"),
                "no step": ("synchronized backward #2", "optimizer steps: ranks [{r}]: 2; ranks [{l}]: 1"),
                "no step, at the end": ("found by check_consistency()",
                                        "optimizer steps: ranks [{r}]: 3; ranks [{l}]: 2")}
    for rank, out in enumerate(results):
        for case, (when, counters) in expected.items():
            text = out[case]
            assert text.startswith("mismatch:") and when in text, (rank, case, text)
            assert "replicas: the replicas of a shard" in text and "ran different steps" in text, text
            assert "hold different values" not in text, text  # (digests of different steps: not the cause)
            early, late = rank % 2, rank % 2 + 2
            assert f"replicas of rank {rank}'s pieces (ranks [{early}, {late}]) ran different steps" in text, text
            assert counters.format(r=early, l=late) in text, (rank, case, text)
