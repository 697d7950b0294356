"""Train a small LightningModule with fusedist underneath Lightning.

    pip install "fusedist[lightning]"
    python examples/lightning_train.py                    # 2 CPU processes (Lightning launches them)
    python examples/lightning_train.py --zero 2 --precision bf16-mixed --clip 1.0
    torchrun --standalone --nproc_per_node=2 examples/lightning_train.py   # or under torchrun

The module is ordinary Lightning code; the only fusedist line is the strategy.
"""

import argparse

import fusedist  # noqa: F401 - before the process group exists (see the README's quickstart)
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fusedist.integrations.lightning import FusedistStrategy


class Regressor(L.LightningModule):
    def __init__(self, width: int = 256, lr: float = 3e-3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                                 nn.Linear(width, 8))
        self.lr = lr

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def synthetic_data(n: int = 4096) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=gen)
    w = torch.randn(32, 8, generator=gen) / 32 ** 0.5
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 8, generator=gen))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--zero", type=int, choices=[0, 1, 2], default=0, help="ZeRO stage (0: off)")
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed")
    p.add_argument("--clip", type=float, default=None, help="gradient_clip_val")
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args(argv)
    if args.epochs < 0:  # (Lightning's max_epochs=-1 trains without end)
        p.error(f"--epochs must be >= 0, got {args.epochs}")
    if args.devices < 1:
        p.error(f"--devices must be >= 1, got {args.devices}")
    torch.manual_seed(0)
    trainer = L.Trainer(strategy=FusedistStrategy(zero_stage=args.zero), accelerator="cpu", devices=args.devices,
                        precision=args.precision, gradient_clip_val=args.clip, max_epochs=args.epochs,
                        logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), DataLoader(synthetic_data(), batch_size=64, shuffle=True))
    if trainer.is_global_zero and "loss" not in trainer.callback_metrics:  # (it raised KeyError: 'loss')
        print(f"nothing trained: --epochs {args.epochs}")
    elif trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss'].item():.4f} "
              f"(optimizer {type(trainer.optimizers[0]).__qualname__}, ZeRO stage {args.zero})")


if __name__ == "__main__":
    main()
