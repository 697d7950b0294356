"""FusedistFabricStrategy with a scaler the user gave Fabric's fp16 plugin, against Fabric's own
``strategy="ddp"`` (two gloo ranks): a subclass of torch's GradScaler keeps its overrides
(the strategy used to replace it by a plain fusedist scaler, dropping them without a word); a
disabled one (``GradScaler(enabled=False)``) trains unscaled, where the conversion read the
settings a disabled scaler does not keep and failed; a scaler of another kind is refused by
name. Tolerance: fp16 autocast, 1e-3 (test_fabric_strategy.py); a skipped or unscaled step
moves the weights by 1e-2 or more.

A loop that unscales through the optimizer it built and kept (``fabric.clip_gradients(model,
kept, max_norm)``, which the strategy handed over to its fused optimizer) and steps through Fabric's
wrapper (``optimizer.step()``) unscales once, as under ``strategy="ddp"``, where both names lead to
one optimizer: the scaler keeps one record per stepped optimizer (Note [one scaler state per stepped
optimizer] in fusedist/optim/_scaler_protocol.py). Each name had its own record, so the step unscaled
the gradients a second time (SGD's updates ``scale`` times too small: 3.3e-2 apart after six steps).
Tolerance 1e-6: with a max_norm that never clips (1e9) both sides run SGD with momentum on the same
averaged gradients; the fused step unscales inside its kernel where torch's scaler unscales ``p.grad``
first, a rounding apart (3e-8 after six steps, with or without the clip call).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_lightning_launch import register, shared_launch


class _RecordingScaler(torch.amp.GradScaler):
    """Records the scale after every update and caps its growth: overrides a user might write."""

    def update(self, new_scale=None):
        super().update(new_scale)
        if self.get_scale() > 2.0 ** 9:
            super().update(2.0 ** 9)
        self.seen = getattr(self, "seen", []) + [self.get_scale()]


def _fit(side: str, scaler):
    import lightning as L
    from lightning.fabric.plugins.precision import MixedPrecision

    if side == "ddp":
        strategy = "ddp"
    else:
        from fusedist.integrations.fabric import FusedistFabricStrategy

        strategy = FusedistFabricStrategy()
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                      plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + fabric.global_rank)
        x = torch.randn(4, 8, generator=g)
        fabric.backward(nn.functional.mse_loss(model(x).float(), torch.sin(2 * x[:, :3])))
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _fit_clipping_the_kept_optimizer(side: str):
    """Six fp16 steps of SGD with momentum: clip through the optimizer the program built and kept,
    step through Fabric's wrapper of it."""
    import lightning as L
    from lightning.fabric.plugins.precision import MixedPrecision

    if side == "ddp":
        strategy = "ddp"
    else:
        from fusedist.integrations.fabric import FusedistFabricStrategy

        strategy = FusedistFabricStrategy()
    # (fp16 with its GradScaler on the CPU: Fabric's precision="16-mixed" would take bf16 there)
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                      plugins=[MixedPrecision("16-mixed", "cpu")])
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    kept = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, kept)
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + fabric.global_rank)
        x = torch.randn(4, 8, generator=g)
        fabric.backward(nn.functional.mse_loss(model(x).float(), torch.sin(2 * x[:, :3])))
        fabric.clip_gradients(model, kept, max_norm=1e9)
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _clip_kept(rank: int, world: int):
    _launched_env(rank, world)
    ours, ddp = (_fit_clipping_the_kept_optimizer(side) for side in ("fusedist", "ddp"))
    return float((ours - ddp).abs().max())


def _worker(rank: int, world: int):
    _launched_env(rank, world)
    out = {}
    for kind in ("subclass", "disabled"):
        runs = []
        for side in ("fusedist", "ddp"):
            scaler = (_RecordingScaler("cpu", init_scale=2.0 ** 8, growth_interval=2) if kind == "subclass"
                      else torch.amp.GradScaler("cpu", enabled=False))
            runs.append((_fit(side, scaler), getattr(scaler, "seen", None)))
        (ours, our_seen), (ddp, ddp_seen) = runs
        out[kind] = (float((ours - ddp).abs().max()), our_seen, ddp_seen)
    return out


SCENARIOS = {
    "test_scaler_subclass_and_disabled_scaler_train_as_under_fabric_ddp": {"subclass and disabled": (_worker, ())},
    "test_clip_through_the_kept_optimizer_and_step_through_the_wrapper_as_under_fabric_ddp": {
        "clip the kept optimizer": (_clip_kept, ())},
}


def _jobs(tmp_path_factory):
    """The scenarios, in the launch shared with the other Lightning and Fabric files
    (test_lightning_launch.py)."""
    return SCENARIOS


register(_jobs, seconds=300)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def test_scaler_subclass_and_disabled_scaler_train_as_under_fabric_ddp(launched):
    for rank_out in results_of(launched, "subclass and disabled"):
        err, ours, ddp = rank_out["subclass"]
        assert ddp and ours == ddp, (ours, ddp)  # the override ran, on the user's object, as under ddp
        assert err <= 1e-3, err
        err, _, _ = rank_out["disabled"]
        assert err <= 1e-3, err


def test_clip_through_the_kept_optimizer_and_step_through_the_wrapper_as_under_fabric_ddp(launched):
    for err in results_of(launched, "clip the kept optimizer"):
        assert err <= 1e-6, err


def test_a_scaler_of_another_kind_is_refused_by_name():
    from lightning.fabric.plugins.precision import MixedPrecision

    from fusedist.integrations.fabric import FusedistFabricStrategy

    class NotAScaler:
        pass

    refusal = "FusedistFabricStrategy: MixedPrecision.*NotAScaler.*not a torch.amp.GradScaler"
    with pytest.raises(TypeError, match=refusal):
        FusedistFabricStrategy().precision = MixedPrecision("16-mixed", "cpu", scaler=NotAScaler())
