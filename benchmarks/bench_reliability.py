"""Cost of the always-on reliability checks on the DDP benchmark's model (target there: < 1% of a step).

The target holds for a model whose step does real work (this one: ~50 ms a step), not for a
tiny one: there the step is the collectives' latency, and the per-step check is a large share of
it -- on a 3-layer MLP of width 32 (2 ranks, gloo, 2-core CPU) the check's own small all-reduce
made the step 2.2-3x torch DDP's where ``FUSEDIST_CHECKS=0`` was ~1.0-1.2x; carried by the last
bucket's all-reduce (Note [the check carried by the last bucket] in
fusedist/reliability/carried_check.py) it costs ~0.05-0.15 ms of host CPU a step there, up to ~15%
of such a step.
``benchmarks/bench_ddp_step_overhead.py`` measures that case, and
``benchmarks/results/ddp_step_check_cpu_2026-12-07.md`` holds the figures.

    python benchmarks/bench_reliability.py            # 2 ranks, gloo, the bench_ddp.py model
    python benchmarks/bench_reliability.py --quick    # smaller, for a smoke run

Two fusedist DDP copies of the model train in the same processes, alternating rounds so
that drifting machine load hits both equally:

* ``checks on``: the default (collective monitor on the communicator, the per-step
  cross-rank check, the optimizer-step guard);
* ``checks off``: built with ``FUSEDIST_CHECKS=0`` on a separate process group, so its
  communicator carries no monitor and its reducer no step check.

The optimizer-step guard is a process-wide hook, so it runs for both copies; its cost is
timed on its own (microbenchmark of the pre/post hooks) and added to the "on" side. The
monitor's per-collective cost is microbenchmarked too, so the report gives both the measured
end-to-end difference (noisy on a shared machine) and the sum of the measured components.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import write_results  # noqa: E402
from bench_ddp import _time_steps, add_model_args, make_model  # noqa: E402
from fusedist.reliability.step_check import FIELDS  # noqa: E402


def _per_call_us(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def worker(rank, world_size, args):
    import fusedist
    from fusedist.reliability import monitor_of, optimizer_guard

    # Each copy gets its own process group (so the monitor sits on one communicator only);
    # which copy gets the default group alternates with --swap, to rule out group effects.
    groups = [None, dist.new_group(list(range(world_size)))]
    if args.swap:
        groups.reverse()
    os.environ["FUSEDIST_CHECKS"] = "0"
    torch.manual_seed(0)
    off = fusedist.DistributedDataParallel(make_model(args.width, args.layers), bucket_cap_mb=args.bucket_cap_mb,
                                           process_group=groups[1])
    os.environ["FUSEDIST_CHECKS"] = "1"
    torch.manual_seed(0)
    on = fusedist.DistributedDataParallel(make_model(args.width, args.layers), bucket_cap_mb=args.bucket_cap_mb,
                                          process_group=groups[0])
    assert monitor_of(on.comm) is not None and on.watch.step_check is not None
    assert monitor_of(off.comm) is None and off.watch.step_check is None
    impls = {"on": on, "off": off}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in impls.items()}
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    for k in impls:  # warm-up, includes the one-time bucket rebuild
        _time_steps(impls[k], opts[k], x, 3, True)
    times = {k: [] for k in impls}
    ratios = []  # per round: on / off, the paired comparison least sensitive to load drift
    for round_index in range(args.rounds):  # alternate the order too: on/off, off/on, ...
        this_round = {}
        for k in (list(impls) if round_index % 2 == 0 else list(reversed(list(impls)))):
            this_round[k] = _time_steps(impls[k], opts[k], x, args.steps, True)
            times[k] += this_round[k]
        ratios.append(statistics.median(this_round["on"]) / statistics.median(this_round["off"]))

    # Components, each timed on its own.
    monitor = monitor_of(on.comm)
    handle = on.comm.all_reduce(torch.zeros(1), tag="probe")
    monitor_us = _per_call_us(lambda: monitor.on_launch(on.comm, handle), 20000)
    guard_us = _per_call_us(lambda: (optimizer_guard._pre_step(opts["on"], (), {}),
                                     optimizer_guard._post_step(opts["on"], (), {})), 20000)
    probe = torch.zeros(2 * len(FIELDS), dtype=torch.int64)
    dist.barrier()
    check_us = _per_call_us(lambda: on.comm.all_reduce(probe, op="max"), 200)
    launch = []
    for _ in range(200):  # what the step check costs the critical path: the launch only
        t0 = time.perf_counter()
        on.watch.step_check.launch([0] * len(FIELDS), {})
        launch.append(time.perf_counter() - t0)
        on.watch.step_check.settle()
    check_launch_us = statistics.median(launch) * 1e6
    # (the check's own all-reduce, unless the last bucket carries it: then no collective of its own)
    collectives_per_step = len(on.buckets) + (0 if on.watch.carries(on.reducer) else 1)
    return {
        "round_ratios": ratios,
        "on_ms": statistics.median(times["on"]) * 1e3,
        "off_ms": statistics.median(times["off"]) * 1e3,
        "monitor_us": monitor_us,
        "guard_us": guard_us,
        "check_roundtrip_us": check_us,
        "check_launch_us": check_launch_us,
        "collectives_per_step": collectives_per_step,
        "buckets": len(on.buckets),
        "params": sum(p.numel() for p in on.parameters()),
    }


#: what ``--quick`` sets, unless the option is given too
QUICK = {"width": 512, "layers": 4, "rounds": 3, "steps": 3}


def parse_options(argv=None) -> argparse.Namespace:
    """The options, ``--quick``'s sizes standing in for the defaults only: parsed again with them
    as defaults, so an option given explicitly wins whichever comes first (``--quick --width 256``
    is a smoke run of width 256), as in bench_ddp.py."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, rounds=12, steps=2, quick_help=(
        "smoke-run sizes: " + ", ".join(f"--{k} {v}" for k, v in QUICK.items())
        + "; an option given explicitly keeps its value"))
    p.add_argument("--swap", action="store_true", help="checks-on copy on the new group, off on the default")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    return args


def main(argv=None):
    args = parse_options(argv)

    from fusedist.testing import run_distributed

    r = run_distributed(worker, args.world_size, args, timeout=1800, pg_timeout=600)[0]
    measured = r["on_ms"] / r["off_ms"] - 1.0
    quartiles = statistics.quantiles(r["round_ratios"], n=4)
    paired = statistics.median(r["round_ratios"]) - 1.0
    # Per step: one on_launch per collective, the guard's two hooks and the check's launch; its
    # verdict is read at the next forward, after the round trip completed behind the optimizer.
    component_us = r["monitor_us"] * r["collectives_per_step"] + r["guard_us"] + r["check_launch_us"]
    component = component_us / (r["off_ms"] * 1e3)
    rows = [{"checks_on_step_ms": r["on_ms"], "checks_off_step_ms": r["off_ms"], "measured_overhead": measured,
             "monitor_us_per_collective": r["monitor_us"], "guard_us_per_step": r["guard_us"],
             "check_allreduce_us": r["check_roundtrip_us"],
             "check_launch_us": r["check_launch_us"], "component_overhead_bound": component,
             "paired_round_median": paired}]
    lines = [
        f"Model: {args.layers}x Linear({args.width},{args.width}) MLP ({r['params'] / 1e6:.1f}M params), batch "
        f"{args.batch} per rank, {args.world_size} ranks, gloo, bucket_cap_mb={args.bucket_cap_mb} ({r['buckets']} "
        f"buckets), {args.rounds} alternating rounds x {args.steps} steps, SGD.",
        "",
        "| | fwd+bwd+sync (ms, median; optimizer step untimed) |",
        "|---|---|",
        f"| checks on (default) | {r['on_ms']:.2f} |",
        f"| checks off (FUSEDIST_CHECKS=0) | {r['off_ms']:.2f} |",
        "",
        f"- measured end-to-end: on / off - 1 = **{100 * measured:+.2f}%** on the medians; paired per round "
        f"(on / off of the same round): median {100 * paired:+.2f}%, quartiles {100 * (quartiles[0] - 1):+.1f}% .. "
        f"{100 * (quartiles[2] - 1):+.1f}% over {args.rounds} rounds (the spread is this machine's load noise)",
        f"- components: monitor {r['monitor_us']:.2f} us per collective x {r['collectives_per_step']} collectives, "
        f"optimizer guard {r['guard_us']:.2f} us per step, step-check launch {r['check_launch_us']:.0f} us "
        f"(its all-reduce round trip, {r['check_roundtrip_us']:.0f} us here, completes behind the optimizer "
        "step: the verdict is read at the next forward) -> "
        f"{component_us:.0f} us per step = **{100 * component:.2f}%** of the step (target < 1%; on a "
        "latency-bound tiny model the forward waits for the check instead: bench_ddp_step_overhead.py)",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        md, _ = write_results("reliability", rows, "Cost of the reliability checks (CPU, gloo)\n\n" + text)
        print("written:", md)


if __name__ == "__main__":
    main()
