"""Two more faults for the fault matrix, run under torchrun by tests/test_fault_matrix_ws2.py.

    torchrun --standalone --nproc_per_node=2 mismatch_and_stall.py <fault> <cpu|cuda>

Faults (rank 1): ``mismatched_model`` (its model has a hidden layer of 33 instead of 32),
``stall`` (at step 2 it sleeps ``STALL_S`` seconds outside any collective, e.g. a stuck data
loader, so its peer's gradient all-reduce times out), ``none``. ``cpu`` runs on gloo; ``cuda``
on NCCL, each rank on its GPU (``LOCAL_RANK``, several ranks may share one).
"""

import sys
import time

import torch
from torch import nn

import fusedist

STEPS = 5
FAULT_RANK, FAULT_STEP = 1, 2
STALL_S = 120.0  # far beyond the collective timeout: the peer's timeout must end the job


def main(fault: str, device_type: str) -> None:
    info = fusedist.init_distributed(backend="nccl" if device_type == "cuda" else "gloo")
    faulty = info.rank == FAULT_RANK
    torch.manual_seed(0)
    hidden = 33 if (fault == "mismatched_model" and faulty) else 32
    if fault == "mismatched_model" and faulty:
        print(f"FAULT_AT {time.time():.3f}", flush=True)
    model = fusedist.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 4)).to(info.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(info.rank)
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen).to(info.device), torch.randn(8, 4, generator=gen).to(info.device)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        if fault == "stall" and faulty and step == FAULT_STEP:
            print(f"FAULT_AT {time.time():.3f}", flush=True)
            time.sleep(STALL_S)
        loss.backward()
        opt.step()
    print(f"rank {info.rank} finished {STEPS} steps on {info.backend}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
