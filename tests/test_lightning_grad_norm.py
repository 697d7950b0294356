"""Gradient-norm logging (``self.log_dict(grad_norm(self, norm_type))`` in
``on_before_optimizer_step``) under FusedistStrategy, against the rows Lightning's
``strategy="ddp"`` logs with Lightning's own ``grad_norm`` on the same module, data and seed.

ZeRO stage 2 keeps no ``p.grad``, so Lightning's helper logged nothing there;
``fusedist.integrations.lightning.grad_norm`` combines the shards' norms across the ranks
(Note [gradient norms under ZeRO stage 2]). Tolerances as in test_lightning_drop_in.py: the
same math in another order, 1e-5 in fp32 and 1e-3 under fp16 autocast (norms of order 1).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _data, _launched_env
from test_lightning_drop_in import _memory_logger
from test_lightning_launch import register, shared_launch

TOL = {"32-true": 1e-5, "16-mixed": 1e-3}


def _module(norm_types, use_fusedist, unused):
    import lightning as L
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    from fusedist.integrations.lightning import grad_norm as fusedist_grad_norm

    grad_norm = fusedist_grad_norm if use_fusedist else lightning_grad_norm

    class Logged(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
            self.branch = nn.Linear(8, 3)  # unused on odd batches when ``unused``

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x) if unused and batch_idx % 2 else self.net(x) + self.branch(x)
            return nn.functional.mse_loss(out.float(), y)

        def on_before_optimizer_step(self, optimizer):
            for norm_type in norm_types:
                self.log_dict(grad_norm(self, norm_type=norm_type))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Logged()


def _fit(strategy, *, norm_types=(2,), use_fusedist=True, unused=False, precision="32-true", **trainer_kwargs):
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    torch.manual_seed(0)
    module = _module(norm_types, use_fusedist, unused)
    logger = _memory_logger()
    plugins = [MixedPrecision("16-mixed", "cpu")] if precision == "16-mixed" else None
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=logger, max_epochs=1,
                        precision=None if plugins else precision, plugins=plugins, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        deterministic=True, **trainer_kwargs)
    trainer.fit(module, _data(1))
    return {"rows": logger.rows, "precision": precision}


CASES = {
    # name: (fusedist strategy, Lightning's strategy, options)
    "ZeRO 2, norms 2 and inf": ("fusedist_zero2", "ddp", dict(norm_types=(2, "inf"))),
    "ZeRO 2, a branch unused on odd batches": (dict(zero_stage=2, find_unused_parameters=True),
                                               "ddp_find_unused_parameters_true", dict(unused=True)),
    "ZeRO 2, fp16-mixed (shards still scaled)": ("fusedist_zero2", "ddp", dict(precision="16-mixed")),
    "ZeRO 2, accumulate 2, clip": ("fusedist_zero2", "ddp", dict(accumulate_grad_batches=2, gradient_clip_val=0.3)),
    # (norms 2 and inf, as the first case: the two share Lightning's reference run)
    "ZeRO 1, norms 2 and inf": ("fusedist_zero1", "ddp", dict(norm_types=(2, "inf"))),
    "fused optimizer, fp16-mixed, Lightning's grad_norm": ("fusedist", "ddp",
                                                           dict(use_fusedist=False, precision="16-mixed")),
    "ZeRO 1, fp16-mixed": ("fusedist_zero1", "ddp", dict(precision="16-mixed")),
}


def _worker(rank, world):
    from fusedist.integrations.lightning import FusedistStrategy

    _launched_env(rank, world)
    out, references = {}, {}
    for name, (ours, theirs, options) in CASES.items():
        strategy = FusedistStrategy(**ours) if isinstance(ours, dict) else ours
        reference = {k: v for k, v in options.items() if k != "use_fusedist"}
        # Cases that share a reference run (fp16-mixed under "ddp") fit it once: seeded and
        # deterministic, a second fit would log the same rows.
        key = (theirs, tuple(sorted(reference.items())))
        if key not in references:
            references[key] = _fit(theirs, use_fusedist=False, **reference)
        out[name] = (_fit(strategy, **options), references[key])
    return out


def _jobs(tmp_path_factory):
    """The grad-norm runs, in the launch shared with the other Lightning and Fabric files
    (test_lightning_launch.py)."""
    return {"test_grad_norm_logging_matches_ddp": {"grad norms": (_worker, ())}}


register(_jobs, seconds=300)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def test_grad_norm_logging_matches_ddp(launched):
    """Every step logs the keys and values Lightning's DDP run logs: per-parameter global norms
    and their total, the same on every rank. (A branch no rank used in a step gets no new
    norm: Lightning's row then repeats its last value, and the total leaves it out.)"""
    results = results_of(launched, "grad norms")
    for rank, runs in enumerate(results):
        for name, (ours, ref) in runs.items():
            tol = TOL[ref["precision"]]
            what = f"{name}, rank {rank}"
            steps = [row for _, row in ref["rows"] if any(k.startswith("grad_") for k in row)]
            assert len(steps) >= 3, (what, ref["rows"][:2])
            assert len(ours["rows"]) == len(ref["rows"]), what
            for (step, mine), (ref_step, theirs) in zip(ours["rows"], ref["rows"]):
                assert step == ref_step and mine.keys() == theirs.keys(), \
                    f"{what}: logged\n {step} {sorted(mine)}\nvs\n {ref_step} {sorted(theirs)}"
                for key, value in theirs.items():
                    # (fp16's first steps overflow at the initial scale: inf on both sides)
                    assert mine[key] == value or abs(mine[key] - value) <= tol * max(1.0, abs(value)), \
                        f"{what}: {key} at step {step}: {mine[key]} vs {value}"
    for name in CASES:  # every rank logged the same (global) norms
        assert results[0][name][0]["rows"] == results[1][name][0]["rows"], name
