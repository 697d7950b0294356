"""FusedistStrategy and optimizer states the LightningModule handles itself -- loaded through
the LightningOptimizer that ``self.optimizers()`` returns or through the optimizer that
``configure_optimizers`` returned and the module kept -- and learning rates written through
that kept optimizer after a resume, against Lightning's ``strategy="ddp"``.

Ranks are processes of :func:`fusedist.testing.run_distributed` with the torchelastic
variables set (test_e2e_lightning_recipe.py). Tolerance as in test_lightning_drop_in.py: fp32,
fused kernels against torch's foreach AdamW over a few steps, 1e-5; a load that is dropped
trains from a fresh state and moves the weights by ~1e-1. Learning rates are Python floats
computed by the same code: compared exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed
from shared_rank_launch import results_of
from test_e2e_lightning_recipe import IN, OUT, _data, _flat, _launched_env
from test_lightning_launch import register, shared_launch


def _saved_state(params) -> dict:
    """A torch AdamW state dict after three steps on random gradients, at another learning rate."""
    opt = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in params], lr=0.05, weight_decay=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt.state_dict()


def _module(opts: dict):
    import lightning as L

    class Keeps(L.LightningModule):
        """Keeps the optimizer it returns (``self.opt``); ``opts["load"]`` names what it loads a
        saved state through at the start of training, ``opts["warmup"]`` writes a learning rate
        through ``self.opt`` before each batch."""

        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))
            self.saved = _saved_state(list(self.parameters()))
            self.seen = {"lrs": []}

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            self.opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            if opts.get("own_scheduler") == "before setup":  # on the returned optimizer, stepped by the module
                self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 1, 0.5)
            return self.opt

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if opts.get("own_scheduler"):
                self.sched.step()

        def on_train_start(self):
            if opts.get("own_scheduler") == "after setup":  # on the returned optimizer, once swapped
                self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 1, 0.5)
            stepping = self.trainer.strategy.optimizers[0]
            through = {"stepping": stepping, "self.optimizers()": self.optimizers(), "kept": self.opt}
            if "load" in opts:
                through[opts["load"]].load_state_dict(self.saved)
                self.opt.param_groups[0]["lr"] = 0.02  # after the load: still the stepping optimizer's

        def on_train_batch_start(self, batch, batch_idx):
            if opts.get("scheduler first") and batch_idx == 0:  # before any optimizer step: torch warns
                self.sched.step()
            if opts.get("warmup"):
                for group in self.opt.param_groups:
                    group["lr"] = 1e-2 * min(1.0, (self.global_step + 1) / 6)
            self.seen["lrs"].append(self.trainer.strategy.optimizers[0].param_groups[0]["lr"])

        def on_train_end(self):
            self.seen["kept state"] = len(self.opt.state_dict()["state"])
            self.seen["wrapper lr"] = self.optimizers().param_groups[0]["lr"]

    return Keeps()


def _fit(strategy, opts, max_steps=3, ckpt_path=None, save=None):
    import lightning as L

    torch.manual_seed(0)
    module = _module(opts)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, _data(1), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)
    return _flat(module), module.seen


def _loading_worker(rank: int, world: int) -> dict:
    _launched_env(rank, world)
    from fusedist.integrations.lightning import FusedistStrategy

    # Lightning's DDP drops a load through its wrapper (the wrapper keeps what torch's loader
    # assigns); the reference loads into the optimizer that steps. (zero_stage=1/2 took a load
    # through the wrapper already: ZeRO keeps its state where wrappers share it.)
    return {"ddp": _fit("ddp", {"load": "stepping"}),
            "through self.optimizers()": _fit(FusedistStrategy(), {"load": "self.optimizers()"}),
            "through the kept optimizer": _fit(FusedistStrategy(), {"load": "kept"})}


def test_a_state_loaded_by_the_module_reaches_the_optimizer_that_steps(launched):
    """A state loaded through ``self.optimizers()`` or through the optimizer the module returned
    and kept is the swapped optimizer's, as it is Lightning's DDP optimizer's; the kept one's
    ``state_dict()`` is the stepping one's, and a learning rate set through it after the load
    still reaches it. (The fused optimizer stepped from a fresh state: the load landed on the
    wrapper, or on the kept optimizer, which then no longer shared the swapped one's groups.)"""
    for rank, runs in enumerate(results_of(launched, "loading")):
        runs = dict(runs)  # popped below: a copy
        ref_weights, ref_seen = runs.pop("ddp")
        assert ref_seen["lrs"] == [0.02] * 3 and ref_seen["kept state"] == 4, (rank, ref_seen)
        for name, (weights, seen) in runs.items():
            assert seen == ref_seen, (rank, name, seen, ref_seen)
            diff = (weights - ref_weights).abs().max().item()
            assert diff <= 1e-5, f"{name}, rank {rank}: weights differ by {diff}"


def _kept_scheduler_worker(rank: int, world: int) -> dict:
    import warnings

    _launched_env(rank, world)
    from fusedist.integrations.lightning import FusedistStrategy

    out = {}
    for built, first in (("before setup", False), ("after setup", False), ("after setup", True)):
        for name, strategy in (("ddp", "ddp"), ("fusedist", FusedistStrategy())):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                weights, seen = _fit(strategy, {"own_scheduler": built, "scheduler first": first})
            seen["warnings"] = [str(w.message)[:60] for w in caught if "lr_scheduler" in str(w.message)]
            out[built, first, name] = (weights, seen)
    return out


def test_a_scheduler_the_module_keeps_warns_and_schedules_as_under_ddp(launched):
    """An LR scheduler the module builds on the optimizer it returns -- in configure_optimizers
    or after the swap, in on_train_start -- and steps itself, drives the optimizer that steps,
    as under ``strategy="ddp"``, without torch's warning that it stepped "before
    optimizer.step()": torch read the flag of the returned optimizer, which the swap kept from
    stepping (Note [a scheduler built on the returned optimizer]). Stepped before the first
    optimizer step, it warns, as under ``strategy="ddp"``."""
    first_warning = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"[:60]  # as recorded
    for rank, runs in enumerate(results_of(launched, "kept scheduler")):
        for built, first in (("before setup", False), ("after setup", False), ("after setup", True)):
            ref_weights, ref_seen = runs[built, first, "ddp"]
            lrs = [5e-3, 2.5e-3, 1.25e-3] if first else [1e-2, 5e-3, 2.5e-3]
            assert ref_seen["lrs"] == lrs and ref_seen["warnings"] == ([first_warning] if first else []), \
                (rank, built, first, ref_seen)
            weights, seen = runs[built, first, "fusedist"]
            assert seen == ref_seen, (rank, built, first, seen, ref_seen)
            diff = (weights - ref_weights).abs().max().item()
            assert diff <= 1e-5, f"{built}, {first}, rank {rank}: weights differ by {diff}"


def _resume_worker(rank: int, world: int, path: str) -> list:
    _launched_env(rank, world)
    from fusedist.integrations.lightning import FusedistStrategy

    _fit(FusedistStrategy(), {"warmup": True}, max_steps=2, save=path)
    return _fit(FusedistStrategy(), {"warmup": True}, max_steps=5, ckpt_path=path)[1]["lrs"]


def test_learning_rates_set_through_the_kept_optimizer_reach_it_after_a_resume(launched):
    """A warm-up written against the optimizer ``configure_optimizers`` returned sets the
    learning rate of the optimizer that steps after ``trainer.fit(ckpt_path=...)`` too, as under
    ``strategy="ddp"``, where they are one optimizer. (The resume's load replaced the swapped
    optimizer's groups, and the learning rate stayed at the checkpoint's.)"""
    for rank, lrs in enumerate(results_of(launched, "resume")):
        assert lrs == [1e-2 * min(1.0, (step + 1) / 6) for step in (2, 3, 4)], (rank, lrs)


def _jobs(tmp_path_factory):
    """The three 2-rank tests' workers, in the launch shared with the other Lightning and Fabric
    files (test_lightning_launch.py)."""
    path = str(tmp_path_factory.mktemp("kept") / "step2.ckpt")
    jobs = {"test_a_state_loaded_by_the_module_reaches_the_optimizer_that_steps": {"loading": (_loading_worker, ())},
            "test_a_scheduler_the_module_keeps_warns_and_schedules_as_under_ddp": {
                "kept scheduler": (_kept_scheduler_worker, ())},
            "test_learning_rates_set_through_the_kept_optimizer_reach_it_after_a_resume": {
                "resume": (_resume_worker, (path,))}}
    return jobs


register(_jobs, seconds=200)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def _finetuning_worker(rank: int, world: int, path: str) -> dict:
    _launched_env(rank, world)
    import lightning as L
    from lightning.pytorch.callbacks import BackboneFinetuning

    from fusedist.integrations.lightning import FusedistStrategy

    class Finetuned(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(IN, 16), nn.Tanh())
            self.head = nn.Linear(16, OUT)

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.head(self.backbone(x)), y)

        def configure_optimizers(self):  # BackboneFinetuning froze the backbone before this
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def fit(strategy, epochs, ckpt_path=None, save=None):
        torch.manual_seed(0)
        module = Finetuned()
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=epochs, logger=False,
                            callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1, should_align=False)],
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, _data(1), ckpt_path=ckpt_path)
        if save:
            trainer.save_checkpoint(save)
        return _flat(module)

    fit("ddp", 2, save=path)  # the backbone was unfrozen, its group added, at the second epoch
    return {"ddp": fit("ddp", 3, ckpt_path=path), "ZeRO 2": fit(FusedistStrategy(zero_stage=2), 3, ckpt_path=path)}


def test_zero_resumes_the_param_groups_a_finetuning_callback_added(tmp_path):
    """BackboneFinetuning rebuilds the param groups it added by assigning ``param_groups``
    before the resume loads the optimizer state; a ZeRO optimizer resumes with them as
    Lightning's DDP does (the load failed: the state of parameters it did not hold). One rank:
    Lightning's DDP does not reduce parameters unfrozen after it wrapped the module, so with
    more its ranks drift apart."""
    runs = run_distributed(_finetuning_worker, 1, str(tmp_path / "epoch1.ckpt"), timeout=120)[0]
    assert (runs["ZeRO 2"] - runs["ddp"]).abs().max().item() <= 1e-5
