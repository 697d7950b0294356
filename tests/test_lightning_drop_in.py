"""FusedistStrategy as a drop-in for ``strategy="ddp"`` in what users write around it: the
strategy named by string, the keys LearningRateMonitor logs, and recipes beyond the basic
loop (composite LR schedulers, several optimizers, unused branches, weight averaging,
predict, mid-epoch resumes), each against Lightning's own ``strategy="ddp"`` run.

Ranks are processes of :func:`fusedist.testing.run_distributed` with the torchelastic
variables set (test_e2e_lightning_recipe.py), several Trainers per spawn to keep it fast.

Tolerance, fp32 throughout: fused kernels and the bucketed all-reduce against torch's foreach
ops and all-reduce are the same operations in another order, an ulp or two per step on values
of order 1, compounded over <= 24 steps: 1e-5. The failures these tests exist for move the
weights by 1e-3 or more (a learning rate that stops following its schedule, a missed step).
Learning rates are Python floats computed by the same scheduler code: compared exactly.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed
from test_e2e_lightning_recipe import _data, _flat, _launched_env

TOL = 1e-5


def _module_class():
    import lightning as L

    class Drop(L.LightningModule):
        """A regressor with a side branch; ``opts`` picks the variations a recipe needs."""

        def __init__(self, opts: dict):
            super().__init__()
            self.opts = opts
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
            self.branch = nn.Linear(8, 3)
            self.automatic_optimization = not opts.get("two_optimizers")
            self.returned = None  # the optimizer configure_optimizers returned, as a user keeps it

        def forward(self, x, batch_idx=0):
            # "unused": the branch takes part in even batches only (find_unused_parameters).
            if self.opts.get("unused") and batch_idx % 2:
                return self.net(x)
            return self.net(x) + self.branch(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x, batch_idx).float(), y)
            self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
            if self.opts.get("two_optimizers"):  # a GAN-style loop: the second steps every other batch
                net_opt, branch_opt = self.optimizers()
                self.manual_backward(loss)
                net_opt.step()
                net_opt.zero_grad()
                if batch_idx % 2:
                    branch_opt.step()
                    branch_opt.zero_grad()
                return None
            return loss

        def on_train_batch_start(self, batch, batch_idx):
            if self.opts.get("manual_warmup"):  # warm-up written against the returned optimizer
                for group in self.returned.param_groups:
                    group["lr"] = 1e-2 * min(1.0, (self.global_step + 1) / 6)

        def validation_step(self, batch, _):
            x, y = batch
            out = self(x).float()
            self.log("val_loss", nn.functional.mse_loss(out, y), sync_dist=True)
            self.log("val_max", (out - y).abs().max(), sync_dist=True, reduce_fx="max")

        def predict_step(self, batch, _):
            return self(batch[0])

        def configure_optimizers(self):
            S = torch.optim.lr_scheduler
            if self.opts.get("two_optimizers"):
                return [torch.optim.AdamW(self.net.parameters(), lr=1e-2),
                        torch.optim.SGD(self.branch.parameters(), lr=0.05, momentum=0.9)]
            decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
            rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
            opt = self.returned = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": rest}], lr=1e-2)
            kind = self.opts.get("scheduler", "lambda")
            if kind == "none":
                return opt
            if kind == "warmup_cosine":  # the usual warm-up then decay, as one SequentialLR
                sched = S.SequentialLR(opt, [S.LinearLR(opt, 0.1, 1.0, total_iters=3), S.CosineAnnealingLR(opt, 12)],
                                       milestones=[3])
            elif kind == "chained":
                sched = S.ChainedScheduler([S.ExponentialLR(opt, 0.9), S.StepLR(opt, 2, 0.5)])
            else:
                sched = S.LambdaLR(opt, lambda s: 1.0 / (1 + 0.5 * s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Drop


def _memory_logger():
    from lightning.pytorch.loggers.logger import Logger

    class Memory(Logger):
        """Every row a logger receives, as dashboards would store it."""

        name, version = "memory", 0

        def __init__(self):
            super().__init__()
            self.rows = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

        def log_hyperparams(self, *args, **kwargs):
            pass

    return Memory()


def _fit(strategy, opts=None, callbacks=(), ckpt_dir=None, ckpt_path=None, predict=False, **trainer_kwargs):
    """Train the module (fixed init, data by seed 1) and return what the comparisons read."""
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    import fusedist.integrations.lightning  # noqa: F401  (registers strategy="fusedist...")

    torch.manual_seed(0)
    module = _module_class()(opts or {})
    logger = _memory_logger()
    callbacks = [LearningRateMonitor(log_momentum=True, log_weight_decay=True), *callbacks]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1, filename="{step}"))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=logger, callbacks=callbacks,
                        enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, log_every_n_steps=1, deterministic=True,
                        **{"max_epochs": 2, "val_check_interval": 4, **trainer_kwargs})
    trainer.fit(module, _data(1), _data(2, 16), ckpt_path=ckpt_path)
    out = {"weights": _flat(module), "rows": logger.rows, "global_step": trainer.global_step,
           "strategy": (type(trainer.strategy).__name__, getattr(trainer.strategy, "zero_stage", None)),
           "optimizers": [[c.__name__ for c in type(o).__mro__] for o in trainer.optimizers]}
    if predict:
        out["predictions"] = torch.cat(trainer.predict(module, _data(3, 16)))
    return out


def _same_run(ours: dict, ref: dict, what: str) -> None:
    """Same weights, steps, and logged rows (keys and values) as Lightning's DDP run."""
    assert ours["global_step"] == ref["global_step"], what
    diff = (ours["weights"] - ref["weights"]).abs().max().item()
    assert diff <= TOL, f"{what}: weights differ by {diff}"
    assert len(ours["rows"]) == len(ref["rows"]), f"{what}: {len(ours['rows'])} logged rows vs {len(ref['rows'])}"
    for (step, mine), (ref_step, theirs) in zip(ours["rows"], ref["rows"]):
        assert step == ref_step and mine.keys() == theirs.keys(), f"{what}: logged\n {step} {sorted(mine)}\nvs\n {ref_step} {sorted(theirs)}"
        for key, value in theirs.items():
            exact = key.startswith("lr-")
            assert (mine[key] == value) if exact else abs(mine[key] - value) <= TOL, \
                f"{what}: {key} at step {step}: {mine[key]} vs {value}"
    if "predictions" in ref:
        assert (ours["predictions"] - ref["predictions"]).abs().max().item() <= TOL, what


# ----------------------------------------------------------------------------- strategy names
def test_strategy_names_are_registered():
    """Lightning resolves strategy strings in its StrategyRegistry; importing the integration
    registers the strategy's names there (Note [strategy names]) and leaves Lightning's own."""
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    from fusedist.integrations.lightning import FusedistStrategy

    expected = {"fusedist": (0, False), "fusedist_zero1": (1, False), "fusedist_zero2": (2, False),
                "fusedist_find_unused_parameters_true": (0, True)}
    for name, (stage, unused) in expected.items():
        strategy = StrategyRegistry.get(name)
        assert type(strategy) is FusedistStrategy, name
        assert strategy.zero_stage == stage and strategy._ddp_kwargs.get("find_unused_parameters", False) == unused, name
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy  # DDPStrategy's names stay Lightning's
    assert type(StrategyRegistry.get("ddp_find_unused_parameters_true")) is DDPStrategy
    # A second registration (a reloaded module) replaces the entries instead of failing.
    FusedistStrategy.register_strategies(StrategyRegistry)


def _names_worker(rank, world):
    _launched_env(rank, world)
    return {name: _fit(name) for name in ("ddp", "fusedist", "fusedist_zero2")}


def test_strategy_by_name_and_lr_monitor_keys_match_ddp():
    """``Trainer(strategy="fusedist")`` / ``"fusedist_zero2"`` train as ``strategy="ddp"``,
    and log the same rows under the same keys: LearningRateMonitor's ``lr-AdamW/pg1`` (with
    momentum and weight decay) and not ``lr-FusedAdamW/pg1`` or
    ``lr-ZeroRedundancyOptimizer/pg1`` for the optimizer the strategy swapped in (Note [the
    optimizer's name]), and the validation metrics logged with ``sync_dist=True``."""
    for rank, runs in enumerate(run_distributed(_names_worker, 2, timeout=180)):
        ref = runs["ddp"]
        assert "lr-AdamW/pg1" in ref["rows"][0][1] and any("val_loss" in r for _, r in ref["rows"]), ref["rows"][:2]
        for name, stage, implementation in (("fusedist", 0, "FusedAdamW"), ("fusedist_zero2", 2, "ZeroRedundancyOptimizer")):
            what = f"strategy={name!r}, rank {rank}"
            assert runs[name]["strategy"] == ("FusedistStrategy", stage), what
            assert runs[name]["optimizers"][0][:2] == ["AdamW", implementation], what
            _same_run(runs[name], ref, what)


def test_swapped_optimizer_pickles():
    """The optimizer named as the returned class (Note [the optimizer's name]) pickles like
    the fused one: torch.save of the optimizer object used to fail on the made-up class."""
    import io

    from fusedist.integrations.lightning import FusedistStrategy
    from fusedist.optim import FusedAdamW

    params = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(2, 3))]
    swapped = FusedistStrategy()._convert_optimizer(torch.optim.AdamW(params, lr=1e-2), master_weights=False)
    for p in params:
        p.grad = torch.ones_like(p)
    swapped.step()
    buffer = io.BytesIO()
    torch.save(swapped, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is type(swapped) and isinstance(loaded, FusedAdamW) and type(loaded).__name__ == "AdamW"
    assert torch.equal(loaded.state_dict()["state"][1]["exp_avg"], swapped.state_dict()["state"][1]["exp_avg"])
