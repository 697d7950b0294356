"""SyncBatchNorm's backward all-reduce posts no part fingerprint where the forward's statistics
gather already agreed on its layout and the backwards run in the reverse order of the forwards
(Note [the backward's parts agreed in the forward] in fusedist/nn/_grad_order.py), and keeps the
check where they do not.

Oracle: nn.BatchNorm on the concatenated global batch in each rank (torch.nn.SyncBatchNorm does not
run on CPU). fp32 throughout: 1e-5, the tolerance of tests/test_syncbn.py (weight gradients, sums over
the global batch summed again over the ranks: 1e-4 of the gradients' largest magnitude, at least 1e-4
absolute). C = 48, so the sums (2 x 48 fp32, 384 bytes) take gloo's own all-reduce, where the
fingerprints are posted (smaller ones go through the exchange, which labels them instead). A joined
rank's shadows (fusedist DDP's join(), with empty batches on the rank still training) pass no
fingerprint either, in step with the active rank. A forward kept alive on one rank only, never
backpropagated, makes both ranks keep the check for the forwards before it. The scenarios share one
2-rank launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fusedist.nn import SyncBatchNorm
from shared_rank_launch import launch_for_selected, results_of

C = 48
SIZES = (3, 5)  # per-rank batch sizes: the global statistics differ from either rank's
TOL = dict(rtol=1e-5, atol=1e-5)


class _Counting:
    """Counts the part agreements gloo's all-reduces start (torch_comm's AgreedAllReduce)."""

    def __init__(self):
        from fusedist.comm import torch_comm

        self.module, self.original, self.count = torch_comm, torch_comm.AgreedAllReduce, 0
        counting = self

        class Counted(self.original):
            def __init__(self, *args, **kwargs):
                counting.count += 1
                super().__init__(*args, **kwargs)

        torch_comm.AgreedAllReduce = Counted

    def close(self):
        self.module.AgreedAllReduce = self.original


def _batches(seed, steps, tail=(4,)):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(sum(SIZES), C, *tail, generator=gen) * 2 + 1, torch.randn(sum(SIZES), C, *tail, generator=gen))
            for _ in range(steps)]


def _mine(t, rank):
    start = sum(SIZES[:rank])
    return t[start:start + SIZES[rank]]


def _summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def _stack(seed, depth):
    gen = torch.Generator().manual_seed(seed)
    # a Tanh between the layers: a layer straight after another cancels its per-channel scale (its weight
    # gradient is zero but for rounding)
    ours = nn.Sequential(*[m for _ in range(depth) for m in (SyncBatchNorm(C), nn.Tanh())])
    ref = nn.Sequential(*[m for _ in range(depth) for m in (nn.BatchNorm1d(C), nn.Tanh())])
    with torch.no_grad():
        for a, b in zip(ours[::2], ref[::2]):
            w, bias = torch.randn(C, generator=gen), torch.randn(C, generator=gen)
            a.weight.copy_(w), b.weight.copy_(w), a.bias.copy_(bias), b.bias.copy_(bias)
    return ours, ref


def _compare(ours, ref, rank, y, y_ref, x, x_ref):
    torch.testing.assert_close(y, _mine(y_ref, rank), **TOL)
    torch.testing.assert_close(x.grad, _mine(x_ref.grad, rank), **TOL)
    for a, b in zip(ours[::2], ref[::2]):
        # a sum over the global batch of products through the stack: fp32 rounding relative to its largest terms
        scale = max(1.0, (b.weight.grad.abs().max() + b.bias.grad.abs().max()).item())
        torch.testing.assert_close(_summed(a.weight.grad), b.weight.grad, rtol=1e-4, atol=1e-4 * scale)
        torch.testing.assert_close(a.running_mean, b.running_mean, **TOL)
        torch.testing.assert_close(a.running_var, b.running_var, **TOL)


def _in_order(rank, world):
    """Two layers, two steps, backward in reverse forward order: no fingerprint at all."""
    ours, ref = _stack(1, 2)
    counting = _Counting()
    try:
        for X, DY in _batches(2, 2):
            for m in (ours, ref):
                m.zero_grad()
            x = _mine(X, rank).clone().requires_grad_()
            y = ours(x)
            (y * _mine(DY, rank)).sum().backward()
            x_ref = X.clone().requires_grad_()
            y_ref = ref(x_ref)
            (y_ref * DY).sum().backward()
            _compare(ours, ref, rank, y, y_ref, x, x_ref)
    finally:
        counting.close()
    return counting.count


def _out_of_order(rank, world):
    """Two separate graphs backpropagated in forward order (first layer's loss first) on every
    rank: the first backward is out of order and keeps the check, the second is in order."""
    (a, _, b, _), (ra, _, rb, _) = _stack(3, 2)
    counting = _Counting()
    try:
        (X, DY), (X2, DY2) = _batches(4, 2)
        x, x2 = _mine(X, rank).clone().requires_grad_(), _mine(X2, rank).clone().requires_grad_()
        ya, yb = a(x), b(x2)
        (ya * _mine(DY, rank)).sum().backward()
        (yb * _mine(DY2, rank)).sum().backward()
        x_ref, x2_ref = X.clone().requires_grad_(), X2.clone().requires_grad_()
        ya_ref, yb_ref = ra(x_ref), rb(x2_ref)
        (ya_ref * DY).sum().backward()
        (yb_ref * DY2).sum().backward()
        _compare([a, None], [ra, None], rank, ya, ya_ref, x, x_ref)
        _compare([b, None], [rb, None], rank, yb, yb_ref, x2, x2_ref)
    finally:
        counting.close()
    return counting.count


def _kept_on_one_rank(rank, world):
    """Two training forwards of one layer; rank 0 keeps the second's output alive, never
    backpropagated, rank 1 drops it; then the first is backpropagated. Both ranks keep the check
    (a fingerprint each: rank 0 finds a live forward above the first, rank 1 a dead one) and
    meet in one all-reduce. Before, rank 1 skipped the fingerprint rank 0 waited for, until the
    timeout."""
    (layer, _), (ref, _) = _stack(5, 1)
    counting = _Counting()
    try:
        (X, DY), (X2, _) = _batches(6, 2)
        x = _mine(X, rank).clone().requires_grad_()
        y = layer(x)
        kept = [layer(_mine(X2, rank).clone().requires_grad_())]
        if rank == 1:
            kept.clear()
        (y * _mine(DY, rank)).sum().backward()
        kept.clear()
    finally:
        counting.close()
    x_ref = X.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * DY).sum().backward()
    ref(X2)  # (the second forward's share of the running statistics)
    _compare([layer, None], [ref, None], rank, y, y_ref, x, x_ref)
    return counting.count


JOIN_SIZES = {0: [4, 0, 3, 0, 5], 1: [5, 2]}  # rank 1 joins after two batches; rank 0 has empty ones


def _join_model(sync_bn_cls):
    torch.manual_seed(11)
    model = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, C), nn.BatchNorm1d(C), nn.Tanh(), nn.Linear(C, 4))
    return model if sync_bn_cls is None else sync_bn_cls.convert_sync_batchnorm(model)


def _join_batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    n = JOIN_SIZES[rank][step]
    return torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)


def _joined_with_empty_batches(rank, world):
    """fusedist DDP under join(): rank 1 runs out of inputs while rank 0 goes on with batches of
    other sizes, empty ones included (an empty global batch: torch's BatchNorm returns an empty
    output, counts the batch and leaves the running statistics). The joined rank's shadows
    all-reduce without fingerprints as the active rank's in-order backwards do. Oracle: BatchNorm
    on the active ranks' concatenated batches, loss summed over them / world (DDP averages); a
    sum-of-squares loss, which an empty batch makes 0 (a mean would be NaN)."""
    import fusedist

    ours = fusedist.DistributedDataParallel(_join_model(fusedist.nn.SyncBatchNorm))
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    with ours.join():
        for i in range(len(JOIN_SIZES[rank])):
            x, y = _join_batch(rank, i)
            opt.zero_grad()
            ((ours(x) - y) ** 2).sum().div(8).backward()
            opt.step()
    ours.check_consistency()
    ref = _join_model(None)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(max(map(len, JOIN_SIZES.values()))):
        data = [_join_batch(r, i) for r in range(world) if len(JOIN_SIZES[r]) > i]
        out = ref(torch.cat([x for x, _ in data]))
        opt_ref.zero_grad()
        ((out - torch.cat([y for _, y in data])) ** 2).sum().div(8 * world).backward()
        opt_ref.step()
    for (name, a), b in zip(list(ref.named_parameters()) + list(ref.named_buffers()),
                            list(ours.module.parameters()) + list(ours.module.buffers())):
        torch.testing.assert_close(b, a, **TOL, msg=lambda m: f"{name}: {m}")
    return True


def _other_width_on_one_rank(rank, world):
    """A converted layer with another channel count on rank 1: refused on every rank in the
    forward, before any gradient all-reduce, naming the layer and each rank's width."""
    model = SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(C + rank)))
    try:
        model[1](torch.randn(3, C + rank, requires_grad=True)).sum().backward()
    except ValueError as exc:
        return str(exc)
    return None


def _other_momentum_on_one_rank(rank, world):
    """momentum 0.1 on rank 0, 0.3 on rank 1: the running statistics part at the first step, and the
    second forward is refused on every rank, the message naming momentum among the causes."""
    layer = SyncBatchNorm(C, momentum=0.1 + 0.2 * rank)
    x = torch.randn(3, C, generator=torch.Generator().manual_seed(rank)) * 2 + 1
    try:
        for _ in range(2):
            layer(x)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, {
        "test_in_order_backward_posts_no_fingerprint": {"in_order": (_in_order, ())},
        "test_out_of_order_backward_keeps_the_check": {"out_of_order": (_out_of_order, ())},
        "test_joined_rank_and_empty_batches_match_batchnorm": {"joined": (_joined_with_empty_batches, ())},
        "test_a_forward_kept_on_one_rank_only_keeps_the_check_on_both": {"kept": (_kept_on_one_rank, ())},
        # (these raise on every rank: last)
        "test_other_momentum_on_one_rank_is_refused_naming_momentum": {"momentum": (_other_momentum_on_one_rank, ())},
        "test_other_width_on_one_rank_is_refused_naming_the_layer": {"width": (_other_width_on_one_rank, ())},
    }, 2, timeout=180)


def test_in_order_backward_posts_no_fingerprint(launched):
    assert results_of(launched, "in_order") == [0, 0]


def test_out_of_order_backward_keeps_the_check(launched):
    assert results_of(launched, "out_of_order") == [1, 1]


def test_joined_rank_and_empty_batches_match_batchnorm(launched):
    assert results_of(launched, "joined") == [True, True]


def test_a_forward_kept_on_one_rank_only_keeps_the_check_on_both(launched):
    assert results_of(launched, "kept") == [1, 1]


def test_other_width_on_one_rank_is_refused_naming_the_layer(launched):
    for rank, message in enumerate(results_of(launched, "width")):
        assert message is not None, f"rank {rank} was not refused"
        assert f"SyncBatchNorm '1': ranks disagree on the number of channels (per rank: [{C}, {C + 1}]; " \
               f"rank {rank} has {C + rank})" in message, message


def test_other_momentum_on_one_rank_is_refused_naming_momentum(launched):
    for rank, message in enumerate(results_of(launched, "momentum")):
        assert message is not None, f"rank {rank} was not refused"
        assert "not normalizing the same layer" in message and "num_batches_tracked=2" in message, message
        assert "momentum differs between ranks" in message, message
