"""fusedist DDP against torch's DistributedDataParallel on 2 gloo ranks: chained reentrant
activation checkpoints (Note [the end of a backward with nested ones] in fusedist/ddp/prepared.py),
unused parameters counted ready as the backward begins (Note [unused parameters known after the
forward] in fusedist/ddp/unused.py), and the hint of the "received no gradient" error. The
scenarios (each asserts in the ranks) share one launch of the ranks (``launched``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shared_rank_launch import launch_for_selected, results_of


class Chained(nn.Module):
    """Two linears, each in a reentrant checkpoint, the second fed by the first."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return checkpoint(self.b, checkpoint(self.a, x, use_reentrant=True), use_reentrant=True)


class Plain(Chained):
    def forward(self, x):
        return self.b(self.a(x))


def _chained_steps(ddp_cls, rank, steps=3, penalty=False, model_cls=Chained, **options):
    """Grads of every step and the final parameters, SGD with momentum, per-rank random batches;
    ``penalty``: an input gradient through the output (``torch.autograd.grad``) before each loss."""
    model = model_cls()
    ddp = ddp_cls(model, **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 8, generator=g, requires_grad=True)
        out = ddp(x)
        loss = out.pow(2).sum()
        if penalty:
            (gx,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
            loss = loss + gx.detach().sum()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return grads, [p.detach().clone() for p in model.parameters()]


def _close(want, got):
    for a, b in zip(want[0] + [want[1]], got[0] + [got[1]]):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x)


def _chained_worker(rank, world):
    import fusedist

    warnings.filterwarnings("ignore")
    ref = _chained_steps(torch.nn.parallel.DistributedDataParallel, rank)
    _close(ref, _chained_steps(fusedist.DistributedDataParallel, rank))
    _close(ref, _chained_steps(fusedist.DistributedDataParallel, rank, static_graph=True))
    # (torch's find_unused_parameters fails here: "Expected to mark a variable ready only once")
    _close(ref, _chained_steps(fusedist.DistributedDataParallel, rank, find_unused_parameters=True))
    # an input gradient through the output first accumulates nothing: the loss's backward synchronizes
    ref_grad = _chained_steps(torch.nn.parallel.DistributedDataParallel, rank, penalty=True, model_cls=Plain)
    _close(ref_grad, _chained_steps(fusedist.DistributedDataParallel, rank, penalty=True, model_cls=Plain))


def test_chained_reentrant_checkpoints_train_as_torch_ddp(launched):
    results_of(launched, "chained")


class SideFirst(nn.Module):
    """A chain of linears and ``side``, registered last (so in the first bucket, which ZeRO stage
    2 keeps), used where ``use_side`` says."""

    def __init__(self, n=6, d=64):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.side = nn.Linear(d, d)
        self.use_side = False

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x + self.side(x) if self.use_side else x


def _side_steps(rank, pattern, ours, steps=4):
    import fusedist

    model = SideFirst()
    if ours:
        ddp = fusedist.DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.016)
        opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.016)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    peaks = []
    for step in range(steps):
        model.use_side = {"never": False, "odd steps": step % 2 == 1, "rank 1": rank == 1}[pattern]
        g = torch.Generator().manual_seed(100 * step + rank)
        ddp(torch.randn(4, 64, generator=g)).pow(2).sum().backward()
        if ours:
            stats = ddp.reducer.last_stats
            peaks.append((stats["peak_grad_bytes"], stats["grad_bytes"], model.use_side))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], peaks


def _unused_first_worker(rank, world):
    warnings.filterwarnings("ignore")
    for pattern in ("never", "odd steps", "rank 1"):
        want, _ = _side_steps(rank, pattern, ours=False)
        got, peaks = _side_steps(rank, pattern, ours=True)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, msg=lambda m: f"{pattern}: {m}")
        for step, (peak, total, used) in enumerate(peaks):
            if not used:  # the later buckets were reduce-scattered (and released) during backward
                assert peak < total, f"{pattern}, step {step}: held every gradient ({peak} of {total} bytes)"


def test_unused_parameters_in_the_first_bucket_hold_back_no_launch(launched):
    results_of(launched, "unused first")


class OneCheckpoint(Chained):
    def forward(self, x):
        return self.b(checkpoint(self.a, x, use_reentrant=True))


def _hint_worker(rank, world):
    import fusedist

    warnings.filterwarnings("ignore")
    ddp = fusedist.DistributedDataParallel(OneCheckpoint())
    try:
        ddp(torch.randn(4, 8)).sum().backward()  # (the checkpoint's input needs no gradient)
    except RuntimeError as exc:
        text = str(exc)
    else:
        raise AssertionError("no error")
    assert "received no gradient" in text and "static_graph=True" in text, text


def test_no_gradient_error_names_static_graph_for_reentrant_checkpoints(launched):
    results_of(launched, "hint")


def _late_worker(rank, world):
    import fusedist

    warnings.filterwarnings("ignore")
    model = SideFirst()
    ddp = fusedist.DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.016)
    g = torch.Generator().manual_seed(rank)
    # side.weight in the loss outside the forward, its bucket already launched: every rank says so
    # (torch's DDP: "Expected to mark a variable ready only once"), none waits for the others
    reg = model.side.weight.pow(2).sum()
    try:
        (ddp(torch.randn(4, 64, generator=g)).pow(2).sum() + reg).backward()
    except RuntimeError as exc:
        text = str(exc)
    else:
        raise AssertionError("no error")
    assert "['side.weight'] received a gradient" in text and "outside the forward" in text, text


def test_a_gradient_outside_the_forward_graph_is_reported_on_every_rank(launched):
    results_of(launched, "late")


def _replicated(model, **options):
    import fusedist

    return fusedist.replicate(model, **options)


def _replicate_worker(rank, world):
    warnings.filterwarnings("ignore")
    ref = _chained_steps(torch.nn.parallel.DistributedDataParallel, rank)
    _close(ref, _chained_steps(_replicated, rank))
    _close(ref, _chained_steps(_replicated, rank, find_unused_parameters=True))


def test_chained_reentrant_checkpoints_under_replicate_train_as_torch_ddp(launched):
    """``fusedist.replicate`` (no wrapper: forward hooks) hooks its outputs as the wrapper's
    forward does, so its backward through chained reentrant checkpoints ends where the outer
    one ends (it raised "received no gradient: ['a.weight', 'a.bias']")."""
    results_of(launched, "replicate")


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    # (the two backwards that raise last: every rank raised at the same point, but nothing needs to follow them)
    return launch_for_selected(request, {
        "test_chained_reentrant_checkpoints_train_as_torch_ddp": {"chained": (_chained_worker, ())},
        "test_unused_parameters_in_the_first_bucket_hold_back_no_launch": {"unused first": (_unused_first_worker, ())},
        "test_chained_reentrant_checkpoints_under_replicate_train_as_torch_ddp": {
            "replicate": (_replicate_worker, ())},
        "test_no_gradient_error_names_static_graph_for_reentrant_checkpoints": {"hint": (_hint_worker, ())},
        "test_a_gradient_outside_the_forward_graph_is_reported_on_every_rank": {"late": (_late_worker, ())},
    }, 2, timeout=300)
