"""Lightning's strategies swapped for fusedist's, against Lightning's own on the same inputs.

* A meta-device build (``trainer.init_module(empty_init=True)``) under
  ``FusedistModelParallelStrategy``: Lightning materializes the model with ``reset_parameters()``
  on each submodule in ``module.modules()``'s order, parents before their children, so a block
  whose ``reset_parameters`` re-initializes its Linear layers is overwritten by theirs. The
  strategy ran the calls children first (``nn.Module.apply``'s order): the block's init won and
  the RNG was drawn in another order. Reference: Lightning's materialization of the unsharded
  module built on the meta device, from the same RNG state; bit for bit.
* A precision plugin object given to two Trainers in turn (a second ``trainer.fit`` of the same
  recipe): under ``strategy="ddp"`` its GradScaler carries its scale over; fusedist's adapter
  started a fresh scaler at ``init_scale`` each time, so the second fit skipped the steps the
  reference took. Tolerance 1e-3: fp16 autocast with a loss scale (the drop-in tests' bound).
* A user's subclass of ``MixedPrecision`` that records in its own attributes (a count of its
  optimizer steps): Lightning's strategies run the user's object, fusedist's adapter ran a copy
  of its attributes, so the user's reference read 0 after fit.
"""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch
from torch import nn

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_lightning_launch import register, shared_launch

WORLD = 2


def _env(rank: int, world: int, port: int) -> None:
    _launched_env(rank, world)
    os.environ["MASTER_PORT"] = str(port)
    warnings.filterwarnings("ignore")


def _quiet_trainer(strategy, epochs: int, **kwargs):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=epochs, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, **kwargs)


# -- meta-device materialization order -------------------------------------------------------


class _Block(nn.Module):
    """A block with a parameter of its own whose ``reset_parameters`` re-initializes its layers."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def reset_parameters(self):
        nn.init.normal_(self.scale)
        for fc in (self.fc1, self.fc2):
            nn.init.normal_(fc.weight, std=0.02)
            nn.init.zeros_(fc.bias)

    def forward(self, x):
        return x * self.scale + self.fc2(torch.tanh(self.fc1(x)))


def _block_module(fully_shard):
    import lightning as L

    class Blocks(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(_Block(12), _Block(12), nn.Linear(12, 3))

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for block in list(self.net)[:2]:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Blocks


def _regression_data(seed: int, n: int = 16, width: int = 12, out: int = 3):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, out, generator=g)),
                      batch_size=4)


def _materialization_order_worker(rank, world, seed, port):
    from lightning.fabric.utilities.init import _materialize_distributed_module
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fusedist import fully_shard
    from fusedist.integrations.lightning import FusedistModelParallelStrategy

    _env(rank, world, port)
    with torch.device("meta"):
        reference = _block_module(fully_shard)()
    torch.manual_seed(seed)
    _materialize_distributed_module(reference, torch.device("cpu"))

    trainer = _quiet_trainer(FusedistModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), 0)
    with trainer.init_module(empty_init=True):
        module = _block_module(fully_shard)()
    torch.manual_seed(seed)
    trainer.fit(module, _regression_data(seed))
    ours = get_model_state_dict(module.net, options=StateDictOptions(full_state_dict=True))
    return {name: float((ours[name] - ref).abs().max()) for name, ref in reference.net.state_dict().items()}


def test_meta_device_build_is_materialized_in_lightnings_order(launched):
    seed = launched["seeds"]["materialization"]
    results = results_of(launched, "materialization")
    failures = [f"rank {rank}: {name}: max |fusedist - Lightning| = {err:.3g}"
                for rank, errors in enumerate(results) for name, err in errors.items() if err != 0]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures)


# -- one precision plugin, two Trainers ------------------------------------------------------


def _small_module():
    import lightning as L

    class Small(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    return Small()


def _two_fits(strategy, seed):
    """Two fits of one module, one plugin object given to both Trainers; the weights after each
    and the scale the user's plugin holds at the end."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    # an initial scale that overflows fp16: the first fit backs it off over its first steps
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**18))
    torch.manual_seed(seed)
    module = _small_module()
    weights = []
    for fit in range(2):
        _quiet_trainer(strategy(), 1, plugins=[plugin]).fit(module, _regression_data(seed + fit, 64, 6, 2))
        weights.append(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
    return weights, float(plugin.scaler.get_scale())


def _plugin_reuse_worker(rank, world, seed, port):
    from fusedist.integrations.lightning import FusedistStrategy

    _env(rank, world, port)
    ours, our_scale = _two_fits(FusedistStrategy, seed)
    ref, ref_scale = _two_fits(lambda: "ddp", seed)
    return [float((a - b).abs().max()) for a, b in zip(ours, ref)], (our_scale, ref_scale)


def test_a_plugin_given_to_two_trainers_keeps_its_scale_as_under_ddp(launched):
    seed = launched["seeds"]["plugin reuse"]
    for rank, (errors, (ours, ref)) in enumerate(results_of(launched, "plugin reuse")):
        assert max(errors) <= 1e-3, f"seed {seed}, rank {rank}: max |fusedist - ddp| after each fit: {errors}"
        assert ours == ref, f"seed {seed}, rank {rank}: the plugin's scale {ours}, under ddp {ref}"


def _counting_plugin_worker(rank, world, port):
    from lightning.pytorch.plugins.precision import MixedPrecision

    from fusedist.integrations.lightning import FusedistStrategy

    class CountingMixed(MixedPrecision):
        """A user's plugin counting its optimizer steps in an attribute of its own."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps = 0

        def optimizer_step(self, *args, **kwargs):
            self.steps += 1
            return super().optimizer_step(*args, **kwargs)

    _env(rank, world, port)
    out = {}
    for name, strategy in (("fusedist", lambda: FusedistStrategy(zero_stage=2)), ("ddp", lambda: "ddp")):
        plugin = CountingMixed("16-mixed", "cpu")
        torch.manual_seed(0)
        _quiet_trainer(strategy(), 1, plugins=[plugin]).fit(_small_module(), _regression_data(0, 32, 6, 2))
        out[name] = plugin.steps, float(plugin.scaler.get_scale())
    return out


def test_a_plugin_subclass_records_in_the_users_object_as_under_ddp(launched):
    for rank, out in enumerate(results_of(launched, "counting plugin")):
        assert out["fusedist"] == out["ddp"] and out["ddp"][0] > 0, \
            f"rank {rank}: (steps counted, scale) in the user's plugin: {out}"


# -- init_parameters(order="modules") without Lightning ----------------------------------------


def _modules_order_worker(rank, world, seed):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist

    def reset(sub):
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()

    reference = nn.Sequential(_Block(8), _Block(8), nn.Linear(8, 3))
    torch.manual_seed(seed)
    for sub in reference.modules():
        reset(sub)
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = nn.Sequential(_Block(8), _Block(8), nn.Linear(8, 3))
    for block in list(model)[:2]:
        fusedist.fully_shard(block, mesh=mesh)
    fusedist.fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    fusedist.fsdp.init_parameters(model, reset, order="modules")
    ours = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: float((ours[name] - ref).abs().max()) for name, ref in reference.state_dict().items()}


def test_init_parameters_in_modules_order_equals_the_unsharded_loop(launched):
    """``init_parameters(model, init_fn, order="modules")`` gives what ``for m in
    model.modules(): init_fn(m)`` gives the unsharded model (parents first), bit for bit."""
    seed = launched["seeds"]["modules order"]
    for rank, errors in enumerate(results_of(launched, "modules order")):
        assert all(err == 0 for err in errors.values()), f"seed {seed}, rank {rank}: {errors}"


# fresh each run
SEEDS = {name: random.randrange(2**20) for name in ("materialization", "plugin reuse", "modules order")}
PORT = random.randrange(20000, 60000)


def _jobs(tmp_path_factory):
    """The selected tests' cases, each on a fresh random seed (each builds its own Trainers,
    plugins and models), in the launch shared with the other Lightning and Fabric files
    (test_lightning_launch.py)."""
    return {
        "test_meta_device_build_is_materialized_in_lightnings_order": {
            "materialization": (_materialization_order_worker, (SEEDS["materialization"], PORT))},
        "test_a_plugin_given_to_two_trainers_keeps_its_scale_as_under_ddp": {
            "plugin reuse": (_plugin_reuse_worker, (SEEDS["plugin reuse"], PORT))},
        "test_a_plugin_subclass_records_in_the_users_object_as_under_ddp": {
            "counting plugin": (_counting_plugin_worker, (PORT,))},
        "test_init_parameters_in_modules_order_equals_the_unsharded_loop": {
            "modules order": (_modules_order_worker, (SEEDS["modules order"],))},
    }


register(_jobs, seconds=360)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return {"seeds": SEEDS, **shared_launch(request, tmp_path_factory)}
