"""Launching a compiled Triton kernel again without the JIT's per-call work.

Note [a launch cache in front of the JIT]
    ``kernel[grid](*args)`` binds the arguments, computes Triton's specialization key, looks
    the compiled kernel up, checks the globals it used, then calls the launcher. On an H200's
    host that cost 17-41 us a launch (``benchmarks/gpu/profile_launch_bound.py``), against
    9-15 us for the compiled kernel's launcher alone: most of the host time of a SyncBN call
    on a small ResNet layer, and a tenth of a small fused optimizer step. ``cached(kernel)``
    keeps, per kernel, the compiled kernel each argument pattern led to, and calls its
    launcher directly when the pattern repeats.

    The key must separate every pair of calls Triton would compile differently; it is a
    superset of Triton's specialization (``tests/test_launch_cache.py`` checks it against
    Triton's own specializer):
    - a tensor: its dtype and whether its address is 16-byte aligned (Triton's "D");
    - an int: its exact value (Triton specializes 1, multiples of 16 and the int width);
      ints that change every call would miss every time, so kernels take such numbers as
      floats (the optimizers' step) or tensors;
    - a float: only its type (Triton passes every Python float as fp32);
    - anything else (bool, None, a constexpr such as a ``tl.dtype``): its type and value;
    - the keyword arguments likewise, and the current device (the launcher's module is
      loaded on one device).
    The first call of a pattern goes through the JIT, which compiles or finds the kernel and
    launches it; the cache keeps what it returned. The JIT path is also taken whenever a
    launch hook is installed (profilers read the launch metadata it builds), for a grid given
    as a function, when the kernel has pre-run hooks or arguments left to their defaults,
    under the interpreter, for Triton versions without the launcher convention checked here
    (3.4 and later: every argument, constexprs included, in signature order).

Note [the launch cache is opt-in]
    Set ``FUSEDIST_TRITON_LAUNCH_CACHE=1`` to use it. It is off by default until a GPU run
    has compared its launches with the JIT's (``tests/test_kernels_gpu_launch.py``) and timed
    them (``benchmarks/gpu/profile_launch_bound.py`` times both paths whatever the setting):
    the launcher convention it relies on was read from Triton 3.9's source and seen to work
    through ``CompiledKernel``'s own runner on Triton 3.6, but this module's calls have not
    run on a GPU yet.
"""

from __future__ import annotations

import os

import torch

from ..backend import triton_interpreting

# Entries per kernel before the cache starts over: argument patterns are few (one per layer
# shape and dtype); a caller feeding ever-new ints must not grow it without bound.
MAX_ENTRIES = 512


def _triton_supports_direct_launch() -> bool:
    try:
        import triton
        from triton.compiler.compiler import CompiledKernel
    except ImportError:
        return False
    try:
        major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 4) and hasattr(triton, "knobs") and hasattr(CompiledKernel, "launch_metadata")


def _enabled() -> bool:
    value = os.environ.get("FUSEDIST_TRITON_LAUNCH_CACHE", "0").strip() or "0"
    if value not in ("0", "1"):  # refused, not read as off: "true" or "yes" would be ignored silently
        raise ValueError(f"FUSEDIST_TRITON_LAUNCH_CACHE must be 0 or 1, got {value!r}")
    if value == "0":  # Note [the launch cache is opt-in]
        return False
    if triton_interpreting():
        return False
    return _triton_supports_direct_launch()


def _value_key(v):
    """One argument's part of the key (Note [a launch cache in front of the JIT])."""
    if type(v) is int:
        return v
    if isinstance(v, torch.Tensor):
        return v.dtype, not v.data_ptr() & 15
    if type(v) is float:
        return float
    return type(v), v


class CachedLauncher:
    """``launcher[grid](*args, **kwargs)`` as ``kernel[grid](...)``, with the JIT's per-call
    work skipped for argument patterns seen before."""

    __slots__ = ("kernel", "names", "entries", "pid", "_device", "_stream", "_knobs")

    def __init__(self, kernel, device_fn=None, stream_fn=None, knobs=None):
        self.kernel = kernel
        self.names = tuple(kernel.arg_names)
        self.entries: dict = {}
        self.pid = os.getpid()
        if device_fn is None or stream_fn is None or knobs is None:
            import triton
            from triton.runtime import driver

            device_fn, stream_fn, knobs = (driver.active.get_current_device, driver.active.get_current_stream,
                                           triton.knobs)
        self._device, self._stream, self._knobs = device_fn, stream_fn, knobs.runtime
        _ = self._knobs.launch_enter_hook, self._knobs.launch_exit_hook  # (AttributeError: not the convention checked)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        runtime = self._knobs
        if runtime.launch_enter_hook is not None or runtime.launch_exit_hook is not None or callable(grid):
            return self.kernel[grid](*args, **kwargs)
        if self.pid != os.getpid():  # a forked child: the parent's loaded modules are not its own
            self.entries.clear()
            self.pid = os.getpid()
        device = self._device()
        try:
            key = (device, tuple([_value_key(v) for v in args]),
                   tuple([(k, _value_key(v)) for k, v in kwargs.items()]))
            entry = self.entries.get(key)
        except TypeError:  # an unhashable argument: the JIT decides
            return self.kernel[grid](*args, **kwargs)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            self._remember(key, compiled, len(args), kwargs)
            return compiled
        compiled, tail = entry
        values = args + tuple([kwargs[name] for name in tail]) if tail else args
        n = len(grid)
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._stream(device),
                     compiled.function, compiled.packed_metadata, None, None, None, *values)
        return compiled

    def _remember(self, key, compiled, n_args: int, kwargs: dict) -> None:
        if compiled is None or getattr(self.kernel, "pre_run_hooks", None):
            return
        tail = self.names[n_args:]
        if any(name not in kwargs for name in tail):
            return  # defaults or launch options the kernel's signature does not hold: the JIT binds them
        if len(self.entries) >= MAX_ENTRIES:
            self.entries.clear()
        self.entries[key] = (compiled, tail)


_LAUNCHERS: dict = {}  # id(kernel) -> (kernel, its launcher); by id: a JITFunction hashes its source key under a lock


def cached(kernel):
    """The cached launcher of ``kernel`` (a ``triton.jit`` function), or ``kernel`` itself
    where the cache does not apply (an interpreted kernel, a test's stand-in, a Triton
    without the checked launcher convention, the cache not switched on)."""
    entry = _LAUNCHERS.get(id(kernel))
    if entry is not None and entry[0] is kernel:
        return entry[1]
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        return kernel
    launcher = kernel
    if _enabled():
        try:
            launcher = CachedLauncher(kernel)
        except (RuntimeError, AttributeError):  # no GPU driver (the JIT's launch reports it), or other knobs
            return kernel
    _LAUNCHERS[id(kernel)] = (kernel, launcher)
    return launcher
