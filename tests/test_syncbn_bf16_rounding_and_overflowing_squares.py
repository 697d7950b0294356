"""fusedist.nn.SyncBatchNorm's kernels at the edges of their dtypes: bf16 outputs and input
gradients, and fp32 values whose squares overflow.

Oracles: torch's own rounding (``.to(torch.bfloat16)`` of the same computation in fp32) and
nn.BatchNorm on the same batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fusedist.nn import SyncBatchNorm

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bn_step(module, x, dy):
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y, x.grad


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("train", [True, False])
def test_bf16_output_and_input_grad_round_to_nearest(layout, train):
    """A bf16 input gives the fp32 computation's output and input gradient rounded to nearest,
    as torch's ``.to(torch.bfloat16)`` rounds: Triton's interpreter truncated the kernels'
    stores (one unit low in magnitude for about half of the elements, Note [rounding to bf16]
    in triton_kernels/syncbn_elementwise.py). The same values in fp32 take the same kernels and the same
    fp32 arithmetic, so the bf16 results must be exactly their rounding."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 5, 7, 3, generator=g) * 3 + 2).to(torch.bfloat16)
    dy = torch.randn(x.shape, generator=g).to(torch.bfloat16)
    x, dy = x.contiguous(memory_format=layout).to(DEVICE), dy.contiguous(memory_format=layout).to(DEVICE)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        bn = SyncBatchNorm(5).to(DEVICE).train(train)
        with torch.no_grad():
            bn.weight.copy_(torch.linspace(0.5, 2.0, 5))
            bn.bias.copy_(torch.linspace(-1.0, 1.0, 5))
            bn.running_mean.fill_(1.5)
            bn.running_var.fill_(7.0)
        results.append(_bn_step(bn, x.to(dtype), dy.to(dtype)))
    (y16, dx16), (y32, dx32) = results
    assert y16.dtype == dx16.dtype == torch.bfloat16
    assert torch.equal(y16, y32.to(torch.bfloat16))
    assert torch.equal(dx16, dx32.to(torch.bfloat16))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("shape", [(16, 4, 3), (16, 4), (6, 4, 3, 3)])
def test_values_whose_squares_overflow_fp32_give_torchs_result(shape):
    """Values near 1e20 square past fp32's range: the variance is inf, so torch's BatchNorm
    outputs the bias, has finite gradients and an inf running variance. The kernels gave NaN
    everywhere, from 0 * inf in the tile lanes that held no value (Note [overflowing
    squares] in triton_kernels/syncbn_reduce.py)."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=g) * 1e20).to(DEVICE)
    dy = torch.randn(shape, generator=g).to(DEVICE)
    ours = SyncBatchNorm(4).to(DEVICE)
    ref = (nn.BatchNorm1d(4) if len(shape) < 4 else nn.BatchNorm2d(4)).to(DEVICE)
    with torch.no_grad():
        for m in (ours, ref):
            m.bias.copy_(torch.arange(4.0))
    y, dx = _bn_step(ours, x, dy)
    ref_y, ref_dx = _bn_step(ref, x, dy)
    assert not y.isnan().any() and not ours.running_var.isnan().any()
    torch.testing.assert_close(y, ref_y)
    torch.testing.assert_close(dx, ref_dx)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
    torch.testing.assert_close(ours.running_var, ref.running_var)
    # (a mean of values ~1e20 summed in another order: a few fp32 ulps of the largest value, times momentum)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, rtol=0.0, atol=1e-6 * 0.1 * x.abs().max().item())
