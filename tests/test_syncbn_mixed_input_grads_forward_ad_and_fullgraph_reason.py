"""SyncBatchNorm when the ranks' inputs differ in whether they require a gradient, under
forward-mode AD, and what fullgraph compilation of a synchronized training forward reports.

A rank with no samples often hands the layer a fresh ``x.new_zeros(0, C)`` (no gradient) while
the other ranks' inputs require one (Note [one backward decision for all ranks] in
fusedist/nn/_sync_stats.py). The reference is nn.BatchNorm on the concatenated global batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.nn as nn

from fusedist.nn import SyncBatchNorm
from fusedist.testing import run_distributed

# fp32 against fp32 BatchNorm on the same values: sums over a few dozen values differ only
# by fp32 rounding (about 1e-7 relative), far inside 1e-5.
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def _slice(t: torch.Tensor, sizes, rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def _mixed_requirements(sizes, rank: int, wants_grad: bool):
    """One training step of our layer on this rank's slice (its input requiring a gradient only
    where ``wants_grad``), then the global-batch reference; returns what to compare."""
    g = torch.Generator().manual_seed(sum(sizes))
    x_all = torch.randn(sum(sizes), 3, 4, generator=g) * 2 + 1
    dy_all = torch.randn(sum(sizes), 3, 4, generator=g)
    ours, ref = SyncBatchNorm(3), nn.BatchNorm1d(3)
    x = _slice(x_all, sizes, rank).clone()
    if sizes[rank] == 0:
        x = x.new_zeros(0, 3, 4)  # what a rank without samples typically builds
    x.requires_grad_(wants_grad)
    ours(x).backward(_slice(dy_all, sizes, rank))
    x_ref = x_all.clone().requires_grad_()
    ref(x_ref).backward(dy_all)
    if wants_grad:
        torch.testing.assert_close(x.grad, _slice(x_ref.grad, sizes, rank), **FP32_TOL)
    grads = torch.stack([ours.weight.grad, ours.bias.grad])
    dist.all_reduce(grads)  # weight/bias gradients stay local: their sum is the global one
    torch.testing.assert_close(grads, torch.stack([ref.weight.grad, ref.bias.grad]), **FP32_TOL)
    torch.testing.assert_close(ours.running_var, ref.running_var, **FP32_TOL)


def _refused_where_a_rank_runs_no_backward(rank: int) -> str:
    """affine=False and an input without a gradient on rank 1: rank 1 has no backward through the
    layer, so rank 0's backward would wait for it forever. Refused in the forward on both ranks,
    the batch not counted, and the layer still works afterwards."""
    bn = SyncBatchNorm(3, affine=False)
    x = torch.randn(4, 3, requires_grad=True) if rank == 0 else torch.zeros(0, 3)
    try:
        bn(x)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("a forward whose backward would leave ranks waiting was accepted")
    assert int(bn.num_batches_tracked) == 0
    with torch.no_grad():  # no backward anywhere: nothing to refuse
        bn(torch.randn(2 + rank, 3, requires_grad=True))
    bn(torch.randn(2 + rank, 3, requires_grad=True)).sum().backward()
    return message


def _worker(rank: int, world_size: int) -> str:
    # rank 0's input wants a gradient, rank 1's (with samples, then empty) does not
    _mixed_requirements((3, 4), rank, wants_grad=rank == 0)
    _mixed_requirements((5, 0), rank, wants_grad=rank == 0)
    # the other way round: rank 1 wants it, rank 0 contributes its dy without wanting it
    _mixed_requirements((2, 5), rank, wants_grad=rank == 1)
    return _refused_where_a_rank_runs_no_backward(rank)


def test_ranks_that_want_no_input_grad_still_join_the_backward():
    """Before: the rank whose input needed no gradient skipped the backward all-reduce, so the
    others stalled in it until the timeout (and their input gradients lacked its dy)."""
    # The decision is the same on every kernel path; the PyTorch one keeps the launch short (the
    # interpreted kernels' backward numerics are tested in test_syncbn.py).
    messages = run_distributed(_worker, 2, timeout=60, pg_timeout=10, env={"FUSEDIST_KERNEL_BACKEND": "torch"})
    for message in messages:
        assert "ranks [0] want this layer's input gradient" in message, message
        assert "ranks [1] will run no backward" in message, message
        assert "requires_grad_()" in message, message


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train_alone"])
def test_forward_mode_ad_where_torchs_layer_is_batch_norm(train):
    """Eval, and training without other ranks, are torch's F.batch_norm in torch.nn.SyncBatchNorm,
    whose dual tensors carry a tangent; ours raised "You must implement the jvp function" (Note
    [SyncBatchNorm under torch.func]). Tangents of the input and the weight, fp32 against fp32
    BatchNorm on the same values (same op: equal to rounding)."""
    g = torch.Generator().manual_seed(0)
    x, x_dot = torch.randn(5, 3, 4, generator=g) * 2 + 1, torch.randn(5, 3, 4, generator=g)
    w_dot = torch.randn(3, generator=g)
    ours, ref = SyncBatchNorm(3), nn.BatchNorm1d(3)
    for m in (ours, ref):
        m.running_mean.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
        m.train(train)
    outs = []
    for m in (ours, ref):
        weight = m.weight.detach().clone()
        del m.weight
        with fwAD.dual_level():
            m.weight = fwAD.make_dual(weight, w_dot)
            y = m(fwAD.make_dual(x, x_dot))
            outs.append(fwAD.unpack_dual(y))
    (y, y_dot), (ref_y, ref_y_dot) = outs
    torch.testing.assert_close(y, ref_y, **FP32_TOL)
    torch.testing.assert_close(y_dot, ref_y_dot, **FP32_TOL)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, **FP32_TOL)
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == int(train)


def test_fullgraph_capture_of_a_synchronized_training_forward_names_the_layer(monkeypatch):
    """The synchronized training forward runs eagerly (Note [SyncBatchNorm under torch.compile]);
    fullgraph=True reported only "Skip inlining `torch.compiler.disable()`d function ... Remove the
    `torch.compiler.disable` call". One process, the layer told that it synchronizes: dynamo
    refuses at trace time, before anything would be exchanged."""
    import inspect

    if "reason" not in inspect.signature(torch.compiler.disable).parameters:
        pytest.skip("this torch's compiler.disable takes no reason")
    bn = SyncBatchNorm(3)
    monkeypatch.setattr(SyncBatchNorm, "_synchronizes", lambda self: True)
    with pytest.raises(Exception, match="a training forward that synchronizes with other ranks") as info:
        torch.compile(bn, fullgraph=True)(torch.randn(4, 3))
    assert "eval mode" in str(info.value)
    assert int(bn.num_batches_tracked) == 0
