"""SyncBatchNorm kernels (Triton, interpreted on CPU) against the pure-PyTorch reference and
an fp64 oracle: statistics, normalize, backward reduce, input gradient, for contiguous,
channels_last and folded (N, C) layouts, fp32/fp16/bf16 inputs, odd sizes."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from fusedist.nn import _bn_reference as reference
from fusedist.nn._layout import NCSLayout, as_ncs, like_layout, ncs_layout

triton = pytest.importorskip("triton")
from fusedist.triton_kernels import syncbn as kernels  # noqa: E402  (needs triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (shape, memory layout): odd sizes, a single-row tile, a C that is not a power of two,
# spatial sizes that leave partial tiles.
CASES = [
    ((3, 5, 4, 6), "contiguous"),
    ((3, 5, 4, 6), "channels_last"),
    ((7, 3), "contiguous"),
    ((2, 6, 17), "contiguous"),
    ((2, 6, 17), "channels_last"),
    ((2, 3, 2, 3, 5), "contiguous"),
    ((2, 3, 2, 3, 5), "channels_last"),
    ((1, 4, 1, 1), "contiguous"),
    ((5, 1, 3, 3), "contiguous"),
]


def _make(shape, layout, dtype, offset=3.0, scale=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale + offset
    x = x.to(dtype)
    if layout == "channels_last":
        if x.dim() == 3:  # (N, C, L) stored as (N, L, C)
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        else:
            fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
            x = x.contiguous(memory_format=fmt)
    return x.to(DEVICE)


def _oracle_stats(x):
    x64 = x.double()
    dims = [0] + list(range(2, x.dim()))
    mean = x64.mean(dims)
    m2 = ((x64 - mean.view([1, -1] + [1] * (x.dim() - 2))) ** 2).sum(dims)
    return mean, m2


def _stats(fn, x, layout=None):
    C = x.shape[1]
    mean, m2, count = (torch.empty(C, dtype=torch.float64, device=x.device),
                       torch.empty(C, dtype=torch.float64, device=x.device),
                       torch.empty(1, dtype=torch.float64, device=x.device))
    if layout is None:
        fn(x, mean, m2, count)
    else:
        fn(x, layout, mean, m2, count)
    return mean, m2, count


@pytest.mark.parametrize("shape,layout", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_welford_stats_match_fp64(shape, layout, dtype):
    x = _make(shape, layout, dtype)
    x_view, lay = as_ncs(x)
    assert x_view.data_ptr() == x.data_ptr(), "contiguous and channels_last are read in place"
    mean, m2, count = _stats(kernels.welford_stats, x, lay)
    ref_mean, ref_m2 = _oracle_stats(x)
    assert count.item() == x.numel() // x.shape[1]
    # fp32 accumulation of the (exactly representable) input values: a few fp32 ulps of the
    # result, whatever the input dtype.
    torch.testing.assert_close(mean, ref_mean, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(m2, ref_m2, rtol=1e-5, atol=1e-5)
    # and the reference path agrees with the same oracle
    r_mean, r_m2, r_count = _stats(reference.welford_stats, x)
    torch.testing.assert_close(r_mean, ref_mean, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(r_m2, ref_m2, rtol=1e-5, atol=1e-5)
    assert r_count.item() == count.item()


def test_welford_stable_with_large_offset():
    """|mean| / std = 1e4: the naive E[x^2] - E[x]^2 in fp32 loses every digit here."""
    for layout in ("contiguous", "channels_last"):
        x = _make((16, 3, 8, 8), layout, torch.float32, offset=1e4, scale=1.0, seed=3)
        ref_mean, ref_m2 = _oracle_stats(x)
        for mean, m2, _ in (_stats(kernels.welford_stats, x, ncs_layout(x)),
                            _stats(reference.welford_stats, x)):
            torch.testing.assert_close(mean, ref_mean, rtol=3e-7, atol=0)  # a few fp32 ulps
            # fp32 ulp at 1e4 is ~1e-3 (= std * 1e-3): the M2 error stays ~1e-3 relative,
            # where sum(x^2) - n mean^2 would lose every digit
            torch.testing.assert_close(m2, ref_m2, rtol=2e-3, atol=0)
        # backward sums: sum(dy * (x - mean) * invstd) must not cancel either
        dy = _make((16, 3, 8, 8), layout, torch.float32, offset=0.0, scale=1.0, seed=4)
        mean32, invstd = ref_mean.float(), torch.rsqrt(ref_m2 / 1024).float()
        xhat64 = (x.double() - ref_mean.view(1, -1, 1, 1)) * invstd.double().view(1, -1, 1, 1)
        want = torch.stack([dy.double().sum((0, 2, 3)), (dy.double() * xhat64).sum((0, 2, 3))])
        for got in (kernels.backward_reduce(dy, x, ncs_layout(x), mean32, invstd),
                    reference.backward_reduce(dy, x, mean32, invstd)):
            # x - mean is exact to ~1 fp32 ulp of 1e4 = 1e-3 std per element
            torch.testing.assert_close(got.double(), want, rtol=0, atol=0.05)


class _Recorder:
    """Wraps a kernel to record the grids it is launched with."""

    def __init__(self, kernel, grids):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_many_row_splits_and_tiles(monkeypatch):
    """Several programs along the row axis (partial rows merged by the combine kernel in more
    than one chunk), several spatial tiles per sample, and the GPU's block-size choices."""
    monkeypatch.setattr(kernels, "triton_interpreting", lambda: False)
    monkeypatch.setattr(kernels, "_reduction_tile", lambda device: 16)
    monkeypatch.setattr(kernels, "_row_splits", lambda units, c_blocks, device: min(units, 37))
    for layout in ("contiguous", "channels_last"):
        x = _make((12, 2, 5, 7), layout, torch.float32, seed=4)
        launches = []
        real_partial = kernels._welford_partial_kernel
        monkeypatch.setattr(kernels, "_welford_partial_kernel", _Recorder(real_partial, launches))
        mean, m2, count = _stats(kernels.welford_stats, x, ncs_layout(x))
        monkeypatch.setattr(kernels, "_welford_partial_kernel", real_partial)
        assert launches[0][1] > 32, "more partial rows than one combine chunk"
        ref_mean, ref_m2 = _oracle_stats(x)
        torch.testing.assert_close(mean, ref_mean, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(m2, ref_m2, rtol=1e-5, atol=1e-5)
        dy = _make((12, 2, 5, 7), layout, torch.float32, offset=0, scale=1, seed=5)
        invstd = torch.rsqrt(m2 / count + 1e-5).float()
        got = kernels.backward_reduce(dy, x, ncs_layout(x), mean.float(), invstd)
        want = reference.backward_reduce(dy, x, mean.float(), invstd)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,layout", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_reduce_matches_reference(shape, layout, dtype):
    x = _make(shape, layout, dtype, seed=1)
    dy = _make(shape, layout, dtype, offset=0.0, scale=1.0, seed=2)
    lay = ncs_layout(x)
    C = shape[1]
    mean = torch.randn(C, device=DEVICE) + 3
    invstd = torch.rand(C, device=DEVICE) + 0.5
    got = kernels.backward_reduce(dy, x, lay, mean, invstd)
    want = reference.backward_reduce(dy, x, mean, invstd)
    assert got.shape == (2, C) and got.dtype == torch.float32
    # both accumulate exactly representable products in fp32, in different orders
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,layout", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_channel_affine_matches_reference(shape, layout, dtype):
    u = _make(shape, layout, dtype, seed=1)
    v = _make(shape, layout, dtype, seed=2)
    lay = ncs_layout(u)
    C = shape[1]
    p, q, r, t, b = (torch.randn(C, device=DEVICE) for _ in range(5))
    for extra in ({}, {"b": b}, {"v": v, "r": r, "t": t}, {"v": v, "r": r, "t": t, "b": b}):
        got = kernels.channel_affine(torch.empty_like(u), u, lay, p, q, **extra)
        want = reference.channel_affine(u, p, q, **extra)
        assert got.stride() == u.stride(), "the output keeps the input's memory format"
        # same fp32 expression, one rounding to the output dtype: at most one ulp apart
        # (fp32 FMA contraction may differ by an ulp before that rounding)
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("shape,layout", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_grad_equals_the_factors_made_by_torch_ops(shape, layout, dtype):
    """Note [the backward's factors in the kernel]: the input gradient made from the sums in
    one launch equals the torch-ops path (the factors by torch, then ``channel_affine``): the
    same fp32 operations in the same order. Exact under the interpreter; on a GPU the
    compiler may contract a multiply-add differently in the two kernels (an ulp)."""
    dy = _make(shape, layout, dtype, seed=4)
    x = _make(shape, layout, dtype, seed=5)
    lay = ncs_layout(x)
    C = shape[1]
    g = torch.Generator().manual_seed(6)
    sums, mean = torch.randn(2, C, generator=g).to(DEVICE), torch.randn(C, generator=g).to(DEVICE)
    invstd = (torch.rand(C, generator=g) + 0.5).to(DEVICE)
    count = (x.numel() // C) * 3 + 1  # (a global count: several ranks' batches)
    for weight in (None, (torch.rand(C, generator=g) + 0.5).to(DEVICE, dtype)):
        got = kernels.input_grad(torch.empty_like(x), dy, x, lay, sums, mean, invstd, weight, count)
        k = invstd if weight is None else invstd * weight.to(torch.float32)
        want = kernels.channel_affine(torch.empty_like(x), dy, lay, (sums[0] / count).contiguous(), k.contiguous(),
                                      v=x, r=mean, t=(-k * invstd * (sums[1] / count)).contiguous())
        exact = DEVICE == "cpu"
        ulp = 0 if exact else torch.finfo(dtype).eps
        torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=0 if exact else 1e-6)


def test_layout_view_and_copies():
    x = torch.randn(2, 3, 4, 5)
    assert ncs_layout(x) == NCSLayout(2, 3, 20, 60, 20, 1)
    cl = x.contiguous(memory_format=torch.channels_last)
    assert ncs_layout(cl) == NCSLayout(1, 3, 40, 120, 1, 3)  # batch folded into the rows
    assert ncs_layout(torch.randn(6, 4)) == NCSLayout(1, 4, 6, 24, 1, 4)
    # neither layout: a transposed spatial pair, or a strided slice -> copied to contiguous
    for odd in (x.transpose(2, 3), x[:, :, ::2]):
        assert ncs_layout(odd) is None
        view, lay = as_ncs(odd)
        assert view.is_contiguous() and lay == ncs_layout(view) and torch.equal(view, odd)
    # like_layout: a gradient in another layout (or expanded) gets the reference's strides
    dy = torch.ones(1).expand(2, 3, 4, 5)
    same = like_layout(dy, cl)
    assert same.stride() == cl.stride() and torch.equal(same, dy)
    assert like_layout(cl, cl) is cl


def _aot_compile_all() -> None:
    """Compile every kernel for sm_90 with Triton's CUDA backend (no GPU needed to compile).
    Runs in a process without TRITON_INTERPRET: interpreted kernels cannot be compiled."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    ints = ("N", "C", "S", "stride_n", "stride_c", "stride_s", "num_s_tiles", "SPLIT")

    def compile_(fn, pointers, scalars, constexprs, options=None):
        sig = dict(pointers)
        sig.update({name: "i32" for name in scalars})
        sig.update({name: "constexpr" for name in constexprs})
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=target,
                                  options=options)
        assert ".entry" in compiled.asm["ptx"], fn

    # the input dtype and the index width are separate constexprs: every dtype, and each width, once
    for x_type, wide in (("*fp32", False), ("*bf16", True), ("*fp16", False)):
        compile_(kernels._welford_partial_kernel,
                 {"x_ptr": x_type, "mean_part_ptr": "*fp32", "m2_part_ptr": "*fp32",
                  "count_part_ptr": "*i32"}, ints,
                 {"BLOCK_S": 32, "BLOCK_C": 64, "WIDE_INDEX": wide})
        compile_(kernels._backward_reduce_kernel,
                 {"dy_ptr": x_type, "x_ptr": x_type, "mean_ptr": "*fp32", "invstd_ptr": "*fp32",
                  "part_ptr": "*fp32"}, ints,
                 {"BLOCK_S": 2048, "BLOCK_C": 1, "WIDE_INDEX": wide})
        compile_(kernels._welford_channel_kernel,
                 {"x_ptr": x_type, "mean_out_ptr": "*fp32", "m2_out_ptr": "*fp32", "count_out_ptr": "*fp32"},
                 ("total_count", "N", "S", "stride_n", "stride_c"),
                 {"BLOCK_N": 128, "BLOCK_S": 64, "WIDE_INDEX": wide}, {"num_warps": 8})
        compile_(kernels._backward_reduce_channel_kernel,
                 {"dy_ptr": x_type, "x_ptr": x_type, "mean_ptr": "*fp32", "invstd_ptr": "*fp32",
                  "out_ptr": "*fp32"}, ("N", "C", "S", "stride_n", "stride_c"),
                 {"BLOCK_N": 16, "BLOCK_S": 256, "WIDE_INDEX": wide})
        compile_(kernels._channel_affine_kernel,
                 {"out_ptr": x_type, "u_ptr": x_type, "v_ptr": x_type,
                  **{f"{n}_ptr": "*fp32" for n in "pqrtb"}},
                 ("C", "S", "stride_n", "stride_c", "stride_s", "num_s_tiles"),
                 {"HAS_V": True, "HAS_B": True, "BLOCK_S": 64, "BLOCK_C": 64, "WIDE_INDEX": False})
        compile_(kernels._welford_combine_kernel,
                 {"x_ptr": x_type, "mean_part_ptr": "*fp32", "m2_part_ptr": "*fp32", "count_part_ptr": "*i32",
                  "mean_out_ptr": "*fp64", "m2_out_ptr": "*fp64", "count_out_ptr": "*fp64"},
                 ("P", "C", "total_count", "stride_c"), {"BLOCK_P": 32, "BLOCK_C": 64})
    for x_type in ("*fp32", "*bf16", "*fp16"):
        compile_(kernels._input_grad_kernel,
                 {"out_ptr": x_type, "dy_ptr": x_type, "x_ptr": x_type, "sums_ptr": "*fp32", "mean_ptr": "*fp32",
                  "invstd_ptr": "*fp32", "weight_ptr": x_type, "count": "i64"},
                 ("C", "S", "stride_n", "stride_c", "stride_s", "num_s_tiles"),
                 {"HAS_WEIGHT": True, "BLOCK_S": 64, "BLOCK_C": 64, "WIDE_INDEX": False})
    for stat_type in ("*fp32", "*fp16", "*bf16"):
        for total_type in ("i32", "i64"):  # (a global count past 2**31 is passed as i64)
            compile_(kernels._rank_combine_kernel,
                     {"gathered_ptr": "*fp64", "out_ptr": "*fp32",
                      **{f"{n}_ptr": stat_type for n in ("weight", "bias", "running_mean", "running_var")},
                      "total": total_type, **{f"{n}_{part}": "fp32" for n in ("eps", "momentum")
                                              for part in ("hi", "mid", "lo")}},
                     ("W", "row_len", "C"), {"HAS_WEIGHT": True, "HAS_BIAS": True, "UPDATE_RUNNING": True,
                                             "BLOCK_C": 256})
    print("compiled")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile and run the kernels")
def test_aot_compile_for_sm90():
    """The kernels compile for a real GPU target, not only under the interpreter (which
    accepts some programs the compiler rejects)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this triton install has no ptxas to compile with")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


if __name__ == "__main__":
    _aot_compile_all()


def test_parallel_welford_combine_over_uneven_ranks():
    """The cross-rank combine of per-rank (count, mean, M2) payloads equals the statistics of
    the whole batch, for uneven splits with empty and single-sample ranks (no processes
    needed: this is the math the all-gather feeds)."""
    from fusedist.nn._bn_ops import stats_payload
    from fusedist.nn._sync_stats import combine

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(12, 3, 5, generator=g) * 2 + 7).to(DEVICE)
    ref_mean, ref_m2 = _oracle_stats(x)
    for sizes in ((12,), (5, 7), (0, 12), (1, 0, 11), (4, 1, 6, 0, 1), (1,) * 12):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        payloads = [stats_payload(*as_ncs(x[s:s + n])) for s, n in zip(starts, sizes)]
        stats = combine(torch.stack(payloads), 3)
        assert stats.count == 60 and stats.rank_counts == [n * 5 for n in sizes]
        torch.testing.assert_close(stats.mean, ref_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(stats.m2, ref_m2, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"more than 1 value per channel .* \[1, 0\]"):
        combine(torch.stack([stats_payload(*as_ncs(x[:1, :, :1])), stats_payload(*as_ncs(x[:0, :, :1]))]), 3)


@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_rank_combine_kernel_equals_the_torch_path(affine, buffer_dtype):
    """Note [the forward's combine in one launch]: the kernel's mean, invstd, scale, shift and
    blended running statistics equal the PyTorch path's (combine, rsqrt, the fp64 blend) on
    gathered statistics of uneven ranks -- an empty one, a single-sample one -- with and
    without an identity tail, for momentum 0.1 and a cumulative average's 1/3 (fp64 values
    that fp32 arguments would round: Note [fp64 scalars as three fp32 arguments]). Both work
    in fp64 in the same order; the bound is one rounding of each output (fp32, or the
    buffers' dtype)."""
    from fusedist.nn._bn_ops import stats_payload
    from fusedist.nn._function import _blend_
    from fusedist.nn._sync_stats import IDENTITY_LEN, combine

    g = torch.Generator().manual_seed(11)
    for C, sizes, tail, momentum in ((5, (4, 0, 1, 3), 0, 0.1), (37, (6, 2), IDENTITY_LEN, 1 / 3),
                                     (1, (3,), 0, 0.1)):
        x = (torch.randn(sum(sizes), C, 3, generator=g) * 3 + 5).to(DEVICE)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        rows = [torch.cat([stats_payload(*as_ncs(x[s:s + n])),
                           torch.randn(tail, generator=g, dtype=torch.float64).to(DEVICE)])
                for s, n in zip(starts, sizes)]
        gathered = torch.stack(rows)
        weight = torch.rand(C, generator=g).to(DEVICE) + 0.5 if affine else None
        bias = torch.randn(C, generator=g).to(DEVICE) if affine else None
        running = [torch.rand(C, generator=g).to(DEVICE, buffer_dtype) + 0.5 for _ in range(2)]
        theirs = [r.clone() for r in running]
        stats = combine(gathered[:, :2 * C + 1], C)
        out = kernels.combine_ranks(gathered, C, stats.count, 1e-5, momentum, weight, bias, *running)
        invstd = torch.rsqrt(stats.m2 / stats.count + 1e-5).float()
        _blend_(theirs, [stats.mean, stats.m2 / (stats.count - 1)], momentum)
        one_rounding = dict(rtol=1.2e-7, atol=0)
        torch.testing.assert_close(out[0], stats.mean.float(), **one_rounding)
        torch.testing.assert_close(out[1], invstd, **one_rounding)
        torch.testing.assert_close(out[2], invstd * weight if affine else invstd, **one_rounding)
        if affine:
            torch.testing.assert_close(out[3], bias, rtol=0, atol=0)
        ulp = torch.finfo(buffer_dtype).eps
        for mine, ref in zip(running, theirs):
            torch.testing.assert_close(mine.float(), ref.float(), rtol=ulp, atol=0)


@triton.jit
def _fp64_scalar_kernel(out_ptr, hi, mid, lo):
    triton.language.store(out_ptr, kernels._fp64_from_parts(hi, mid, lo))


def test_fp64_scalars_reach_the_kernel_exactly():
    """Note [fp64 scalars as three fp32 arguments]: momentum and eps arrive in the combine
    kernel as the fp64 numbers the PyTorch path uses; one fp32 argument would not carry them
    (the last check: 0.1 and 1/3 are not fp32 numbers)."""
    g = torch.Generator().manual_seed(3)
    values = [0.1, 1 / 3, 1e-5, 1e-3, 0.999, 0.0, 1.0]
    values += (torch.rand(50, generator=g, dtype=torch.float64) ** 3).tolist()
    out = torch.empty(1, dtype=torch.float64, device=DEVICE)
    for value in values:
        parts = kernels._fp64_parts(value)
        assert all(float(torch.tensor(p, dtype=torch.float32)) == p for p in parts), (value, parts)
        _fp64_scalar_kernel[(1,)](out, *parts)
        assert out.item() == value, (value, parts, out.item())
    _fp64_scalar_kernel[(1,)](out, 0.1, 0.0, 0.0)
    assert out.item() != 0.1


def test_launch_arithmetic_equals_tritons():
    """Note [launch arithmetic in plain Python]: the launchers' own cdiv and next power of two
    give what triton's helpers give, over every value the launch sizes can take."""
    import triton

    from fusedist.triton_kernels.syncbn import _cdiv, _next_pow2

    values = list(range(0, 4200)) + [2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1, 2**31, 3 * 2**33 + 5]
    for n in values:
        assert _next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 32, 64, 1000, 2048):
            assert _cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_row_splits_ask_the_device_once(monkeypatch):
    """The CUDA launch split reads the multiprocessor count once per device (each lookup costs
    host time in every BatchNorm call): four waves of programs over the channel blocks, per
    device, with the properties asked once for each device."""
    from types import SimpleNamespace

    from fusedist.triton_kernels import syncbn as k

    asked = []

    def properties(index):
        asked.append(index)
        return SimpleNamespace(multi_processor_count={0: 132, 1: 16}[index])

    monkeypatch.setattr(k, "_SM_COUNTS", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for _ in range(3):
        assert k._row_splits(10_000, 8, torch.device("cuda", 0)) == 4 * 132 // 8
        assert k._row_splits(10_000, 8, torch.device("cuda")) == 4 * 16 // 8  # the current device
        assert k._row_splits(5, 8, torch.device("cuda", 0)) == 5  # no more splits than rows
    assert asked == [0, 1]


# Note [one program per channel]: shapes the launchers give one program per channel (NCHW,
# few values per channel), including a padded batch (N=100 at 7x7: the statistics' one 128x64
# tile, the backward reduce's two 64-row tiles, the second partial) and S padded to a power of
# two. Programs do not depend on each other, and every interpreted program costs time, so these
# tests open the path from 2 channels up (test_one_program_per_channel_only_where_meant checks
# the real channel range): a few channels walk the same tiles as hundreds.
CHANNEL_PATH = [(3, 5, 2, 3), (5, 6, 7, 7), (100, 3, 7, 7), (2, 4, 9)]
CHANNEL_PATH_CASES = ([(shape, torch.float32) for shape in CHANNEL_PATH]
                      + [(CHANNEL_PATH[1], torch.bfloat16), (CHANNEL_PATH[1], torch.float16)])


def _channel_launches(monkeypatch):
    monkeypatch.setattr(kernels, "_CHANNEL_PATH_MIN_C", 2)
    grids = {"stats": [], "reduce": []}
    monkeypatch.setattr(kernels, "_welford_channel_kernel", _Recorder(kernels._welford_channel_kernel, grids["stats"]))
    monkeypatch.setattr(kernels, "_backward_reduce_channel_kernel",
                        _Recorder(kernels._backward_reduce_channel_kernel, grids["reduce"]))
    return grids


@pytest.mark.parametrize("shape,dtype", CHANNEL_PATH_CASES)
def test_one_program_per_channel_matches_fp64(shape, dtype, monkeypatch):
    grids = _channel_launches(monkeypatch)
    x = _make(shape, "contiguous", dtype, seed=7)
    lay = ncs_layout(x)
    mean, m2, count = _stats(kernels.welford_stats, x, lay)
    assert grids["stats"] == [(shape[1],)], "one launch, one program per channel"
    ref_mean, ref_m2 = _oracle_stats(x)
    assert count.item() == x.numel() // shape[1]
    torch.testing.assert_close(mean, ref_mean, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(m2, ref_m2, rtol=1e-5, atol=1e-5)
    dy = _make(shape, "contiguous", dtype, offset=0.0, scale=1.0, seed=8)
    mean32, invstd = mean.float(), torch.rsqrt(m2 / count + 1e-5).float()
    got = kernels.backward_reduce(dy, x, lay, mean32, invstd)
    assert grids["reduce"] == [(shape[1],)]
    assert got.shape == (2, shape[1]) and got.dtype == torch.float32
    # Against fp64 sums of the same terms: fp32 lanes summed as a tree err by about
    # log2(n) * eps32 * sum|term| (n up to 4900 here: ~1e-6 of sum|term|).
    dims = [0] + list(range(2, x.dim()))
    view = [1, -1] + [1] * (x.dim() - 2)
    terms = dy.double() * ((x.double() - mean32.double().view(view)) * invstd.double().view(view))
    want = torch.stack([dy.double().sum(dims), terms.sum(dims)])
    bound = 1e-6 * torch.stack([dy.double().abs().sum(dims), terms.abs().sum(dims)]) + 1e-12
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (inf - inf in the interpreter)
def test_one_program_per_channel_non_finite(monkeypatch):
    """Note [non-finite statistics] on the per-channel path: a channel with +inf has mean +inf,
    +inf and -inf together NaN, M2 NaN for both; the other channels are untouched."""
    grids = _channel_launches(monkeypatch)
    x = _make((4, 11, 3, 3), "contiguous", torch.float32, seed=9)
    x[1, 3, 2, 1] = float("inf")
    x[0, 7, 0, 0], x[3, 7, 1, 2] = float("inf"), float("-inf")
    x[2, 9, 1, 1] = float("nan")
    mean, m2, _ = _stats(kernels.welford_stats, x, ncs_layout(x))
    r_mean, r_m2, _ = _stats(reference.welford_stats, x)
    assert grids["stats"], "the per-channel kernel ran"
    assert mean[3].item() == float("inf") and math.isnan(mean[7].item()) and math.isnan(mean[9].item())
    torch.testing.assert_close(mean, r_mean, equal_nan=True, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(m2, r_m2, equal_nan=True, rtol=1e-5, atol=1e-5)
    # backward: an infinite invstd with dy * (x - mean) > 0 everywhere in channel 5 sums to
    # +inf; the tile's padding lanes (S = 9 in 16 lanes) must add 0, not 0 * inf = NaN
    dy = _make((4, 11, 3, 3), "contiguous", torch.float32, offset=0.0, scale=1.0, seed=10)
    dy[:, 5] = dy[:, 5].abs() + 0.5
    mean32 = torch.zeros(11)
    mean32[5] = x[:, 5].min() - 1.0
    invstd = torch.ones(11)
    invstd[5] = float("inf")
    got = kernels.backward_reduce(dy, x, ncs_layout(x), mean32, invstd)
    assert grids["reduce"] and got[1, 5].item() == float("inf")
    x64 = x.double()
    want = torch.stack([dy.double().sum((0, 2, 3)),
                        (dy.double() * (x64 - mean32.double().view(1, -1, 1, 1)) * invstd.double().view(1, -1, 1, 1))
                        .sum((0, 2, 3))])
    torch.testing.assert_close(got.double(), want, equal_nan=True, rtol=1e-5, atol=1e-4)
    # the CPU path too (its fused inference form would give NaN here: x * inf - mean * inf)
    torch.testing.assert_close(reference.backward_reduce(dy, x, mean32, invstd).double(), want, equal_nan=True,
                               rtol=1e-5, atol=1e-4)


def test_one_program_per_channel_only_where_meant():
    """channels_last (channels contiguous, the batch folded into S), too few or too many
    channels, or too many values per channel keep the row-split kernels."""
    cases = {
        (8, 512, 7, 7): True, (64, 512, 7, 7): True, (32, 256, 14, 14): True,
        (64, 256, 14, 14): False,  # 64 x 256 values per channel: the row-split path
        (64, 2048, 7, 7): False, (64, 128, 7, 7): False, (64, 512, 28, 28): False,
    }
    for shape, expected in cases.items():
        x = torch.empty(shape, device="meta")
        assert (kernels._channel_path(ncs_layout(x)) is not None) == expected, shape
        xl = x.contiguous(memory_format=torch.channels_last)
        assert kernels._channel_path(ncs_layout(xl)) is None, shape
    assert kernels._channel_path(ncs_layout(torch.empty(64, 512, device="meta"))) is None  # (N, C)
    assert kernels._channel_path((0, 512, 49, 512 * 49, 49, 1)) is None  # an empty batch
    assert kernels._channel_path((8, 512, 0, 0, 0, 1)) is None  # no spatial values
