"""A tiny DDP training loop with one injected fault, run under torchrun by test_fault_matrix.py.

    torchrun --standalone --nproc_per_node=2 train_fault.py <fault>

Faults (all on rank 1, at step 2): ``raise_in_backward`` (an exception inside backward,
uncaught), ``skip_step`` (computes the loss, then skips backward and optimizer.step),
``exit_early`` (leaves the loop one iteration before the others), ``none``.
"""

import sys
import time

import torch
from torch import nn

import fusedist

STEPS = 5
FAULT_RANK, FAULT_STEP = 1, 2


class RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("injected failure in backward")


def main(fault: str) -> None:
    info = fusedist.init_distributed()  # timeout from FUSEDIST_TIMEOUT_S
    torch.manual_seed(0)
    # On the rank's GPU when init_distributed chose NCCL (the fault matrix's GPU tier), else CPU.
    model = fusedist.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(info.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(info.rank)
    faulty = info.rank == FAULT_RANK
    steps = STEPS - 1 if (fault == "exit_early" and faulty) else STEPS
    for step in range(steps):
        if faulty and step == FAULT_STEP and fault != "none":
            print(f"FAULT_AT {time.time():.3f}", flush=True)  # lets the test bound the reaction time
        x, y = torch.randn(8, 16, generator=gen).to(info.device), torch.randn(8, 4, generator=gen).to(info.device)
        opt.zero_grad()
        out = model(x)
        if fault == "raise_in_backward" and faulty and step == FAULT_STEP:
            out = RaiseInBackward.apply(out)
        loss = (out - y).pow(2).mean()
        if fault == "skip_step" and faulty and step == FAULT_STEP:
            continue
        loss.backward()
        opt.step()
    print(f"rank {info.rank} finished {steps} steps", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
