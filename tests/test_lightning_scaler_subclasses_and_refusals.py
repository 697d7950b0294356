"""Lightning's precision plugins under fusedist's strategies, against Lightning's own
``strategy="ddp"`` (or the documented behaviour) on 2 gloo ranks:

* a user's subclass of ``torch.amp.GradScaler`` given to ``MixedPrecision("16-mixed", ...,
  scaler=...)`` was replaced by a plain fusedist GradScaler: its overrides (here an
  ``update()`` that caps the scale and records it) silently stopped running (Note [a subclass
  of torch's GradScaler]);
* a scaler that is no ``torch.amp.GradScaler`` at all failed with an AttributeError on a
  private attribute (now refused naming it, as is a user's subclass of torch's
  ``ShardedGradScaler``, whose unscale would run instead of fusedist's);
* a disabled scaler (``GradScaler(enabled=False)``) failed with an AttributeError too;
* the precision refusals named ``FusedistStrategy`` under ``FusedistModelParallelStrategy``.

Tolerance 1e-3: fp16 autocast with a loss scale, the same operations in another order over
an epoch (the bound of the other "16-mixed" Lightning tests).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _data, _flat, _launched_env
from test_lightning_launch import register, shared_launch
from test_lightning_teardown_adagrad_and_lbfgs import _module

TOL = 1e-3
CAP = 2.0**10


def _capping_scaler():
    class CappedScaler(torch.amp.GradScaler):
        """A user's scaler: the scale never grows above CAP, and every update is recorded."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.history = []

        def update(self, new_scale=None):
            super().update(new_scale)
            if self.get_scale() > CAP:
                super().update(CAP)
            self.history.append(self.get_scale())

    return CappedScaler("cpu", init_scale=2.0**9, growth_interval=2)


def _fit(strategy, path):
    import importlib

    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    importlib.import_module("fusedist.integrations.lightning")  # registers strategy="fusedist..."

    scaler = _capping_scaler()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], gradient_clip_val=0.3,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True)
    module = _module("adamw")
    trainer.fit(module, _data(1, 32))
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    return {"weights": _flat(module), "history": list(scaler.history), "scale": scaler.get_scale(),
            "saved scale": saved["MixedPrecision"]["scale"], "global step": trainer.global_step,
            "scaler class": type(trainer.strategy.precision_plugin.scaler).__name__}


def _scaler_subclass_worker(rank, world, tmp):
    _launched_env(rank, world)
    return {side: _fit(side, os.path.join(tmp, f"{side}.ckpt")) for side in ("ddp", "fusedist", "fusedist_zero2")}


def _jobs(tmp_path_factory):
    """The scaler subclass's runs, in the launch shared with the other Lightning and Fabric files
    (test_lightning_launch.py)."""
    return {"test_a_subclass_of_torchs_grad_scaler_keeps_its_overrides_as_under_ddp": {
        "scaler subclass": (_scaler_subclass_worker, (str(tmp_path_factory.mktemp("scaler_subclass")),))}}


register(_jobs, seconds=180)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def test_a_subclass_of_torchs_grad_scaler_keeps_its_overrides_as_under_ddp(launched):
    for rank, out in enumerate(results_of(launched, "scaler subclass")):
        ref = out["ddp"]
        # growth_interval=2: without the cap the scale keeps a value for at most 2 updates
        assert max(ref["history"]) == CAP and ref["history"].count(CAP) > 2, ref["history"]
        for side in ("fusedist", "fusedist_zero2"):
            ours = out[side]
            diff = (ours["weights"] - ref["weights"]).abs().max().item()
            assert diff <= TOL, f"{side}, rank {rank}: weights differ by {diff}"
            assert ours["history"] == ref["history"], f"{side}, rank {rank}: {ours['history']} vs {ref['history']}"
            assert (ours["scale"], ours["saved scale"], ours["global step"], ours["scaler class"]) == \
                (ref["scale"], ref["saved scale"], ref["global step"], ref["scaler class"]), (side, rank, ours, ref)


class _NotAScaler:
    """Duck-types a scaler's four methods, but is no torch.amp.GradScaler."""

    def scale(self, loss):
        return loss

    def unscale_(self, optimizer):
        pass

    def step(self, optimizer, *args, **kwargs):
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale=None):
        pass


@pytest.mark.parametrize("strategy", ["FusedistStrategy", "FusedistModelParallelStrategy"])
def test_scalers_are_replaced_or_refused_naming_them(strategy):
    """torch's ShardedGradScaler does for its gradients what fusedist's scaler does for all the
    gradients it steps (ZeRO-2's shards included): replaced by it, with its settings and scale. A
    user's subclass of it would run torch's unscale instead of fusedist's, and a scaler that is
    no torch.amp.GradScaler failed on a private attribute: both refused, naming them."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    import fusedist
    from fusedist.integrations import lightning

    make = getattr(lightning, strategy)
    scale = 2.0 ** random.randint(4, 12)
    instance = make()
    instance.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=ShardedGradScaler("cpu", init_scale=scale))
    scaler = instance.precision_plugin.scaler
    assert type(scaler) is fusedist.amp.GradScaler and scaler.get_scale() == scale, (type(scaler), scaler.get_scale())
    with pytest.raises(TypeError, match=f"^{strategy}: MixedPrecision\\(scaler=...\\) got a _NotAScaler, which is "
                                        "not a torch.amp.GradScaler"):
        make().precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=_NotAScaler())
    users = type("UsersShardedScaler", (ShardedGradScaler,), {})
    with pytest.raises(TypeError, match=f"^{strategy}: the GradScaler UsersShardedScaler subclasses torch's "
                                        "ShardedGradScaler"):
        make().precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=users("cpu"))


def _stage2_optimizer():
    """A ZeroRedundancyOptimizer of stage 2, as the clip's check sees it (not stepped)."""
    import fusedist

    zero = fusedist.ZeroRedundancyOptimizer.__new__(fusedist.ZeroRedundancyOptimizer)
    zero.__dict__["stage"] = 2
    return zero


@pytest.mark.parametrize("strategy", ["FusedistStrategy", "FusedistModelParallelStrategy"])
def test_precision_refusals_name_the_strategy_in_use(strategy):
    from lightning.pytorch.plugins.precision import FSDPPrecision, Precision

    from fusedist.integrations import lightning

    make = getattr(lightning, strategy)
    with pytest.raises(ValueError, match=f"^{strategy}: the precision plugin FSDPPrecision is not supported"):
        make().precision_plugin = FSDPPrecision("32-true")
    for plugin in (Precision(), type("UsersPrecision", (Precision,), {})()):
        instance = make()
        instance.precision_plugin = plugin
        with pytest.raises(ValueError, match=f"^{strategy}: gradient_clip_algorithm='value' cannot be applied"):
            instance.precision_plugin.clip_grad_by_value(_stage2_optimizer(), random.uniform(0.1, 1.0))


def test_a_disabled_scaler_is_taken_as_lightnings_ddp_takes_it():
    """``GradScaler(enabled=False)`` (the ``enabled=use_amp`` idiom) keeps no settings, and the
    strategy failed reading them ("no attribute '_init_scale'"); Lightning's DDP steps unscaled."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    import fusedist
    from fusedist.integrations.lightning import FusedistStrategy

    strategy = FusedistStrategy(zero_stage=random.choice([0, 1, 2]))
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False))
    scaler = strategy.precision_plugin.scaler
    assert isinstance(scaler, fusedist.amp.GradScaler) and not scaler.is_enabled()
    loss = torch.randn(())
    assert scaler.scale(loss) is loss and scaler.state_dict() == {}
