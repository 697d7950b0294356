"""A user's own ZeroRedundancyOptimizer over a fusedist DDP model whose module is wrapped again
(Note [an optimizer over a module wrapped again] in fusedist/ddp/succession.py): it trains on
through the newer wrapper as torch's ZeroRedundancyOptimizer does over torch DDP wrapped again,
or, where it cannot follow, refuses its next step naming what to do."""

from __future__ import annotations

import pytest

from shared_rank_launch import launch_for_selected, results_of

STEPS_BEFORE, STEPS_AFTER = 2, 3


def _model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batches(torch, rank: int, n: int) -> list:
    gen = torch.Generator().manual_seed(1234 + rank)
    return [(torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)) for _ in range(n)]


def _train(torch, wrapped, optimizer, batches) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        optimizer.step()


def _rewrapped(rank, world, stage, rewrap_in_torch, unfreeze=False, overlap=False):
    """Weights after training, wrapping the module again halfway: fusedist's DDP and sharded
    optimizer against torch's DDP and ZeroRedundancyOptimizer on the same data. ``unfreeze``: a
    parameter frozen until then is trained from the wrapping again on (torch's DDP, which does
    not follow trainability changes, is wrapped again after it)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    import fusedist

    batches = _batches(torch, rank, STEPS_BEFORE + STEPS_AFTER)
    ours_model, ref_model = _model(torch), _model(torch)
    for m in (ours_model, ref_model):
        m[0].bias.requires_grad_(not unfreeze)
    ours = fusedist.DistributedDataParallel(ours_model, bucket_cap_mb=0.0002)  # several buckets
    ours_opt = fusedist.ZeroRedundancyOptimizer(ours_model.parameters(), torch.optim.AdamW, stage=stage, lr=0.05,
                                                overlap_param_gather=overlap)
    ref = torch.nn.parallel.DistributedDataParallel(ref_model)
    ref_opt = TorchZero(ref_model.parameters(), torch.optim.AdamW, lr=0.05)
    _train(torch, ours, ours_opt, batches[:STEPS_BEFORE])
    _train(torch, ref, ref_opt, batches[:STEPS_BEFORE])
    ours = fusedist.DistributedDataParallel(ours_model)  # the module wrapped again (other bucket caps)
    for m in (ours_model, ref_model):
        m[0].bias.requires_grad_(True)
    if rewrap_in_torch:
        ref = torch.nn.parallel.DistributedDataParallel(ref_model)
    _train(torch, ours, ours_opt, batches[STEPS_BEFORE:])
    _train(torch, ref, ref_opt, batches[STEPS_BEFORE:])
    dist.barrier()
    return [(a.detach().clone(), b.detach().clone()) for a, b in zip(ours_model.parameters(), ref_model.parameters())]


def _wrapped_inside_a_larger_module(rank, world):
    """The module wrapped again inside a larger one: the stage-2 optimizer's shards cannot follow
    the newer wrapper's buckets (it holds parameters the optimizer does not), so its next step
    refuses, naming what to do; the newer wrapper trains with a new optimizer."""
    import torch

    import fusedist

    model = _model(torch)
    ddp = fusedist.DistributedDataParallel(model)
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=0.05)
    batches = _batches(torch, rank, 3)
    _train(torch, ddp, opt, batches[:1])
    bigger = fusedist.DistributedDataParallel(torch.nn.Sequential(model, torch.nn.Linear(3, 3)))
    x, y = batches[1]
    torch.nn.functional.mse_loss(bigger(x), y).backward()
    try:
        opt.step()
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = None
    # torch's clip measures the newer wrapper's averaged p.grad, not the refused optimizer's shards
    grads = [p.grad for p in bigger.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    measured = torch.nn.utils.clip_grad_norm_(bigger.parameters(), max_norm=1e6)
    fresh = fusedist.ZeroRedundancyOptimizer(bigger.parameters(), torch.optim.AdamW, stage=2, lr=0.05)
    _train(torch, bigger, fresh, batches[2:])
    return message, measured.item(), expected.item()


SCENARIOS = {
    "test_stage2_optimizer_follows_the_module_wrapped_again": {
        "stage2": (_rewrapped, (2, True)),
        "stage2 overlapped, torch not rewrapped": (_rewrapped, (2, False, False, True)),
    },
    "test_stage1_optimizer_follows_the_module_wrapped_again": {"stage1": (_rewrapped, (1, True))},
    "test_parameters_unfrozen_after_the_module_is_wrapped_again_join_the_optimizer": {
        f"stage{stage} unfrozen": (_rewrapped, (stage, True, True)) for stage in (1, 2)},
    "test_stage2_optimizer_refuses_when_it_cannot_follow": {"larger": (_wrapped_inside_a_larger_module, ())},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, 2, timeout=120)


def _assert_matches_torch(results) -> None:
    import torch

    for per_rank in results:
        for ours, ref in per_rank:
            # fp32 AdamW, the same reduction (average of two ranks) in another order: a few ulps
            # per step, well under the 1e-2-scale drift of an optimizer that stops stepping
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_stage2_optimizer_follows_the_module_wrapped_again(launched):
    _assert_matches_torch(results_of(launched, "stage2"))
    _assert_matches_torch(results_of(launched, "stage2 overlapped, torch not rewrapped"))


def test_stage1_optimizer_follows_the_module_wrapped_again(launched):
    _assert_matches_torch(results_of(launched, "stage1"))


def test_parameters_unfrozen_after_the_module_is_wrapped_again_join_the_optimizer(launched):
    """The newer wrapper tells the optimizer of the parameters it takes on, as the first would have."""
    for stage in (1, 2):
        _assert_matches_torch(results_of(launched, f"stage{stage} unfrozen"))


def test_stage2_optimizer_refuses_when_it_cannot_follow(launched):
    for rank, (message, measured, expected) in enumerate(results_of(launched, "larger")):
        assert message is not None, f"rank {rank}: the stage-2 optimizer stepped shards nothing reduces into"
        assert f"rank {rank}" in message and "wrapped again" in message and "ZeroRedundancyOptimizer" in message
        # fp32 norms of the same tensors, summed in another order
        assert abs(measured - expected) <= 1e-5 * expected, (rank, measured, expected)
