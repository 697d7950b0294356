"""Benchmark: the fused AMP optimizer step against torch's, in the same run.

fusedist:  GradScaler(lazy_unscale=True).unscale_ -> fusedist.clip_grad_norm_ ->
           GradScaler.step(FusedAdamW with master_weights=True) -> update. Two passes over the
           gradients, no host sync. ``fusedist_default_ms``: the same with the default
           GradScaler, whose unscale_ also writes the unscaled gradients (as torch's does, so
           torch's clip_grad_norm_ may be used; Note [lazy unscale]).
torch:     FP32 master weights done torch's way: upcast the bf16 grads into the fp32 masters'
           grads, GradScaler.unscale_ -> torch.nn.utils.clip_grad_norm_ ->
           GradScaler.step(AdamW(fused=True)) -> update, then copy the masters back into the
           bf16 parameters. (An ``fp32`` row compares plain fp32 parameters, no masters.)

Reported per configuration: median ms (and 20/80% quantiles) of both, the ratio
torch/fusedist (> 1 means fusedist is faster), GB/s at the modeled traffic of 28 bytes per
parameter for bf16 params + grads with fp32 master and states (read grad 2 + read/write master,
exp_avg, exp_avg_sq 24 + write param 2; 16 B/param more for fp32 params without masters), and
on CUDA the fraction of a same-run device-to-device copy moving the same number of bytes.

CUDA sizes: 1M, 10M, 100M, 1B parameters (4 tensors each), a GPT-like list of 196 tensors
(~152M params) and 200 small tensors. The last line is the verdict: the lowest ratio against
torch over every row, lazy and default unscale alike (target >= 1.0), and the lowest copy
fraction from 100M parameters up (target >= 0.9). CPU sizes are smaller; on CPU fusedist runs whatever
backend ``fusedist.backend`` picks for CPU tensors (the pure-PyTorch reference, or the C++
CPU extension when built), and the row says which.

Usage: python benchmarks/bench_optimizer.py [--device auto|cpu|cuda] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (bench_ms, environment, host_ms_per_call, launch_cache_on,  # noqa: E402
                     with_launchers, write_results)

import fusedist  # noqa: E402
from fusedist.amp import GradScaler  # noqa: E402
from fusedist.backend import select_backend  # noqa: E402
from fusedist.optim import FusedAdamW  # noqa: E402
from fusedist.optim import functional as F  # noqa: E402

BYTES_PER_PARAM = {"bf16+master": 28, "fp32": 32}  # see module docstring
# The gradients are set once and reused by every timed step. An unscale that writes them (torch's
# unscale_, fusedist's default one) multiplies them by 1/scale each step: with torch's default
# 65536 they turn denormal within a few repetitions, and denormal arithmetic is several times
# slower on x86, which once inflated every such row. At scale 1 every pass still runs (the
# multiplications by 1.0 are done), and the values stay as they are.
LOSS_SCALE = 1.0


def gpt_like_shapes(layers: int = 16, d: int = 768, vocab: int = 50304, ctx: int = 1024):
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def split_shapes(total: int, pieces: int = 4):
    return [(total // pieces,)] * pieces


def configs(device: torch.device, quick: bool):
    if device.type == "cuda":
        out = [("1M", split_shapes(1_000_000)), ("10M", split_shapes(10_000_000)), ("100M", split_shapes(100_000_000))]
        if not quick:
            out.append(("1B", split_shapes(1_000_000_000)))
        out += [("gpt-196-tensors", gpt_like_shapes()), ("200x4K-small", [(4096,)] * 200)]
        return out
    if quick:
        return [("1M", split_shapes(1_000_000, 8)), ("64x4K-small", [(4096,)] * 64)]
    return [("1M", split_shapes(1_000_000, 8)), ("8M", split_shapes(8_000_000, 8)), ("64x4K-small", [(4096,)] * 64)]


def _grads_like(params, dtype):
    gen = torch.Generator(device=params[0].device).manual_seed(0)
    return [torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).to(dtype) for p in params]


def fusedist_step(shapes, device, mode, lazy_unscale=True):
    dtype = torch.bfloat16 if mode == "bf16+master" else torch.float32
    params = [torch.empty(s, device=device, dtype=dtype).normal_().requires_grad_() for s in shapes]
    for p, g in zip(params, _grads_like(params, dtype)):
        p.grad = g
    opt = FusedAdamW(params, lr=1e-4, weight_decay=0.01, master_weights=mode == "bf16+master")
    scaler = GradScaler(device.type, init_scale=LOSS_SCALE, lazy_unscale=lazy_unscale)
    scaler.scale(torch.ones((), device=device))  # initializes the scale tensor

    def step():
        scaler.unscale_(opt)
        fusedist.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()

    return step, (params, opt, scaler)


def torch_step(shapes, device, mode):
    if mode == "bf16+master":
        model = [torch.empty(s, device=device, dtype=torch.bfloat16).normal_() for s in shapes]
        model_grads = _grads_like(model, torch.bfloat16)
        masters = [p.float().requires_grad_() for p in model]
        for m in masters:
            m.grad = torch.empty_like(m)
    else:
        model, model_grads = None, None
        masters = [torch.empty(s, device=device).normal_().requires_grad_() for s in shapes]
        for m, g in zip(masters, _grads_like(masters, torch.float32)):
            m.grad = g
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE)
    scaler.scale(torch.ones((), device=device))
    grads = [m.grad for m in masters]

    def step():
        if model is not None:
            torch._foreach_copy_(grads, model_grads)  # upcast bf16 grads into the fp32 masters
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        scaler.step(opt)
        scaler.update()
        if model is not None:
            torch._foreach_copy_(model, masters)  # write the new weights back to bf16

    return step, (model, model_grads, masters, opt, scaler)


def copy_ms(nbytes_moved: int, device: torch.device, **timing):
    src = torch.empty(nbytes_moved // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return bench_ms(lambda: dst.copy_(src), device, **timing)["median_ms"]  # both freed on return


def verdict(rows: list[dict]) -> str:
    """One line: the worst ratio against torch (lazy or default unscale) and, where measured,
    the worst copy fraction from 100M parameters up."""
    worst = min(rows, key=lambda r: min(r["speedup_vs_torch"], r["default_speedup_vs_torch"]))
    ratio = min(worst["speedup_vs_torch"], worst["default_speedup_vs_torch"])
    text = (f"verdict: lowest ratio against torch {ratio:.3f}x ({worst['config']} {worst['mode']}; "
            f"target >= 1.0)")
    cached = [r for r in rows if r.get("launch_cache_speedup_vs_torch") == r.get("launch_cache_speedup_vs_torch")]
    if cached:  # (rows with a launch-cache timing: the ratio is not nan)
        low = min(cached, key=lambda r: r["launch_cache_speedup_vs_torch"])
        text += (f"; with FUSEDIST_TRITON_LAUNCH_CACHE=1: lowest ratio {low['launch_cache_speedup_vs_torch']:.3f}x "
                 f"({low['config']} {low['mode']})")
    big = [r for r in rows if "copy_fraction" in r and r["params_M"] >= 100]
    if big:
        low = min(big, key=lambda r: r["copy_fraction"])
        text += (f"; lowest copy fraction from 100M up {low['copy_fraction']:.2f} "
                 f"({low['config']} {low['mode']}; target >= 0.9)")
    return text


def interleaved_rounds(steps: dict, device: torch.device, rounds: int, timing: dict) -> dict:
    """Each contender timed once per round, in turn, for ``rounds`` rounds: a slow stretch of a
    shared host (the small steps are bound by it) falls on every contender alike instead of on
    whichever ran then. Per contender: the median of its rounds' medians, and the spread of
    those (max - min over the median). (``_common.time_interleaved`` alternates too, but
    synchronizes around every single call: at tens of microseconds per step that would time
    the synchronization; each round here is ``bench_ms``'s own timing.)"""
    per_round: dict = {k: [] for k in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            per_round[key].append(bench_ms(step, device, **timing)["median_ms"])
    out = {}
    for key, values in per_round.items():
        median = statistics.median(values)
        out[key] = {"median_ms": median, "spread": (max(values) - min(values)) / median}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (smoke run)")
    parser.add_argument("--no-write", action="store_true", help="print only, do not write results/")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default); 1 gives steadier numbers on a shared machine")
    parser.add_argument("--rounds", type=int, default=0,
                        help="timing rounds, the contenders in turn in each (0: 3 on CUDA, 1 on CPU)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("warning: TRITON_INTERPRET is set; CPU timings measure the Triton interpreter", file=sys.stderr)
    # (CUDA: three rounds of ~50 ms per contender, about the one 125 ms timing of before)
    timing = {"warmup": 10, "rep": 40} if device.type == "cuda" else {"warmup": 2, "repeats": 5 if args.quick else 15}
    modes = ["bf16+master", "fp32"]
    backend = select_backend("adam_update", device, has_cpu_ext=F._has_cpu_adam())
    rows = []
    rounds = args.rounds or (3 if device.type == "cuda" else 1)
    for name, shapes in configs(device, args.quick):
        n = sum(torch.Size(s).numel() for s in shapes)
        for mode in modes:
            contenders = {"ours": fusedist_step(shapes, device, mode),
                          "default": fusedist_step(shapes, device, mode, lazy_unscale=False),
                          "theirs": torch_step(shapes, device, mode)}
            if device.type == "cuda":  # the lazy step again, its launches through the launch cache
                cached_step, launchers = fusedist_step(shapes, device, mode), {}
                with launch_cache_on(launchers) as on:
                    cached_step[0]()
                if on:
                    contenders["cached"] = (with_launchers(cached_step[0], launchers), cached_step[1])
            times = interleaved_rounds({k: step for k, (step, _) in contenders.items()}, device, rounds, timing)
            ours_t, default_t, theirs_t = times["ours"], times["default"], times["theirs"]
            ours_host = host_ms_per_call(contenders["ours"][0]) if device.type == "cuda" else None
            theirs_host = host_ms_per_call(contenders["theirs"][0]) if device.type == "cuda" else None
            del contenders
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            modeled = BYTES_PER_PARAM[mode] * n
            row = {
                "config": name, "tensors": len(shapes), "params_M": n / 1e6, "mode": mode,
                "fusedist_backend": backend,
                "fusedist_ms": ours_t["median_ms"], "fusedist_round_spread": ours_t["spread"],
                "torch_ms": theirs_t["median_ms"], "torch_round_spread": theirs_t["spread"],
                "speedup_vs_torch": theirs_t["median_ms"] / ours_t["median_ms"],
                "fusedist_default_ms": default_t["median_ms"],
                "default_speedup_vs_torch": theirs_t["median_ms"] / default_t["median_ms"],
                "launch_cache_ms": times["cached"]["median_ms"] if "cached" in times else float("nan"),
                "launch_cache_speedup_vs_torch": (theirs_t["median_ms"] / times["cached"]["median_ms"]
                                                  if "cached" in times else float("nan")),
                "fusedist_GBps": modeled / ours_t["median_ms"] / 1e6,
                "torch_GBps": modeled / theirs_t["median_ms"] / 1e6,
            }
            if device.type == "cuda":
                row["copy_fraction"] = copy_ms(modeled, device, **timing) / ours_t["median_ms"]
                row["fusedist_host_ms"], row["torch_host_ms"] = ours_host, theirs_host
            rows.append(row)
            print(", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    notes = (
        "fusedist: GradScaler(lazy_unscale=True).unscale_ + fusedist.clip_grad_norm_ + GradScaler.step(FusedAdamW) "
        "+ update; fusedist_default_ms: the same with the default GradScaler, whose unscale_ also writes the "
        "unscaled gradients in place (as torch's does).\n"
        "torch: grad upcast + GradScaler.unscale_ + clip_grad_norm_ + GradScaler.step(AdamW(fused=True)) "
        "+ update + bf16 write-back (bf16+master); fp32 rows have no masters.\n"
        f"speedup_vs_torch = torch_ms / fusedist_ms. GB/s at {BYTES_PER_PARAM} bytes/param (modeled). "
        f"Times: median over {rounds} round(s), the contenders timed in turn in each round; "
        "_round_spread = (slowest - fastest round) / median, the host's noise on the launch-bound rows. "
        "Loss scale 1 on both sides, so the in-place unscales do not drive the reused gradients into "
        "denormals (the passes run all the same)."
        + ("\nlaunch_cache_ms: fusedist's lazy step with its Triton launches through the launch cache "
           "(FUSEDIST_TRITON_LAUNCH_CACHE=1, off by default: Note [the launch cache is opt-in]), a fourth "
           "contender in the same rounds."
           "\ncopy_fraction = time of a device-to-device copy of the same bytes / fusedist_ms. "
           "fusedist_host_ms / torch_host_ms: the host's time per step, 20 steps issued back to back "
           "(near the device time: bound by launches and Python; above it: the step synchronizes)."
           if device.type == "cuda" else
           "\nOn CPU fusedist_backend says what ran: 'torch' is the pure-PyTorch reference (about a dozen foreach "
           "passes), against torch's single-pass C++ fused AdamW; the C++ CPU Adam ('cpu_ext') is the intended fast "
           "CPU path. CPU timings on a shared machine are noisy: see loadavg_1m and the p20/p80 columns.")
    )
    line = verdict(rows)
    print(line)
    notes += "\n\n" + line
    if not args.no_write:
        md, csv_path = write_results(f"optimizer_{device.type}", rows, notes, environment())
        print(f"wrote {md} and {csv_path}")


if __name__ == "__main__":
    main()
