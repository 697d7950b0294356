"""DDP against torch's: a communication hook sees torch's buckets in the first backwards too
(Note [a hook's first buckets] in fusedist/ddp/comm_hook.py), and keeps them when a layer is
frozen after wrapping (Note [trainable set changes] in fusedist/ddp/trainable.py).
The two-rank scenarios share one launch of the ranks (``launched``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


class _TwoPaths(nn.Module):
    """Registration order is not the backward's (``d`` is last registered, first ready)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(24, 48)
        self.b = nn.Linear(48, 40)
        self.c = nn.Linear(40, 6)
        self.d = nn.Linear(24, 6)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) + self.d(x)


def _recording(hook, log, names, step, wait):
    """Logs each bucket the hook gets. ``wait``: torch's side completes the hook's collectives
    before returning (gloo runs PowerSGD's chained collectives on its own thread)."""
    def recorded(state, bucket):
        log.append((step[0], bucket.index(), bucket.is_last(), bucket.buffer().numel(),
                    [names[p] for p in bucket.parameters()]))
        fut = hook(state, bucket)
        if wait:
            fut.wait()
        return fut
    return recorded


def _train_pair(rank, settings, steps, powersgd, freeze_at=None, thaw_at=None):
    """torch's DDP and fusedist's on one model and the same inputs, each with a logging PowerSGD
    hook: (bucket logs, the largest weight difference after each step). Layer ``a`` is frozen at
    step ``freeze_at`` and trainable again at ``thaw_at``."""
    import fusedist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    base = _TwoPaths()
    models = {"torch": nn.parallel.DistributedDataParallel(copy.deepcopy(base), **settings),
              "fusedist": fusedist.DistributedDataParallel(copy.deepcopy(base), **settings)}
    logs, opts, step = {}, {}, [0]
    for name, model in models.items():
        names = {p: n for n, p in model.module.named_parameters()}
        state = ps.PowerSGDState(process_group=None, random_seed=7, min_compression_rate=0.5, **powersgd)
        logs[name] = []
        model.register_comm_hook(state, _recording(ps.powerSGD_hook, logs[name], names, step, name == "torch"))
        opts[name] = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    worst = []
    for step[0] in range(steps):
        x, y = torch.randn(16, 24, generator=gen), torch.randn(16, 6, generator=gen)
        for name, model in models.items():
            if step[0] in (freeze_at, thaw_at):
                model.module.a.requires_grad_(step[0] == thaw_at)
            nn.functional.mse_loss(model(x), y).backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
        worst.append(max((a - b).abs().max().item()
                         for a, b in zip(models["torch"].parameters(), models["fusedist"].parameters())))
    return logs["torch"], logs["fusedist"], worst


def _first_buckets_worker(rank, world):
    import fusedist

    # PowerSGD compressing from the first backward: its matrices are the buckets' gradients.
    eager = dict(matrix_approximation_rank=1, start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)
    out = [(settings, _train_pair(rank, settings, 3, eager))
           for settings in ({}, dict(bucket_cap_mb=0.004), dict(bucket_cap_mb_list=[0.002, 0.02]),
                            dict(static_graph=True, bucket_cap_mb=0.004))]
    # A ZeroRedundancyOptimizer built after the registration fixes the usual buckets, not one.
    model = fusedist.DistributedDataParallel(_TwoPaths(), bucket_cap_mb=0.004)
    model.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    fusedist.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    return out, len(model.reducer.layout.buckets)


def test_hook_sees_torchs_buckets_from_the_first_backward(launched):
    """Before: the first backward handed the hook fusedist's reverse-order buckets (two, the last
    one is_last) where torch's DDP hands one bucket in registration order, and PowerSGD
    compressing from the first step parted from torch's weights by ~1e-2."""
    for results, zero_buckets in results_of(launched, "first buckets"):
        for settings, (torch_log, fusedist_log, worst) in results:
            assert fusedist_log == torch_log, (settings, fusedist_log[:3], torch_log[:3])
            assert all(w <= 1e-6 for w in worst), (settings, worst)  # (NaN fails too)
        assert zero_buckets == 2


def _freeze_worker(rank, world):
    feedback = dict(matrix_approximation_rank=1, start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
    return [(settings, _train_pair(rank, settings, 7, feedback, freeze_at=3, thaw_at=5))
            for settings in (dict(find_unused_parameters=True), dict(find_unused_parameters=True, bucket_cap_mb=0.004))]


def test_powersgd_keeps_its_buckets_when_a_layer_is_frozen_and_thawed(launched):
    """Before: freezing a layer re-bucketed the model and PowerSGD's next backward failed (its
    error feedback, keyed by bucket index, had another bucket's size); torch's DDP keeps its
    buckets and sends the frozen slots as zeros. Thawed again, the layer's first gradient was
    averaged outside the hook (uncompressed), 1e-3 off torch's weights."""
    for results in results_of(launched, "freeze"):
        for settings, (torch_log, fusedist_log, worst) in results:
            assert fusedist_log == torch_log, (settings, fusedist_log[-2:], torch_log[-2:])
            assert all(w <= 1e-6 for w in worst), (settings, worst)  # (NaN fails too)


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, {
        "test_hook_sees_torchs_buckets_from_the_first_backward": {"first buckets": (_first_buckets_worker, ())},
        "test_powersgd_keeps_its_buckets_when_a_layer_is_frozen_and_thawed": {"freeze": (_freeze_worker, ())},
    }, 2, timeout=240)
