"""Two follow-ups, each against torch:

* ``fusedist.clip_grad_norm_`` over a ``fully_shard`` model with complex parameters measures
  complex gradients by their magnitudes, as ``torch.nn.utils.clip_grad_norm_`` does, for every
  norm order, in float64 for complex128: the norm and the clipped gradients match torch's clip
  on the unsharded model, and torch FSDP2's clip where FSDP2 takes the model (one dtype);
* SyncBatchNorm under ``model.join()`` with buffers not broadcast: a rank that ran out of
  inputs keeps its running statistics and ``num_batches_tracked`` in step with the ranks still
  training, so training goes on after the context; the statistics match BatchNorm on the
  concatenated batches of the ranks still training, in one process (torch's SyncBatchNorm does
  not run on CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from fusedist.testing import run_distributed

INF = float("inf")
ORDERS = [2.0, 1.0, INF, -INF, 0.0, 3.5, -1.5]


class _Complex(nn.Module):
    """``x @ w.T`` with a complex weight, and a real bias of the matching real dtype when asked."""

    def __init__(self, dtype, with_real: bool):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 3, dtype=dtype, generator=g))
        self.b = nn.Parameter(torch.randn(4, dtype=dtype.to_real(), generator=g)) if with_real else None

    def forward(self, x):
        y = x @ self.w.T
        return y if self.b is None else y + self.b


def _input(rank, dtype):
    return torch.randn(5, 3, dtype=dtype, generator=torch.Generator().manual_seed(rank))


def _clip_each_order(model, clip) -> list:
    """``clip(params, nt)`` for each order from the same gradients: (norm, clipped gradients) each."""
    params = list(model.parameters())
    saved = [p.grad.clone() for p in params]
    out = []
    for nt in ORDERS:
        for p, g in zip(params, saved):
            p.grad.copy_(g)
        total = clip(params, nt)
        out.append((total, [p.grad.clone() for p in params]))
    return out


def _complex_case(rank, ws, mesh, dtype, with_real):
    """(mismatches) of fusedist's clip against torch's on the unsharded model and FSDP2's."""
    import fusedist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours = fusedist.fully_shard(_Complex(dtype, with_real), mesh=mesh)
    ours(_input(rank, dtype)).abs().sum().backward()
    got = _clip_each_order(ours, lambda ps, nt: fusedist.clip_grad_norm_(ps, 1.0, nt))
    ref = _Complex(dtype, with_real)  # the gradient fully_shard averages: the mean of the ranks' losses
    (sum(ref(_input(r, dtype)).abs().sum() for r in range(ws)) / ws).backward()
    expected = _clip_each_order(ref, lambda ps, nt: torch.nn.utils.clip_grad_norm_(ps, 1.0, nt))
    if not with_real:  # torch FSDP2 wants one parameter dtype per group
        theirs = torch_fully_shard(_Complex(dtype, with_real), mesh=mesh)
        theirs(_input(rank, dtype)).abs().sum().backward()
        fsdp2 = _clip_each_order(theirs, lambda ps, nt: torch.nn.utils.clip_grad_norm_(ps, 1.0, nt).full_tensor())
    # complex64: float32 sums of 12-16 magnitudes, in another order over the pieces (a few ulp);
    # complex128: float64 ones, returned in float64 as torch's
    fp64 = dtype == torch.complex128
    tol = dict(rtol=1e-12, atol=0) if fp64 else dict(rtol=2e-6, atol=1e-7)
    bad = []
    for i, nt in enumerate(ORDERS):
        total, grads = got[i]
        same = torch.allclose(total.double(), expected[i][0].double(), **tol)
        if not same or (fp64 and total.dtype != torch.float64):
            bad.append((nt, "torch", total, expected[i][0]))
        if not with_real and not torch.allclose(total.double(), fsdp2[i][0].double(), **tol):
            bad.append((nt, "fsdp2", total, fsdp2[i][0]))
        # this rank's pieces of the clipped gradients: the whole gradient's rows, split over the ranks
        for name, g, full in zip(("w", "b"), grads, expected[i][1]):
            piece = full.chunk(ws)[rank] if rank < len(full.chunk(ws)) else full[:0]
            if g.shape != piece.shape or not torch.allclose(g, piece, **tol):
                bad.append((nt, "grad", name))
    return [(str(dtype), with_real, *b) for b in bad]


def _complex_worker(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    bad = []
    for dtype in (torch.complex64, torch.complex128):
        for with_real in (False, True):
            bad += _complex_case(rank, ws, mesh, dtype, with_real)
    assert not bad, bad


def test_clip_of_complex_gradients_matches_torch_for_every_order():
    run_distributed(_complex_worker, 2, timeout=60)


def _batch(rank, step, n=6):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _bn_model():
    torch.manual_seed(11)  # (momentum None: the cumulative average, counted by num_batches_tracked)
    return nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=None), nn.Tanh(),
                         nn.Linear(16, 4))


def _ref_step(ref, opt, world, data):
    """One step of BatchNorm on the concatenated batches of ``data``'s ranks, loss summed over
    them / world size (the gradient DDP averages)."""
    out = ref(torch.cat([x for x, _ in data]))
    loss = sum(nn.functional.mse_loss(o, y) for o, (_, y) in zip(out.split(6), data)) / world
    opt.zero_grad()
    loss.backward()
    opt.step()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(list(a.parameters()) + list(a.buffers()), list(b.parameters()) + list(b.buffers()))
    return max((x.double() - y.double()).abs().max().item() for x, y in pairs)


def _join_case(rank, world, counts, setting, freeze_at=None):
    """Train under join with ``setting`` (buffers not broadcast), then one more step on every
    rank after the context; each rank's model against the one-process reference. ``freeze_at``:
    the iteration from which the first BatchNorm and Linear are frozen (then no rank wants the
    second BatchNorm's input gradient, whatever a rank that joined earlier ran last)."""
    import fusedist

    ours = fusedist.DistributedDataParallel(fusedist.nn.SyncBatchNorm.convert_sync_batchnorm(_bn_model()),
                                            **{setting: False})
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ref = _bn_model()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    with ours.join():
        for i in range(counts[rank]):
            if i == freeze_at:
                ours.module[:2].requires_grad_(False)
            x, y = _batch(rank, i)
            opt.zero_grad()
            nn.functional.mse_loss(ours(x), y).backward()
            opt.step()
    for i in range(max(counts)):
        if i == freeze_at:
            ref[:2].requires_grad_(False)
        _ref_step(ref, opt_ref, world, [_batch(r, i) for r in range(world) if counts[r] > i])
    after_join = _max_diff(ref, ours.module)
    x, y = _batch(rank, 100)  # every rank trains again: refused before on every rank as layers mixed up
    opt.zero_grad()
    nn.functional.mse_loss(ours(x), y).backward()
    opt.step()
    _ref_step(ref, opt_ref, world, [_batch(r, 100) for r in range(world)])
    tracked = [int(m.num_batches_tracked) for m in ours.module if hasattr(m, "num_batches_tracked")]
    return after_join, _max_diff(ref, ours.module), tracked


def _join_worker(rank, world):
    out = {}
    out["forward_sync_buffers=False"] = _join_case(rank, world, [2, 3, 4], "forward_sync_buffers")
    out["broadcast_buffers=False, a rank without batches, frozen"] = _join_case(
        rank, world, [0, 2, 4], "broadcast_buffers", freeze_at=3)
    return out


def test_join_keeps_running_stats_of_joined_ranks_without_buffer_broadcast():
    results = run_distributed(_join_worker, 3, timeout=60)
    for rank, out in enumerate(results):
        for case, (after_join, after_step, tracked) in out.items():
            # float32 training, a few dozen ops per value: as tests/test_ddp_join.py
            assert after_join < 2e-5 and after_step < 2e-5, (rank, case, after_join, after_step)
            assert tracked == [5, 5], (rank, case, tracked)  # max(counts) + 1 forwards, on every rank
