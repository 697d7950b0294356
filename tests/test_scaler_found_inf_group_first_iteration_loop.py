"""GradScaler(found_inf_group=...): torch's multi-optimizer loop from the first iteration.

A rank holding several pipeline stages steps their optimizers as torch documents for several
optimizers -- ``scaler.step(opt1); scaler.step(opt2); scaler.update()`` -- without ``unscale_``.
In the first iteration the scaler does not know yet which optimizers the rank steps: it agreed
the group's inf/nan flag at ``step(opt1)`` without ``opt2``'s, stepped ``opt1`` (and the other
ranks' stages) through an overflow in ``opt2``'s stage, and raised at ``step(opt2)`` while the
other rank went on (Note [the first iteration's steps wait for update()] in
fusedist/amp/found_inf_group.py). The oracle: torch's GradScaler on each stage, its found_inf
all-reduced (max) over the ranks before the steps.
Tolerance: fp32 SGD/Adam steps in another summation order, 1e-6; scales exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fusedist.testing import run_distributed

WIDTH = 5
STAGES_OF = {0: (0, 2), 1: (1,)}  # rank 0 holds stages 0 and 2 (steps two optimizers)


def _stage(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(WIDTH, WIDTH)


def _optimizer(stage: int, params, ours: bool):
    import fusedist

    if stage == 0 and ours:
        return fusedist.optim.FusedSGD(params, lr=0.1, momentum=0.9)
    if stage == 1 and ours:
        return fusedist.optim.FusedAdamW(params, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01) if stage == 1 else torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _oracle_step(scalers: dict, opts: dict) -> None:
    """torch's scaler per stage, with found_inf all-reduced over the ranks before any step."""
    flags = []
    for s, opt in opts.items():
        scalers[s].unscale_(opt)
        flags += scalers[s]._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
    flag = torch.stack(flags).max().reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    for s, opt in opts.items():
        for value in scalers[s]._per_optimizer_states[id(opt)]["found_inf_per_device"].values():
            value.copy_(flag.reshape(value.shape))
        scalers[s].step(opt)
        scalers[s].update()


def _error_of(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def _zeroed_shards_error(rank):
    """A stage of ZeroRedundancyOptimizer stage 2 (its own data-parallel group of one rank),
    whose gradients are shards (``p.grad`` is None): rank 0 zeroes them in place between the
    first iteration's step() and update()."""
    import fusedist

    own = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    model = fusedist.DistributedDataParallel(_stage(rank), process_group=own)
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), fusedist.optim.FusedAdamW, process_group=own,
                                           stage=2, lr=0.01)
    scaler = fusedist.amp.GradScaler("cpu", found_inf_group=dist.group.WORLD)
    scaler.scale(model(torch.randn(2, WIDTH)).square().mean()).backward()
    scaler.step(opt)
    if rank == 0:
        opt.zero_grad(set_to_none=False)
    error = _error_of(scaler.update)
    opt.wait_for_params()
    return error


def _worker(rank, world_size, seed):
    """The plain loop against the oracle (an inf in stage 2, rank 0's second optimizer, in the
    first iteration, then at random), and on fresh scalers: the refusals of a first iteration
    whose gradients (or ZeRO-2 gradient shards) are zeroed between step() and update(), of
    unscale_ after step(), and of an optimizer new after the first iteration."""
    from fusedist.amp import GradScaler

    stages = STAGES_OF[rank]
    models = {s: _stage(seed + s) for s in stages}
    refs = {s: _stage(seed + s) for s in stages}
    opts = {s: _optimizer(s, models[s].parameters(), True) for s in stages}
    ref_opts = {s: _optimizer(s, refs[s].parameters(), False) for s in stages}
    scaler = GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2, found_inf_group=dist.group.WORLD)
    ref_scalers = {s: torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2) for s in stages}
    g = torch.Generator().manual_seed(seed)
    scales, weights = [], 0.0
    for step in range(5):
        xs = [torch.randn(3, WIDTH, generator=g) for _ in range(3)]
        bad = 2 if step == 0 else int(torch.randint(0, 5, (), generator=g))  # (3, 4: none)
        for s in stages:
            blowup = float("inf") if s == bad else 1.0
            # (each stage's own loss; a middle stage's gradients arrive scaled: no scale(loss))
            (models[s](xs[s]).square().mean() * blowup * scaler.get_scale()).backward()
            ref_scalers[s].scale(refs[s](xs[s]).square().mean() * blowup).backward()
        _oracle_step(ref_scalers, ref_opts)
        for s in stages:
            scaler.step(opts[s])
        scaler.update()
        for opt in [*opts.values(), *ref_opts.values()]:
            opt.zero_grad()
        scales.append((scaler.get_scale(), ref_scalers[stages[0]].get_scale()))
        weights = max(weights, *(float((p - q).detach().abs().max()) for s in stages
                                 for p, q in zip(models[s].parameters(), refs[s].parameters())))

    errors = {}
    fresh = GradScaler("cpu", init_scale=2.0 ** 8, found_inf_group=dist.group.WORLD)
    for s in stages:
        fresh.scale(models[s](xs[s]).sum()).backward()
    first = opts[stages[0]]
    fresh.step(first)
    errors["unscale_ after step"] = _error_of(lambda: fresh.unscale_(first))
    if rank == 0:
        first.zero_grad()
        fresh.step(opts[stages[1]])
    errors["zeroed before update"] = _error_of(fresh.update)

    errors["zeroed shards"] = _zeroed_shards_error(rank)

    late = GradScaler("cpu", init_scale=2.0 ** 8, found_inf_group=dist.group.WORLD)
    for it in range(2):
        for s in stages:
            late.scale(models[s](xs[s]).sum()).backward()
        late.step(first)
        if rank == 0 and it == 1:
            errors["new optimizer"] = _error_of(lambda: late.step(opts[2]))
        late.update()
        for opt in opts.values():
            opt.zero_grad()
    return weights, scales, errors


def test_found_inf_group_plain_multi_optimizer_loop_from_the_first_iteration():
    """Before: rank 0 raised at its second step() of the first iteration (its first optimizer
    and rank 1's stage already stepped through stage 2's overflow), and rank 1 lost its peer."""
    seed = int(torch.randint(0, 10_000, ()).item())
    results = run_distributed(_worker, 2, seed, timeout=60)
    for rank, (weights, scales, errors) in enumerate(results):
        assert weights < 1e-6, (seed, rank, weights)
        assert all(ours == theirs for ours, theirs in scales), (seed, rank, scales)
        assert scales[0] == (128.0, 128.0), (seed, rank, scales)  # the first iteration's overflow
        assert errors["unscale_ after step"] == "unscale_() is being called after step().", errors
    zeroed = results[0][2]["zeroed before update"]
    assert zeroed and "rank 0" in zeroed and "FusedSGD" in zeroed and "after scaler.update()" in zeroed, zeroed
    assert results[1][2]["zeroed before update"] is None
    shards = results[0][2]["zeroed shards"]
    assert shards and "ZeroRedundancyOptimizer" in shards and "after scaler.update()" in shards, shards
    assert results[1][2]["zeroed shards"] is None
    new = results[0][2]["new optimizer"]
    assert new and "rank 0" in new and "SGD" in new and "unscale_" in new, new
