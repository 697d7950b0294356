"""The Triton launch cache (Note [a launch cache in front of the JIT] in
``triton_kernels/launch_cache.py``): its key separates every pair of arguments Triton's own
specializer separates, and the launcher reuses a compiled kernel only for a repeated pattern,
passing the arguments as the JIT would. Stand-ins replace the kernel and its launcher here
(nothing compiles without a GPU); ``tests/test_kernels_gpu_launch.py`` compares real launches."""

from __future__ import annotations

import os
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedist.triton_kernels import launch_cache
from fusedist.triton_kernels.launch_cache import CachedLauncher, _value_key

# ----------------------------------------------------------------------------- the key


def _tritons_specialization():
    """Triton's per-argument specializer (type string and specialization, e.g. ('i32', 'D'))."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return lambda v: tuple(native_specialize_impl(BaseBackend, v, False, True, True)[:2])


_BASE = torch.zeros(64, dtype=torch.float64)

_ints = st.one_of(
    st.sampled_from([0, 1, 2, 15, 16, 17, 32, 2**31 - 16, 2**31 - 1, 2**31, 2**32, -(2**31), -(2**31) - 16,
                     2**63 - 16, -1, -16]),
    st.integers(min_value=-(2**40), max_value=2**40),
)
_tensors = st.builds(
    lambda dtype, offset: _BASE.view(torch.uint8)[offset:offset + 64].view(dtype),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.uint8]),
    st.sampled_from([0, 4, 8, 12, 16, 32, 48]),
)
_values = st.one_of(_ints, st.floats(allow_nan=True), st.booleans(), st.none(), _tensors)


@settings(max_examples=400, deadline=None)
@given(_values, _values)
def test_key_separates_what_triton_specializes_apart(a, b):
    """Equal keys -> equal Triton specializations (the key may split more, never less)."""
    specialize = _tritons_specialization()
    if _value_key(a) == _value_key(b):
        assert specialize(a) == specialize(b), (a, b)


def test_key_keeps_floats_together_and_splits_the_rest():
    assert _value_key(0.5) == _value_key(3e9)  # one fp32 argument, whatever its value
    assert _value_key(1) != _value_key(True) and _value_key(0) != _value_key(0.0) and _value_key(None) != _value_key(0)
    aligned, shifted = _BASE[:8].float(), _BASE.view(torch.float32)[1:9]
    assert _value_key(aligned) != _value_key(shifted)  # 16-byte aligned against 4-byte
    assert _value_key(aligned) != _value_key(aligned.half())


# ----------------------------------------------------------------------------- the launcher


class _Compiled:
    def __init__(self, tag):
        self.tag, self.function, self.packed_metadata, self.launches = tag, f"function-{tag}", f"meta-{tag}", []

    def run(self, *args):
        self.launches.append(args)


class _Kernel:
    """A stand-in JIT function: ``kernel[grid](*args, **kwargs)`` records the call and returns a
    new compiled kernel for each new pattern, as Triton's cache would."""

    arg_names = ["x_ptr", "n", "scale", "BLOCK", "FLAG"]

    def __init__(self):
        self.jit_calls, self.pre_run_hooks = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return _Compiled(len(self.jit_calls))
        return launch


def _launcher(device=None, hooks=None):
    device = device if device is not None else [0]
    knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(launch_enter_hook=hooks, launch_exit_hook=None))
    kernel = _Kernel()
    return kernel, CachedLauncher(kernel, device_fn=lambda: device[0], stream_fn=lambda d: 1000 + d, knobs=knobs)


def test_a_repeated_pattern_skips_the_jit_and_passes_every_argument_in_order():
    kernel, launcher = _launcher()
    x = torch.zeros(8)
    first = launcher[(4,)](x, 7, 0.5, BLOCK=64, FLAG=True, num_warps=4)
    assert len(kernel.jit_calls) == 1 and first.launches == []
    again = launcher[(4, 2)](x, 7, 0.25, BLOCK=64, FLAG=True, num_warps=4)  # another float: the same kernel
    assert again is first and len(kernel.jit_calls) == 1
    assert first.launches == [(4, 2, 1, 1000, "function-1", "meta-1", None, None, None, x, 7, 0.25, 64, True)]


@pytest.mark.parametrize("change", ["int", "dtype", "alignment", "constexpr", "option", "device", "bool for int 1"])
def test_a_new_pattern_goes_through_the_jit(change):
    device = [0]
    kernel, launcher = _launcher(device)
    x = torch.zeros(16)
    args, kwargs = [x, 1, 0.5], dict(BLOCK=64, FLAG=True, num_warps=4)
    launcher[(1,)](*args, **kwargs)
    launcher[(1,)](*args, **kwargs)
    assert len(kernel.jit_calls) == 1
    if change == "int":
        args[1] = 2
    elif change == "dtype":
        args[0] = x.half()
    elif change == "alignment":
        args[0] = x[1:]
    elif change == "constexpr":
        kwargs["FLAG"] = False
    elif change == "option":
        kwargs["num_warps"] = 8
    elif change == "device":
        device[0] = 1
    else:
        args[1] = True
    launcher[(1,)](*args, **kwargs)
    assert len(kernel.jit_calls) == 2, change


def test_the_jit_path_where_the_cache_does_not_apply():
    # a launch hook (a profiler reading launch metadata): every call through the JIT
    kernel, launcher = _launcher(hooks=lambda *a: None)
    for _ in range(3):
        launcher[(1,)](torch.zeros(4), 1, 0.5, BLOCK=8, FLAG=False)
    assert len(kernel.jit_calls) == 3
    # an argument left to its default (FLAG missing): the JIT binds it, never the cache
    kernel, launcher = _launcher()
    for _ in range(3):
        launcher[(1,)](torch.zeros(4), 1, 0.5, BLOCK=8)
    assert len(kernel.jit_calls) == 3
    # an unhashable argument
    kernel, launcher = _launcher()
    for _ in range(2):
        launcher[(1,)](torch.zeros(4), [1, 2], 0.5, BLOCK=8, FLAG=False)
    assert len(kernel.jit_calls) == 2
    # pre-run hooks
    kernel, launcher = _launcher()
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    for _ in range(2):
        launcher[(1,)](torch.zeros(4), 1, 0.5, BLOCK=8, FLAG=False)
    assert len(kernel.jit_calls) == 2


def test_the_cache_is_bounded_and_starts_over_in_a_forked_child(monkeypatch):
    monkeypatch.setattr(launch_cache, "MAX_ENTRIES", 4)
    kernel, launcher = _launcher()
    x = torch.zeros(4)
    for n in range(10):
        launcher[(1,)](x, n, 0.5, BLOCK=8, FLAG=False)
    assert len(launcher.entries) <= 4
    launcher[(1,)](x, 9, 0.5, BLOCK=8, FLAG=False)
    assert len(kernel.jit_calls) == 10  # the newest pattern is still there
    launcher.pid = os.getpid() + 1  # as if the launcher had been made before a fork
    launcher[(1,)](x, 9, 0.5, BLOCK=8, FLAG=False)
    assert len(kernel.jit_calls) == 11


def test_cached_returns_kernels_it_cannot_serve_unchanged(monkeypatch):
    from fusedist.triton_kernels import syncbn

    stand_in = _Kernel()
    assert launch_cache.cached(stand_in) is stand_in
    # under the interpreter (as here) or without a GPU driver, the kernel itself
    kernel = syncbn._welford_channel_kernel
    assert launch_cache.cached(kernel) is kernel
    # Note [the launch cache is opt-in]: off unless switched on, and never under the interpreter
    monkeypatch.delenv("FUSEDIST_TRITON_LAUNCH_CACHE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not launch_cache._enabled()
    monkeypatch.setenv("FUSEDIST_TRITON_LAUNCH_CACHE", "1")
    assert launch_cache._enabled() == launch_cache._triton_supports_direct_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch_cache._enabled()


def test_the_benchmarks_switch_restores_the_setting(monkeypatch):
    """``benchmarks/_common.launch_cache_on`` (the SyncBN benchmark's second timing) switches
    the cache on for its block only, and says whether it could."""
    import sys

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                             "benchmarks"))
    sys.modules.pop("_common", None)
    from _common import launch_cache_on, with_launchers

    monkeypatch.delenv("FUSEDIST_TRITON_LAUNCH_CACHE", raising=False)
    before = launch_cache._LAUNCHERS
    with launch_cache_on() as on:
        assert os.environ["FUSEDIST_TRITON_LAUNCH_CACHE"] == "1" and launch_cache._LAUNCHERS is not before
        assert on == launch_cache._enabled()
    assert "FUSEDIST_TRITON_LAUNCH_CACHE" not in os.environ and launch_cache._LAUNCHERS is before
    kept = {}
    with launch_cache_on(kept):
        assert launch_cache._LAUNCHERS is kept
    seen = []
    run = with_launchers(lambda: seen.append(launch_cache._LAUNCHERS) or 7, kept)
    assert run() == 7 and seen == [kept] and launch_cache._LAUNCHERS is before
