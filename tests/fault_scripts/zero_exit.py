"""ZeRO training that ends right after its last ``optimizer.step()``, run under torchrun by
tests/test_zero_exit.py: the step's parameter all-gathers are still in flight when the
script returns (Note [draining at exit] in fusedist/comm/__init__.py).

    torchrun --standalone --nproc_per_node=2 zero_exit.py <stages> <destroy|keep>

``<stages>``: the ZeRO stages to train, comma-separated (``1,2``): one model and optimizer per
stage, stepped in turn, so that every stage's last gathers are in flight at the end of one
process (each process start costs seconds: one job covers several stages).
"""

import sys

import torch
from torch import nn

import fusedist


def main(stages: list, destroy: bool) -> None:
    info = fusedist.init_distributed()
    torch.manual_seed(0)
    trained = []
    for stage in stages:
        model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)),
                                                 bucket_cap_mb=0.01, first_bucket_cap_mb=0.01)
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-3,
                                               overlap_param_gather=True)
        trained.append((model, opt))
    gen = torch.Generator().manual_seed(info.rank)
    for _ in range(3):
        for model, opt in trained:
            opt.zero_grad()
            model(torch.randn(8, 64, generator=gen)).pow(2).mean().backward()
        for _, opt in trained:  # (every forward and backward first: the last steps leave their gathers in flight)
            opt.step()
    print(f"rank {info.rank} finished", flush=True)
    if destroy:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main([int(stage) for stage in sys.argv[1].split(",")], sys.argv[2] == "destroy")
