"""Benchmark: fusedist's C++ CPU Adam/AdamW against torch.optim.AdamW (and DeepSpeedCPUAdam).

Same run, same machine, same memory: every contender of a case steps the *same* tensors
(parameters, gradients, moments; torch's optimizers get them as pre-filled state), so no
contender is favoured by where its buffers happen to sit (separately allocated buffers of
the same size differ by up to 20% in speed here). Each repetition times every contender once,
in a freshly shuffled order (a step right after another memory-bound one runs slower: a fixed
rotation would bias the pairs). Reported: medians over repetitions, and the median of the
*paired* ratios (baseline time / contender time within the same repetition), which cancels
slow drifts of the machine.

1. fp32 parameters: fusedist ``adam_update`` vs ``torch.optim.AdamW(foreach=True)`` and
   ``(fused=True)``; at the smaller size also each fusedist ISA path (avx512/avx2/scalar).
2. bf16 parameters and gradients with FP32 master weights: fusedist in one pass vs torch's
   best equivalent (copy the bf16 grads into fp32 ``.grad`` buffers, fused AdamW on the
   masters, copy the masters back into the bf16 params).
3. ``DeepSpeedCPUAdam`` (fp32), when ``--deepspeed-python`` names an interpreter of an
   environment where ``deepspeed`` is installed: that interpreter re-runs this script in
   ``--deepspeed-only`` mode with this repository on ``PYTHONPATH`` and times DeepSpeed,
   fusedist and torch fused in one process.

Reported: ms per step (median and min; on a shared machine the min is the least disturbed),
parameters/s, GB/s at modeled bytes (fp32 Adam: read p, g, m, v and
write p, m, v = 28 B/param; fusedist bf16+master: 4+2+4+4 read, 4+4+4+2 written = 28 B/param;
torch's bf16 equivalent: 6 (grad upcast) + 28 + 6 (copy back) = 40 B/param), a same-run
memory-copy bandwidth (``dst.copy_(src)`` on fp32, 8 B/element, timed inside the same
shuffled rounds), and ratios against torch (paired, of medians, and of minima).

    python benchmarks/bench_cpu_adam.py --sizes 10M,100M --tensors 64
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


# ----------------------------------------------------------------------------- helpers


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * mult)


def tensor_sizes(total: int, count: int) -> list[int]:
    """``count`` sizes summing to ``total``, uneven (±40%) and mostly not multiples of 16."""
    gen = torch.Generator().manual_seed(0)
    weights = 0.6 + 0.8 * torch.rand(count, generator=gen, dtype=torch.float64)
    sizes = [max(1, int(w)) for w in (weights / weights.sum() * total).tolist()]
    sizes[-1] += total - sum(sizes)
    return sizes


def shuffled_rounds(contenders: dict, reps: int, warmup: int = 2, seed: int = 0) -> dict[str, list[float]]:
    """Time each callable ``reps`` times; every repetition runs all of them once, in a new
    random order. Returns seconds per call, indexed by repetition."""
    import random

    rng = random.Random(seed)
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in contenders}
    names = list(contenders)
    for _ in range(reps):
        rng.shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def fusedist_update():
    sys.path.insert(0, REPO)
    from fusedist.optim._cpu_adam import adam_update

    return adam_update


# ----------------------------------------------------------------------------- contenders


class SharedState:
    """The tensors every contender of one case steps: fp32 masters/params, gradients (fp32 or
    bf16), moments, and for the bf16 case the bf16 parameters and torch's fp32 grad buffers."""

    def __init__(self, sizes, bf16: bool = False, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.sizes = sizes
        self.masters = [torch.randn(n, generator=gen) for n in sizes]
        grads = [torch.randn(n, generator=gen) for n in sizes]
        self.m = [torch.zeros(n) for n in sizes]
        self.v = [torch.zeros(n) for n in sizes]
        if bf16:
            self.params = [p.to(torch.bfloat16) for p in self.masters]
            self.grads = [g.to(torch.bfloat16) for g in grads]
            self.grad32 = grads  # torch's upcast target, refilled each step
        else:
            self.params, self.grads = None, grads


def torch_adamw(state: SharedState, **flags):
    """torch.optim.AdamW over the shared masters, its state pointing at the shared moments."""
    params = [torch.nn.Parameter(p, requires_grad=True) for p in state.masters]  # shares storage
    grads = state.grad32 if state.params is not None else state.grads
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], **flags)
    for p, m, v in zip(params, state.m, state.v):
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}
    return opt


def fusedist_fp32(state: SharedState, isa=None):
    adam_update = fusedist_update()
    counter = {"step": 0}

    def step():
        if isa is not None:
            os.environ["FUSEDIST_CPU_ISA"] = isa
        counter["step"] += 1
        adam_update(state.masters, state.grads, state.m, state.v, None, adamw=True,
                    step=counter["step"], **HYPER)
        if isa is not None:
            os.environ.pop("FUSEDIST_CPU_ISA")

    return step


def torch_fp32(state: SharedState, **flags):
    return torch_adamw(state, **flags).step


def fusedist_bf16_master(state: SharedState):
    adam_update = fusedist_update()
    counter = {"step": 0}

    def step():
        counter["step"] += 1
        adam_update(state.params, state.grads, state.m, state.v, state.masters, adamw=True,
                    step=counter["step"], **HYPER)

    return step


def torch_bf16_master(state: SharedState):
    """torch's best equivalent: upcast grads, fused AdamW on the FP32 master, copy back."""
    opt = torch_adamw(state, fused=True)

    def step():
        torch._foreach_copy_(state.grad32, state.grads)
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(state.params, state.masters)

    return step


def deepspeed_fp32(state: SharedState):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    params = [torch.nn.Parameter(p) for p in state.masters]
    for p, g in zip(params, state.grads):
        p.grad = g
    opt = DeepSpeedCPUAdam(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                           eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], adamw_mode=True)
    for p, m, v in zip(params, state.m, state.v):
        opt.state[p] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}
    return opt.step


# ----------------------------------------------------------------------------- cases


COPY = "_copy"


def run_case(case: str, total: int, count: int, reps: int, builders: dict, bytes_per_param: dict,
             baseline: str, bf16: bool = False) -> list[dict]:
    """Time the contenders on one shared state, plus an fp32 ``copy_`` of ``total`` elements
    in the same shuffled rounds (the memory reference, measured under the same conditions)."""
    state = SharedState(tensor_sizes(total, count), bf16=bf16)
    contenders = {name: build(state) for name, build in builders.items()}
    src, dst = torch.randn(total), torch.empty(total)
    contenders[COPY] = lambda: dst.copy_(src)
    times = shuffled_rounds(contenders, reps)
    del contenders, src, dst, state
    gc.collect()
    copy_times = times.pop(COPY)
    copy_gbs = 8 * total / statistics.median(copy_times) / 1e9
    base, base_min = statistics.median(times[baseline]), min(times[baseline])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        gbs = bytes_per_param[name] * total / med / 1e9
        paired = [b / t for b, t in zip(times[baseline], ts)]
        rows.append({
            "case": case, "params": total, "tensors": count, "impl": name,
            "ms_median": round(med * 1e3, 3), "ms_min": round(min(ts) * 1e3, 3),
            "Mparams_per_s": round(total / med / 1e6, 1), "bytes_per_param": bytes_per_param[name],
            "GB_per_s_modeled": round(gbs, 2), "copy_GB_per_s": round(copy_gbs, 2),
            "frac_of_copy_bw": round(gbs / copy_gbs, 2),
            "baseline": baseline, "speedup_median": round(base / med, 2),
            "speedup_paired": round(statistics.median(paired), 2),
            "speedup_paired_min_max": f"{min(paired):.2f}-{max(paired):.2f}",
            "speedup_min": round(base_min / min(ts), 2), "reps": reps,
        })
    return rows


def main_cases(args) -> list[dict]:
    from fusedist.optim import _cpu_adam

    rows = []
    for total in args.sizes:
        reps = args.reps if total <= 20_000_000 else max(3, args.reps // 2)
        fp32 = {
            "fusedist": lambda s: fusedist_fp32(s),
            "torch_fused": lambda s: torch_fp32(s, fused=True),
            "torch_foreach": lambda s: torch_fp32(s, foreach=True),
        }
        if total <= 20_000_000:
            for isa in _cpu_adam.available_isas():
                fp32[f"fusedist[{isa}]"] = lambda s, isa=isa: fusedist_fp32(s, isa)
        rows += run_case("fp32", total, args.tensors, reps, fp32, {k: 28 for k in fp32},
                         "torch_fused")
        bf16 = {"fusedist": fusedist_bf16_master, "torch_fused_master": torch_bf16_master}
        rows += run_case("bf16+fp32 master", total, args.tensors, reps, bf16,
                         {"fusedist": 28, "torch_fused_master": 40}, "torch_fused_master", bf16=True)
    return rows


def deepspeed_only(args) -> None:
    rows = []
    for total in args.sizes:
        reps = args.reps if total <= 20_000_000 else max(3, args.reps // 2)
        builders = {"deepspeed_cpu_adam": deepspeed_fp32, "fusedist": fusedist_fp32,
                    "torch_fused": lambda s: torch_fp32(s, fused=True)}
        rows += run_case("fp32 (DeepSpeed run)", total, args.tensors, reps, builders,
                         {k: 28 for k in builders}, "deepspeed_cpu_adam")
    import deepspeed

    print("DEEPSPEED_JSON " + json.dumps({"rows": rows, "version": deepspeed.__version__}))


def run_deepspeed(args) -> tuple[list[dict], str]:
    if not args.deepspeed_python:
        return [], "not run: pass --deepspeed-python with an interpreter that has deepspeed"
    cmd = [args.deepspeed_python, os.path.abspath(__file__), "--deepspeed-only",
           "--sizes", ",".join(str(s) for s in args.sizes), "--tensors", str(args.tensors),
           "--reps", str(args.reps), "--threads", str(torch.get_num_threads())]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=str(torch.get_num_threads()))
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("DEEPSPEED_JSON "):
            data = json.loads(line[len("DEEPSPEED_JSON "):])
            return data["rows"], f"deepspeed {data['version']} (op load + run {time.time() - t0:.0f} s)"
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
    return [], "failed: " + " | ".join(tail)


# ----------------------------------------------------------------------------- report


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001 - best-effort metadata
        return "?"


def write_report(args, rows, ds_note, load_before, load_after) -> None:
    from fusedist.optim import _cpu_adam

    os.makedirs(args.out, exist_ok=True)
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    cpu = sh("lscpu | sed -n 's/^Model name: *//p'")
    cores = os.cpu_count()
    fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(os.path.join(args.out, f"bench_cpu_adam{args.tag}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["date", "cpu", "cores", "torch"] + fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({"date": today, "cpu": cpu, "cores": cores, "torch": torch.__version__, **r})
    lines = [
        f"# CPU Adam/AdamW benchmark ({today})",
        "",
        f"- CPU: {cpu}, {cores} cores; torch {torch.__version__} ({torch.get_num_threads()} threads); "
        f"Python {platform.python_version()}; {sh('g++ --version | head -1')}",
        f"- fusedist {sh(f'git -C {REPO} rev-parse --short HEAD')}, ISA paths available: "
        f"{_cpu_adam.available_isas()} (default: {_cpu_adam.selected_isa()})",
        f"- Load average (1/5/15 min) before / after: {load_before} / {load_after}"
        + (" -- the load average exceeded 1.5 during this run, so other processes competed for the cores:"
           " expect noise, trust the same-run ratios and the `ms_min` column more than absolute medians"
           if max(float(x) for x in (load_before + " " + load_after).split()[::3]) > 1.5 else ""),
        f"- {args.tensors} tensors of uneven sizes; AdamW lr={HYPER['lr']} wd={HYPER['weight_decay']}; "
        "every contender steps the same tensors; each repetition runs all contenders in a new random order; "
        "`speedup_paired` = median over repetitions of baseline time / contender time in that repetition.",
        f"- DeepSpeedCPUAdam: {ds_note}",
        "",
        "Modeled bytes/param: fp32 Adam 28; fusedist bf16 + FP32 master 28; torch's bf16 "
        "equivalent 40 (grad upcast 6 + fused step 28 + copy back 6). `frac_of_copy_bw` = modeled "
        "GB/s divided by the same-run fp32 `copy_` bandwidth.",
        "",
    ]
    cols = ["case", "params", "impl", "ms_median", "ms_min", "Mparams_per_s", "GB_per_s_modeled",
            "copy_GB_per_s", "frac_of_copy_bw", "baseline", "speedup_paired", "speedup_paired_min_max",
            "speedup_median", "speedup_min"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    lines.append("")
    with open(os.path.join(args.out, f"bench_cpu_adam{args.tag}.md"), "w") as f:
        f.write("\n".join(lines) + (args.notes or ""))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10M,100M", help="total parameters per case, comma-separated")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--deepspeed-python", default=None,
                        help="python of an environment with deepspeed installed (run separately)")
    parser.add_argument("--deepspeed-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--notes", default="", help="markdown appended to the report")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (fusedist follows torch's thread count)")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    args = parser.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.deepspeed_only:
        deepspeed_only(args)
        return
    sys.path.insert(0, REPO)
    load_before = sh("cat /proc/loadavg | cut -d' ' -f1-3")
    rows = main_cases(args)
    ds_rows, ds_note = run_deepspeed(args)
    load_after = sh("cat /proc/loadavg | cut -d' ' -f1-3")
    write_report(args, rows + ds_rows, ds_note, load_before, load_after)


if __name__ == "__main__":
    main()
