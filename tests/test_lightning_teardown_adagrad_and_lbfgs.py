"""FusedistStrategy against Lightning's ``strategy="ddp"`` where a fit meets what the strategy
does not convert, and what a module is after a fit:

* an optimizer that fills its state when it is built (torch's Adagrad) sharded with ZeRO, and one
  that stepped before the strategy, whose state the conversion carries over;
* a module trained by FusedistStrategy and then by anything else (a second Trainer with
  ``strategy="ddp"``, a plain loop): the fusedist wrapper stayed registered on its parameters,
  so torch's optimizers were refused as stepping unsynchronized gradients and torch's clip
  read the retired ZeRO-2 shards (a norm of 0, nothing clipped).

Ranks are processes of :func:`fusedist.testing.run_distributed` with the torchelastic
variables set (test_e2e_lightning_recipe.py). Tolerance: fp32, the same operations in
another order over 16 steps on values of order 1: 1e-5; the failures move weights by far
more, or raise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _data, _flat, _launched_env
from test_lightning_launch import register, shared_launch

TOL = 1e-5


def _module(optimizer: str):
    import lightning as L

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y, reduction="sum")

        def configure_optimizers(self):
            if optimizer == "adagrad":
                return torch.optim.Adagrad(self.parameters(), lr=1e-2, initial_accumulator_value=0.1)
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    return Regressor()


def _fit(module, strategy, **trainer_kw):
    import importlib

    import lightning as L

    importlib.import_module("fusedist.integrations.lightning")  # registers strategy="fusedist..."

    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, **{"max_epochs": 2, **trainer_kw})
    trainer.fit(module, _data(1))
    return _flat(module)


def _adagrad_worker(rank, world):
    _launched_env(rank, world)
    # (one epoch, 8 steps: the state built in the constructor is stepped from the first)
    clip = dict(gradient_clip_val=0.5, max_epochs=1)
    ref = _fit(_module("adagrad"), "ddp", **clip)
    return {name: (_fit(_module("adagrad"), name, **clip) - ref).abs().max().item()
            for name in ("fusedist_zero1", "fusedist_zero2")}


def test_adagrad_is_sharded_as_ddp_trains_it(launched):
    """torch's Adagrad builds its state (``step`` 0, ``sum`` at ``initial_accumulator_value``)
    in its constructor; ZeRO 1 and 2 shard it and train as Lightning's DDP, clipped by norm."""
    for rank, diffs in enumerate(results_of(launched, "adagrad")):
        for name, diff in diffs.items():
            assert diff <= TOL, f"{name}, rank {rank}: weights differ by {diff}"


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                  lambda p: torch.optim.AdamW(p, lr=0.1)], ids=["SGD momentum", "AdamW"])
def test_an_optimizer_that_stepped_carries_its_state(make):
    """The conversion takes the state a step made (a momentum buffer, Adam's moments and step;
    an optimizer the strategy keeps, Adagrad without ZeRO, is not converted)."""
    from fusedist.integrations.lightning import FusedistStrategy

    params = [nn.Parameter(torch.randn(4, 3))]
    optimizer = make(params)
    params[0].grad = torch.randn(4, 3)
    optimizer.step()
    expected = copy.deepcopy(optimizer.state_dict()["state"])
    new = FusedistStrategy()._convert_optimizer(optimizer, master_weights=False)
    assert new is not optimizer
    got = new.state_dict()["state"]
    assert got.keys() == expected.keys()
    for i in expected:
        assert expected[i].keys() == got[i].keys()
        for key, value in expected[i].items():
            assert torch.equal(torch.as_tensor(got[i][key]).float(), torch.as_tensor(value).float()), key


def _after_fit_worker(rank, world):
    _launched_env(rank, world)
    out = {}
    # Clipped at 0.05, which bites every step: a clip with a wrong norm shows from the first of
    # an epoch's 8 steps, as a second Trainer refusing to step does.
    clip = dict(gradient_clip_val=0.05, max_epochs=1)
    ref = _module("adamw")
    _fit(ref, "ddp", **clip)
    ref = _fit(ref, "ddp", **clip)
    for first in ("fusedist", "fusedist_zero2"):
        module = _module("adamw")
        _fit(module, first, **clip)
        out[f"{first}, then strategy='ddp'"] = (_fit(module, "ddp", **clip) - ref).abs().max().item()
    # and in a plain loop: torch's optimizer and clip on the module a ZeRO-2 fit returned
    module = _module("adamw")
    _fit(module, "fusedist_zero2", max_epochs=1)
    x, y = next(iter(_data(2)))
    nn.functional.mse_loss(module.net(x), y).backward()
    true_norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in module.parameters()]))
    out["torch clip's norm"] = (torch.nn.utils.clip_grad_norm_(module.parameters(), 1e9) - true_norm).abs().item()
    before = _flat(module)
    torch.optim.SGD(module.parameters(), lr=0.1).step()
    out["plain SGD step"] = ((before - _flat(module)) - 0.1 * torch.cat(
        [p.grad.reshape(-1) for p in module.parameters()])).abs().max().item()
    return out


def test_a_module_after_fit_trains_as_after_lightnings_ddp(launched):
    """After ``trainer.fit`` the strategy leaves the module as Lightning's DDP leaves it: a
    second Trainer with ``strategy="ddp"`` continues as after a ``"ddp"`` fit (it was refused:
    "step() after a backward pass that was not synchronized"), and torch's optimizer and
    clip see the module's own ``p.grad`` (the clip measured the retired ZeRO-2 shards)."""
    for rank, diffs in enumerate(results_of(launched, "after fit")):
        for name, diff in diffs.items():
            assert diff <= TOL, f"{name}, rank {rank}: differs by {diff}"


def _jobs(tmp_path_factory):
    """The two multi-rank tests' workers, in the launch shared with the other Lightning and
    Fabric files (test_lightning_launch.py)."""
    jobs = {"test_adagrad_is_sharded_as_ddp_trains_it": {"adagrad": (_adagrad_worker, ())},
            "test_a_module_after_fit_trains_as_after_lightnings_ddp": {"after fit": (_after_fit_worker, ())}}
    return jobs


register(_jobs, seconds=300)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def test_lbfgs_under_fp16_mixed_is_refused_as_lightning_refuses_it():
    """Lightning's "16-mixed" refuses LBFGS before running its closure; the strategy's plugin
    ran the closure and then failed inside ``LBFGS.step`` ("missing ... 'closure'")."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from fusedist.integrations.lightning import FusedistStrategy

    strategy = FusedistStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu")
    for plugin in (MixedPrecision("16-mixed", "cpu"), strategy.precision_plugin):
        calls = []
        optimizer = torch.optim.LBFGS([nn.Parameter(torch.randn(3))])
        with pytest.raises(MisconfigurationException, match="LBFGS optimizer are not compatible"):
            plugin.optimizer_step(optimizer, model=None, closure=lambda: calls.append(1))
        assert calls == [], type(plugin).__name__


@pytest.mark.parametrize("make, flag", [
    (lambda p: torch.optim.AdamW(p, lr=0.1, capturable=True), "capturable"),
    (lambda p: torch.optim.SGD(p, lr=0.1, differentiable=True), "differentiable"),
], ids=["AdamW capturable", "SGD differentiable"])
def test_settings_without_a_fused_counterpart_name_the_strategy_setting_that_keeps_torchs(make, flag):
    """A setting the fused optimizers do not run is refused at setup naming the user's class
    and ``fused_optimizer=False`` (the refusal came from FusedAdamW, a class the user never
    wrote); with ``fused_optimizer=False`` torch's optimizer is kept as it is."""
    from fusedist.integrations.lightning import FusedistStrategy

    optimizer = make([nn.Parameter(torch.randn(4, 3))])
    name = type(optimizer).__name__
    with pytest.raises(ValueError, match=rf"{name}\({flag}=True\).*fused_optimizer=False"):
        FusedistStrategy()._convert_optimizer(optimizer, master_weights=False)
    assert FusedistStrategy(fused_optimizer=False)._convert_optimizer(optimizer, master_weights=False) is optimizer
