"""fusedist.DistributedDataParallel's module API against torch's DistributedDataParallel on 2 gloo
ranks: torch's positional arguments, the ``require_backward_grad_sync`` flag scripts set instead
of ``no_sync()``, and torch's read-only settings attributes.
The two-rank scenarios share one launch of the ranks (``launched``)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _grads(model) -> list:
    return [p.grad.detach().clone() for p in model.parameters()]


def _positional_worker(rank, world_size):
    import fusedist

    out = {}
    # torch's order: ..., find_unused_parameters, check_reduction, gradient_as_bucket_view, static_graph
    args = (None, None, 0, True, True, None, 25, False, False, True, True)
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_net(), *args)
        torch.manual_seed(10 + rank)
        model(torch.randn(4, 5)).square().sum().backward()
        out[who] = (_grads(model), model.static_graph, model.find_unused_parameters)
    return out


def test_torchs_positional_arguments_bind_as_in_torch(launched):
    theirs = list(inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters)
    import fusedist

    params = inspect.signature(fusedist.DistributedDataParallel.__init__).parameters.values()
    assert [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD] == theirs
    for out in results_of(launched, "positional"):
        ref, ours = out["torch"], out["fusedist"]
        assert ours[1:] == ref[1:] == (True, False)
        assert max((a - b).abs().max().item() for a, b in zip(ref[0], ours[0])) <= 1e-6


def _flag_worker(rank, world_size):
    import fusedist

    out = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_net())
        torch.manual_seed(20 + rank)
        xs = [torch.randn(4, 5) for _ in range(3)]
        model.require_backward_grad_sync = False  # local gradients, no reduction
        model(xs[0]).square().sum().backward()
        local = _grads(model)
        model.zero_grad()
        for i, x in enumerate(xs):  # nanoGPT's accumulation: only the last micro-step reduces
            model.require_backward_grad_sync = i == len(xs) - 1
            model(x).square().sum().backward()
        accumulated = _grads(model)
        model.zero_grad()
        with model.no_sync():
            inside = model.require_backward_grad_sync
            model.require_backward_grad_sync = True  # (accelerate's sync inside no_sync) reduces
            model(xs[0]).square().sum().backward()
        out[who] = (local, accumulated, _grads(model), inside, model.require_backward_grad_sync)
    return out


def test_require_backward_grad_sync_false_keeps_gradients_local_as_torch(launched):
    """Setting the flag (as nanoGPT does) was ignored: every backward reduced."""
    for out in results_of(launched, "flag"):
        ref, ours = out["torch"], out["fusedist"]
        for k in (0, 1, 2):
            assert max((a - b).abs().max().item() for a, b in zip(ref[k], ours[k])) <= 1e-6, k
        assert ours[3:] == ref[3:] == (False, True)


def _attributes_worker(rank, world_size):
    import fusedist

    out = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_net(), find_unused_parameters=True, gradient_as_bucket_view=True)
        before = (model.find_unused_parameters, model.static_graph, model.gradient_as_bucket_view)
        model._set_static_graph()
        out[who] = before + (model.static_graph,)
    return out


def test_torchs_settings_attributes_are_readable(launched):
    """find_unused_parameters, static_graph, gradient_as_bucket_view raised AttributeError."""
    for out in results_of(launched, "attributes"):
        assert out["fusedist"] == out["torch"] == (True, False, True, True)


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, {
        "test_torchs_positional_arguments_bind_as_in_torch": {"positional": (_positional_worker, ())},
        "test_require_backward_grad_sync_false_keeps_gradients_local_as_torch": {"flag": (_flag_worker, ())},
        "test_torchs_settings_attributes_are_readable": {"attributes": (_attributes_worker, ())},
    }, 2, timeout=240)
