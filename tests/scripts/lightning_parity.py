"""Trains one small LightningModule with Lightning's strategy="ddp" and with FusedistStrategy
in several configurations, under torchrun (2 CPU ranks), and writes the largest parameter
difference of each against its "ddp" twin to the JSON file named by argv[1] (rank 0)."""

import json
import os
import sys

import fusedist  # before the process group exists (Note [binding torch.distributed.nn early])
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fusedist.integrations.lightning import FusedistStrategy
from lightning.pytorch.plugins.precision import MixedPrecision


class Regressor(L.LightningModule):
    def __init__(self, optimizer: str):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        self.optimizer = optimizer
        self.seen_optimizer = None

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}]
        if self.optimizer == "sgd":
            opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
        else:
            opt = torch.optim.AdamW(groups, lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_end(self):
        # The class's name (what LearningRateMonitor logs under) and the implementation's bases.
        self.seen_optimizer = [c.__name__ for c in type(self.trainer.optimizers[0]).__mro__]


def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 16, generator=gen)
    y = torch.sin(x[:, :4]) + 0.1 * torch.randn(96, 4, generator=gen)
    return TensorDataset(x, y)


def train(strategy, precision, optimizer="adamw", clip=None, accumulate=1, epochs=2, save=None, resume=None):
    torch.manual_seed(42)
    model = Regressor(optimizer)
    plugins = None
    if precision == "16-mixed":  # Lightning turns the flag into bf16 on a CPU; the plugin keeps fp16 + scaler
        precision, plugins = None, [MixedPrecision("16-mixed", "cpu")]
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, precision=precision, plugins=plugins,
                        max_epochs=epochs,
                        gradient_clip_val=clip, accumulate_grad_batches=accumulate, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True)
    trainer.fit(model, DataLoader(data(), batch_size=8, shuffle=False), ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)  # every rank takes part (ZeRO consolidates its shards)
    TRAINERS[:] = [trainer]
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return flat, model.seen_optimizer, trainer.global_step


TRAINERS = []

CASES = {
    # name: (fusedist strategy kwargs, precision, optimizer, clip, accumulate)
    "fused_adamw_fp32": (dict(), "32-true", "adamw", None, 1),
    "zero2_bf16_mixed_clip": (dict(zero_stage=2), "bf16-mixed", "adamw", 0.5, 1),
    "zero1_fp16_mixed_clip_accumulate": (dict(zero_stage=1), "16-mixed", "adamw", 0.5, 2),
    "zero2_fp16_mixed_clip_sgd": (dict(zero_stage=2), "16-mixed", "sgd", 0.5, 1),
    "torch_optimizer_kept": (dict(fused_optimizer=False), "32-true", "sgd", 0.5, 1),
}


def main(out_path):
    results = {}
    # The clip is active in these runs: without it the same training ends elsewhere.
    unclipped, _, _ = train("ddp", "32-true", "sgd", None, 1)
    clipped = train("ddp", "32-true", "sgd", 0.5, 1)
    results["clip_effect"] = (unclipped - clipped[0]).abs().max().item()
    # Lightning's DDP runs are deterministic: the clipped one above is also the reference of the
    # case with the same settings (one Trainer less to start).
    refs = {("32-true", "sgd", 0.5, 1): clipped}
    for name, (kwargs, precision, optimizer, clip, accumulate) in CASES.items():
        key = (precision, optimizer, clip, accumulate)
        ref, _, ref_steps = refs[key] if key in refs else train("ddp", *key)
        ours, opt_name, steps = train(FusedistStrategy(**kwargs), precision, optimizer, clip, accumulate)
        scaler = getattr(TRAINERS[-1].precision_plugin, "scaler", None)
        results[name] = {"scaler": None if scaler is None else f"{type(scaler).__module__}.{type(scaler).__name__}",
                         "max_diff": (ref - ours).abs().max().item(), "moved": (ours - train_init()).abs().max().item(),
                         "optimizer": opt_name, "steps": [ref_steps, steps]}
    # Save after one epoch and resume for the second: the same weights as two epochs straight.
    ckpt = os.path.join(os.path.dirname(out_path), "zero2.ckpt")
    straight, _, _ = train(FusedistStrategy(zero_stage=2), "32-true", clip=0.5)
    train(FusedistStrategy(zero_stage=2), "32-true", clip=0.5, epochs=1, save=ckpt)
    resumed, _, steps = train(FusedistStrategy(zero_stage=2), "32-true", clip=0.5, resume=ckpt)
    results["zero2_resume_gap"] = (straight - resumed).abs().max().item()
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def train_init():
    torch.manual_seed(42)
    return torch.cat([p.detach().reshape(-1) for p in Regressor("adamw").parameters()])


if __name__ == "__main__":
    main(sys.argv[1])
