"""torch's own ``torch.amp.GradScaler`` over ``fully_shard`` pieces skips an overflowing step on
every rank together, as over FSDP2's DTensor gradients (Note [torch's scaler on sharded
gradients] in fusedist/amp/torch_scaler.py): before, the rank whose piece held the inf skipped
alone and the per-step cross-rank check stopped the run. World 2 on gloo; an inf is written into
rank 1's piece of one gradient in the second step, the same on FSDP2's local shard. The weights
and the scale after four steps must equal FSDP2's (fp32, same reduction: bitwise in practice,
1e-6 allowed)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fusedist.testing import run_distributed
from fusedist.testing.fsdp_compare import full_state


def _local(grad):
    return grad.to_local() if isinstance(grad, DTensor) else grad  # (FSDP2's; ours: this rank's piece)


def _train(base, rank, ours):
    import fusedist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = fusedist.fully_shard if ours else torch_fully_shard
    model = copy.deepcopy(base)
    for layer in model:
        if isinstance(layer, nn.Linear):
            shard(layer)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    gen = torch.Generator().manual_seed(rank)
    skipped = []
    for step in range(4):
        scaler.scale(model(torch.randn(4, 8, generator=gen)).square().mean()).backward()
        if step == 1 and rank == 1:  # this rank's piece of the first weight overflows
            _local(model[0].weight.grad).view(-1)[0] = float("inf")
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        opt.zero_grad()
    if ours:
        model.check_consistency()
    return full_state(model, ours), scaler.get_scale(), skipped


def _worker(rank, world_size):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    want, want_scale, want_skipped = _train(base, rank, ours=False)
    got, got_scale, got_skipped = _train(base, rank, ours=True)
    assert want_skipped == [False, True, False, False]
    assert got_skipped == want_skipped and got_scale == want_scale
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_torch_grad_scaler_skips_on_every_rank_as_over_fsdp2():
    run_distributed(_worker, 2, timeout=120)
