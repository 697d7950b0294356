"""SyncBatchNorm on inputs whose mean dwarfs their spread (|mean| / std up to 2e4), against
nn.BatchNorm's own fp32 error.

Oracle: nn.BatchNorm on the global batch in fp64. fp32 cannot do better than rounding x
itself (about eps * |mean|), so each of fusedist's errors is held to torch's fp32 layer's
error on the same inputs, times a margin for a different summation order (1.5x, plus a
floor of a few ulps of the result; 2.5x for the output, whose largest error is one element's
rounding). Before the corrected two-pass statistics and the
centered backward sums, the running variance was 30-100x torch's error at |mean| = 1e4 and
the input gradient 2-3x at 1e3.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fusedist.nn import SyncBatchNorm
from shared_rank_launch import launch_for_selected, results_of, under_env

MARGIN = 1.5
OUTPUT_MARGIN = 2.5  # the output's largest error is one element's rounding: 0.5-1.8x torch's across seeds


def _error(ours: torch.Tensor, oracle: torch.Tensor) -> float:
    return (ours.detach().double() - oracle.detach()).abs().max().item()


def _check(name: str, ours, torch32, oracle, floor: float, margin: float = MARGIN) -> None:
    mine, theirs = _error(ours, oracle), _error(torch32, oracle)
    assert mine <= margin * theirs + floor, (
        f"{name}: fusedist's error {mine:.3g} against fp64, torch's fp32 BatchNorm's {theirs:.3g}")


def _offset_batches(rank: int, ws: int, channels_last: bool) -> None:
    for seed, offset in enumerate([1e2, 1e3, 1e4]):
        gen = torch.Generator().manual_seed(100 + seed)
        X = torch.randn(6 * ws, 12, 5, 5, generator=gen) * 0.5 + offset * (1 + torch.rand(12, 1, 1, generator=gen))
        DY = torch.randn(X.shape, generator=gen)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        mine = slice(rank * 6, rank * 6 + 6)

        oracle, ref = nn.BatchNorm2d(12).double(), nn.BatchNorm2d(12)
        ours = SyncBatchNorm(12)
        x64 = X.double().requires_grad_()
        y64 = oracle(x64)
        y64.backward(DY.double())
        x32 = X.clone().requires_grad_()
        y32 = ref(x32)
        y32.backward(DY)
        x = X[mine].contiguous(memory_format=fmt).requires_grad_()
        y = ours(x)
        y.backward(DY[mine].contiguous(memory_format=fmt))
        grad_w = ours.weight.grad.clone()
        dist.all_reduce(grad_w)

        ulp = torch.finfo(torch.float32).eps
        _check(f"output at {offset:g}", y, y32[mine], y64[mine], 4 * ulp, OUTPUT_MARGIN)
        _check(f"input grad at {offset:g}", x.grad, x32.grad[mine], x64.grad[mine], 4 * ulp)
        _check(f"weight grad at {offset:g}", grad_w, ref.weight.grad, oracle.weight.grad, 300 * ulp)
        _check(f"running var at {offset:g}", ours.running_var, ref.running_var, oracle.running_var, 4 * ulp)
        _check(f"running mean at {offset:g}", ours.running_mean, ref.running_mean, oracle.running_mean,
               4 * ulp * offset)


BACKENDS = ["triton", "torch"]


@pytest.fixture(scope="module")
def launched(request):
    """Both paths and both layouts in one launch, each under its own kernel backend."""
    scenarios = {(channels_last, backend): (under_env, ({"FUSEDIST_KERNEL_BACKEND": backend}, _offset_batches,
                                                       channels_last))
                 for backend in BACKENDS for channels_last in (False, True)}
    return launch_for_selected(request, {"test_statistics_and_gradients_of_a_large_mean_as_accurate_as_torch":
                                         scenarios}, 2, timeout=240)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("channels_last", [False, True])
def test_statistics_and_gradients_of_a_large_mean_as_accurate_as_torch(launched, channels_last, backend):
    """Both paths: the Triton kernels (under the interpreter here) and the PyTorch fallback."""
    results_of(launched, (channels_last, backend))
