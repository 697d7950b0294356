"""Where the launch-bound rows of bench_optimizer and bench_syncbn spend their time (CUDA only).

The fused AMP step loses to torch at 1M-10M parameters and on hundreds of small tensors, and
some SyncBN statistics shapes (512x7x7) take ten times torch's time. Whether that is host time
(Python, launches), a synchronization, or a slow kernel decides the fix. For each row this
prints, for fusedist and torch side by side:

* the device time per call (CUDA events over back-to-back calls) and the host's time per call;
* the host's time per phase of the optimizer step (unscale, clip, step, update);
* a torch.profiler summary: kernels launched per call, host-to-device synchronizations
  (memcpy to the host, stream/device synchronize) per call, device time per kernel name, the
  top host operators.

    python benchmarks/gpu/profile_launch_bound.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from bench_optimizer import fusedist_step, split_shapes, torch_step  # noqa: E402
from _common import host_ms_per_call, time_cuda  # noqa: E402

CALLS = 20


def _profile(fn, calls: int = CALLS) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                          "cudaLaunchKernelExC"))
    syncs = {e.key: e.count / calls for e in events
             if "Synchronize" in e.key or ("Memcpy" in e.key and "cuda" in e.key.lower())}
    kernels = sorted(((e.key, e.device_time_total / e.count, e.count / calls) for e in events
                      if e.device_time_total > 0 and e.device_type.name == "CUDA"), key=lambda r: -r[1] * r[2])
    host_ops = sorted(((e.key, e.self_cpu_time_total / calls, e.count / calls) for e in events
                       if e.self_cpu_time_total > 0), key=lambda r: -r[1])
    return {"launches_per_call": launches / calls, "syncs_per_call": syncs,
            "kernels_us_per_call": [(k, round(us, 2), n) for k, us, n in kernels[:12]],
            "top_host_ops_us_per_call": [(k, round(us, 2), n) for k, us, n in host_ops[:15]]}


def _phases(step_parts, calls: int = CALLS) -> dict:
    """Host time per phase, phases issued back to back with no synchronization."""
    totals = {name: 0.0 for name, _ in step_parts}
    for _ in range(3):
        for _, part in step_parts:
            part()
    torch.cuda.synchronize()
    for _ in range(calls):
        for name, part in step_parts:
            t0 = time.perf_counter()
            part()
            totals[name] += time.perf_counter() - t0
    torch.cuda.synchronize()
    return {name: round(t / calls * 1e6, 1) for name, t in totals.items()}


def optimizer_rows() -> list[dict]:
    import fusedist

    device = torch.device("cuda")
    rows = []
    for label, shapes, mode in (("1M", split_shapes(1_000_000), "fp32"), ("1M", split_shapes(1_000_000), "bf16+master"),
                                ("10M", split_shapes(10_000_000), "fp32"),
                                ("200x4K", [(4096,)] * 200, "fp32")):
        step, (params, opt, scaler) = fusedist_step(shapes, device, mode)
        parts = [("unscale_", lambda: scaler.unscale_(opt)), ("clip", lambda: fusedist.clip_grad_norm_(params, 1.0)),
                 ("step", lambda: scaler.step(opt)), ("update", scaler.update)]
        t_step, t_keep = torch_step(shapes, device, mode)
        _, _, masters, t_opt, t_scaler = t_keep
        t_parts = [("unscale_", lambda: t_scaler.unscale_(t_opt)),
                   ("clip", lambda: torch.nn.utils.clip_grad_norm_(masters, 1.0)),
                   ("step", lambda: t_scaler.step(t_opt)), ("update", t_scaler.update)]
        for who, fn, ps in (("fusedist", step, parts), ("torch", t_step, t_parts)):
            row = {"row": f"adamw {label} {mode}", "who": who,
                   "device_ms": round(time_cuda(fn)["median_ms"], 4), "host_ms": round(host_ms_per_call(fn, 50), 4)}
            try:
                row["host_us_by_phase"] = _phases(ps) if mode == "fp32" else "n/a (torch row adds copies)"
            except Exception as exc:  # noqa: BLE001
                row["host_us_by_phase"] = f"{type(exc).__name__}: {exc}"
            row.update(_profile(fn))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def syncbn_rows() -> list[dict]:
    from fusedist.nn._layout import ncs_layout
    from fusedist.triton_kernels import syncbn as kernels

    rows = []
    for batch, C, H, W, dtype, fmt in ((64, 512, 7, 7, torch.float16, "NCHW"), (64, 2048, 7, 7, torch.float16, "NCHW"),
                                       (64, 1024, 14, 14, torch.float32, "NCHW"),
                                       (64, 512, 7, 7, torch.float16, "NHWC")):
        x = torch.randn(batch, C, H, W, device="cuda", dtype=dtype)
        if fmt == "NHWC":
            x = x.contiguous(memory_format=torch.channels_last)
        layout = ncs_layout(x)
        f32 = dict(device="cuda", dtype=torch.float32)
        mean_out, m2_out, count_out = torch.empty(C, **f32), torch.empty(C, **f32), torch.empty(1, **f32)
        ours = lambda: kernels.welford_stats(x, layout, mean_out, m2_out, count_out)  # noqa: E731
        theirs = lambda: torch.batch_norm_stats(x, 1e-5)  # noqa: E731
        for who, fn in (("fusedist", ours), ("torch", theirs)):
            path = "per-channel" if kernels._channel_path(layout) is not None else "row-split"
            row = {"row": f"stats {batch}x{C}x{H}x{W} {str(dtype)[6:]} {fmt} ({path})", "who": who,
                   "device_ms": round(time_cuda(fn)["median_ms"], 4), "host_ms": round(host_ms_per_call(fn, 50), 4)}
            row.update(_profile(fn))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def channel_path_variants() -> list[dict]:
    """The per-channel kernels (Note [one program per channel]) at each warp count and, for the
    backward reduce, one whole-slab tile against 4096-value tiles: the kernels' device time
    alone (replayed from a CUDA graph), beside torch's kernels, to pick the launch settings."""
    import triton
    from fusedist.nn._layout import ncs_layout
    from fusedist.triton_kernels import syncbn as K

    def device_us(fn):
        fn()
        return round(triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3, 2)

    rows = []
    for shape in ((64, 512, 7, 7), (32, 512, 7, 7), (32, 256, 14, 14)):
        for dtype in (torch.float32, torch.bfloat16):
            N, C = shape[:2]
            x = torch.randn(shape, device="cuda", dtype=dtype)
            dy = torch.randn(shape, device="cuda", dtype=dtype)
            lay = ncs_layout(x)
            _, _, S, stride_n, stride_c, _ = lay
            blocks = K._channel_path(lay)
            if blocks is None:
                continue
            f32 = dict(device="cuda", dtype=torch.float32)
            mean, m2, count = torch.empty(C, **f32), torch.empty(C, **f32), torch.empty(1, **f32)
            invstd, out = torch.ones(C, **f32), torch.empty((2, C), **f32)
            weight = torch.ones(C, device="cuda", dtype=dtype)
            row = {"row": f"per-channel kernels {'x'.join(map(str, shape))} {str(dtype)[6:]}", "who": "both",
                   "torch_stats_us": device_us(lambda: torch.batch_norm_stats(x, 1e-5)),
                   "torch_reduce_us": device_us(lambda: torch.batch_norm_backward_reduce(
                       dy, x, mean, invstd, weight, True, True, True))}
            block_n = K._next_pow2(N)
            for warps in (2, 4, 8):
                row[f"stats_w{warps}_us"] = device_us(lambda: K._welford_channel_kernel[(C,)](
                    x, mean, m2, count, N * S, N, S, stride_n, stride_c,
                    BLOCK_N=block_n, BLOCK_S=blocks[1], WIDE_INDEX=False, num_warps=warps))
                for label, bn in (("tile", blocks[0]), ("slab", block_n)):
                    row[f"reduce_{label}_w{warps}_us"] = device_us(lambda: K._backward_reduce_channel_kernel[(C,)](
                        dy, x, mean, invstd, out, N, C, S, stride_n, stride_c,
                        BLOCK_N=bn, BLOCK_S=blocks[1], WIDE_INDEX=False, num_warps=warps))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _record_launch(module, name: str, call) -> tuple:
    """(kernel, grid, args, kwargs) of the first launch of ``module.name`` made by ``call()``."""
    kernel, seen = getattr(module, name), []

    class _Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((grid, args, kwargs))
                return kernel[grid](*args, **kwargs)
            return launch

    setattr(module, name, _Recorder())
    try:
        call()
    finally:
        setattr(module, name, kernel)
    grid, args, kwargs = seen[0]
    return kernel, grid, args, kwargs


def triton_launch_rows() -> list[dict]:
    """The host's time per launch of one Triton kernel through its JIT function (argument
    binding, specialization key, cache lookup, then the launch) and through the compiled
    kernel's own runner (the launch alone, arguments as the JIT function passes them), with
    the outputs compared; through fusedist's launch cache (the call sites' path: key, lookup,
    then the compiled kernel's launcher); beside one torch op's call."""
    from fusedist.nn._layout import ncs_layout
    from fusedist.triton_kernels import multi_tensor as MT
    from fusedist.triton_kernels import syncbn as K
    from fusedist.triton_kernels.launch_cache import CachedLauncher

    x = torch.randn(64, 512, 7, 7, device="cuda", dtype=torch.float16)
    layout = ncs_layout(x)
    x_nhwc = x.contiguous(memory_format=torch.channels_last)
    layout_nhwc = ncs_layout(x_nhwc)
    f32 = dict(device="cuda", dtype=torch.float32)
    outs = torch.empty(512, **f32), torch.empty(512, **f32), torch.empty(1, **f32)
    step, (params, opt, scaler) = fusedist_step(split_shapes(1_000_000), torch.device("cuda"), "fp32")
    for _ in range(3):
        step()
    cases = [("welford per channel (syncbn stats, NCHW)", K, "_welford_channel_kernel",
              lambda: K.welford_stats(x, layout, *outs)),
             ("welford partial (syncbn stats, NHWC)", K, "_welford_partial_kernel",
              lambda: K.welford_stats(x_nhwc, layout_nhwc, *outs)),
             ("adam (1M fp32, 4 tensors)", MT, "_adam_kernel", step)]
    rows = []
    for label, module, name, call in cases:
        kernel, grid, args, kwargs = _record_launch(module, name, call)
        jit = lambda: kernel[grid](*args, **kwargs)  # noqa: E731
        compiled = jit()
        torch.cuda.synchronize()
        row = {"row": f"launch {label}", "who": "fusedist", "jit_host_us": round(host_ms_per_call(jit, 200) * 1e3, 2)}
        named = dict(zip(kernel.arg_names, args), **kwargs)
        constexprs = getattr(kernel, "constexprs", ())
        variants = {"runtime args": [named[n] for i, n in enumerate(kernel.arg_names) if i not in constexprs],
                    "all args": [named[n] for n in kernel.arg_names]}
        outputs = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        jit()
        torch.cuda.synchronize()
        expected = [o.clone() for o in outputs]
        launcher = CachedLauncher(kernel)  # Note [a launch cache in front of the JIT], whatever the setting
        row["launch_cache_host_us"] = round(host_ms_per_call(lambda: launcher[grid](*args, **kwargs), 200) * 1e3, 2)
        row["launch_cache_one_entry"] = len(launcher.entries) == 1
        if "welford" in label:  # its outputs (all but the input x) wiped, then one launch from the cache
            for o in outputs[1:]:
                o.fill_(float("nan"))
            launcher[grid](*args, **kwargs)
            torch.cuda.synchronize()
            row["launch_cache_same_outputs_as_jit"] = all(torch.equal(o, e) for o, e in zip(outputs, expected))
        grid3 = tuple(grid) + (1,) * (3 - len(grid))  # (the runner reads grid[0], grid[1], grid[2])
        for variant, call_args in variants.items():
            try:
                runner = compiled[grid3]
                runner(*call_args)
                torch.cuda.synchronize()
                row[f"runner_{variant}_host_us"] = round(host_ms_per_call(lambda: runner(*call_args), 200) * 1e3, 2)
                jit()
                torch.cuda.synchronize()
                row[f"runner_{variant}_same_outputs_as_jit"] = all(
                    torch.equal(o, e) for o, e in zip(outputs, expected)) if "welford" in label else "n/a (stateful)"
            except Exception as exc:  # noqa: BLE001 - an internal API: report what it says
                row[f"runner_{variant}"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    torch_op = lambda: torch.batch_norm_stats(x, 1e-5)  # noqa: E731
    rows.append({"row": "torch.batch_norm_stats call", "who": "torch",
                 "jit_host_us": round(host_ms_per_call(torch_op, 200) * 1e3, 2)})
    print(json.dumps(rows[-1]), flush=True)
    rows.append(_stats_launcher_parts(x_nhwc, layout_nhwc, outs))
    print(json.dumps(rows[-1]), flush=True)
    return rows


def _stats_launcher_parts(x, layout, outs) -> dict:
    """The host's µs for each piece of the SyncBN statistics launcher, called alone 200 times:
    where its time outside the two launches goes."""
    from fusedist.triton_kernels import syncbn as K

    N, C, S, stride_n, stride_c, stride_s = layout
    block_s, block_c = K._tile(C, S, stride_c, K._reduction_tile(x.device))
    split = K._row_splits(N * K._cdiv(S, block_s), K._cdiv(C, block_c), x.device)
    f32 = dict(device=x.device, dtype=torch.float32)
    parts = {
        "welford_stats, row-split (whole)": lambda: K.welford_stats(x, layout, *outs),
        "_channel_path": lambda: K._channel_path(layout),
        "launch arithmetic (_tile, _cdiv, _wide_index)": lambda: (
            K._tile(C, S, stride_c, K._reduction_tile(x.device)), K._wide_index(layout, C, S)),
        "_row_splits (device properties)": lambda: K._row_splits(N, 4, x.device),
        "torch.cuda.get_device_properties": lambda: torch.cuda.get_device_properties(x.device),
        "one torch.empty((split, C))": lambda: torch.empty((split, C), **f32),
        "triton_interpreting()": K.triton_interpreting,
    }
    row = {"row": "statistics launcher, host us per piece", "who": "fusedist"}
    for name, fn in parts.items():
        try:
            row[name] = round(host_ms_per_call(fn, 200) * 1e3, 2)
        except Exception as exc:  # noqa: BLE001 - one piece's failure must not lose the others
            row[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    rows = []
    for section in (triton_launch_rows, channel_path_variants, optimizer_rows, syncbn_rows):
        try:
            rows += section()
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the other's rows
            print(f"{section.__name__} failed: {type(exc).__name__}: {exc}", flush=True)
    with open(os.path.join(args.out, "profile_launch_bound.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n| row | who | device_ms | host_ms | launches/call | syncs/call |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "device_ms" in r:
            print(f"| {r['row']} | {r['who']} | {r['device_ms']} | {r['host_ms']} | {r['launches_per_call']:.1f} | "
                  f"{r['syncs_per_call']} |")
        else:
            print(f"| {r['row']} | {r['who']} | "
                  f"{json.dumps({k: v for k, v in r.items() if k not in ('row', 'who')})} |")


if __name__ == "__main__":
    main()
