"""DistributedDataParallel and ``fusedist.replicate`` over a tensor-parallel model, and the
optimizer guard's words for a ``fusedist.replicate`` module; one 2-rank launch on gloo.

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
* ``fusedist.replicate`` of such a module is refused at the call, in the same detail, pointing to
  ``fully_shard(model, mesh=mesh["dp"])``; the module is left as it was. A tensor-parallel submodule
  given as ``ignored_modules`` is taken (as by torch's replicate): the rest is averaged around it.
* A step before any backward, or after a backward under ``set_requires_gradient_sync(False)``, is
  refused naming the replicated module and its setting (not ``no_sync()`` of a wrapper the user
  never made); the wrapper's words stay as they were.
* A DTensor buffer is refused in replicate's words, at ``replicate`` and at the first forward.
* A step before a replicated module's first forward (its engine is built there) is refused: without
  gradients, and with the local ones of a submodule called on its own, which torch's replicate steps
  on silently; also for a module replicated on the meta device and materialized after
  (Note [a step before the first forward] in fusedist/ddp/replicate.py).
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


def _replicate_dtensor_refused(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fusedist
    from fusedist.ddp.replicate import ReplicatedModule

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    before = [p.to_local().clone() for p in model.parameters()]
    hooks = (len(model._forward_pre_hooks), len(model._forward_hooks))
    try:
        fusedist.replicate(model, device_mesh=mesh["dp"])
        message = None
    except NotImplementedError as e:
        message = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"message": message, "alive": t.item(),
            "untouched": (not isinstance(model, ReplicatedModule)
                          and hooks == (len(model._forward_pre_hooks), len(model._forward_hooks))),
            "still_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
            "unchanged": all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))}


def _replicate_ignores_tensor_parallel(rank: int, world: int) -> dict:
    """A tensor-parallel submodule given as ``ignored_modules`` is the user's to reduce (torch's
    replicate takes it): replicated around it, not refused."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import fusedist

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    ref_global, ref_local = copy.deepcopy(net), copy.deepcopy(net)
    parallelize_module(net[0], mesh["tp"], ColwiseParallel(use_local_output=True))
    model = fusedist.replicate(net, ignored_modules=[net[0]], device_mesh=mesh["dp"])
    g = torch.Generator().manual_seed(30)
    x_all, y_all = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
    x, y = x_all[4 * rank:4 * rank + 4], y_all[4 * rank:4 * rank + 4]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    for ref, (xs, ys) in ((ref_global, (x_all, y_all)), (ref_local, (x, y))):
        (ref(xs) - ys).pow(2).mean().backward()
        torch.optim.SGD(ref.parameters(), lr=0.1).step()
    # the replicated part as on the global batch; the ignored one on this rank's batch alone
    return {"replicated": max((a - b).abs().max().item() for a, b in zip(ref_global[2].parameters(),
                                                                          model[2].parameters())),
            "ignored": max((a - b.to_local()).abs().max().item() for a, b in zip(ref_local[0].parameters(),
                                                                                 model[0].parameters()))}


def _refused_step(opt, params) -> tuple:
    """(the refusal's message or None, whether the parameters were left as they were)."""
    before = [p.detach().clone() for p in params]
    try:
        opt.step()
        message = None
    except RuntimeError as e:
        message = str(e)
    return message, all(torch.equal(b, p) for b, p in zip(before, params))


def _step_words(rank: int, world: int) -> dict:
    import fusedist

    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ref = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ref.load_state_dict(net.state_dict())
    model = fusedist.replicate(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    out = {}
    x_all, y_all, x, y = _batch(20, rank, world)
    with torch.no_grad():  # evaluated, then stepped: the engine is built, no backward has run
        model(x)
    out["no_backward"], out["no_backward_unchanged"] = _refused_step(opt, params)

    # micro-batch accumulation without the last forward synchronized
    model.set_requires_gradient_sync(False)
    (model(x) - y).pow(2).mean().backward()
    out["unsynced"], out["unsynced_unchanged"] = _refused_step(opt, params)

    # what the user meant: the last micro-batch synchronized; torch.optim.SGD on the global micro-batches
    model.set_requires_gradient_sync(True)
    x2_all, y2_all, x2, y2 = _batch(21, rank, world)
    (model(x2) - y2).pow(2).mean().backward()
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (ref(x_all) - y_all).pow(2).mean().backward()
    (ref(x2_all) - y2_all).pow(2).mean().backward()
    ref_opt.step()
    out["diff"] = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), params))

    # the wrapper keeps its words
    wrapped = fusedist.DistributedDataParallel(nn.Linear(6, 3))
    wopt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    out["wrapper_no_backward"], _ = _refused_step(wopt, list(wrapped.parameters()))
    with wrapped.no_sync():
        (wrapped(x) - y).pow(2).mean().backward()
    out["wrapper_unsynced"], _ = _refused_step(wopt, list(wrapped.parameters()))
    return out


def _replicate_dtensor_buffer_refused(rank: int, world: int) -> dict:
    """A DTensor buffer (of a module whose parameters are plain) is refused in replicate's words, at
    ``replicate`` and, for one registered after it, at the first forward (where the engine is built)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import fusedist

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    out = {}
    for when in ("at replicate", "at the first forward"):
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        scale = distribute_tensor(torch.ones(4), mesh["tp"], [Replicate()])
        if when == "at replicate":
            net[1].register_buffer("scale", scale)
        try:
            model = fusedist.replicate(net, device_mesh=mesh["dp"])
            if when != "at replicate":
                net[1].register_buffer("scale", scale)
                model(torch.randn(2, 4))
            out[when] = None
        except NotImplementedError as e:
            out[when] = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    out["alive"] = t.item()
    return out


def _step_before_the_first_forward(rank: int, world: int) -> dict:
    """Steps before a replicated module's first forward (its engine is built there): refused, where
    torch's replicate steps on each rank's local gradients; then training as torch.optim.SGD on the
    global batch."""
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate as torch_replicate

    import fusedist

    def net():
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))

    out = {}
    x_all, y_all, x, y = _batch(40, rank, world)
    # torch's replicate: a submodule called on its own before the first forward, then a step
    theirs = torch_replicate(net())
    theirs[0](x).pow(2).sum().backward()
    grad = theirs[0].weight.grad.clone()
    grads = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(grads, grad)
    out["torch_spread"] = max((g - grads[0]).abs().max().item() for g in grads)

    model, ref = fusedist.replicate(net()), net()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    out["no_backward"], out["no_backward_unchanged"] = _refused_step(opt, params)
    model[0](x).pow(2).sum().backward()
    out["local"], out["local_unchanged"] = _refused_step(opt, params)
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    (ref(x_all) - y_all).pow(2).mean().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    out["diff"] = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), params))

    # a module replicated on the meta device, materialized after (new Parameters): watched too
    with torch.device("meta"):
        meta = fusedist.replicate(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)))
    meta.to_empty(device="cpu")
    opt = torch.optim.SGD(meta.parameters(), lr=0.1)
    meta[2](torch.randn(2, 5)).sum().backward()
    out["meta"], _ = _refused_step(opt, list(meta.parameters()))
    return out


_SCENARIOS = {
    "test_ddp_over_a_tensor_parallel_model_is_refused_by_name": {"dtensor": (_dtensor_refused, ())},
    "test_guard_names_the_replicated_module": {"guard": (_guard_words, ())},
    "test_replicate_of_a_tensor_parallel_model_is_refused_by_name": {
        "replicate_dtensor": (_replicate_dtensor_refused, ())},
    "test_replicate_leaves_ignored_tensor_parallel_modules_to_the_user": {
        "replicate_ignored_tp": (_replicate_ignores_tensor_parallel, ())},
    "test_step_refusals_name_the_replicated_module": {"step_words": (_step_words, ())},
    "test_replicate_refuses_dtensor_buffers_in_its_own_words": {
        "replicate_dtensor_buffer": (_replicate_dtensor_buffer_refused, ())},
    "test_step_before_the_first_forward_of_a_replicated_module_is_refused": {
        "before_first_forward": (_step_before_the_first_forward, ())},
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


def test_replicate_of_a_tensor_parallel_model_is_refused_by_name(launched):
    for rank, out in enumerate(results_of(launched, "replicate_dtensor")):
        msg = out["message"]
        assert msg is not None, f"rank {rank}: fusedist.replicate took DTensor parameters"
        assert f"fusedist.replicate(Sequential) (rank {rank})" in msg and "parameter '0.weight'" in msg, msg
        assert "(and 3 more)" in msg and "Shard(dim=0)" in msg and "'tp'" in msg and "local shape (16, 8)" in msg, msg
        assert "fusedist.fully_shard(model, mesh=mesh['dp'])" in msg, msg
        assert "replicate(model, device_mesh=mesh['dp'])" in msg, msg
        assert out["alive"] == 2.0 and out["untouched"] and out["still_dtensors"] and out["unchanged"], out


def test_replicate_leaves_ignored_tensor_parallel_modules_to_the_user(launched):
    for rank, out in enumerate(results_of(launched, "replicate_ignored_tp")):
        # fp32, a batch of 8 (or 4) summed in another order: a few ulps
        assert out["replicated"] < 1e-6 and out["ignored"] < 1e-6, (rank, out)


def test_step_refusals_name_the_replicated_module(launched):
    for rank, out in enumerate(results_of(launched, "step_words")):
        for key in ("no_backward", "unsynced"):
            msg = out[key]
            assert msg is not None, f"rank {rank}: the {key} step was not refused"
            assert f"rank {rank}" in msg and "the replicated Sequential (fusedist.replicate)" in msg, msg
            assert "DistributedDataParallel" not in msg and "no_sync" not in msg, msg
            assert "model.module" not in msg and "wrapper" not in msg, msg
            assert out[f"{key}_unchanged"], key
        assert "before any backward pass" in out["no_backward"], out["no_backward"]
        assert "with set_requires_gradient_sync(True)" in out["no_backward"], out["no_backward"]
        assert "not synchronized" in out["unsynced"], out["unsynced"]
        assert "set_requires_gradient_sync(False)" in out["unsynced"], out["unsynced"]
        # fp32, two micro-batches of 8 summed in another order across the ranks' halves: a few ulps
        assert out["diff"] < 1e-6, out["diff"]
        wrapper = out["wrapper_no_backward"]
        assert "through the DistributedDataParallel model" in wrapper and "outside no_sync()" in wrapper, wrapper
        wrapper = out["wrapper_unsynced"]
        assert "its forward ran under no_sync()" in wrapper and "through the wrapper" in wrapper, wrapper


def test_replicate_refuses_dtensor_buffers_in_its_own_words(launched):
    for rank, out in enumerate(results_of(launched, "replicate_dtensor_buffer")):
        for when in ("at replicate", "at the first forward"):
            msg = out[when]
            assert msg is not None, f"rank {rank}: a DTensor buffer was taken {when}"
            assert f"fusedist.replicate(Sequential) (rank {rank})" in msg and "buffer '1.scale'" in msg, (when, msg)
            assert "DistributedDataParallel" not in msg and "plain parameters and buffers" in msg, (when, msg)
        assert out["alive"] == 2.0, out


def test_step_before_the_first_forward_of_a_replicated_module_is_refused(launched):
    for rank, out in enumerate(results_of(launched, "before_first_forward")):
        assert out["torch_spread"] > 0  # torch's replicate: local gradients, stepped on silently
        msg = out["no_backward"]
        assert msg is not None and f"rank {rank}" in msg and "before any backward pass" in msg, msg
        assert "replicated Sequential (fusedist.replicate)" in msg and "built at its first forward" in msg, msg
        for key in ("local", "meta"):
            msg = out[key]
            assert msg is not None, f"rank {rank}: the {key} step was not refused"
            assert "before the first forward of the replicated Sequential" in msg, (key, msg)
            assert "this rank's own, not averaged" in msg and "DistributedDataParallel" not in msg, (key, msg)
        assert out["no_backward_unchanged"] and out["local_unchanged"]
        # fp32, a batch of 8 summed in another order across the ranks' halves: a few ulps
        assert out["diff"] < 1e-6, out["diff"]
