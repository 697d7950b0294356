"""The fusedist Lightning and Fabric strategies against Lightning's and Fabric's own ``"ddp"`` for
optimizer state that a run starts from. (1) A module that builds its optimizer once and returns it
from ``configure_optimizers`` on every fit: a second fit steps on from the first one's state. (2) A
torch optimizer that loaded a state dict whose param groups say ``capturable=True`` or
``differentiable=True`` (saved by a CUDA-graph run, or by an optimizer with a differentiable
group, before its first step) while the optimizer was built without them: torch steps it as an
ordinary optimizer, and so must the strategy, which is not to refuse it at setup. With Lightning the
same trainer and strategy object then run ``validate``, ``test``, ``predict`` and a second ``fit``
resumed from the first one's checkpoint into a fresh module.

torch's Adam cannot step a capturable group on a CPU (it asserts a CUDA device), so the capturable
runs are compared with Fabric's DDP on the optimizer without the loaded flag: the flag says how the
saving optimizer ran its step, not what it computes. Ranks are processes of
:func:`fusedist.testing.run_distributed` with the torchelastic variables set. Tolerance 1e-5, fp32:
fused kernels and bucketed all-reduces against torch's AdamW and all-reduce over a few steps (an ulp
or two per step); a step that is skipped or not synchronized moves the weights by 1e-3 or more.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_lightning_launch import register, shared_launch

TOL = 1e-5
STEPS = 3


def _saved_with(params, flag: str) -> dict:
    """The state dict of a torch AdamW built with ``flag=True``, saved before its first step."""
    copies = [p.detach().clone().requires_grad_() for p in params]
    return torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.1, **{flag: True}).state_dict()


def _optimizer(model, flag, load: bool):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if load:
        optimizer.load_state_dict(_saved_with(list(model.parameters()), flag))
        assert optimizer.param_groups[0][flag] and not optimizer.defaults[flag]
    return optimizer


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 8, generator=g)
    return x, torch.sin(2 * x[:, :3])


def _fabric_run(side: str, flag: str, zero_stage: int, load: bool):
    import lightning as L

    if side == "ddp":
        strategy = "ddp"
    else:
        from fusedist.integrations.fabric import FusedistFabricStrategy

        strategy = FusedistFabricStrategy(zero_stage=zero_stage)
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    model, optimizer = fabric.setup(model, _optimizer(model, flag, load))
    for step in range(STEPS):
        x, y = _batch(fabric.global_rank, step)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _fabric_loaded_flags(rank, world, flag, zero_stage):
    _launched_env(rank, world)
    ours = _fabric_run("fusedist", flag, zero_stage, load=True)
    theirs = _fabric_run("ddp", flag, zero_stage, load=flag == "differentiable")
    assert (ours - theirs).abs().max().item() <= TOL, (ours - theirs).abs().max().item()


def _module_class():
    import lightning as L

    class Loads(L.LightningModule):
        """Builds a torch AdamW that loads a state dict whose groups say ``differentiable=True``."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
            self.steps = []

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def test_step(self, batch, _):
            x, y = batch
            self.log("test", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def predict_step(self, batch, _):
            return self.net(batch[0])

        def configure_optimizers(self):
            return _optimizer(self, "differentiable", load=True)

    return Loads


def _data(seed: int):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.sin(2 * x[:, :3])), batch_size=4)


def _lightning_run(side: str, root: str):
    import lightning as L

    if side == "ddp":
        strategy = "ddp"
    else:
        from fusedist.integrations.lightning import FusedistStrategy

        strategy = FusedistStrategy()

    module = _module_class()()
    first = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, deterministic=True)
    first.fit(module, _data(1), _data(2))
    path = os.path.join(root, f"{side}.ckpt")
    first.save_checkpoint(path)
    after_first = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    val = first.validate(module, _data(2), verbose=False)[0]["val"]
    test = first.test(module, _data(3), verbose=False)[0]["test"]
    predicted = torch.cat(first.predict(module, _data(3)))
    first.fit_loop.max_epochs = 2  # the same trainer and strategy object, resumed into a fresh module
    resumed = _module_class()()
    first.fit(resumed, _data(1), _data(2), ckpt_path=path)
    after_second = torch.cat([p.detach().reshape(-1) for p in resumed.parameters()])
    return after_first, val, test, predicted, after_second


def _kept_module_class():
    import lightning as L

    class KeepsOne(L.LightningModule):
        """Builds its optimizer once, with the module, and returns it on every fit."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
            self.opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return self.opt

    return KeepsOne


def _two_fits(side: str, zero_stage: int, then: tuple = ()):
    """Fits of one module: the first under ``side``, then one under each of ``then`` ("ddp" or
    "fusedist"; one more under ``side`` when none is given)."""
    import lightning as L

    module = _kept_module_class()()
    for fit_side in (side, *(then or (side,))):
        if fit_side == "ddp":
            strategy = "ddp"
        else:
            from fusedist.integrations.lightning import FusedistStrategy

            strategy = FusedistStrategy(zero_stage=zero_stage)
        L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  deterministic=True).fit(module, _data(1))
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _optimizer_given_again(rank, world, zero_stage):
    _launched_env(rank, world)
    ours, theirs = _two_fits("fusedist", zero_stage), _two_fits("ddp", zero_stage)
    assert (ours - theirs).abs().max().item() <= TOL, (ours - theirs).abs().max().item()


def _optimizer_given_to_ddp_after(rank, world, zero_stage, then):
    _launched_env(rank, world)
    ours, theirs = _two_fits("fusedist", zero_stage, then), _two_fits("ddp", zero_stage, ("ddp",) * len(then))
    assert (ours - theirs).abs().max().item() <= TOL, (ours - theirs).abs().max().item()


def _lightning_loaded_flag(rank, world, root):
    _launched_env(rank, world)
    ours = _lightning_run("fusedist", root)
    theirs = _lightning_run("ddp", root)
    for name, a, b in zip(("weights", "validate", "test", "predict", "resumed weights"), ours, theirs):
        diff = (torch.as_tensor(a) - torch.as_tensor(b)).abs().max().item()
        assert diff <= TOL, (name, diff)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_lightning_optimizer_returned_on_a_second_fit_keeps_its_state_as_lightnings_ddp(zero_stage, launched):
    results_of(launched, f"given again ZeRO {zero_stage}")


@pytest.mark.parametrize("zero_stage, then", [(1, "ddp"), (2, "ddp"), (2, "ddp, fusedist")])
def test_lightning_optimizer_kept_from_a_zero_fit_trains_later_fits_as_lightnings_ddp(zero_stage, then, launched):
    """The sharded optimizer retired with the first fit: the kept optimizer steps on from its whole
    state under "ddp", and a later ZeRO fit converts it from that state again."""
    results_of(launched, f"ZeRO {zero_stage} then {then}")


@pytest.mark.parametrize("flag, zero_stage", [("differentiable", 0), ("capturable", 2)])
def test_fabric_optimizer_with_loaded_group_flags_trains_as_fabrics_ddp(flag, zero_stage, launched):
    results_of(launched, f"fabric {flag} ZeRO {zero_stage}")


def test_lightning_optimizer_with_loaded_differentiable_group_fits_resumes_as_lightnings_ddp(launched):
    results_of(launched, "lightning differentiable")


def _jobs(tmp_path_factory):
    """This file's selected scenarios, in the launch shared with the other Lightning and Fabric
    files (test_lightning_launch.py)."""
    root = str(tmp_path_factory.mktemp("resumed"))
    jobs = {"test_lightning_optimizer_returned_on_a_second_fit_keeps_its_state_as_lightnings_ddp": {
                f"given again ZeRO {stage}": (_optimizer_given_again, (stage,)) for stage in (0, 2)},
            "test_lightning_optimizer_kept_from_a_zero_fit_trains_later_fits_as_lightnings_ddp": {
                f"ZeRO {stage} then {then}": (_optimizer_given_to_ddp_after, (stage, tuple(then.split(", "))))
                for stage, then in ((1, "ddp"), (2, "ddp"), (2, "ddp, fusedist"))},
            "test_fabric_optimizer_with_loaded_group_flags_trains_as_fabrics_ddp": {
                f"fabric {flag} ZeRO {stage}": (_fabric_loaded_flags, (flag, stage))
                for flag, stage in (("differentiable", 0), ("capturable", 2))},
            "test_lightning_optimizer_with_loaded_differentiable_group_fits_resumes_as_lightnings_ddp": {
                "lightning differentiable": (_lightning_loaded_flag, (root,))}}
    return jobs


register(_jobs, seconds=600)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)
