"""fusedist.nn.SyncBatchNorm under inputs and uses that tests/test_syncbn.py does not cover.

The oracle is again nn.BatchNorm on the global batch (torch.nn.SyncBatchNorm cannot run on
CPU). All multi-rank probes share one spawn of 3 gloo ranks; each probe reports "ok" or its
error, so one failure does not hide the others.
"""

from __future__ import annotations

import copy
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fusedist.nn import SyncBatchNorm
from fusedist.testing import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)
_BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _slice(t, sizes, rank):
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def _pair(C, dim, **kw):
    ours, ref = SyncBatchNorm(C, **kw), _BN[dim](C, **kw)
    if ours.affine:
        g = torch.Generator().manual_seed(5)
        w, b = torch.randn(C, generator=g), torch.randn(C, generator=g)
        with torch.no_grad():
            for m in (ours, ref):
                m.weight.copy_(w)
                m.bias.copy_(b)
    return ours, ref


def _all_sum(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def _data(sizes, shape, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn((sum(sizes),) + shape, generator=g) * 2 + 3
    DY = torch.randn((sum(sizes),) + shape, generator=g)
    return X, DY


def _step(module, x, dy):
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * dy).sum().backward()
    return y, x.grad


# ----------------------------------------------------------------------------- probes


def _one_value_per_rank(rank, ws):
    """Each rank holds a single (1, C, 1, 1) sample: its own variance is that of one value,
    the global one is valid. Both layouts, momentum 0.1 and None (cumulative average)."""
    for layout in (torch.contiguous_format, torch.channels_last):
        for kw in ({}, {"momentum": None}):
            X, DY = _data([1] * ws, (3, 1, 1), seed=1)
            ours, ref = _pair(3, 4, **kw)
            for _ in range(2):
                y, dx = _step(ours, X[rank:rank + 1].contiguous(memory_format=layout), DY[rank:rank + 1])
                ref_y, ref_dx = _step(ref, X, DY)
                torch.testing.assert_close(y, ref_y[rank:rank + 1], **TOL)
                torch.testing.assert_close(dx, ref_dx[rank:rank + 1], **TOL)
            for name in ("running_mean", "running_var"):
                torch.testing.assert_close(getattr(ours, name), getattr(ref, name), **TOL)
            torch.testing.assert_close(_all_sum(ours.weight.grad), ref.weight.grad, **TOL)
            assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 2


def _different_lengths(rank, ws):
    """(N, C, L) with a different L on every rank: statistics weigh each rank by its count of
    values per channel (N * L), not by its batch size."""
    lengths = [5, 7, 3][:ws]
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 3, L, generator=g) * 2 + 1 for L in lengths]
    dys = [torch.randn(2, 3, L, generator=g) for L in lengths]
    ours, ref = _pair(3, 3)
    y, dx = _step(ours, xs[rank], dys[rank])

    def flat(ts):  # every value of a channel along one axis: (1, C, sum N * L)
        return torch.cat([t.permute(1, 0, 2).reshape(3, -1) for t in ts], 1)[None]

    ref_y, ref_dx = _step(ref, flat(xs), flat(dys))
    start, L = sum(2 * n for n in lengths[:rank]), lengths[rank]

    def mine(t):
        return t[0, :, start:start + 2 * L].reshape(3, 2, L).permute(1, 0, 2)

    torch.testing.assert_close(y, mine(ref_y), **TOL)
    torch.testing.assert_close(dx, mine(ref_dx), **TOL)
    torch.testing.assert_close(ours.running_var, ref.running_var, **TOL)


def _nan_on_one_rank(rank, ws):
    """A NaN in one rank's input poisons that channel on every rank (as BatchNorm on the
    global batch does), and only that channel."""
    sizes = (2, 3, 2)[:ws]
    X, DY = _data(sizes, (3, 4), seed=3)
    X[sizes[0], 1, 2] = float("nan")  # rank 1, channel 1
    ours, ref = _pair(3, 3)
    y, dx = _step(ours, _slice(X, sizes, rank), _slice(DY, sizes, rank))
    ref_y, ref_dx = _step(ref, X, DY)
    close = dict(equal_nan=True, **TOL)
    torch.testing.assert_close(y, _slice(ref_y, sizes, rank), **close)
    torch.testing.assert_close(dx, _slice(ref_dx, sizes, rank), **close)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, **close)
    torch.testing.assert_close(ours.running_var, ref.running_var, **close)
    torch.testing.assert_close(_all_sum(ours.weight.grad), ref.weight.grad, **close)
    assert y[:, 1].isnan().all() and not y[:, [0, 2]].isnan().any()


def _backward_twice(rank, ws):
    """backward(retain_graph=True) then backward again: gradients accumulate twice."""
    sizes = (2, 3, 2)[:ws]
    X, DY = _data(sizes, (3, 4), seed=4)
    ours, ref = _pair(3, 3)
    x = _slice(X, sizes, rank).clone().requires_grad_(True)
    loss = (ours(x) * _slice(DY, sizes, rank)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    xr = X.clone().requires_grad_(True)
    ref_loss = (ref(xr) * DY).sum()
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    torch.testing.assert_close(x.grad, _slice(xr.grad, sizes, rank), **TOL)
    torch.testing.assert_close(_all_sum(ours.weight.grad), ref.weight.grad, **TOL)


def _subset_groups(rank, ws):
    """Ranks [0, 1] synchronize in one group, rank 2 alone in another (a group of one:
    plain BatchNorm)."""
    g01, g2 = dist.new_group([0, 1]), dist.new_group([2])  # collective: every rank creates both
    sizes = (2, 3, 2)
    X, DY = _data(sizes, (3, 4), seed=6)
    ours, ref = _pair(3, 3)
    ours.process_group = g01 if rank < 2 else g2
    y, dx = _step(ours, _slice(X, sizes, rank), _slice(DY, sizes, rank))
    members = slice(0, 5) if rank < 2 else slice(5, 7)
    ref_y, ref_dx = _step(ref, X[members], DY[members])
    mine = slice(0, 2) if rank != 1 else slice(2, 5)
    torch.testing.assert_close(y, ref_y[mine], **TOL)
    torch.testing.assert_close(dx, ref_dx[mine], **TOL)
    torch.testing.assert_close(ours.running_var, ref.running_var, **TOL)
    _converted_with_a_group_that_leaves_rank_2_out(rank, g01)


def _converted_with_a_group_that_leaves_rank_2_out(rank, g01):
    """``convert_sync_batchnorm(model, g01)`` on every rank: rank 2, outside the group (its
    ``new_group`` returned torch's non-member placeholder), trains as torch.nn.SyncBatchNorm
    does there -- BatchNorm on its own batch, running statistics and count included -- and
    is warned once, by rank, naming both layers (it named only the first to run); ranks 0 and
    1 synchronize over their two batches. (Its forward used to be refused.)"""
    sizes = (2, 3, 4)
    X, _ = _data(sizes, (3, 5), seed=9)
    DY = torch.randn(sum(sizes), 4, 5, generator=torch.Generator().manual_seed(9))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv1d(3, 4, 1), nn.BatchNorm1d(4), nn.Tanh(), nn.BatchNorm1d(4, momentum=None))
    model = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref), process_group=g01)
    batch = slice(0, 5) if rank < 2 else slice(5, 9)  # the batch each rank's statistics cover
    mine = _slice(X, sizes, rank)
    mine_in_batch = {0: slice(0, 2), 1: slice(2, 5), 2: slice(0, 4)}[rank]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            y, dx = _step(model, mine, _slice(DY, sizes, rank))
            ref_y, ref_dx = _step(ref, X[batch], DY[batch])
            torch.testing.assert_close(y, ref_y[mine_in_batch], **TOL)
            torch.testing.assert_close(dx, ref_dx[mine_in_batch], rtol=1e-4, atol=1e-5)  # (through the conv)
    for name in ("1.running_mean", "1.running_var", "3.running_var", "3.num_batches_tracked"):
        torch.testing.assert_close(model.get_buffer(name), ref.get_buffer(name), **TOL)
    outside = [str(w.message) for w in caught if "not a member" in str(w.message)]
    if rank == 2:  # once per process, however many layers and steps, naming every layer it affects
        assert len(outside) == 1, outside
        assert "rank 2 is not a member of the process_group of 2 SyncBatchNorm layers ('1', '3')" in outside[0], outside
    else:
        assert not outside, outside


def _half_params(rank, ws):
    """model.half() / model.bfloat16(): parameters, buffers, output and gradients in the
    half dtype, statistics still computed in fp32."""
    for dt in (torch.float16, torch.bfloat16):
        ours, ref = _pair(3, 4)
        ours.to(dt)
        oracle = copy.deepcopy(ref).double()
        X, _ = _data([2] * ws, (3, 2, 2), seed=8)
        X = X.to(dt)
        x = X[2 * rank:2 * rank + 2].clone().requires_grad_(True)
        y = ours(x)
        y.float().sum().backward()
        assert y.dtype == x.grad.dtype == ours.weight.grad.dtype == ours.running_var.dtype == dt
        want = oracle(X.double())[2 * rank:2 * rank + 2]
        torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=3e-2)
        torch.testing.assert_close(ours.running_var.double(), oracle.running_var, rtol=1e-2, atol=1e-2)


def _autocast(rank, ws):
    """Under CPU autocast a Linear hands bf16 to the layer, whose parameters stay fp32."""
    torch.manual_seed(0)
    lin, ours = nn.Linear(4, 3), SyncBatchNorm(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(torch.randn(3 + rank, 4))
        y = ours(h)
    assert h.dtype == y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32 and lin.weight.grad is not None


def _empty_everywhere(rank, ws):
    """Every rank's batch is empty (e.g. a detection head with no proposals anywhere this
    step): like BatchNorm on an empty batch, an empty output, zero parameter gradients,
    running statistics untouched, num_batches_tracked counted -- not an error."""
    for momentum in (0.1, None):
        ours, ref = _pair(3, 4, momentum=momentum)
        with torch.no_grad():
            for m in (ours, ref):
                m.running_mean.fill_(0.5)
                m.running_var.fill_(2.0)
        x = torch.randn(0, 3, 2, 2, requires_grad=True)
        y = ours(x)
        y.sum().backward()
        ref(torch.randn(0, 3, 2, 2))
        assert y.shape == (0, 3, 2, 2) and x.grad.shape == x.shape
        assert torch.equal(ours.weight.grad, torch.zeros(3))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(getattr(ours, name), getattr(ref, name)), name
        # and the layer synchronizes normally afterwards
        y = ours(torch.randn(2, 3, 2, 2))
        assert not y.isnan().any()


def _eval_batch_stats_empty_rank(rank, ws):
    """Eval with track_running_stats=False normalizes each rank's own batch (no
    communication); an empty one gives an empty output, as BatchNorm does."""
    bn = SyncBatchNorm(3, track_running_stats=False).eval()
    assert bn(torch.randn(0 if rank == 1 else 3, 3, 2, 2)).shape[1:] == (3, 2, 2)


def _double_backward_synchronized(rank, ws):
    """Synchronized training has no double backward (neither has torch's layer there): the
    second backward raises, naming the layer; eval on the same ranks has one (Note [double
    backward where torch's layer has one] in fusedist/nn/_function.py)."""
    bn = SyncBatchNorm(3)
    x = torch.randn(4, 3, 5, requires_grad=True)
    (gx,) = torch.autograd.grad((bn(x) * torch.randn(4, 3, 5)).sum(), x, create_graph=True)
    try:
        gx.square().sum().backward()
    except RuntimeError as exc:
        assert "SyncBatchNorm" in str(exc) and "double backward" in str(exc), exc
    else:
        raise AssertionError("a double backward through synchronized statistics did not raise")
    bn.eval()
    (gx,) = torch.autograd.grad(bn(x).square().sum(), x, create_graph=True)
    gx.square().sum().backward()
    assert bn.weight.grad is not None and bn.weight.grad.abs().sum() > 0


PROBES = [_one_value_per_rank, _different_lengths, _nan_on_one_rank, _backward_twice,
          _subset_groups, _half_params, _autocast, _empty_everywhere, _eval_batch_stats_empty_rank,
          _double_backward_synchronized]


def _probes_rank(rank, ws, probes):
    """Run every probe on this rank; "ok" or the end of its traceback, by name."""
    out = {}
    for probe in probes:
        try:
            probe(rank, ws)
            out[probe.__name__] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported per probe
            out[probe.__name__] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-1500:]
    return out


def run_probes(probes, world: int, timeout: float) -> None:
    """The probes on ``world`` ranks in one spawn; fails listing every probe that failed on a rank."""
    results = run_distributed(_probes_rank, world, probes, timeout=timeout)
    failed = {f"rank {r} {name}": err for r, out in enumerate(results)
              for name, err in out.items() if err != "ok"}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())


def test_adversarial_probes_at_world_size_3():
    run_probes(PROBES, 3, timeout=300)


# ----------------------------------------------------------------------------- one process


def test_empty_batch_single_process_is_batchnorm():
    """No process group: an empty training batch is what BatchNorm makes of it."""
    ours, ref = _pair(3, 4)
    x = torch.randn(0, 3, 2, 2, requires_grad=True)
    ours(x).sum().backward()
    ref(x.detach())
    assert x.grad.shape == x.shape and torch.equal(ours.weight.grad, torch.zeros(3))
    assert torch.equal(ours.running_var, ref.running_var)
    assert int(ours.num_batches_tracked) == 1
    # a single value per channel is still an error, as in BatchNorm
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        ours(torch.randn(1, 3, 1, 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_double_backward_where_torchs_layer_has_one(train, affine, dtype):
    """A gradient penalty (create_graph=True) through the layer where torch.nn.SyncBatchNorm is
    F.batch_norm -- eval with running statistics, training without a process group (Note
    [double backward where torch's layer has one]): the penalty's gradients equal torch's.
    (Synchronized training still raises: _double_backward_synchronized above.) fp64: the same
    formulas, last-bit differences; fp32: a sum over 60 terms twice differentiated, 1e-4."""
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(4, 3, 5, generator=g, dtype=dtype) * 2 + 0.5
    upstream = torch.randn(4, 3, 5, generator=g, dtype=dtype)
    grads = []
    for cls in (nn.SyncBatchNorm, SyncBatchNorm):
        bn = cls(3, affine=affine).to(dtype).train(train)
        with torch.no_grad():
            bn.running_mean.copy_(torch.tensor([0.3, -0.2, 1.0]))
            bn.running_var.copy_(torch.tensor([2.0, 0.5, 1.5]))
            if affine:
                bn.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
                bn.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
        x = x0.clone().requires_grad_()
        (gx,) = torch.autograd.grad((bn(x) * upstream).square().sum(), x, create_graph=True)
        (gx.square().sum() + gx.sum()).backward()
        grads.append([x.grad, gx.detach(), *([bn.weight.grad, bn.bias.grad] if affine else [])])
    for theirs, ours in zip(*grads):
        torch.testing.assert_close(ours, theirs, **tol)
    assert grads[1][0].abs().sum() > 0


def _nested_model():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn3 = nn.BatchNorm3d(2, momentum=None, eps=1e-3)
            self.seq = nn.Sequential(nn.BatchNorm1d(4, affine=False),
                                     nn.ModuleList([nn.BatchNorm2d(5, track_running_stats=False)]))

    model = nn.Sequential(nn.BatchNorm2d(3), Inner())
    model[0].weight.requires_grad_(False)
    model[1].seq.eval()
    model[1].seq[1][0].bias.requires_grad_(False)
    with torch.no_grad():
        model[0].running_mean.fill_(2.0)
        model[1].bn3.num_batches_tracked.fill_(3)
    return model


def test_convert_nested_keeps_tensors_flags_and_options():
    model = _nested_model()
    tensors = dict(model.state_dict(keep_vars=True))
    training = {n: m.training for n, m in model.named_modules()}
    requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
    options = {n: (m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats)
               for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    group = object()  # stands for a process group: carried over as is
    converted = SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    assert converted is model
    after = converted.state_dict(keep_vars=True)
    assert after.keys() == tensors.keys()
    assert all(after[k] is tensors[k] for k in tensors)
    assert {n: m.training for n, m in converted.named_modules()} == training
    assert {n: p.requires_grad for n, p in converted.named_parameters()} == requires_grad
    converted_bns = {n: m for n, m in converted.named_modules() if isinstance(m, SyncBatchNorm)}
    assert converted_bns.keys() == options.keys()
    for n, m in converted_bns.items():
        assert (m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats) == options[n], n
        assert m.process_group is group
    assert converted[1].seq[1][0].running_mean is None


def test_convert_uninitialized_lazy_batchnorm_is_refused():
    """A LazyBatchNorm has no num_features until its first forward; converting it before
    would make a layer of 0 channels that fails later with a misleading message."""
    with pytest.raises(ValueError, match="LazyBatchNorm2d.*uninitialized.*forward"):
        SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))
    lazy = nn.Sequential(nn.LazyBatchNorm2d())
    lazy(torch.randn(2, 3, 2, 2))  # initialized: converts like any BatchNorm2d
    assert SyncBatchNorm.convert_sync_batchnorm(lazy)[0].num_features == 3
