"""fusedist.DistributedDataParallel's sparse gradients (Note [sparse gradients] in
fusedist/ddp/sparse.py): averaged through fusedist's communicator, so a rank that skips the
averaging is a fusedist collective error naming the collective and the rank, not a hang or gloo's
bare timeout; and a sparse weight frozen when wrapped and unfrozen later is averaged (Note
[sparse weights frozen at wrapping]). 2 gloo ranks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

import fusedist
from fusedist.comm import CollectiveError
from fusedist.testing import run_distributed


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 4, sparse=True, padding_idx=0)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def _skipping_worker(rank, world_size):
    """Rank 1 runs its second backward under no_sync; rank 0 synchronizes it, and must fail in
    the sparse averaging with fusedist's error (its deadline, FUSEDIST_TIMEOUT_S)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(20, 4, sparse=True))
    model = fusedist.DistributedDataParallel(net)
    ids = torch.randint(0, 20, (6,), generator=torch.Generator().manual_seed(rank))
    model(ids).sum().backward()  # a synchronized step on both ranks
    start = time.monotonic()
    try:
        if rank == 1:
            with model.no_sync():
                model(ids).sum().backward()
            time.sleep(4)  # alive (not crashed) while rank 0 waits for it
            return None
        model(ids).sum().backward()
    except CollectiveError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_a_rank_that_skips_the_sparse_averaging_gets_fusedists_collective_error():
    results = run_distributed(_skipping_worker, 2, timeout=90, env={"FUSEDIST_TIMEOUT_S": "2"})
    kind, message, waited = results[0]
    assert kind != "no error", "rank 0 synchronized a backward rank 1 skipped without an error"
    assert "ddp sparse gradient" in message and "rank 0 of 2" in message, message
    assert waited < 20, waited


def _local_grad(net: nn.Module, ids) -> list:
    """Each parameter's gradient of one rank's loss, computed outside DDP (dense)."""
    clone = _Bag()
    clone.load_state_dict(net.state_dict())
    clone.emb.weight.requires_grad_(net.emb.weight.requires_grad)
    clone(ids).pow(2).sum().backward()
    return [None if p.grad is None else p.grad.to_dense() for p in clone.parameters()]


def _averaged(grads: list, world_size: int) -> list:
    out = []
    for g in grads:
        if g is None:
            out.append(None)
            continue
        every = [torch.zeros_like(g) for _ in range(world_size)]
        dist.all_gather(every, g)
        out.append(sum(every) / world_size)
    return out


def _thawed_worker(rank, world_size):
    """The embedding is frozen when wrapped and unfrozen at the second step: from then on its
    sparse gradient must be the average of the ranks' (the replicas stay equal)."""
    torch.manual_seed(0)
    net = _Bag()
    net.emb.weight.requires_grad_(False)
    model = fusedist.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mismatches = []
    for step in range(3):
        if step == 1:
            net.emb.weight.requires_grad_(True)
        gen = torch.Generator().manual_seed(10 * step + rank)
        ids = torch.randint(0, 16, (4, 3), generator=gen)
        expected = _averaged(_local_grad(net, ids), world_size)
        model(ids).pow(2).sum().backward()
        for name, p, want in zip(["emb.weight", "head.weight", "head.bias"], net.parameters(), expected):
            got = None if p.grad is None else p.grad.to_dense()
            if (got is None) != (want is None) or (got is not None and not torch.allclose(got, want, atol=1e-6)):
                mismatches.append((step, name))
        opt.step()
        opt.zero_grad()
    weights = _averaged([net.emb.weight.detach().clone()], world_size)[0]
    return mismatches, torch.equal(weights, net.emb.weight.detach())


def test_a_sparse_weight_frozen_when_wrapped_is_averaged_once_unfrozen():
    for mismatches, replicas_equal in run_distributed(_thawed_worker, 2, timeout=90):
        assert mismatches == [], mismatches
        assert replicas_equal
