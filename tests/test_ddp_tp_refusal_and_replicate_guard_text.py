"""DistributedDataParallel over a tensor-parallel model, and the optimizer guard's words for a
``fusedist.replicate`` module; one 2-rank launch on gloo.

* A module whose parameters are DTensors (``parallelize_module`` on ``mesh["tp"]``) wrapped with
  ``device_mesh=mesh["dp"]`` is refused at construction on every rank, naming the first DTensor
  parameter and what to use instead (Note [DDP over a tensor-parallel model] in
  fusedist/ddp/arguments.py); it used to fail inside the first broadcast with
  "'DeviceMesh' object has no attribute 'dtype'". The (dp=2, tp=1) mesh is the smallest that
  reaches that broadcast. Nothing was changed: the parameters are still the DTensors they were,
  and the group still runs collectives.
* An optimizer over a replicated module's parameters plus one the module does not own, or over a
  parameter assigned into the module after its first forward, is refused naming the replicated
  module (not a "DistributedDataParallel model" / ``ddp_model.parameters()`` the user never
  made); the wrapper's words stay as they were. The refused step changes no parameter, and the
  module trains as torch.optim.SGD on the global batch does afterwards.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


def _dtensor_refused(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fusedist

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), mesh["tp"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    before = [p.to_local().clone() for p in model.parameters()]
    try:
        fusedist.DistributedDataParallel(model, device_mesh=mesh["dp"])
        message = None
    except NotImplementedError as e:
        message = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"message": message, "alive": t.item(),
            "still_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
            "unchanged": all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))}


def _batch(seed: int, rank: int, world: int):
    """Rank ``rank``'s slice of a global batch of 4 per rank (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 3, generator=g)
    return x, y, x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]


def _guard_words(rank: int, world: int) -> dict:
    import fusedist

    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ref = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ref.load_state_dict(net.state_dict())
    model = fusedist.replicate(net)
    extra = nn.Linear(2, 2)
    out = {}
    x_all, y_all, x, y = _batch(10, rank, world)
    (model(x) - y).pow(2).mean().backward()
    mixed = torch.optim.SGD([{"params": model.parameters()}, {"params": extra.parameters()}], lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        mixed.step()
    except ValueError as e:
        out["unowned"] = str(e)
    out["unowned_unchanged"] = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))

    # the step the user meant, against torch.optim.SGD on the global batch (mean over it)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (ref(x_all) - y_all).pow(2).mean().backward()
    ref_opt.step()
    out["diff"] = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))

    # a Parameter assigned into the module after its first forward (the engine was built then)
    opt.zero_grad()
    model[2].bias = nn.Parameter(model[2].bias.detach().clone())
    (model[0](x).sum() + model[2].bias.sum()).backward()  # around the replicated forward
    try:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    except ValueError as e:
        out["assigned"] = str(e)

    # the wrapper keeps its words
    wrapped = fusedist.DistributedDataParallel(nn.Linear(6, 3))
    (wrapped(x) - y).pow(2).mean().backward()
    try:
        torch.optim.SGD([*wrapped.parameters(), *extra.parameters()], lr=0.1).step()
    except ValueError as e:
        out["wrapper_unowned"] = str(e)
    return out


_SCENARIOS = {
    "test_ddp_over_a_tensor_parallel_model_is_refused_by_name": {"dtensor": (_dtensor_refused, ())},
    "test_guard_names_the_replicated_module": {"guard": (_guard_words, ())},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, _SCENARIOS, 2, timeout=180)


def test_ddp_over_a_tensor_parallel_model_is_refused_by_name(launched):
    for rank, out in enumerate(results_of(launched, "dtensor")):
        msg = out["message"]
        assert msg is not None, f"rank {rank}: DistributedDataParallel took DTensor parameters"
        assert f"rank {rank}" in msg and "parameter '0.weight'" in msg and "(and 3 more)" in msg, msg
        assert "Shard(dim=0)" in msg and "'tp'" in msg and "local shape (16, 8)" in msg, msg
        assert "fusedist.fully_shard(model, mesh=mesh['dp'])" in msg, msg
        assert out["alive"] == 2.0 and out["still_dtensors"] and out["unchanged"], out


def test_guard_names_the_replicated_module(launched):
    for rank, out in enumerate(results_of(launched, "guard")):
        unowned = out["unowned"]
        assert f"rank {rank}" in unowned and "replicated Sequential (fusedist.replicate)" in unowned, unowned
        assert "param_groups[1]['params'][0]" in unowned and "shape (2, 2)" in unowned, unowned
        assert "DistributedDataParallel" not in unowned and "ddp_model" not in unowned, unowned
        assert "replicate the module that owns that parameter too" in unowned, unowned
        assert out["unowned_unchanged"]
        # fp32, 12 features summed in another order across the ranks' halves: a few ulps
        assert out["diff"] < 1e-6, out["diff"]
        assigned = out["assigned"]
        assert "parameter '2.bias'" in assigned and "replicated Sequential (fusedist.replicate)" in assigned, assigned
        assert "after its first forward" in assigned and "DistributedDataParallel" not in assigned, assigned
        assert "before the first forward of the replicated Sequential" in assigned, assigned
        wrapper = out["wrapper_unowned"]
        assert "DistributedDataParallel model" in wrapper and "ddp_model.parameters() only" in wrapper, wrapper
