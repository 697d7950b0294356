"""fusedist.DistributedDataParallel's module API against torch's DistributedDataParallel on 2 gloo
ranks: torch's positional arguments, the ``require_backward_grad_sync`` flag scripts set instead
of ``no_sync()``, torch's read-only settings attributes, and torch's logging dict
(``_get_ddp_logging_data``, Note [torch's DDP logging data] in fusedist/ddp/logging_data.py).
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


class _WithFrozenAndUnused(nn.Module):
    """A frozen layer (not counted by torch's logger) and an unused one (counted)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused, self.frozen = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(3, 3), nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


# torch's sampled timings, which the dict leaves to ``comm_stats()`` (Note [torch's DDP logging data])
_TIMING_KEYS = ("avg_", "backward_", "forward_", "has_rebuilt", "num_buckets_reduced", "prev_iteration",
                "rebuilt_", "unused_parameter_size")


def _logging_data_worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import fusedist

    cases = {  # name: (options, hook, training iterations, sample rate, joined)
        "unused, 13 iterations": (dict(find_unused_parameters=True, bucket_cap_mb=0.0001), None, 13, None, False),
        "static graph, a hook, rate 3": (dict(static_graph=True, broadcast_buffers=False), "allreduce", 14, 3, False),
        "builtin hook": (dict(find_unused_parameters=True), "fp16", 2, None, False),
        "joined": (dict(find_unused_parameters=True), None, 2, None, True),
        "fresh": ({}, None, 0, None, False),
    }
    out = {}
    wrappers = (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel))
    for name, (options, hook, iterations, rate, joined) in cases.items():
        for who, cls in wrappers:
            torch.manual_seed(0)
            model = cls(_WithFrozenAndUnused(), gradient_as_bucket_view=True, **options)
            if rate:
                model._set_ddp_runtime_logging_sample_rate(rate)
            if hook == "allreduce":
                model.register_comm_hook(None, default_hooks.allreduce_hook)
            elif hook == "fp16":
                model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
            gen = torch.Generator().manual_seed(30 + rank)
            with model.join(enable=joined):
                for i in range(iterations + (rank if joined else 0)):
                    if i == 1 and not joined:  # (torch's join pairs every forward) neither kind counts:
                        with torch.no_grad():  # an evaluating one,
                            model(torch.randn(3, 4, generator=gen))
                        with model.no_sync():  # an accumulating one
                            model(torch.randn(3, 4, generator=gen)).sum().backward()
                    model(torch.randn(3, 4, generator=gen)).sum().backward()
            data = model._get_ddp_logging_data()
            out[(name, who)] = {k: v for k, v in data.items() if not k.startswith(_TIMING_KEYS)}
        try:
            model._set_ddp_runtime_logging_sample_rate(0)
        except ValueError as e:
            out["rate 0"] = str(e)
    # (torch's DDP refuses SyncBatchNorm on CPU: fusedist's counts as torch's does on GPU)
    synced = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), fusedist.nn.SyncBatchNorm(4)))
    out["has_sync_bn"] = synced._get_ddp_logging_data()["has_sync_bn"]
    return out


def test_ddp_logging_data_as_torchs(launched):
    """``_get_ddp_logging_data()`` (torch's documented way to read a DDP model's settings) was an
    AttributeError; the same keys and values as torch's DDP now, its sampled timings aside."""
    for out in results_of(launched, "logging data"):
        for name in ("static graph, a hook, rate 3", "builtin hook", "joined", "fresh"):
            assert out[(name, "fusedist")] == out[(name, "torch")], name
        # below the size of one layer the buckets are cut differently, holding the same bytes
        ours, ref = out[("unused, 13 iterations", "fusedist")], out[("unused, 13 iterations", "torch")]
        assert {**ours, "bucket_sizes": None} == {**ref, "bucket_sizes": None}
        assert sum(map(int, ours["bucket_sizes"].split(", "))) == sum(map(int, ref["bucket_sizes"].split(", ")))
        # the 14th forward records the 13th iteration's count; after the first 10, multiples of the rate
        assert out[("static graph, a hook, rate 3", "torch")]["iteration"] == 12
        assert out[("unused, 13 iterations", "torch")]["iteration"] == 10
        assert "sample rate should be equal or greater than 1" in out["rate 0"]
        assert out["has_sync_bn"] == 1


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, {
        "test_torchs_positional_arguments_bind_as_in_torch": {"positional": (_positional_worker, ())},
        "test_require_backward_grad_sync_false_keeps_gradients_local_as_torch": {"flag": (_flag_worker, ())},
        "test_torchs_settings_attributes_are_readable": {"attributes": (_attributes_worker, ())},
        "test_ddp_logging_data_as_torchs": {"logging data": (_logging_data_worker, ())},
    }, 2, timeout=240)
