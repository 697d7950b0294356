"""SyncBatchNorm with inf/NaN in the input or the upstream gradient, against
``F.batch_norm`` on the same batch (one process: the kernels and the fallback are what
differ; the cross-rank combine is fp64 torch arithmetic).

Where torch's result is well defined the non-finite pattern must match exactly: which
elements are NaN, +inf or -inf in the output, the input/weight/bias gradients and the
running statistics (``assert_close`` with ``equal_nan`` compares inf positions and signs).
Both the Triton kernels (interpreted on CPU) and the pure-PyTorch fallback are checked.
The shapes leave masked lanes in the kernels' tiles and several values per lane, where a
Welford recurrence that meets an inf turns the mean into NaN.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusedist.backend import triton_available, triton_interpreting
from fusedist.nn import SyncBatchNorm

INF, NAN = float("inf"), float("nan")
TOL = dict(rtol=1e-5, atol=1e-5, equal_nan=True)

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not (triton_available() and (torch.cuda.is_available() or triton_interpreting())),
    reason="needs triton (interpreted on CPU)"))]

# (tensor to poison, values written into channel 1 at flat positions 1, 4, ...)
POISON = {
    "x+inf": ("x", [INF]),
    "x-inf": ("x", [-INF]),
    "x+inf twice": ("x", [INF, INF]),
    "x nan": ("x", [NAN]),
    "x+inf-inf": ("x", [INF, -INF]),
    "x all +inf": ("x", "all"),
    "dy+inf": ("dy", [INF]),
    "dy-inf": ("dy", [-INF]),
}
SHAPES = [((6, 3, 5), None), ((5, 3, 2, 3), torch.channels_last), ((8, 3), None)]


def _poisoned(shape, target, values, seed):
    g = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    channel = (x if target == "x" else dy)[:, 1]
    flat = channel.reshape(-1).clone()
    if values == "all":
        flat.fill_(INF)
    for i, v in enumerate([] if values == "all" else values):
        flat[3 * i + 1] = v
    channel.copy_(flat.view_as(channel))
    return x, dy


def _params(C):
    return torch.linspace(0.5, 1.5, C), torch.linspace(-1.0, 1.0, C)


def _reference(x, dy, training, running_mean):
    w0, b0 = _params(x.shape[1])
    w, b = w0.requires_grad_(True), b0.requires_grad_(True)
    rm, rv = running_mean.clone(), torch.full_like(running_mean, 2.0)
    x = x.clone().requires_grad_(True)
    y = F.batch_norm(x, rm, rv, w, b, training=training, momentum=0.1, eps=1e-5)
    (y * dy).sum().backward()
    return dict(y=y.detach(), dx=x.grad, dw=w.grad, db=b.grad, rm=rm, rv=rv)


def _ours(x, dy, training, running_mean, fmt):
    layer = SyncBatchNorm(x.shape[1], momentum=0.1, eps=1e-5).train(training)
    w0, b0 = _params(x.shape[1])
    with torch.no_grad():
        layer.weight.copy_(w0)
        layer.bias.copy_(b0)
        layer.running_mean.copy_(running_mean)
        layer.running_var.fill_(2.0)
    x = (x if fmt is None else x.contiguous(memory_format=fmt)).clone().requires_grad_(True)
    y = layer(x)
    (y * dy).sum().backward()
    return dict(y=y.detach(), dx=x.grad, dw=layer.weight.grad, db=layer.bias.grad,
                rm=layer.running_mean, rv=layer.running_var)


def _assert_same(ours, ref):
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,fmt", SHAPES)
@pytest.mark.parametrize("poison", list(POISON))
def test_training_matches_batch_norm(monkeypatch, backend, shape, fmt, poison):
    """Batch statistics: a channel with +inf (and no NaN or -inf) has mean +inf, so the
    running mean becomes +inf, not NaN; the variance, output and input gradient are NaN;
    the bias gradient stays finite. An inf in dy leaves the same mix of NaN and +-inf in
    the input gradient as torch's centered formula."""
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", backend)
    target, values = POISON[poison]
    x, dy = _poisoned(shape, target, values, seed=len(shape))
    zeros = torch.zeros(shape[1])
    _assert_same(_ours(x, dy, True, zeros, fmt), _reference(x, dy, True, zeros))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,fmt", SHAPES)
def test_eval_with_infinite_running_mean(monkeypatch, backend, shape, fmt):
    """Running statistics: after a step on a batch with +inf the running mean is +inf; in
    eval the output is -inf there, and with a positive dy the weight gradient is -inf
    (padding lanes of a kernel tile must not add 0 * inf = NaN)."""
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", backend)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g)
    dy = torch.rand(shape, generator=g) + 0.1
    running_mean = torch.tensor([0.25, INF, -0.5])
    _assert_same(_ours(x, dy, False, running_mean, fmt), _reference(x, dy, False, running_mean))
