"""Compiled kernels launched through the launch cache (Note [a launch cache in front of the
JIT] in ``triton_kernels/launch_cache.py``) on a GPU: repeated calls skip the JIT, and give
bit for bit what the JIT's own launch of the same kernel gives."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


class _CountingJIT:
    """Wraps a JIT function; counts the launches that go through it."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0
        self.arg_names, self.pre_run_hooks = kernel.arg_names, kernel.pre_run_hooks

    def __getitem__(self, grid):
        self.calls += 1
        return self.kernel[grid]


@pytest.fixture
def counted(monkeypatch):
    """``counted(module, name)`` -> (launcher, counter): the kernel's call sites get a launch
    cache (switched on for the test: Note [the launch cache is opt-in]) whose JIT launches
    are counted."""
    from fusedist.triton_kernels import launch_cache

    assert launch_cache._triton_supports_direct_launch(), "this Triton lacks the launcher convention checked"
    monkeypatch.setattr(launch_cache, "_LAUNCHERS", {})

    def install(module, name):
        kernel = getattr(module, name)
        counter = _CountingJIT(kernel)
        launcher = launch_cache.CachedLauncher(counter)
        launch_cache._LAUNCHERS[id(kernel)] = (kernel, launcher)
        return launcher, counter

    return install


@pytest.mark.parametrize("shape,layout", [((64, 512, 7, 7), "nchw"), ((16, 64, 9, 9), "nhwc")])
def test_cached_syncbn_statistics_equal_the_jits(shape, layout, counted):
    from fusedist.nn._layout import ncs_layout
    from fusedist.triton_kernels import syncbn as K

    name = "_welford_channel_kernel" if layout == "nchw" else "_welford_partial_kernel"
    launcher, counter = counted(K, name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    outs = []
    for i in range(3):  # fresh inputs, the same argument pattern
        x = torch.randn(shape, device="cuda", generator=gen) * (i + 1) + 3.0
        if layout == "nhwc":
            x = x.contiguous(memory_format=torch.channels_last)
        lay = ncs_layout(x)
        cached_out = [torch.empty(shape[1], device="cuda"), torch.empty(shape[1], device="cuda"),
                      torch.empty(1, device="cuda")]
        K.welford_stats(x, lay, *cached_out)
        outs.append((x, lay, cached_out))
    assert counter.calls == 1, "only the first call of the pattern goes through the JIT"
    # the same inputs through the JIT (nothing cached for these calls)
    launcher.entries = _NeverCaching()
    for x, lay, cached_out in outs:
        jit_out = [torch.empty_like(t) for t in cached_out]
        K.welford_stats(x, lay, *jit_out)
        for a, b in zip(cached_out, jit_out):
            assert torch.equal(a, b)
        var = x.double().transpose(0, 1).reshape(shape[1], -1).var(dim=1, unbiased=False)
        torch.testing.assert_close(cached_out[1].double() / cached_out[2].double(), var, rtol=1e-4, atol=1e-5)


class _NeverCaching(dict):
    def __setitem__(self, key, value):
        pass


def test_cached_fused_adamw_steps_equal_torchs(counted):
    """Steps after the first launch the Adam kernel from the cache; the result still follows
    torch's AdamW (the tolerance of the fused optimizer's own tests)."""
    from fusedist.optim import FusedAdamW
    from fusedist.triton_kernels import multi_tensor as MT

    launcher, counter = counted(MT, "_adam_kernel")
    gen = torch.Generator().manual_seed(1)
    shapes = [(256, 33), (1000,), (7, 9, 11)]
    ours = [torch.randn(s, generator=gen).cuda().requires_grad_() for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen).cuda()
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    assert counter.calls == len(launcher.entries) < 4, "later steps launch from the cache"
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
