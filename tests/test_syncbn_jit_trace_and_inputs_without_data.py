"""``torch.jit.trace`` of a model holding fusedist.nn.SyncBatchNorm where it does not synchronize,
and its forward on inputs without data (meta device, FakeTensorMode).

torch.nn.SyncBatchNorm is ``F.batch_norm`` in eval and without other ranks, so TorchScript
deployment (trace, save, load) of a model holding it works; ours failed inside its kernel
launchers or on its autograd Function's arguments (Note [SyncBatchNorm under torch.jit.trace]).
The reference is the same model with torch's layer, traced, saved and loaded alike: both
record torch's batch_norm, so the results agree to fp32 rounding. (A synchronized training
forward is refused under the tracer: tests/test_syncbn_func_refusal_and_whole_graph_capture.py.)
The metadata of meta/fake forwards are compared with torch's layer's. One process, no spawn.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

from fusedist.nn import SyncBatchNorm

TOL = dict(rtol=1e-5, atol=1e-5)


def _saved_and_loaded(module, example):
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.trace(module, example, check_trace=False), buffer)
    buffer.seek(0)
    return torch.jit.load(buffer)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_traced_saved_and_loaded_like_torchs_layer(train, momentum):
    g = torch.Generator().manual_seed(31)
    torch.manual_seed(31)
    theirs = nn.Sequential(nn.Conv2d(3, 4, 1), nn.SyncBatchNorm(4, momentum=momentum), nn.ReLU())
    with torch.no_grad():
        theirs[1].running_mean.uniform_(-1, 1, generator=g)
        theirs[1].running_var.uniform_(0.5, 2, generator=g)
        theirs[1].weight.uniform_(0.5, 2, generator=g)
    ours = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(theirs))
    theirs.train(train), ours.train(train)
    example = torch.randn(2, 3, 5, 5, generator=g)
    loaded = [_saved_and_loaded(m, example) for m in (theirs, ours)]
    for _ in range(2):  # fresh inputs, other than the example
        x = torch.randn(3, 3, 5, 5, generator=g) * 2 + 1
        want, got = (m(x) for m in loaded)
        torch.testing.assert_close(got, want, **TOL)
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        torch.testing.assert_close(loaded[1].state_dict()[name], loaded[0].state_dict()[name], **TOL)


# ----------------------------------------------------------------------------- inputs without data


@pytest.mark.parametrize("where", ["meta", "fake"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_meta_and_fake_inputs_give_torchs_metadata(train, where):
    """A meta-device or FakeTensorMode forward (shape inference, memory estimators) gives what
    torch's layer gives: output shape, dtype, device and memory format, and a backward's gradient
    shapes (Note [inputs without data]); ours failed on the missing data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    results = []
    for cls in (nn.SyncBatchNorm, SyncBatchNorm):
        context = FakeTensorMode() if where == "fake" else torch.device("meta")
        with context:
            layer = cls(4).train(train)
            x = torch.randn(3, 4, 5, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
            y = layer(x)
            y.sum().backward()
        results.append((y.shape, y.dtype, y.device.type, y.is_contiguous(memory_format=torch.channels_last),
                        x.grad.shape, layer.weight.grad.shape))
    assert results[1] == results[0]
    assert results[1][2] == ("meta" if where == "meta" else "cpu")
