"""FusedistStrategy as a drop-in for ``strategy="ddp"`` in what users write around it: the
strategy named by string, the keys LearningRateMonitor logs, and recipes beyond the basic
loop (composite LR schedulers, several optimizers, unused branches, weight averaging,
predict, mid-epoch resumes), each against Lightning's own ``strategy="ddp"`` run.

Ranks are processes of :func:`fusedist.testing.run_distributed` with the torchelastic
variables set (test_e2e_lightning_recipe.py): every Trainer of this file runs in the launch
shared with the other Lightning and Fabric files (test_lightning_launch.py), since starting
ranks that import Lightning costs more than a fit.

Tolerances, by dtype. fp32: fused kernels and the bucketed all-reduce against torch's foreach
ops and all-reduce are the same operations in another order, an ulp or two per step on values
of order 1, compounded over <= 24 steps: 1e-5. bf16 / fp16 autocast: both sides run the same
autocast matmuls on the same inputs, but a differently rounded fp32 weight can land a matmul
output on the neighbouring half-precision value (2^-8 / 2^-11 relative): 1e-3, as in
test_e2e_lightning_recipe.py. The failures these tests exist for move the weights by 1e-2 or
more (a learning rate that stops following its schedule, a missed step). Learning rates are
Python floats computed by the same scheduler code: compared exactly.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _data, _flat, _launched_env
from test_lightning_launch import register, shared_launch

TOL = {"32-true": 1e-5, "bf16-mixed": 1e-3, "16-mixed": 1e-3}


def _module_class():
    import lightning as L

    class Drop(L.LightningModule):
        """A regressor with a side branch; ``opts`` picks the variations a recipe needs."""

        def __init__(self, opts: dict):
            super().__init__()
            self.opts = opts
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
            self.branch = nn.Linear(8, 3)
            if opts.get("backbone"):
                self.backbone = self.net  # what BackboneFinetuning freezes, then unfreezes
            self.automatic_optimization = not opts.get("two_optimizers")
            self.returned = None  # the optimizer configure_optimizers returned, as a user keeps it

        def forward(self, x, batch_idx=0):
            # "unused" (find_unused_parameters): the branch takes part in even batches only, or
            # ("by data") where the batch says so, on some ranks and not others in one step.
            unused = self.opts.get("unused")
            if (unused == "by data" and x[:, 0].sum() < 0) or (unused is True and batch_idx % 2):
                return self.net(x)
            return self.net(x) + self.branch(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x, batch_idx).float(), y)
            # Each rank's own loss (no sync_dist): compared rank by rank with the reference, it
            # says more than the mean would, without two collectives (Lightning's barrier and
            # all-reduce) per step; the validation metrics below keep sync_dist.
            self.log("train_loss", loss, on_step=True, on_epoch=True)
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
                # Two of one class: LearningRateMonitor numbers them (lr-AdamW, lr-AdamW-1) by type.
                return [torch.optim.AdamW(self.net.parameters(), lr=1e-2),
                        torch.optim.AdamW(self.branch.parameters(), lr=3e-2, weight_decay=0.1)]
            if self.opts.get("backbone"):  # BackboneFinetuning froze self.backbone before this
                return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)
            decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
            rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
            opt = self.returned = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": rest}],
                                                    lr=1e-2)
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


def _fit(strategy, opts=None, callbacks=(), ckpt_dir=None, ckpt_path=None, predict=False, precision="32-true",
         **trainer_kwargs):
    """Train the module (fixed init, data by seed 1) and return what the comparisons read."""
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.plugins.precision import MixedPrecision

    import fusedist.integrations.lightning  # noqa: F401  (registers strategy="fusedist...")

    torch.manual_seed(0)
    module = _module_class()(opts or {})
    logger = _memory_logger()
    callbacks = [LearningRateMonitor(log_momentum=True, log_weight_decay=True), *callbacks]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1, filename="{step}"))
    plugins = None
    if precision == "16-mixed":  # Lightning turns the flag into bf16 on a CPU; the plugin keeps fp16 and its scaler
        plugins = [MixedPrecision("16-mixed", "cpu")]
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=logger, callbacks=callbacks,
                        precision=None if plugins else precision, plugins=plugins,
                        enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, log_every_n_steps=1, deterministic=True,
                        **{"max_epochs": 2, "val_check_interval": 4, **trainer_kwargs})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, _data(1), _data(2, 16), ckpt_path=ckpt_path)
    out = {"weights": _flat(module), "rows": logger.rows, "global_step": trainer.global_step, "precision": precision,
           "strategy": (type(trainer.strategy).__name__, getattr(trainer.strategy, "zero_stage", None)),
           "optimizers": [[c.__name__ for c in type(o).__mro__] for o in trainer.optimizers],
           # torch's warning that a scheduler stepped an optimizer that had not stepped yet
           "scheduler warnings": [str(w.message)[:80] for w in caught if "lr_scheduler.step()" in str(w.message)]}
    if predict:
        out["predictions"] = torch.cat(trainer.predict(module, _data(3, 16)))
    return out


def _same_run(ours: dict, ref: dict, what: str) -> None:
    """Same weights, steps, and logged rows (keys and values) as Lightning's DDP run."""
    tol = TOL[ref["precision"]]
    assert ours["global_step"] == ref["global_step"], what
    assert ours["scheduler warnings"] == ref["scheduler warnings"], what
    diff = (ours["weights"] - ref["weights"]).abs().max().item()
    assert diff <= tol, f"{what}: weights differ by {diff}"
    assert len(ours["rows"]) == len(ref["rows"]), f"{what}: {len(ours['rows'])} logged rows vs {len(ref['rows'])}"
    for (step, mine), (ref_step, theirs) in zip(ours["rows"], ref["rows"]):
        assert step == ref_step and mine.keys() == theirs.keys(), \
            f"{what}: logged\n {step} {sorted(mine)}\nvs\n {ref_step} {sorted(theirs)}"
        for key, value in theirs.items():
            exact = key.startswith("lr-")
            assert (mine[key] == value) if exact else abs(mine[key] - value) <= tol, \
                f"{what}: {key} at step {step}: {mine[key]} vs {value}"
    if "predictions" in ref:
        assert (ours["predictions"] - ref["predictions"]).abs().max().item() <= tol, what


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
        assert (strategy.zero_stage == stage
                and strategy._ddp_kwargs.get("find_unused_parameters", False) == unused), name
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy  # DDPStrategy's names stay Lightning's
    assert type(StrategyRegistry.get("ddp_find_unused_parameters_true")) is DDPStrategy
    # A second registration (a reloaded module) replaces the entries instead of failing.
    FusedistStrategy.register_strategies(StrategyRegistry)


def _names_worker(rank, world):
    _launched_env(rank, world)
    # One epoch: the names and keys show from the first row (epochs turn in the recipes below).
    return {name: _fit(name, max_epochs=1) for name in ("ddp", "fusedist", "fusedist_zero2")}


def _jobs(tmp_path_factory):
    """The three workers' runs, each as it ran in a spawn of its own."""
    return {"test_strategy_by_name_and_lr_monitor_keys_match_ddp": {"names": (_names_worker, ())},
            "test_learning_rates_reach_the_swapped_optimizer": {"schedules": (_schedules_worker, ())},
            "test_recipes_match_ddp": {"recipes": (_recipes_worker, (str(tmp_path_factory.mktemp("drop_in")),))}}


register(_jobs, seconds=720)  # 100-240 s on a loaded 2-core machine


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def test_strategy_by_name_and_lr_monitor_keys_match_ddp(launched):
    """``Trainer(strategy="fusedist")`` / ``"fusedist_zero2"`` train as ``strategy="ddp"``,
    and log the same rows under the same keys: LearningRateMonitor's ``lr-AdamW/pg1`` (with
    momentum and weight decay) and not ``lr-FusedAdamW/pg1`` or
    ``lr-ZeroRedundancyOptimizer/pg1`` for the optimizer the strategy swapped in (Note [the
    optimizer's name]), and the validation metrics logged with ``sync_dist=True``."""
    for rank, runs in enumerate(results_of(launched, "names")):
        ref = runs["ddp"]
        assert "lr-AdamW/pg1" in ref["rows"][0][1] and any("val_loss" in r for _, r in ref["rows"]), ref["rows"][:2]
        for name, stage, implementation in (("fusedist", 0, "FusedAdamW"),
                                            ("fusedist_zero2", 2, "ZeroRedundancyOptimizer")):
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


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, lr=1e-2, fused=False),
                                  lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=False, fused=False)],
                         ids=["AdamW fused=False", "SGD foreach=False fused=False"])
def test_an_optimizer_choosing_torchs_implementation_is_swapped_all_the_same(make):
    """foreach= / fused=False pick among torch's implementations; the swap replaces the
    implementation (fused=False made the fused class refuse, on every rank at setup). The
    swapped optimizer steps as the returned one: fp32, the same formula fused, within 1e-6."""
    from fusedist.integrations.lightning import FusedistStrategy

    theirs = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(2, 3))]
    ours = [nn.Parameter(p.detach().clone()) for p in theirs]
    ref, swapped = make(theirs), FusedistStrategy()._convert_optimizer(make(ours), master_weights=False)
    assert type(swapped).__name__ == type(ref).__name__ and type(swapped) is not type(ref)
    for step in range(3):
        for p, q in zip(theirs, ours):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            q.grad = p.grad.clone()
        ref.step()
        swapped.step()
    for p, q in zip(theirs, ours):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage", [True, 1.0, "1", 3])
def test_zero_stage_is_0_1_or_2_as_an_int(stage):
    from fusedist.integrations.lightning import FusedistStrategy

    with pytest.raises(ValueError, match="zero_stage must be 0, 1 or 2"):
        FusedistStrategy(zero_stage=stage)


# ----------------------------------------------------------------------------- LR schedules
SCHEDULE_CASES = {
    # name: (strategy, module options)
    "SequentialLR warm-up then cosine": ("fusedist", dict(scheduler="warmup_cosine")),
    "ChainedScheduler, ZeRO 1": ("fusedist_zero1", dict(scheduler="chained")),
    "learning rate set through the returned optimizer, ZeRO 2": ("fusedist_zero2",
                                                                 dict(scheduler="none", manual_warmup=True)),
}


def _schedules_worker(rank, world):
    _launched_env(rank, world)
    # One epoch (8 steps) crosses every schedule's turns: the warm-up's end, SequentialLR's
    # milestone (3), StepLR's steps (every 2).
    return {name: (_fit(strategy, opts, max_epochs=1), _fit("ddp", opts, max_epochs=1))
            for name, (strategy, opts) in SCHEDULE_CASES.items()}


def test_learning_rates_reach_the_swapped_optimizer(launched):
    """The learning rate follows a composite scheduler (SequentialLR, ChainedScheduler), and
    one set through the optimizer configure_optimizers returned, as under ``strategy="ddp"``:
    their parts and the module held the returned optimizer, whose param groups the strategy
    had copied, so the optimizer that steps kept its first learning rate (Note [the returned
    optimizer])."""
    for rank, runs in enumerate(results_of(launched, "schedules")):
        for name, (ours, ref) in runs.items():
            lrs = {row["lr-AdamW/pg1"] for _, row in ref["rows"] if "lr-AdamW/pg1" in row}
            assert len(lrs) > 3, (name, lrs)  # the schedule moves
            _same_run(ours, ref, f"{name}, rank {rank}")


# ----------------------------------------------------------------------------- recipes
def _recipes_worker(rank, world, root):
    from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging, WeightAveraging
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    from fusedist.integrations.lightning import FusedistStrategy

    _launched_env(rank, world)
    out = {}

    def side_by_side(name, ours, ref, **kwargs):
        callbacks = kwargs.pop("callbacks", lambda: [])
        out[name] = (_fit(ours, callbacks=callbacks(), **kwargs), _fit(ref, callbacks=callbacks(), **kwargs))

    # One epoch each (8 batches, 2 validation runs): every step exercises what the recipe checks;
    # turns of epochs are in the SWA, BackboneFinetuning and mid-epoch resume runs below.
    # A branch unused on odd batches, with ZeRO 2 and accumulation over an unused and a used
    # batch; one unused by some ranks and used by others in the same step.
    side_by_side("find_unused_parameters, ZeRO 2, accumulate 2",
                 FusedistStrategy(zero_stage=2, find_unused_parameters=True), "ddp_find_unused_parameters_true",
                 opts=dict(unused=True), accumulate_grad_batches=2, max_epochs=1)
    side_by_side("find_unused_parameters by data, ZeRO 1, fp16-mixed, clip",
                 FusedistStrategy(zero_stage=1, find_unused_parameters=True), "ddp_find_unused_parameters_true",
                 opts=dict(unused="by data"), precision="16-mixed", gradient_clip_val=0.3, max_epochs=1)
    side_by_side("two optimizers, manual optimization, fp16-mixed", "fusedist", "ddp",
                 opts=dict(two_optimizers=True), precision="16-mixed", max_epochs=1)
    side_by_side("StochasticWeightAveraging, ZeRO 2, then predict", "fusedist_zero2", "ddp",
                 opts=dict(scheduler="none"),
                 callbacks=lambda: [StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)],
                 max_epochs=3, predict=True)
    side_by_side("EMA (WeightAveraging), ZeRO 1, bf16-mixed, clip by norm", "fusedist_zero1", "ddp",
                 callbacks=lambda: [WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.9))],
                 precision="bf16-mixed", gradient_clip_val=0.3, max_epochs=1)
    try:
        _fit("fusedist_zero2", opts=dict(two_optimizers=True))
    except ValueError as exc:
        out["two optimizers, ZeRO 2"] = str(exc)
    try:  # the unused branch without find_unused_parameters
        _fit("fusedist_zero2", opts=dict(unused=True))
    except RuntimeError as exc:
        out["unused branch, ZeRO 2"] = str(exc)
    # BackboneFinetuning unfreezes the backbone after the first epoch. Lightning's DDP does not
    # reduce parameters that were frozen when torch's DDP wrapped the module, so its ranks drift
    # apart: no reference; every rank must hold the same weights (after the second epoch's 8
    # steps with the backbone trained).
    out["BackboneFinetuning"] = _fit("fusedist", opts=dict(backbone=True, scheduler="none"), max_epochs=2, callbacks=[
        BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5, should_align=False)])["weights"]
    # A mid-epoch checkpoint (step 3 of 4 per epoch) of a ZeRO 2, fp16-mixed run with clipping and
    # accumulation, resumed by fusedist and by Lightning's DDP, against DDP's own resume.
    recipe = dict(precision="16-mixed", accumulate_grad_batches=2, gradient_clip_val=0.5)
    for side, strategy in (("ddp", "ddp"), ("fusedist", "fusedist_zero2")):
        # (stopped at the checkpoint: the steps after it change nothing in it)
        _fit(strategy, ckpt_dir=os.path.join(root, side), max_steps=3, **recipe)
    ref = _fit("ddp", ckpt_path=os.path.join(root, "ddp", "step=3.ckpt"), **recipe)
    for strategy in ("fusedist_zero2", "ddp"):
        out[f"{strategy} resumed mid-epoch from ZeRO 2"] = (
            _fit(strategy, ckpt_path=os.path.join(root, "fusedist", "step=3.ckpt"), **recipe), ref)
    return out


def test_recipes_match_ddp(launched):
    """Recipes beyond the basic loop train as under ``strategy="ddp"``; ZeRO with two
    optimizers is refused by the strategy, naming the setting, instead of by ZeRO advising to
    freeze the other optimizer's parameters; a parameter without a gradient is reported with
    the strategy's setting to change (fusedist DDP's message named its own keyword alone)."""
    results = [dict(r) for r in results_of(launched, "recipes")]  # popped below: a copy
    backbone = [runs.pop("BackboneFinetuning") for runs in results]
    torch.manual_seed(0)
    initial = _module_class()({"backbone": True})
    n = sum(p.numel() for p in initial.backbone.parameters())  # the backbone's come first
    assert (backbone[0][:n] - _flat(initial)[:n]).abs().max() > 1e-2  # it was unfrozen and trained
    assert torch.equal(backbone[0], backbone[1])
    for rank, runs in enumerate(results):
        message = runs.pop("two optimizers, ZeRO 2", "")
        assert "zero_stage=2" in message and "returned 2 optimizers" in message, (rank, message)
        # fusedist DDP's error names the parameters; the strategy adds the setting to change.
        message = runs.pop("unused branch, ZeRO 2", "")
        assert ("branch.weight" in message
                and "FusedistStrategy(zero_stage=2, find_unused_parameters=True)" in message), (rank, message)
        for name, (ours, ref) in runs.items():
            _same_run(ours, ref, f"{name}, rank {rank}")
        first_row = runs["two optimizers, manual optimization, fp16-mixed"][1]["rows"][0][1]
        assert {"lr-AdamW", "lr-AdamW-1"} <= first_row.keys()
        assert runs["StochasticWeightAveraging, ZeRO 2, then predict"][0]["predictions"].shape == (8, 3)
