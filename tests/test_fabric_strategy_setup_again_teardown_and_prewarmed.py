"""FusedistFabricStrategy against Lightning Fabric's ``strategy="ddp"`` where a program uses one
model and one torch optimizer beyond a single ``fabric.setup``:

* set up again (a second ``fabric.setup`` of the same objects), stepping and clipping through the
  optimizer either setup returned: under Fabric's DDP both are the one torch optimizer;
* ``fabric.strategy.teardown()`` and then another Fabric with ``strategy="ddp"`` (or the same
  Fabric again) over the same model and optimizer: it continues from the optimizer's state;
* an optimizer that stepped on its own before ``fabric.setup`` (a warm-up, a resume loaded by
  hand): its state carries over, as Fabric's DDP steps on from it.

Ranks are processes of :func:`fusedist.testing.run_distributed` with the torchelastic variables
set, so Fabric starts no workers of its own. Tolerance: fp32, fused kernels and bucketed
all-reduces against torch's ops over a few steps on values of order 1: 1e-5 (the results agree
to ~3e-8); the failures these tests exist for (a stale optimizer state, lost moments, an
unsynchronized step) move the weights by 1e-2 or raise.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_lightning_launch import register, shared_launch

TOL = 1e-5


def _fabric(side: str, zero_stage: int = 0):
    import lightning as L

    if side == "ddp":
        strategy = "ddp"
    else:
        from fusedist.integrations.fabric import FusedistFabricStrategy

        strategy = FusedistFabricStrategy(zero_stage=zero_stage)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def _model_and_optimizer(cls=torch.optim.AdamW, **settings):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, cls(model.parameters(), **(settings or dict(lr=1e-2, weight_decay=0.1)))


def _train(fabric, model, optimizer, steps, clip=None):
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + fabric.global_rank)
        x = torch.randn(4, 8, generator=g)
        fabric.backward(nn.functional.mse_loss(model(x), torch.sin(2 * x[:, :3])))
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)  # bites every step
        optimizer.step()
        optimizer.zero_grad()


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _set_up_again(side, zero_stage):
    """Train, set the same model and optimizer up again and train on, then step and clip through
    the optimizer the first setup returned; then set up only the module again and train it with
    the optimizer the second setup returned: the weights after each phase."""
    fabric = _fabric(side, zero_stage)
    model, optimizer = _model_and_optimizer()
    first_model, first = fabric.setup(model, optimizer)
    _train(fabric, first_model, first, range(3))
    second_model, second = fabric.setup(model, optimizer)
    _train(fabric, second_model, second, range(3, 5))
    phases = [_flat(model)]
    _train(fabric, second_model, first, range(5, 7), clip=0.05)
    phases.append(_flat(model))
    _train(fabric, fabric.setup_module(model), second, range(7, 10), clip=0.05)
    return phases + [_flat(model)]


def _in_a_second_fabric(side, first_stage, second_stage):
    """Train, then set the same model and optimizer up in a second Fabric (no teardown) and train on."""
    fabric = _fabric(side, first_stage)
    model, optimizer = _model_and_optimizer()
    _train(fabric, *fabric.setup(model, optimizer), range(3))
    fabric = _fabric(side, second_stage)
    _train(fabric, *fabric.setup(model, optimizer), range(3, 6), clip=0.05)
    return _flat(model)


def _setup_again_worker(rank, world):
    _launched_env(rank, world)
    ref = _set_up_again("ddp", 0)
    out = {f"ZeRO {stage}, phase {i}": (a - b).abs().max().item()
           for stage in (0, 1, 2) for i, (a, b) in enumerate(zip(_set_up_again("fusedist", stage), ref))}
    ref = _in_a_second_fabric("ddp", 0, 0)
    for first, second in ((2, 0), (1, 2)):
        ours = _in_a_second_fabric("fusedist", first, second)
        out[f"ZeRO {first}, then a second Fabric with ZeRO {second}"] = (ours - ref).abs().max().item()
    return out


def test_fabric_strategy_setup_again_steps_one_state_through_either_returned_optimizer(launched):
    """The optimizer the first ``fabric.setup`` returned kept stepping its own state after the
    second setup swapped in another (2e-2 off Fabric's DDP in two steps; at ZeRO stage 2 from
    gradients no wrapper reduced any more): it now forwards to the newest, its clip included. A
    stage-2 optimizer went on stepping the shards of a wrapper that ``fabric.setup_module`` of the
    same model retired (2.4e-2 off in three steps); it is rebuilt on the new wrapper. A second
    Fabric over the same objects reduced into the first one's stage-2 shards (2e-2 off)."""
    for rank, diffs in enumerate(results_of(launched, "set up again")):
        for name, diff in diffs.items():
            assert diff <= TOL, f"{name}, rank {rank}: weights differ from Fabric's DDP by {diff}"


def _torn_down(first, zero_stage, then):
    """Train with ``first``, ``fabric.strategy.teardown()``, then train the same model and optimizer
    with a new Fabric of strategy ``then`` (or, ``then`` None, the same Fabric again)."""
    fabric = _fabric(first, zero_stage)
    model, optimizer = _model_and_optimizer()
    wrapped, returned = fabric.setup(model, optimizer)
    _train(fabric, wrapped, returned, range(3))
    fabric.strategy.teardown()
    refusal = None
    if first != "ddp":  # the retired wrapper refuses a forward that would train unsynchronized
        try:
            wrapped(torch.randn(2, 8))
        except RuntimeError as error:
            refusal = str(error)
    if then is not None:
        fabric = _fabric(then)
    wrapped, returned = fabric.setup(model, optimizer)
    _train(fabric, wrapped, returned, range(3, 6), clip=0.05)
    return _flat(model), refusal


def _teardown_worker(rank, world):
    _launched_env(rank, world)
    ref = _torn_down("ddp", 0, "ddp")[0]
    diffs, refusals = {}, {}
    for stage, then in ((0, "ddp"), (2, "ddp"), (2, None)):
        name = f"ZeRO {stage}, then {'the same Fabric' if then is None else repr(then)}"
        weights, refusals[name] = _torn_down("fusedist", stage, then)
        diffs[name] = (weights - ref).abs().max().item()
    return diffs, refusals


def test_fabric_strategy_teardown_leaves_model_and_optimizer_as_fabrics_ddp(launched):
    """After ``strategy.teardown()`` a Fabric with ``strategy="ddp"`` over the same model and
    optimizer was refused at its first step ("a backward pass that was not synchronized": the
    retired fusedist wrapper still owned the parameters) and its optimizer stepped the swapped-in
    one; it now trains on from the optimizer's state, as after Fabric's DDP. A forward through
    the retired wrapper trained each rank on its own gradients; it is refused."""
    for rank, (diffs, refusals) in enumerate(results_of(launched, "teardown")):
        for name, diff in diffs.items():
            assert diff <= TOL, f"{name}, rank {rank}: weights differ from Fabric's DDP by {diff}"
        for name, refusal in refusals.items():
            assert refusal is not None, f"{name}, rank {rank}: a forward through the retired wrapper ran"
            assert re.search(rf"rank {rank}\): this wrapper was retired .* Set the module up again", refusal), refusal


# optimizer: (class, settings, the ZeRO stages to check: fused at 0, sharded at 1/2; torch's
# Adagrad has no fused counterpart, so only sharding converts it)
_PREWARMED = {"AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), (0, 1, 2)),
              "SGD momentum": (torch.optim.SGD, dict(lr=1e-1, momentum=0.9, nesterov=True), (0, 2)),
              "Adagrad": (torch.optim.Adagrad, dict(lr=1e-1), (2,))}


def _prewarmed(side, zero_stage, name):
    """Two plain torch steps of the optimizer (the same on every rank), then ``fabric.setup``."""
    cls, settings, _ = _PREWARMED[name]
    model, optimizer = _model_and_optimizer(cls, **settings)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + step))
        nn.functional.mse_loss(model(x), torch.sin(2 * x[:, :3])).backward()
        optimizer.step()
        optimizer.zero_grad()
    fabric = _fabric(side, zero_stage)
    wrapped, returned = fabric.setup(model, optimizer)
    _train(fabric, wrapped, returned, range(3), clip=0.5)
    return _flat(model)


def _prewarmed_worker(rank, world):
    _launched_env(rank, world)
    out = {}
    for name, (_, _, stages) in _PREWARMED.items():
        ref = _prewarmed("ddp", 0, name)
        for stage in stages:
            out[f"{name}, ZeRO {stage}"] = (_prewarmed("fusedist", stage, name) - ref).abs().max().item()
    return out


def test_fabric_strategy_takes_the_state_of_an_optimizer_that_stepped_before_setup(launched):
    """An optimizer that stepped before ``fabric.setup`` was refused ("already has state"); its
    moments, step counts, momentum buffers and sums now carry over to the fused or sharded one."""
    for rank, diffs in enumerate(results_of(launched, "prewarmed")):
        for name, diff in diffs.items():
            assert diff <= TOL, f"{name}, rank {rank}: weights differ from Fabric's DDP by {diff}"


def test_fabric_strategy_refuses_a_state_its_replacement_cannot_take():
    """Where the state cannot carry over -- here a moment of another shape, loaded by hand, on
    which torch's own step would fail too -- the setup refuses, naming the fused optimizer's
    reason and the settings that keep torch's optimizer, and nothing is half-converted."""
    from fusedist.integrations.fabric import FusedistFabricStrategy

    param = nn.Parameter(torch.randn(4, 3))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.randn(4, 3)
    optimizer.step()
    optimizer.state[param]["exp_avg"] = torch.zeros(5)
    with pytest.raises(RuntimeError, match=r"AdamW has state from earlier steps, which its replacement AdamW cannot "
                                           r"take over \(.*has shape \(5,\).*fused_optimizer=False and zero_stage=0"):
        FusedistFabricStrategy()._converted(optimizer, None)
    assert optimizer.state[param]["exp_avg"].shape == (5,) and "step" not in optimizer.__dict__


def _jobs(tmp_path_factory):
    """The file's multi-rank checks, in the launch shared with the other Lightning and Fabric
    files (test_lightning_launch.py)."""
    jobs = {"test_fabric_strategy_setup_again_steps_one_state_through_either_returned_optimizer": {
                "set up again": (_setup_again_worker, ())},
            "test_fabric_strategy_teardown_leaves_model_and_optimizer_as_fabrics_ddp": {
                "teardown": (_teardown_worker, ())},
            "test_fabric_strategy_takes_the_state_of_an_optimizer_that_stepped_before_setup": {
                "prewarmed": (_prewarmed_worker, ())}}
    return jobs


register(_jobs, seconds=300)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)
