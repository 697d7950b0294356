"""Small points of ``fully_shard``'s manual API against torch's FSDP2 on 2 gloo ranks: a second
``fully_shard`` call on a sharded module, ``reshard()`` between ``unshard(async_op=True)`` and the
handle's ``wait()``, and an optimizer built while a unit is gathered.

Tolerance: both libraries gather the same fp32 values and average two gradients (exact), and
SGD's update is one multiply-add: FP32 = 1e-6 leaves room for an ulp; a stale or wrong parameter
is off by far more (lr 0.1 times a gradient of order 0.1).
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

DIM, BATCH, STEPS, LR = 4, 3, 2, 0.1
FP32 = dict(rtol=1e-6, atol=1e-6)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))


def _shard(model: nn.Module, shard) -> nn.Module:
    shard(model[0])
    shard(model[2])
    shard(model)
    return model


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _full_weights(model: nn.Module) -> list:
    """Every parameter gathered whole (a DTensor's full tensor), in order."""
    out = []
    for p in model.parameters():
        out.append(p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone())
    return out


def _sharded_twice(rank, world):
    """fusedist and torch both refuse a second call on a sharded module; fusedist names the module
    by its path and says what to do."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    torch_model = _shard(_model(0), torch_fully_shard)
    try:
        torch_fully_shard(torch_model[0])
        torch_refused = False
    except AssertionError:
        torch_refused = True
    ours = _shard(_model(0), fusedist.fully_shard)
    ours(_batch(rank, 0))  # the root names its units
    messages = []
    for module in (ours[2], ours):
        try:
            fusedist.fully_shard(module, reshard_after_forward=False)
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    return torch_refused, messages


def _reshard_before_wait(rank, world):
    """``unshard(async_op=True)``, ``reshard()``, ``wait()``: gathered after the wait in both, and the
    next forward and step match torch's."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    results = []
    for shard in (torch_fully_shard, fusedist.fully_shard):
        model = _shard(_model(1), shard)
        handle = model[0].unshard(async_op=True)
        model[0].reshard()
        handle.wait()
        gathered = tuple(model[0].weight.shape) == (DIM, DIM) and not hasattr(model[0].weight, "full_tensor")
        optimizer = torch.optim.SGD(model.parameters(), lr=LR) if not gathered else None
        outputs = [model(_batch(rank, 0)).detach()]
        if optimizer is None:  # built once resharded (the forward's end resharded the block)
            model.reshard()
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        model(_batch(rank, 1)).square().sum().backward()
        optimizer.step()
        outputs.append(model(_batch(rank, 2)).detach())
        results.append((gathered, outputs, _full_weights(model)))
    return results


def _train(model, optimizer, rank) -> list:
    for step in range(STEPS):
        optimizer.zero_grad()
        model(_batch(rank, step)).square().sum().backward()
        optimizer.step()
    return _full_weights(model)


def _optimizer_over_gathered(rank, world):
    """An optimizer built after ``unshard()`` holds the gathered parameters: its first step raises,
    naming the module, whether the unit is resharded by then or not, and so does the first step after
    such parameters were added as a group; the same optimizer built after ``reshard()`` trains as
    torch's FSDP2."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    torch_model = _shard(_model(2), torch_fully_shard)
    expected = _train(torch_model, torch.optim.SGD(torch_model.parameters(), lr=LR), rank)

    errors = []
    for reshard_first in (True, False):
        model = _shard(_model(2), fusedist.fully_shard)
        model[2].unshard()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        if reshard_first:
            model[2].reshard()
        errors.append(_refusal_of(_train, model, optimizer, rank))

    # a group added after the first step is checked too
    model = _shard(_model(2), fusedist.fully_shard)
    optimizer = torch.optim.SGD(model[0].parameters(), lr=LR)
    _train(model, optimizer, rank)
    model[2].unshard()
    optimizer.add_param_group({"params": list(model[2].parameters())})
    errors.append(_refusal_of(_train, model, optimizer, rank))

    model = _shard(_model(2), fusedist.fully_shard)
    model[2].unshard()
    model[2].reshard()
    trained = _train(model, torch.optim.SGD(model.parameters(), lr=LR), rank)
    return errors, expected, trained


def _refusal_of(fn, *args):
    """The text of the RuntimeError ``fn(*args)`` raises, or None."""
    try:
        fn(*args)
    except RuntimeError as exc:
        return str(exc)
    return None


JOBS = {
    "test_a_second_fully_shard_call_names_the_module_and_what_to_do": {"twice": (_sharded_twice, ())},
    "test_reshard_between_async_unshard_and_wait_leaves_it_gathered_as_fsdp2": {
        "reshard before wait": (_reshard_before_wait, ())},
    "test_an_optimizer_over_gathered_parameters_is_refused_at_its_first_step": {
        "optimizer over gathered": (_optimizer_over_gathered, ())},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, JOBS, 2, timeout=180)


def test_a_second_fully_shard_call_names_the_module_and_what_to_do(launched):
    for torch_refused, (block, root) in results_of(launched, "twice"):
        assert torch_refused
        assert block is not None and "'2' (Linear) is already sharded" in block, block
        assert "once per module" in block and "set_reshard_after_forward" in block, block
        assert root is not None and "Sequential is already sharded" in root, root


def test_reshard_between_async_unshard_and_wait_leaves_it_gathered_as_fsdp2(launched):
    for (torch_gathered, torch_outputs, torch_weights), (gathered, outputs, weights) in \
            results_of(launched, "reshard before wait"):
        assert torch_gathered and gathered
        for ours, theirs in zip(outputs + weights, torch_outputs + torch_weights):
            torch.testing.assert_close(ours, theirs, **FP32)


def test_an_optimizer_over_gathered_parameters_is_refused_at_its_first_step(launched):
    for rank, (errors, expected, trained) in enumerate(results_of(launched, "optimizer over gathered")):
        assert len(errors) == 3
        for error in errors:
            assert error is not None and f"rank {rank}" in error, error
            assert "'2' (Linear)" in error and "'2.weight'" in error, error
            assert "build the optimizer while the module is resharded" in error, error
        for ours, theirs in zip(trained, expected):
            torch.testing.assert_close(ours, theirs, **FP32)
