"""FusedistStrategy with a user's subclass of one of Lightning's precision plugins, against
Lightning's ``strategy="ddp"`` with the same plugin (Note [a subclass of a Lightning plugin]).

A subclass (an override of ``optimizer_step`` around Lightning's, here counting the steps) was
refused as "not supported". It now keeps its overrides, steps through fusedist's GradScaler
(ZeRO-2 keeps no ``p.grad`` for torch's), clips through fusedist's clip, and files its scaler
state under its own class name, as Lightning files it.

Tolerance 1e-3: fp16 autocast with a loss scale, the same operations in another order over
the steps of two epochs (the drop-in tests' bound for "16-mixed").
"""

from __future__ import annotations

import os

import pytest
import torch

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _data, _flat, _launched_env
from test_lightning_launch import register, shared_launch
from test_lightning_teardown_adagrad_and_lbfgs import _module

TOL = 1e-3


def _counting_plugin(steps: list):
    from lightning.pytorch.plugins.precision import MixedPrecision

    class CountingMixed(MixedPrecision):
        """A user's plugin: Lightning's fp16 autocast, counting optimizer steps."""

        def optimizer_step(self, optimizer, model, closure, **kwargs):
            steps.append(optimizer)
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)

    return CountingMixed("16-mixed", "cpu")


def _fit(strategy, path):
    import lightning as L

    import fusedist.integrations.lightning  # noqa: F401  (registers strategy="fusedist...")

    steps = []
    plugin = _counting_plugin(steps)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, logger=False,
                        plugins=[plugin], gradient_clip_val=0.3, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    module = _module("adamw")
    trainer.fit(module, _data(1))
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    return {"weights": _flat(module), "steps": len(steps), "global_step": trainer.global_step,
            "plugin class": type(trainer.strategy.precision_plugin).__name__,
            "state keys": sorted(k for k in saved if "Mixed" in k),
            "scales": [saved[k].get("scale") for k in saved if "Mixed" in k]}


def _worker(rank, world, tmp):
    _launched_env(rank, world)
    ref = _fit("ddp", os.path.join(tmp, "ddp.ckpt"))
    ours = _fit("fusedist_zero2", os.path.join(tmp, "zero2.ckpt"))
    return ref, ours


def _jobs(tmp_path_factory):
    """The subclass's runs, in the launch shared with the other Lightning and Fabric files
    (test_lightning_launch.py)."""
    return {"test_a_subclass_of_mixed_precision_trains_as_under_lightnings_ddp": {
        "subclass": (_worker, (str(tmp_path_factory.mktemp("precision_subclass")),))}}


register(_jobs, seconds=180)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def test_a_subclass_of_mixed_precision_trains_as_under_lightnings_ddp(launched):
    for rank, (ref, ours) in enumerate(results_of(launched, "subclass")):
        diff = (ours["weights"] - ref["weights"]).abs().max().item()
        assert diff <= TOL, f"rank {rank}: weights differ by {diff}"
        counts = (ours["steps"], ref["steps"], ours["global_step"], ref["global_step"])
        assert len(set(counts)) == 1 and counts[0] > 0, f"rank {rank}: steps counted, global steps: {counts}"
        assert ours["plugin class"] == ref["plugin class"] == "CountingMixed"
        assert ours["state keys"] == ref["state keys"], (ours["state keys"], ref["state keys"])
        assert [key.rsplit(".", 1)[-1] for key in ref["state keys"]] == ["CountingMixed"], ref["state keys"]
        assert ours["scales"] == ref["scales"] and None not in ref["scales"], (ours["scales"], ref["scales"])


def test_lightnings_other_plugins_are_still_refused():
    """FSDP's plugin (like bitsandbytes', Transformer Engine's) converts or steps through an
    engine this strategy does not run: refused naming it and what is accepted."""
    from lightning.pytorch.plugins.precision import FSDPPrecision

    from fusedist.integrations.lightning import FusedistStrategy

    with pytest.raises(ValueError, match="FSDPPrecision is not supported.*subclass of Lightning's Precision"):
        FusedistStrategy().precision_plugin = FSDPPrecision("32-true")
