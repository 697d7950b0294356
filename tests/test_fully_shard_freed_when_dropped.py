"""fully_shard under CPUOffloadPolicy: a model dropped by the script is freed, as torch's FSDP2
model is, and what it held gathered leaves ``memory_stats()``.

Registries keyed weakly by a module, parameter or unit held a strong value that leads back to
the key (the state to its modules, the unit to its parameters, the owner to its submodules),
and the unsharded parameters' gradient hooks held the unit, where autograd keeps them out of
the garbage collector's sight: every sharded model stayed alive for good, gathered buffers
included, and their bytes stayed in the process-wide ``gathered_bytes``.

Freed at once too, the garbage collector off (Note [a dropped model freed at once] in
fusedist/fsdp/state.py): the hooks' states, the root's iteration context, tree and step watch held
the modules back, so the model waited for a collection, as FSDP2's does. So did a module given to
``fully_shard`` holding parameters itself (its unit's registrations held it), one holding an
all-gather extension parameter itself (the extension's spec held it, to hand it to
``fsdp_pre_all_gather``), and a weight tied across units (the lending unit held its borrower, which
holds it back).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedist
import models
from fusedist.testing import run_distributed


def _shard(model, fully_shard, mesh, reshard_after_forward, offload):
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    fully_shard(model, mesh=mesh, offload_policy=offload)
    return model


def _storage_holder(model, who):
    """What holds the storage of the first block's parameters: fusedist's unit shard, FSDP2's local piece."""
    if who == "torch":
        return next(model.blocks[0].parameters())._local_tensor
    unit = fusedist.fsdp.state.state_of(model.blocks[0]).unit
    return unit.shard if unit.shard is not None else unit.shards[0]


def _alive_after_del(who, shard, mesh, stage, x, y):
    """Which of (model, block, storage holder) a program that dropped the model and its optimizer
    still has alive, the garbage collector off: after sharding (stage 0), a forward and backward
    (1), an AdamW step (2)."""
    torch.manual_seed(0)
    gc.disable()
    try:
        model = _shard(models.BlockStack(), shard, mesh, True, None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if stage >= 1:
            F.mse_loss(model(x), y).backward()
        if stage >= 2:
            opt.step()
            opt.zero_grad()
        refs = [weakref.ref(model), weakref.ref(model.blocks[0]), weakref.ref(_storage_holder(model, who))]
        del model, opt
        return [r() is not None for r in refs]
    finally:
        gc.enable()
        gc.collect()


class ScaledBlock(nn.Module):
    """A block holding a parameter itself besides its Linear's."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale


class ScaledStack(nn.Module):
    """Blocks holding parameters themselves, under a root holding one itself too."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.ModuleList(ScaledBlock() for _ in range(2))
        self.bias = nn.Parameter(torch.zeros(3))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) + self.bias


def _scaled():
    model = ScaledStack()
    return model, list(model.blocks), torch.randn(4, 5)


def _tied():
    """The embedding sharded on its own, its weight tied to the root's output layer (borrowed)."""
    model = models.TiedLM()
    return model, [model.embed], torch.randint(0, 50, (4, 6))


def _extension():
    """Linears sharded on their own, each holding an all-gather extension weight itself."""
    from test_fully_shard_extension import rowwise_model

    model = rowwise_model()
    return model, [model[0], model[2]], torch.randn(4, 16)


def _dropped_holding_params(build, shard, mesh, stage):
    """Which of (model, first sharded submodule, its unit's storage) is alive once dropped, the garbage
    collector off: after sharding (stage 0), a forward and backward (1), an AdamW step and a
    ``state_dict()`` (2)."""
    torch.manual_seed(0)
    gc.disable()
    try:
        model, units, x = build()
        _shard_units(model, units, shard, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if stage >= 1:
            model(x).float().square().mean().backward()
        if stage >= 2:
            opt.step()
            opt.zero_grad()
            model.state_dict()
        first = units[0]
        held = next(first.parameters())._local_tensor if shard is not fusedist.fully_shard else \
            _unit_storage(fusedist.fsdp.state.state_of(first).unit)
        refs = [weakref.ref(model), weakref.ref(first), weakref.ref(held)]
        del model, units, first, held, opt
        return [r() is not None for r in refs]
    finally:
        gc.enable()
        gc.collect()


def _shard_units(model, units, shard, mesh):
    """(in a frame of its own: a loop variable left holding a module would keep it alive)"""
    for m in units:
        shard(m, mesh=mesh)
    shard(model, mesh=mesh)


def _unit_storage(unit):
    return unit.shard if unit.shard is not None else unit.shards[0]


def _dropped(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(rank)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    out = {"without_gc": {who: [_alive_after_del(who, shard, mesh, stage, x, y) for stage in range(3)]
                          for who, shard in [("torch", fully_shard), ("fusedist", fusedist.fully_shard)]}}
    for who, shard, policy in [("torch", fully_shard, CPUOffloadPolicy(pin_memory=False)),
                               ("fusedist", fusedist.fully_shard, fusedist.CPUOffloadPolicy(pin_memory=False))]:
        torch.manual_seed(0)
        model = _shard(models.BlockStack(), shard, mesh, False, policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # reshard_after_forward=False: the blocks stay gathered
            model(x)
        gathered = model.memory_stats()["gathered_bytes"] if who == "fusedist" else None
        alive = weakref.ref(model)
        del model, opt
        gc.collect()
        out[who] = (alive() is None, gathered)
    out["holding_params"] = {name: [_dropped_holding_params(build, fusedist.fully_shard, mesh, stage)
                                    for stage in range(3)]
                             for name, build in [("scaled", _scaled), ("tied", _tied), ("extension", _extension)]}
    out["holding_params_gathered"] = fusedist.fsdp.memory.COUNTERS.gathered  # (all dropped)
    # FSDP2 (which refuses weights tied across units): kept until the next collection
    out["holding_params_torch"] = {name: _dropped_holding_params(build, fully_shard, mesh, 2)
                                   for name, build in [("scaled", _scaled), ("extension", _extension)]}
    fresh = _shard(models.BlockStack(), fusedist.fully_shard, mesh, True, fusedist.CPUOffloadPolicy())
    out["fresh"] = fresh.memory_stats()["gathered_bytes"]
    return out


@pytest.fixture(scope="module")
def dropped():
    """One launch for the tests below."""
    return run_distributed(_dropped, 2, timeout=120)


def test_a_dropped_model_is_freed_at_once_without_the_garbage_collector(dropped):
    """Its modules hold what leads back to them only weakly (hooks' states, the root's iteration
    context, tree and step watch, the units' callbacks): dropped after sharding, after a training
    step or an optimizer step, model, blocks and the shards' storage go at once. FSDP2's reference
    cycles keep its model until the next collection."""
    for res in dropped:
        assert res["without_gc"]["fusedist"] == [[False, False, False]] * 3, res["without_gc"]
        assert res["without_gc"]["torch"] == [[True, True, True]] * 3, res["without_gc"]  # FSDP2: kept until gc


def test_modules_holding_parameters_themselves_are_freed_at_once(dropped):
    """A module given to fully_shard holding a parameter itself (a block's scale, the root's bias, an
    embedding sharded on its own, a Linear sharded on its own with an all-gather extension weight,
    handed to ``fsdp_pre_all_gather``), and a weight tied across units: dropped after sharding, a
    training step, or an optimizer step and a state_dict(), model, module and storage go at once."""
    for res in dropped:
        for name in ("scaled", "tied", "extension"):
            assert res["holding_params"][name] == [[False, False, False]] * 3, (name, res["holding_params"])
        # the extension's gathered bytes were counted without their unit: they stayed counted once it was freed
        assert res["holding_params_gathered"] == 0, res["holding_params_gathered"]
        for name in ("scaled", "extension"):  # FSDP2: kept until gc
            assert res["holding_params_torch"][name] == [True, True, True], (name, res["holding_params_torch"])


def test_a_dropped_model_is_freed_and_leaves_memory_stats(dropped):
    for res in dropped:
        assert res["torch"][0], res  # torch's FSDP2 model is collected
        freed, gathered = res["fusedist"]
        assert gathered > 0, res
        assert freed, res  # it stayed alive for good
        assert res["fresh"] == 0, res  # the dropped model's gathered bytes were still counted


def _init_then_drop(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    with torch.device("meta"):
        model = models.BlockStack()
    _shard(model, fusedist.fully_shard, mesh, True, fusedist.CPUOffloadPolicy())
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    fusedist.fsdp.init_parameters(model)
    ref = models.BlockStack()
    torch.manual_seed(3)
    ref.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    whole = fusedist.fsdp.full_state_dict(model)
    same = all(torch.equal(whole[k], v) for k, v in ref.state_dict().items())
    model.set_requires_gradient_sync(False)  # a no-sync accumulation left behind
    F.mse_loss(model(torch.randn(2, 5)), torch.randn(2, 3)).backward()
    alive = weakref.ref(model.blocks[0])
    del model
    gc.collect()
    return same, alive() is None


def test_a_meta_initialized_offloaded_model_is_freed():
    for same, freed in run_distributed(_init_then_drop, 2, timeout=120):
        assert same
        assert freed
