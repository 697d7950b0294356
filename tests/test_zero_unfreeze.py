"""ZeroRedundancyOptimizer with parameters that join after construction -- ``add_param_group``
and parameters frozen at construction and unfrozen later (progressive unfreezing; Note
[growing the partition] in fusedist/zero/grow.py) -- and parameters kept in their memory
format (channels_last convolution weights stay channels_last).

The oracle is unsharded torch.optim.AdamW / SGD in one process on the global batch with the
same unfreezing schedule (DDP averages per-rank mean losses over equal chunks: the global
mean loss). Tolerance 1e-5 (fp32; gradients differ in summation order only): lr 1e-2 with
weight decay moves every parameter by ~1e-2 per step, so a joined parameter that is not
stepped, stepped with the wrong group's hyperparameters, given another parameter's state or
a non-averaged gradient is caught, as is an old parameter whose state moved.
"""

import os

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed

GLOBAL_BATCH = 12  # divisible by 2 and 3
STEPS = 7
UNFREEZE_AT = 3
TOL = 1e-5


def _batch(step, rank=None, world_size=1, shape=(8,)):
    gen = torch.Generator().manual_seed(300 + step)
    x, y = torch.randn(GLOBAL_BATCH, *shape, generator=gen), torch.randn(GLOBAL_BATCH, 2, generator=gen)
    if rank is None:
        return x, y
    chunk = GLOBAL_BATCH // world_size
    return x[rank * chunk:(rank + 1) * chunk], y[rank * chunk:(rank + 1) * chunk]


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        return self.head(h.mean(dim=(2, 3)))


def _convnet():
    torch.manual_seed(0)
    return ConvNet().to(memory_format=torch.channels_last)


def _memory_format_worker(rank, world_size):
    """channels_last weights, ZeRO stages 1 and 2 over fusedist DDP, against torch AdamW."""
    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}
    ref = _convnet()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(4):
        x, y = _batch(step, shape=(3, 6, 6))
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x.to(memory_format=torch.channels_last)), y).backward()
        ref_opt.step()
    for stage in (1, 2):
        for inner in (torch.optim.AdamW, fusedist.optim.FusedAdamW):
            model = _convnet()
            ddp = fusedist.DistributedDataParallel(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
            opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), inner, stage=stage, lr=1e-2, weight_decay=0.1)
            for step in range(4):
                x, y = _batch(step, rank, world_size, shape=(3, 6, 6))
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x.to(memory_format=torch.channels_last)), y).backward()
                opt.step()
            key = f"stage {stage} {inner.__name__}"
            out[key] = dict(
                channels_last=[model.conv1.weight.is_contiguous(memory_format=torch.channels_last),
                               model.conv2.weight.is_contiguous(memory_format=torch.channels_last)],
                diff=(_flat(model) - _flat(ref)).abs().max().item(),
            )
            full = opt.consolidate_state_dict()
            if rank == 0:  # the full state dict holds torch's values in the parameter's layout
                theirs = ref_opt.state_dict()["state"]
                out[key]["state_diff"] = max((full["state"][i][k].float() - v).abs().max().item()
                                             for i, st in theirs.items() for k, v in st.items() if k != "step")
    return out


def test_zero_keeps_channels_last_and_matches_adamw():
    for per_rank in run_distributed(_memory_format_worker, 2, timeout=240):
        for key, item in per_rank.items():
            assert item["channels_last"] == [True, True], (key, item)
            assert item["diff"] < TOL, (key, item)
            assert item.get("state_diff", 0.0) < TOL, (key, item)
