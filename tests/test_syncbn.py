"""fusedist.nn.SyncBatchNorm against nn.BatchNorm on the concatenated global batch.

torch.nn.SyncBatchNorm cannot run on CPU, so the oracle is plain BatchNorm applied, inside
every rank, to the whole global batch (built from one seed): outputs, input gradients, the
sum over ranks of the weight/bias gradients, and the running statistics must match it.
Multi-process cases run under gloo with world sizes 2 and 3 and unequal per-rank batches
(including an empty one and batch size 1); many checks share one spawn.
"""

from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch
import torch.nn as nn
from conftest import rank_slot_count, requires_rank_slots

from fusedist.nn import SyncBatchNorm
from fusedist.testing import device_for_rank, run_distributed
from shared_rank_launch import launch_for_selected, results_of

# fp32 against fp32 BatchNorm: both are exact up to fp32 rounding of sums over ~100 values.
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
# Half precision: the result is rounded once to the input dtype (half an ulp, eps/2 relative)
# by both implementations. We must be within twice torch's own half-precision error against
# an fp64 oracle, or within one ulp (eps) of the largest value, whichever is larger.
HALF_EPS = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}

_BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


# ----------------------------------------------------------------------------- helpers


def _to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout != "channels_last" or x.dim() == 2:
        return x.contiguous()
    if x.dim() == 3:  # (N, C, L) stored as (N, L, C)
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def _global_data(sizes, C, tail, seed, steps=2):
    """Per step: global input (mean 3, std 2: a non-zero mean exercises the centering) and a
    random upstream gradient, plus initial weight/bias, all from one seed."""
    g = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    xs = [torch.randn((total, C) + tail, generator=g) * 2 + 3 for _ in range(steps)]
    dys = [torch.randn((total, C) + tail, generator=g) for _ in range(steps)]
    weight, bias = torch.randn(C, generator=g), torch.randn(C, generator=g)
    return xs, dys, weight, bias


def _rank_slice(t, sizes, rank):
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def _make_pair(C, dim, weight, bias_init, dtype_params=torch.float32, **kw):
    ours = SyncBatchNorm(C, **kw)
    ref = _BN[dim](C, **kw)
    for m in (ours, ref):
        if m.affine:
            with torch.no_grad():
                m.weight.copy_(weight)
                if m.bias is not None:
                    m.bias.copy_(bias_init)
        m.to(dtype_params)
    return ours, ref


def _run_steps(module, xs, dys, layout, dtype, train=True):
    """Forward + backward for every step; returns the last step's (y, dx) and the module's
    accumulated parameter gradients."""
    module.train(train)
    outs = []
    for x, dy in zip(xs, dys):
        # a fresh leaf (clone keeps the layout): never mark the shared global batch
        x = _to_layout(x.to(dtype), layout).clone().requires_grad_(True)
        y = module(x)
        (y.float() * dy).sum().backward()
        outs.append((y, x.grad))
    return outs[-1]


def _grads(module):
    if not module.affine:
        return None, None
    bias_grad = torch.zeros(0) if module.bias is None else module.bias.grad.clone()
    return module.weight.grad.clone(), bias_grad


def _all_reduce_sum(t):
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t)
    return t


class _CountingObserver:
    """Counts collectives launched through the communicator (its observer hook)."""

    def __init__(self):
        self.launched = []

    def on_launch(self, comm, handle):
        self.launched.append(handle.tag)

    def on_failure(self, comm, handle, error):
        pass


# ----------------------------------------------------------------------------- one case


def _check_case(rank, world_size, case):
    """Run one configuration on this rank and compare with the global-batch oracle.

    Returns this rank's running statistics (the parent checks they are bit-identical on
    every rank) and a short summary of the worst errors.
    """
    sizes, C, tail, layout, dtype = case["sizes"], case["C"], case["tail"], case["layout"], case["dtype"]
    kw = case.get("kw", {})
    dim = 2 + len(tail)
    xs, dys, weight, bias = _global_data(sizes, C, tail, seed=case.get("seed", 0))
    if dtype != torch.float32:  # the oracle must see the very values the rank sees
        xs = [x.to(dtype).float() for x in xs]
        dys = [dy.to(dtype).float() for dy in dys]
    ours, ref = _make_pair(C, dim, weight, bias, **kw)
    my_xs = [_rank_slice(x, sizes, rank) for x in xs]
    my_dys = [_rank_slice(dy, sizes, rank) for dy in dys]
    y, dx = _run_steps(ours, my_xs, my_dys, layout, dtype)
    gw, gb = _grads(ours)
    if ours.affine:
        gw, gb = _all_reduce_sum(gw), _all_reduce_sum(gb)

    if dtype == torch.float32:
        ref_y, ref_dx = _run_steps(ref, xs, dys, "contiguous", torch.float32)
        ref_gw, ref_gb = _grads(ref)
    else:
        # fp64 oracle, and torch's own half-precision BatchNorm for the error budget
        oracle = copy.deepcopy(ref).double()
        ref_y, ref_dx = _run_steps(oracle, xs, dys, "contiguous", torch.float64)
        torch_y, torch_dx = _run_steps(copy.deepcopy(ref), xs, dys, "contiguous", dtype)
        ref_gw, ref_gb = _grads(oracle)

    def compare(name, got, want, torch_got=None):
        got = got.double()
        want = want.double()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want.to(got.dtype), **FP32_TOL, msg=lambda m: f"{name}: {m}")
            return (got - want).abs().max().item() if got.numel() else 0.0
        err = (got - want).abs().max().item() if got.numel() else 0.0
        torch_err = (torch_got.double() - want).abs().max().item() if got.numel() else 0.0
        budget = max(2 * torch_err, HALF_EPS[dtype] * (want.abs().max().item() if got.numel() else 0.0))
        assert err <= budget, f"{name}: error {err:.3g} > budget {budget:.3g} (torch's own: {torch_err:.3g})"
        return err

    from fusedist.backend import select_backend

    errors = {"backend": select_backend("sync_batch_norm", "cpu")}
    my_ref_y = _rank_slice(ref_y, sizes, rank)
    assert y.shape == my_ref_y.shape and y.dtype == dtype
    if layout == "channels_last" and dim >= 4 and y.numel():
        fmt = torch.channels_last if dim == 4 else torch.channels_last_3d
        assert y.is_contiguous(memory_format=fmt), "the output keeps channels_last"
    errors["y"] = compare("output", y.detach(), my_ref_y,
                          None if dtype == torch.float32 else _rank_slice(torch_y, sizes, rank))
    errors["dx"] = compare("input grad", dx, _rank_slice(ref_dx, sizes, rank),
                           None if dtype == torch.float32 else _rank_slice(torch_dx, sizes, rank))
    if ours.affine:
        # parameter gradients are fp32 sums of exactly representable products for every
        # input dtype, so fp32 accuracy applies to all of them
        torch.testing.assert_close(gw.double(), ref_gw.double(), **FP32_TOL)
        torch.testing.assert_close(gb.double(), ref_gb.double(), **FP32_TOL)
    ref_stats = ref if dtype == torch.float32 else oracle
    if ours.track_running_stats:
        torch.testing.assert_close(ours.running_mean.double(), ref_stats.running_mean.double(), **FP32_TOL)
        torch.testing.assert_close(ours.running_var.double(), ref_stats.running_var.double(), **FP32_TOL)
        assert int(ours.num_batches_tracked) == int(ref_stats.num_batches_tracked)

    # Eval mode: no communication at all. With running statistics it normalizes with them;
    # without, with this rank's own batch (as torch.nn.SyncBatchNorm does).
    from fusedist.comm import get_communicator

    comm = get_communicator()
    comm.observer = observer = _CountingObserver()
    ev_y, ev_dx = _run_steps(ours, my_xs[:1], my_dys[:1], layout, dtype, train=False)
    comm.observer = None
    assert observer.launched == [], f"eval mode launched collectives: {observer.launched}"
    if dtype == torch.float32:
        if ours.track_running_stats:
            ref_ev_y, ref_ev_dx = _run_steps(ref_stats, xs[:1], dys[:1], "contiguous", dtype, train=False)
            ref_ev_y, ref_ev_dx = _rank_slice(ref_ev_y, sizes, rank), _rank_slice(ref_ev_dx, sizes, rank)
        else:
            ref_ev_y, ref_ev_dx = _run_steps(ref_stats, my_xs[:1], my_dys[:1], "contiguous", dtype, train=False)
        torch.testing.assert_close(ev_y.detach(), ref_ev_y, **FP32_TOL)
        torch.testing.assert_close(ev_dx, ref_ev_dx, **FP32_TOL)
    if not ours.track_running_stats:
        return None, None, errors
    # plain lists: tensors sent back through the result queue would be shared-memory handles
    return ours.running_mean.tolist(), ours.running_var.tolist(), errors


# ----------------------------------------------------------------------------- spawned runs


def _cases_rank(rank, world_size, cases):

    results = []
    default = os.environ.get("FUSEDIST_KERNEL_BACKEND", "auto")
    for case in cases:
        # FUSEDIST_KERNEL_BACKEND is read at every call: "torch" selects the pure-PyTorch
        # (CPU fallback) path instead of the interpreted Triton kernels for this case
        os.environ["FUSEDIST_KERNEL_BACKEND"] = case.get("backend", default)
        try:
            results.append(_check_case(rank, world_size, case))
        finally:
            os.environ["FUSEDIST_KERNEL_BACKEND"] = default
    return results


def _assert_identical_running_stats(results):
    for case_idx in range(len(results[0])):
        mean0, var0, _ = results[0][case_idx]
        for rank_results in results[1:]:
            mean, var, _ = rank_results[case_idx]
            if mean0 is None:
                assert mean is None
                continue
            assert mean == mean0 and var == var0, "running stats differ across ranks"


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

WORLD2_CASES = [
    dict(sizes=(3, 5), C=4, tail=(3, 5), layout="contiguous", dtype=F32),
    dict(sizes=(3, 5), C=4, tail=(3, 5), layout="channels_last", dtype=F32),
    dict(sizes=(3, 5), C=6, tail=(), layout="contiguous", dtype=F32),  # (N, C)
    dict(sizes=(3, 5), C=3, tail=(7,), layout="channels_last", dtype=F32),  # (N, C, L)
    dict(sizes=(3, 5), C=3, tail=(2, 3, 4), layout="contiguous", dtype=F32),  # (N, C, D, H, W)
    dict(sizes=(3, 5), C=3, tail=(2, 3, 4), layout="channels_last", dtype=F32),
    dict(sizes=(3, 5), C=4, tail=(3, 5), layout="contiguous", dtype=BF16, seed=1),
    dict(sizes=(3, 5), C=4, tail=(3, 5), layout="channels_last", dtype=F16, seed=2),
    dict(sizes=(3, 5), C=4, tail=(3, 5), layout="contiguous", dtype=F32, kw=dict(momentum=None)),
    dict(sizes=(3, 5), C=4, tail=(3,), layout="contiguous", dtype=F32, kw=dict(affine=False)),
    dict(sizes=(3, 5), C=4, tail=(3,), layout="contiguous", dtype=F32, kw=dict(track_running_stats=False)),
]
if "bias" in inspect.signature(nn.BatchNorm1d.__init__).parameters:  # torch >= 2.13
    WORLD2_CASES.append(dict(sizes=(3, 5), C=4, tail=(3,), layout="channels_last", dtype=F32, kw=dict(bias=False)))

WORLD3_CASES = [
    dict(sizes=(4, 1, 6), C=5, tail=(3, 3), layout="contiguous", dtype=F32),
    dict(sizes=(4, 1, 6), C=5, tail=(3, 3), layout="channels_last", dtype=F32),
    dict(sizes=(4, 1, 6), C=5, tail=(), layout="contiguous", dtype=F32),  # a rank with 1 value
    dict(sizes=(2, 0, 3), C=3, tail=(2, 2), layout="contiguous", dtype=F32),  # an empty rank
    dict(sizes=(0, 3, 2), C=3, tail=(2, 2), layout="channels_last", dtype=F32),
    dict(sizes=(1, 0, 1), C=4, tail=(), layout="contiguous", dtype=F32),  # 2 values in all
    dict(sizes=(4, 1, 6), C=3, tail=(2, 2, 3), layout="channels_last", dtype=BF16, seed=3),
    # the same checks on the pure-PyTorch path
    dict(sizes=(4, 1, 6), C=5, tail=(3, 3), layout="channels_last", dtype=F32, backend="torch"),
    dict(sizes=(2, 0, 3), C=3, tail=(4,), layout="contiguous", dtype=F32, backend="torch"),
    dict(sizes=(4, 1, 6), C=3, tail=(2, 2), layout="contiguous", dtype=BF16, backend="torch"),
]


@pytest.mark.parametrize("world_size,cases", [(2, WORLD2_CASES), (3, WORLD3_CASES)], ids=["ws2", "ws3"])
def test_matches_batchnorm_on_global_batch(world_size, cases, request):
    results = results_of(request.getfixturevalue(f"launched{world_size}"), "cases")
    _assert_identical_running_stats(results)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels really ran (interpreted)
        used = [r[2]["backend"] for r in results[0]]
        assert used == [case.get("backend", "triton") for case in cases], used


# ----------------------------------------------------------------------------- collectives


def _collective_counts_rank(rank, world_size):
    from fusedist.comm import get_communicator

    comm = get_communicator()
    comm.observer = observer = _CountingObserver()
    bn = SyncBatchNorm(4)
    x = torch.randn(3 + rank, 4, 5, requires_grad=True)
    counts = {}
    for step in range(2):
        observer.launched.clear()
        y = bn(x)
        counts[f"fwd{step}"] = list(observer.launched)
        observer.launched.clear()
        y.sum().backward()
        counts[f"bwd{step}"] = list(observer.launched)
    # no input gradient wanted: the backward needs no collective
    observer.launched.clear()
    bn(torch.randn(2, 4, 5)).sum().backward()
    counts["bwd_no_input_grad"] = [t for t in observer.launched if t.endswith(".grad")]
    # fp64 input: the pure-PyTorch path, still one collective each way
    observer.launched.clear()
    bn.double()
    bn(torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)).sum().backward()
    counts["fp64"] = list(observer.launched)
    # a group of one rank: plain BatchNorm on the local batch, nothing to talk about
    import torch.distributed as dist

    solo_groups = [dist.new_group([r]) for r in range(world_size)]  # collective: all ranks
    observer.launched.clear()
    solo, plain = SyncBatchNorm(4, process_group=solo_groups[rank]), nn.BatchNorm1d(4)
    x = torch.randn(3 + rank, 4, 5)
    torch.testing.assert_close(solo(x), plain(x), **FP32_TOL)
    torch.testing.assert_close(solo.running_var, plain.running_var, **FP32_TOL)
    counts["solo_group"] = list(observer.launched)
    comm.observer = None
    return counts


def _protocol_rank(rank, world_size):
    return _collective_counts_rank(rank, world_size), _mismatch_rank(rank, world_size)


def test_collectives_and_cross_rank_errors(launched2):
    """One collective per pass, and errors that involve other ranks raised on every rank."""
    for counts, errors in results_of(launched2, "protocol"):
        _check_counts(counts)
        _check_errors(errors)


def _check_counts(counts):
    # the first synchronized forward of a layer also checks channel agreement, once
    assert counts["fwd0"] == ["sync_batch_norm.check", "sync_batch_norm.stats"]
    assert counts["fwd1"] == ["sync_batch_norm.stats"]
    assert counts["bwd0"] == counts["bwd1"] == ["sync_batch_norm.grad"]
    assert counts["bwd_no_input_grad"] == []
    assert counts["fp64"] == ["sync_batch_norm.stats", "sync_batch_norm.grad"]
    assert counts["solo_group"] == []


# ----------------------------------------------------------------------------- errors


def _mismatch_rank(rank, world_size):
    out = {}
    C = 4 if rank == 0 else 5  # a layer built with a different width on rank 1
    with pytest.raises(ValueError) as info:
        SyncBatchNorm(C)(torch.randn(3, C, 2))
    out["channels"] = str(info.value)
    # a global batch with one value per channel cannot be normalized in training
    with pytest.raises(ValueError) as info:
        SyncBatchNorm(3)(torch.randn(1 - rank, 3))
    out["count"] = str(info.value)
    # the group still works afterwards (every rank raised at the same point)
    y = SyncBatchNorm(3)(torch.randn(2, 3))
    out["after"] = tuple(y.shape)
    return out


def _check_errors(out):
    assert "ranks disagree on the number of channels" in out["channels"]
    assert "[4, 5]" in out["channels"], out["channels"]
    assert "more than 1 value per channel" in out["count"]
    assert "[1, 0]" in out["count"], out["count"]
    assert out["after"] == (2, 3)


def test_local_input_errors():
    bn = SyncBatchNorm(3)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        bn(torch.randn(3))
    with pytest.raises(ValueError, match=r"expected 3 channels in dim 1, got 4 \(input shape \(2, 4, 5\)\)"):
        bn(torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(torch.randn(1, 3))


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_single_process_is_batchnorm(layout):
    """No process group: exactly BatchNorm (train steps, running stats, eval)."""
    xs, dys, weight, bias = _global_data((6,), 3, (4, 5), seed=7)
    ours, ref = _make_pair(3, 4, weight, bias)
    for train in (True, False):
        y, dx = _run_steps(ours, xs, dys, layout, F32, train=train)
        ref_y, ref_dx = _run_steps(ref, xs, dys, "contiguous", F32, train=train)
        torch.testing.assert_close(y, ref_y, **FP32_TOL)
        torch.testing.assert_close(dx, ref_dx, **FP32_TOL)
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.running_var, ref.running_var, **FP32_TOL)


def test_fp64_input_uses_fp64_statistics():
    xs, dys, weight, bias = _global_data((5,), 3, (4,), seed=8)
    ours, ref = _make_pair(3, 3, weight, bias, dtype_params=torch.float64)
    y, dx = _run_steps(ours, xs, dys, "contiguous", torch.float64)
    ref_y, ref_dx = _run_steps(ref, xs, dys, "contiguous", torch.float64)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)


class _Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def _resnet_like():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        _Block(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 6), nn.BatchNorm1d(6),
    )


def test_convert_sync_batchnorm_keeps_weights_and_buffers():
    model = _resnet_like()
    with torch.no_grad():  # non-default statistics, so that keeping them is visible
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d | nn.BatchNorm1d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
                m.num_batches_tracked.fill_(7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    model.eval()
    x = torch.randn(4, 3, 6, 6)
    expected = model(x)
    converted = SyncBatchNorm.convert_sync_batchnorm(model)
    kinds = [type(m).__name__ for m in converted.modules() if "BatchNorm" in type(m).__name__]
    assert kinds == ["SyncBatchNorm"] * 4
    after = converted.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    for k, v in after.items():
        assert v is tensors[k], f"{k} is not the same tensor (an optimizer would lose it)"
        assert torch.equal(v, before[k]), k
    assert not converted[1].training
    torch.testing.assert_close(converted(x), expected, **FP32_TOL)
    # a bare BatchNorm root is replaced and returned; torch's SyncBatchNorm converts too
    root = SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm3d(2, momentum=None, eps=1e-3))
    assert isinstance(root, SyncBatchNorm) and root.momentum is None and root.eps == 1e-3
    assert isinstance(SyncBatchNorm.convert_sync_batchnorm(nn.SyncBatchNorm(2)), SyncBatchNorm)
    if "bias" in inspect.signature(nn.BatchNorm1d.__init__).parameters:  # torch >= 2.13
        no_bias = SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3, bias=False))
        assert no_bias.bias is None and no_bias.weight is not None
        assert no_bias.state_dict().keys() == nn.BatchNorm1d(3, bias=False).state_dict().keys()


def _converted_model_rank(rank, world_size, sizes):
    return [_converted_model_check(rank, sizes, layout) for layout in ("contiguous", "channels_last")]


def _converted_model_check(rank, sizes, layout):
    """A converted ResNet-like model on each rank's slice == the original on the global batch."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(sum(sizes), 3, 6, 6, generator=g)
    # a random linear loss: a loss like sum(y^2) right after a BatchNorm has an input gradient
    # that cancels to ~0, which would compare rounding noise
    target = torch.randn(sum(sizes), 6, generator=g)
    ref = _resnet_like()
    model = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    (ref(x) * target).sum().backward()
    mine = _to_layout(_rank_slice(x, sizes, rank), layout)
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    (model(mine) * _rank_slice(target, sizes, rank)).sum().backward()
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
        # conv/linear grads accumulate in a different order than on the global batch
        torch.testing.assert_close(_all_reduce_sum(p.grad), p_ref.grad, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{name}: {m}")
    for (name, b), (_, b_ref) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, b_ref, **FP32_TOL, msg=lambda m: f"{name}: {m}")
    return True


def test_converted_model_trains_like_global_batch(launched2):
    assert results_of(launched2, "converted") == [[True, True]] * 2


DIVERGED_CASES = ("eval_on_one_rank", "converted_on_one_rank", "fewer_calls_on_one_rank")


def _diverged_rank(rank, world_size):
    """Programs that diverge around a SyncBatchNorm layer -- in eval() on rank 1 only, converted on
    rank 0 only, run twice on rank 0 and once on rank 1 -- then a metric all-reduce on every rank.
    Each case on a group of its own (the group is given up after it), with a communicator timeout
    of 60 s and the divergence probe after 0.5 s. Before, every case ended at the 60 s timeout
    (torch's SyncBatchNorm hangs until its own)."""
    import datetime
    import time

    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator
    from fusedist.reliability import attach_monitor

    out = {}
    for case in DIVERGED_CASES:
        group = dist.new_group(list(range(world_size)))
        comm = get_communicator(group)
        comm.timeout = datetime.timedelta(seconds=60)
        attach_monitor(comm).probe_delay_s = 0.5  # (attached by DDP and ZeRO too, and by the layer where it trains)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        if case != "converted_on_one_rank" or rank == 0:
            model = SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
        if case == "eval_on_one_rank" and rank == 1:
            model.eval()
        start, outcome = time.monotonic(), "no error"
        try:
            for _ in range(2 if case == "fewer_calls_on_one_rank" and rank == 0 else 1):
                y = model(torch.randn(3, 4))
            comm.all_reduce(y.detach().sum().reshape(1), tag="metric")
        except CollectiveError as exc:
            outcome = str(exc)
        out[case] = (outcome, time.monotonic() - start)
    return out


def test_diverged_programs_fail_promptly_naming_both_collectives(launched2):
    for rank, out in enumerate(results_of(launched2, "diverged")):
        for case in DIVERGED_CASES:
            message, elapsed = out[case]
            # every rank learns within seconds (the probe's delay, its confirmation, the peer's entry), not at 60 s
            assert elapsed < 15, (rank, case, elapsed, message)
            assert "collectives that can never pair" in message, (rank, case, message)
            named = "all_reduce (collective #" in message and "all_gather (collective #" in message
            assert named, (rank, case, message)


# The 2-rank checks share one launch, the one that raises errors involving both ranks last
# (the group works on after them, which it checks itself); the 3-rank cases have their own.
@pytest.fixture(scope="module")
def launched2(request):
    return launch_for_selected(request, {
        "test_matches_batchnorm_on_global_batch": {"cases": (_cases_rank, (WORLD2_CASES,))},
        "test_converted_model_trains_like_global_batch": {"converted": (_converted_model_rank, ((3, 5),))},
        "test_collectives_and_cross_rank_errors": {"protocol": (_protocol_rank, ())},
        "test_diverged_programs_fail_promptly_naming_both_collectives": {"diverged": (_diverged_rank, ())},
    }, 2, timeout=360)


@pytest.fixture(scope="module")
def launched3(request):
    return launch_for_selected(request, {
        "test_matches_batchnorm_on_global_batch": {"cases": (_cases_rank, (WORLD3_CASES,))},
    }, 3, timeout=240)


# ----------------------------------------------------------------------------- CUDA


def _cuda_case(x_global, dy_global, sizes, rank, layout, dtype, device):
    """This rank's output/input-grad/param-grads vs nn.BatchNorm on the global batch (fp64
    oracle for half precision, with the error budget of the half-precision tests above)."""
    C, dim = x_global.shape[1], x_global.dim()
    ours = SyncBatchNorm(C).to(device)
    ref = _BN[dim](C).to(device, torch.float64)
    x = _to_layout(_rank_slice(x_global, sizes, rank).to(device, dtype), layout).requires_grad_(True)
    y = ours(x)
    (y.float() * _rank_slice(dy_global, sizes, rank).to(device)).sum().backward()
    xg = x_global.to(device, torch.float64).requires_grad_(True)
    y_ref = ref(xg)
    (y_ref * dy_global.to(device, torch.float64)).sum().backward()
    eps = {torch.float32: 1e-5, torch.bfloat16: HALF_EPS[torch.bfloat16], torch.float16: HALF_EPS[torch.float16]}[dtype]
    scale = lambda t: max(1.0, t.abs().max().item())  # noqa: E731
    my_y, my_dx = _rank_slice(y_ref, sizes, rank), _rank_slice(xg.grad, sizes, rank)
    assert (y.double() - my_y).abs().max().item() <= eps * scale(my_y)
    assert (x.grad.double() - my_dx).abs().max().item() <= eps * scale(my_dx)
    return ours, ref


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_cuda_single_process_matches_batchnorm(dtype, layout):
    """Compiled kernels on CUDA through the module, one process (world of one)."""
    for tail in ((), (33,), (7, 9), (3, 4, 5)):
        xs, dys, _, _ = _global_data((37,), 24, tail, seed=5, steps=1)
        if dtype != torch.float32:
            xs, dys = [x.to(dtype).float() for x in xs], [d.to(dtype).float() for d in dys]
        ours, ref = _cuda_case(xs[0], dys[0], (37,), 0, layout, dtype, "cuda")
        torch.testing.assert_close(ours.weight.grad.double(), ref.weight.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.running_var.double(), ref.running_var, rtol=1e-5, atol=1e-5)


def _nccl_rank(rank, world_size, sizes):
    device = device_for_rank(rank)  # several ranks may share it (FUSEDIST_TEST_RANKS_PER_GPU)
    torch.cuda.set_device(device)
    xs, dys, _, _ = _global_data(sizes, 16, (6, 6), seed=9, steps=1)
    out = []
    for layout in ("contiguous", "channels_last"):
        ours, ref = _cuda_case(xs[0], dys[0], sizes, rank, layout, torch.float32, f"cuda:{device}")
        gw = _all_reduce_sum(ours.weight.grad)
        torch.testing.assert_close(gw.double(), ref.weight.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.running_mean.double(), ref.running_mean, rtol=1e-5, atol=1e-5)
        out.append(ours.running_var.cpu().tolist())
    return out


@pytest.mark.gpu
@requires_rank_slots(2)
def test_nccl_unequal_batches():
    # One rank per slot, up to 3 (the empty middle rank needs 3): one or more GPUs, each
    # shared by FUSEDIST_TEST_RANKS_PER_GPU ranks when set.
    sizes = (5, 0, 3) if rank_slot_count() >= 3 else (5, 3)
    results = run_distributed(_nccl_rank, len(sizes), sizes, backend="nccl", timeout=300)
    assert all(r == results[0] for r in results), "running stats differ across ranks"
