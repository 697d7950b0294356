"""fusedist.nn.SyncBatchNorm under torch.func transforms in synchronized training, and in
``torch.compile(fullgraph=True)`` / ``torch.export`` / ``torch.jit.trace`` where it does not
synchronize (the tracer refuses a synchronized training forward by name).

Oracle: nn.BatchNorm on the concatenated global batch (torch.nn.SyncBatchNorm has no CPU
kernel), and the same model with torch's BatchNorm for the whole-graph captures.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad, jvp, vmap

from fusedist.nn import SyncBatchNorm
from test_syncbn_adversarial import _all_sum, _data, _slice, _step, run_probes

TOL = dict(rtol=1e-5, atol=1e-5)


def _transforms_refused_in_synchronized_training(rank, ws):
    """vmap / jvp / grad of a synchronized training forward raise naming the layer, before
    the batch is counted or anything is exchanged: the layer then trains like BatchNorm on
    the global batch, and eval under the same transforms still works."""
    sizes = (2, 3)
    X, DY = _data(sizes, (4,), seed=12)
    ours, ref = SyncBatchNorm(4), nn.BatchNorm1d(4)
    mine = _slice(X, sizes, rank)
    params, buffers = dict(ours.named_parameters()), dict(ours.named_buffers())
    calls = {
        "vmap": lambda: vmap(ours)(torch.stack([mine, mine])),
        "jvp": lambda: jvp(ours, (mine,), (torch.ones_like(mine),)),
        "grad": lambda: grad(lambda p: functional_call(ours, {**p, **buffers}, (mine,)).sum())(params),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=r"SyncBatchNorm\(4\): torch.func transforms .* synchronized"):
            call()
        assert int(ours.num_batches_tracked) == 0, name
    for _ in range(2):
        y, dx = _step(ours, mine, _slice(DY, sizes, rank))
        ref_y, ref_dx = _step(ref, X, DY)
        torch.testing.assert_close(y, _slice(ref_y, sizes, rank), **TOL)
        torch.testing.assert_close(dx, _slice(ref_dx, sizes, rank), **TOL)
    torch.testing.assert_close(_all_sum(ours.weight.grad), ref.weight.grad, **TOL)
    torch.testing.assert_close(ours.running_var, ref.running_var, **TOL)
    assert int(ours.num_batches_tracked) == 2
    ours.eval(), ref.eval()
    torch.testing.assert_close(vmap(ours)(torch.stack([mine, mine]))[1], ref(mine), **TOL)


def _whole_graph_where_nothing_synchronizes(rank, ws):
    """fullgraph compile and export of an eval model holding the layer (they failed on the
    layer's graph break, where torch.nn.SyncBatchNorm works), and a compiled training step
    that synchronizes (eagerly, between graphs) equal to BatchNorm on the global batch."""
    sizes = (3, 2)
    X, DY = _data(sizes, (4, 5, 5), seed=21)
    mine = _slice(X, sizes, rank)
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
    ours = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    with pytest.raises(RuntimeError, match=r"SyncBatchNorm\(4\): torch.jit.trace cannot record a synchronized"):
        torch.jit.trace(ours, mine, check_trace=False)  # (Note [SyncBatchNorm under torch.jit.trace])
    assert int(ours[1].num_batches_tracked) == 0
    y = torch.compile(ours, backend="aot_eager")(mine)  # training: synchronized
    y.backward(_slice(DY, sizes, rank))
    ref_y = ref(X)
    ref_y.backward(DY)
    torch.testing.assert_close(y, _slice(ref_y, sizes, rank), **TOL)
    torch.testing.assert_close(_all_sum(ours[0].weight.grad), ref[0].weight.grad, **TOL)
    torch.testing.assert_close(ours[1].running_var, ref[1].running_var, **TOL)
    ours.eval(), ref.eval()
    expected = ref(mine)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(ours, fullgraph=True, backend="aot_eager")(mine), expected, **TOL)
    torch.testing.assert_close(torch.export.export(ours, (mine,)).module()(mine), expected, **TOL)
    torch.testing.assert_close(torch.jit.trace(ours, mine)(mine), expected, **TOL)


def test_transforms_refused_and_whole_graph_capture_at_world_size_2():
    """Both probes in one spawn (a failure names the probe and the rank)."""
    run_probes([_transforms_refused_in_synchronized_training, _whole_graph_where_nothing_synchronizes], 2,
               timeout=300)
