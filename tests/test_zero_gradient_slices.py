"""``ZeroRedundancyOptimizer.gradient_slices()`` (Note [per-parameter gradient slices] in
fusedist/zero/grads.py), stages 1 and 2 over a fusedist DDP model at 2 gloo ranks, against
torch's DistributedDataParallel on the same module and data:

* the pairs name exactly the parameters torch's DDP left a ``p.grad`` (not a parameter no rank
  used), in the same order on every rank;
* a parameter's slices over the ranks, in rank order, are its averaged gradient, so their
  global norm (the sum of the ranks' squared slice norms) is the norm of torch's ``p.grad``;
* a parameter with no element in this rank's shard gets an empty slice (tiny buckets put whole
  parameters on one rank), as does a zero-element parameter on every rank;
* no pairs before the first backward, nor in stage 2 after the step consumed the shards.

Inputs are fresh random draws (the seed is in every failure message). Tolerance: at 2 ranks
both sides average the same two fp32 gradients (one sum, one division by 2, which is exact),
so elements may differ only where fusedist's reduce-scatter and torch's all-reduce round the
sum differently, which they do not; still, fp32's default ``assert_close`` tolerance (1.3e-6
relative) leaves room for a differently ordered sum, and a slice of the wrong parameter or
rank is off by far more.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist
from torch import nn

from fusedist.testing import run_distributed

WORLD = 2
TINY_BUCKETS = dict(bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 3)
        self.scale = nn.Parameter(torch.randn(1))
        self.empty = nn.Parameter(torch.empty(0, 4))  # zero elements, used in forward
        self.unused = nn.Linear(3, 3)  # no rank uses it: torch leaves its grad None

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale + self.empty.sum()


def _batch(seed: int, rank: int, step: int):
    g = torch.Generator().manual_seed(seed * 97 + rank * 13 + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)


def _gathered(t: torch.Tensor) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.detach().clone())
    return out


def _worker(rank: int, world: int, seed: int, stage: int):
    import fusedist

    torch.manual_seed(seed)
    module = Model()
    ref_module = copy.deepcopy(module)
    names = {id(p): n for n, p in module.named_parameters()}
    ref_params = dict(ref_module.named_parameters())
    model = fusedist.DistributedDataParallel(module, find_unused_parameters=True, **TINY_BUCKETS)
    ref = torch.nn.parallel.DistributedDataParallel(ref_module, find_unused_parameters=True)
    opt = fusedist.ZeroRedundancyOptimizer(module.parameters(), torch.optim.AdamW, stage=stage,
                                           bucket_cap_mb=0.001, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_module.parameters(), lr=1e-2)
    what = f"seed {seed}, stage {stage}, rank {rank}"
    assert opt.gradient_slices() == [], f"{what}: pairs before any backward"
    empty_somewhere = set()
    for step in range(2):
        x, y = _batch(seed, rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        pairs = opt.gradient_slices()
        order = [names[id(p)] for p, _ in pairs]
        with_grad = [n for n, p in ref_params.items() if p.grad is not None]
        assert order == with_grad, f"{what}, step {step}: pairs for {order}, torch's grads {with_grad}"
        orders = [None] * world
        dist.all_gather_object(orders, order)
        assert all(o == order for o in orders), f"{what}: other parameters on other ranks: {orders}"
        for p, piece in pairs:
            name = names[id(p)]
            assert piece.dim() == 1, f"{what}: {name}: slice of shape {tuple(piece.shape)}"
            expected = ref_params[name].grad.reshape(-1)
            pieces = _gathered(piece)
            if any(q.numel() == 0 for q in pieces):
                empty_somewhere.add(name)
            whole = torch.cat([q.to(expected.dtype) for q in pieces])
            torch.testing.assert_close(whole, expected, msg=lambda m: f"{what}, step {step}: {name}: {m}")
            sumsq = torch.tensor([piece.double().pow(2).sum().item()])
            dist.all_reduce(sumsq)
            torch.testing.assert_close(sumsq.sqrt().float()[0], expected.norm(),
                                       msg=lambda m: f"{what}, step {step}: norm of {name}: {m}")
        opt.step()
        ref_opt.step()
        if stage == 2:
            assert opt.gradient_slices() == [], f"{what}: pairs after the step consumed the shards"
        opt.zero_grad()
        ref_opt.zero_grad()
    # the cases are exercised: whole parameters on one rank only, and the zero-element one
    assert "empty" in empty_somewhere and len(empty_somewhere) >= 2, f"{what}: {sorted(empty_somewhere)}"
    return True


def _stages_worker(rank: int, world: int, seed: int, stages: tuple):
    """:func:`_worker` for each stage in turn, in one launch of the ranks (each launch costs a
    process group and the imports of torch in every rank); each stage builds its own model."""
    return [_worker(rank, world, seed, stage) for stage in stages]


def test_gradient_slices_are_each_parameters_averaged_gradient_stage_1_and_2():
    seed = random.randrange(2**20)
    assert run_distributed(_stages_worker, WORLD, seed, (1, 2), timeout=300) == [[True, True]] * WORLD
