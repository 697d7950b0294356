"""SyncBatchNorm's elementwise launches for layers of more channels than a CUDA grid's second
axis takes (Note [channel blocks on the grid's second axis] in triton_kernels/syncbn.py).

The interpreter has no grid cap, so the launch arithmetic is checked with the GPU's tile
sizes and a recording launcher, and the widened blocks' results against the pure-PyTorch
reference with the cap lowered so that a small layer takes them.
"""

from __future__ import annotations

import pytest
import torch

from fusedist.nn import _bn_reference as reference
from fusedist.nn._layout import ncs_layout

pytest.importorskip("triton")
from fusedist.triton_kernels import syncbn as kernels  # noqa: E402  (needs triton)

CUDA_GRID_AXIS1 = 65535


class _Recorder:
    def __init__(self):
        self.launches = []

    def __call__(self, kernel):
        def at(grid):
            def launch(*args, **meta):
                self.launches.append((kernel.__name__, grid, meta["BLOCK_S"], meta["BLOCK_C"]))
            return launch

        return type("Launcher", (), {"__getitem__": lambda _self, grid: at(grid)})()


@pytest.mark.parametrize("C,S", [(70_000, 8192), (200_003, 4096), (65_536, 1 << 20), (300, 8192)])
def test_elementwise_grid_fits_cuda_for_wide_layers(monkeypatch, C, S):
    """A contiguous (1, C, S) input on a GPU: every program's grid fits CUDA's caps and the
    blocks still cover every channel and position (a 70000-channel layer asked for 70000
    programs on the second axis, which CUDA refuses)."""
    recorder = _Recorder()
    monkeypatch.setattr(kernels, "cached", recorder)
    monkeypatch.setattr(kernels, "triton_interpreting", lambda: False)
    layout = (1, C, S, C * S, S, 1)  # (N, C, S, strides): only the launch arithmetic reads it
    t = torch.empty(1)
    kernels.channel_affine(t, t, layout, t, t)
    kernels.input_grad(t, t, t, layout, t, t, t, None, C * S)
    assert [name for name, *_ in recorder.launches] == ["_channel_affine_kernel", "_input_grad_kernel"]
    for name, grid, block_s, block_c in recorder.launches:
        assert grid[1] <= CUDA_GRID_AXIS1 and grid[0] <= 2**31 - 1, (name, grid)
        assert grid[1] * block_c >= C and grid[0] * block_s >= S, (name, grid, block_s, block_c)
        assert block_s * block_c <= 4096, (name, block_s, block_c)  # the tile's size is kept


def test_widened_channel_blocks_compute_the_same(monkeypatch):
    """With the GPU's tile and the cap lowered to 2 blocks, a 5-channel layer with a long
    spatial run takes widened channel blocks and shortened spatial ones (5 one-channel blocks
    otherwise): normalize and input gradient equal the reference's."""
    monkeypatch.setattr(kernels, "triton_interpreting", lambda: False)
    g = torch.Generator().manual_seed(3)
    u = torch.randn(3, 5, 60, 70, generator=g) * 2 + 1
    v = torch.randn(u.shape, generator=g)
    lay = ncs_layout(u)
    assert kernels._cdiv(5, kernels._elementwise_tile(5, 4200, lay[4], 4096)[1]) == 5
    monkeypatch.setattr(kernels, "_GRID_AXIS1_LIMIT", 2)
    assert kernels._cdiv(5, kernels._elementwise_tile(5, 4200, lay[4], 4096)[1]) == 2
    p, q, r, t, b = (torch.randn(5, generator=g) for _ in range(5))
    got = kernels.channel_affine(torch.empty_like(u), u, lay, p, q, v=v, r=r, t=t, b=b)
    torch.testing.assert_close(got, reference.channel_affine(u, p, q, v=v, r=r, t=t, b=b), rtol=1e-5, atol=1e-5)
    sums, invstd = torch.randn(2, 5, generator=g), torch.rand(5, generator=g) + 0.5
    count = u.numel() // 5
    got = kernels.input_grad(torch.empty_like(u), v, u, lay, sums, p, invstd, None, count)
    want = reference.channel_affine(v, sums[0] / count, invstd, v=u, r=p, t=-invstd * invstd * (sums[1] / count))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
