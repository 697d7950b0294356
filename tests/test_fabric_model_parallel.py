"""FusedistFabricModelParallelStrategy: a Fabric loop whose ``parallelize_fn`` applies
``fusedist.fully_shard``, against the same loop with FSDP2's ``fully_shard`` under Fabric's own
``ModelParallelStrategy``: accumulation under ``no_backward_sync``, the clip's norm,
``fabric.save`` / ``fabric.load`` and training on, fp32 and fp16 with its scaler; a module built
on the meta device gets the unsharded module's initial values.

Ranks are processes of :func:`fusedist.testing.run_distributed` with the torchelastic
variables set. Tolerance 1e-6: the same fp32 operations on values of order 1, reduced in
another order, over five steps (measured: 3e-8); fp16 autocast on a CPU runs the same matmuls
on both sides. Under Fabric's own strategy, ``fabric.save`` refused the fusedist module
("Could not find a distributed model").
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_lightning_launch import register, shared_launch

TOL = 1e-6


def _parallelize_with(fully_shard):
    def parallelize(model, device_mesh):
        for block in model:
            if isinstance(block, nn.Linear):
                fully_shard(block, mesh=device_mesh["data_parallel"])
        return fully_shard(model, mesh=device_mesh["data_parallel"])

    return parallelize


def _fabric(side: str, precision: str, world: int):
    import lightning as L
    from lightning.fabric.plugins.precision import MixedPrecision
    from lightning.fabric.strategies import ModelParallelStrategy

    sizes = {"data_parallel_size": world, "tensor_parallel_size": 1}  # ("auto" would give the devices to TP)
    if side == "fusedist":
        import fusedist
        from fusedist.integrations.fabric import FusedistFabricModelParallelStrategy

        strategy = FusedistFabricModelParallelStrategy(_parallelize_with(fusedist.fully_shard), **sizes)
    else:
        from torch.distributed.fsdp import fully_shard

        strategy = ModelParallelStrategy(_parallelize_with(fully_shard), **sizes)
    plugins = None
    if precision == "16-mixed":  # Fabric turns "16-mixed" into bf16 on a CPU; the plugin keeps fp16 and its scaler
        precision, plugins = None, [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", 2.0**8))]
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=precision, plugins=plugins)
    fabric.launch()
    return fabric


def _full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model._forward_module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _train(fabric, model, optimizer, first, last, norms):
    for step in range(first, last):
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * micro + 10 * step + fabric.global_rank)
            x = torch.randn(4, 8, generator=g)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                if micro == 0 and hasattr(model._forward_module, "_fs_states"):  # fusedist's units, inside it
                    assert not any(st.requires_all_reduce for st in model._forward_module._fs_states())
                fabric.backward(nn.functional.mse_loss(model(x).float(), torch.sin(x[:, :3])) / 2)
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=0.05)))
        optimizer.step()
        optimizer.zero_grad()


def _run(side, precision, world, directory):
    fabric = _fabric(side, precision, world)
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    norms = []
    _train(fabric, model, optimizer, 0, 3, norms)
    path = os.path.join(directory, side)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    _train(fabric, model, optimizer, 3, 5, norms)
    straight = _full_state(model)
    fabric.load(path, {"model": model, "optimizer": optimizer})
    _train(fabric, model, optimizer, 3, 5, norms)
    return norms, straight, _full_state(model)


def _compare(rank, world, precision, directory):
    _launched_env(rank, world)
    ours, theirs = _run("fusedist", precision, world, directory), _run("torch", precision, world, directory)
    assert torch.allclose(torch.tensor(ours[0]), torch.tensor(theirs[0]), rtol=TOL, atol=TOL), (ours[0], theirs[0])
    for k in theirs[1]:
        assert torch.allclose(ours[1][k], theirs[1][k], rtol=TOL, atol=TOL), k
        assert torch.equal(ours[2][k], ours[1][k]), k  # the resumed run retraces the straight one


PRECISIONS = ["32-true", "16-mixed"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fabric_fully_shard_loop_saves_loads_and_trains_as_fsdp2(precision, launched):
    results_of(launched, f"compare {precision}")


def _meta_init(rank, world):
    _launched_env(rank, world)
    import fusedist

    fabric = _fabric("fusedist", "32-true", world)
    torch.manual_seed(0)
    expected = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).state_dict()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    model = fabric.setup_module(model)
    assert any(isinstance(m, fusedist.fsdp.api.FullyShardedModule) for m in model.modules())
    state = _full_state(model)
    for k, v in expected.items():
        assert torch.equal(state[k], v), k


def test_fabric_fully_shard_module_built_on_meta_gets_the_unsharded_initial_values(launched):
    results_of(launched, "meta init")


def _jobs(tmp_path_factory):
    """The selected tests' cases (each sets up its own Fabrics and models, each precision writes
    to its own directory), in the launch shared with the other Lightning and Fabric files
    (test_lightning_launch.py)."""
    return {
        "test_fabric_fully_shard_loop_saves_loads_and_trains_as_fsdp2": {
            f"compare {precision}": (_compare, (precision, str(tmp_path_factory.mktemp("fabric_mp"))))
            for precision in PRECISIONS},
        "test_fabric_fully_shard_module_built_on_meta_gets_the_unsharded_initial_values": {
            "meta init": (_meta_init, ())},
    }


register(_jobs, seconds=480)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)
