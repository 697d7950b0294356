"""ZeroRedundancyOptimizer against torch: an optimizer factory that is not a class, masters
that do not match the parameters at load, and the loaded state of a parameter that joins the
partition after the load (progressive unfreezing resumed)."""

import functools
import warnings

import torch
from torch import nn

import fusedist
from fusedist.testing import run_distributed


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def _train(model, opt, steps, rank, world, seed=1):
    """Steps on a global batch of 6 split between the ranks (a plain model: the whole batch)."""
    for s in steps:
        g = torch.Generator().manual_seed(seed * 100 + s)
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)
        dtype = next(model.parameters()).dtype
        n = 6 // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()


def _flat(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _factory_builds_the_class(rank, world):
    """A lambda (or a partial of one) building AdamW is AdamW: no warning of an optimizer of
    unknown kind, ``optimizer_class`` is the class, offload takes it, same numbers as the class."""
    factories = [lambda groups, **kw: torch.optim.AdamW(groups, **kw),
                 functools.partial(lambda groups, **kw: torch.optim.AdamW(groups, **kw), betas=(0.8, 0.95))]
    for factory in factories:
        runs = []
        for cls, offload in ((torch.optim.AdamW, None), (factory, None), (factory, "cpu")):
            model = _mlp()
            ddp = fusedist.DistributedDataParallel(model)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                kw = dict(betas=(0.8, 0.95)) if cls is torch.optim.AdamW and factory is factories[1] else {}
                opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=cls, lr=0.01,
                                                       offload=offload, **kw)
            assert opt.optimizer_class is torch.optim.AdamW, opt.optimizer_class
            assert "optimizer_class=AdamW" in repr(opt)
            _train(ddp, opt, range(3), rank, world)
            runs.append(_flat(model))
        torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)
        torch.testing.assert_close(runs[2], runs[0])


def _stale_masters_are_dropped(rank, world):
    """A consolidated bf16 state dict (with ``master_param``), trained on by torch's AdamW, which
    carries the old masters forward, and loaded into ZeRO again with the newer model: the
    parameters keep the newer weights and the next steps match torch's AdamW from them."""
    model = _mlp(torch.bfloat16)
    ddp = fusedist.DistributedDataParallel(model)
    opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    _train(ddp, opt, range(2), rank, world)
    full = [opt.consolidate_state_dict(to=0)]
    torch.distributed.broadcast_object_list(full, 0)
    assert "master_param" in full[0]["state"][0]
    plain = _mlp(torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    torch_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    torch_opt.load_state_dict(full[0])
    _train(plain, torch_opt, range(2, 5), 0, 1)
    trained, saved = _flat(plain), torch_opt.state_dict()

    resumed = _mlp(torch.bfloat16)
    ddp2 = fusedist.DistributedDataParallel(resumed)
    opt2 = fusedist.ZeroRedundancyOptimizer(ddp2.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    resumed.load_state_dict(plain.state_dict())
    opt2.load_state_dict(saved)
    torch.testing.assert_close(_flat(resumed), trained, rtol=0, atol=0)
    _train(ddp2, opt2, range(5, 7), rank, world)
    reference = _mlp(torch.bfloat16)
    reference.load_state_dict(plain.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    ref_opt.load_state_dict({**saved, "state": {i: {k: v for k, v in st.items() if k != "master_param"}
                                                for i, st in saved["state"].items()}})
    _train(reference, ref_opt, range(5, 7), 0, 1)
    torch.testing.assert_close(_flat(resumed), _flat(reference), rtol=0, atol=0.02)
    # A consistent master is kept: a round trip through ZeRO's own state dict changes nothing.
    full2 = [opt2.consolidate_state_dict(to=0)]
    torch.distributed.broadcast_object_list(full2, 0)
    before = _flat(resumed)
    opt2.load_state_dict(full2[0])
    torch.testing.assert_close(_flat(resumed), before, rtol=0, atol=0)
    # The optimizer loaded before the model: the FP32 masters survive the model's load, as
    # FusedAdamW's do (a step with lr 0 leaves AdamW's masters as loaded).
    late = _mlp(torch.bfloat16)
    ddp3 = fusedist.DistributedDataParallel(late)
    opt3 = fusedist.ZeroRedundancyOptimizer(ddp3.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    opt3.load_state_dict(full2[0])
    late.load_state_dict(resumed.state_dict())
    opt3.param_groups[0]["lr"] = 0.0
    _train(ddp3, opt3, [9], rank, world)
    kept = opt3.consolidate_state_dict(to=0)
    if rank == 0:
        for i, st in full2[0]["state"].items():
            torch.testing.assert_close(kept["state"][i]["master_param"], st["master_param"], rtol=0, atol=0)


def _build_unfrozen(stage, join_late):
    model = _mlp()
    model[2].bias.requires_grad_(False)
    ddp = fusedist.DistributedDataParallel(model)
    opt = fusedist.ZeroRedundancyOptimizer([model[0].weight, model[0].bias, model[2].weight],
                                           optimizer_class=torch.optim.AdamW, lr=0.01, stage=stage)
    if not join_late:
        model[2].bias.requires_grad_(True)
        opt.add_param_group({"params": [model[2].bias], "lr": 0.03})
    return model, ddp, opt


def _state_of_a_joining_parameter(rank, world):
    """Resuming progressive unfreezing: the layer is unfrozen and its group added before the
    load, and joins the partition only in the next backward. Its loaded moments and step count
    are kept (consolidated right after the load too) and training continues as if uninterrupted."""
    for stage in (1, 2):
        model, ddp, opt = _build_unfrozen(stage, join_late=True)
        _train(ddp, opt, range(2), rank, world)
        model[2].bias.requires_grad_(True)
        opt.add_param_group({"params": [model[2].bias], "lr": 0.03})
        _train(ddp, opt, range(2, 4), rank, world)
        full = [opt.consolidate_state_dict(to=0)]
        torch.distributed.broadcast_object_list(full, 0)
        resumed, ddp2, opt2 = _build_unfrozen(stage, join_late=False)
        resumed.load_state_dict(model.state_dict())
        opt2.load_state_dict(full[0])
        again = opt2.consolidate_state_dict(to=0)
        if rank == 0:
            assert sorted(again["state"]) == sorted(full[0]["state"]) == [0, 1, 2, 3]
            torch.testing.assert_close(again["state"][3], full[0]["state"][3], rtol=0, atol=0)
        _train(ddp, opt, range(4, 6), rank, world)
        _train(ddp2, opt2, range(4, 6), rank, world)
        torch.testing.assert_close(_flat(resumed), _flat(model), rtol=0, atol=0)


def _checks(rank, world):
    _factory_builds_the_class(rank, world)
    _stale_masters_are_dropped(rank, world)
    _state_of_a_joining_parameter(rank, world)


def test_factory_stale_masters_and_state_of_joining_parameters():
    run_distributed(_checks, 2, timeout=120)
