"""Per-step cost of fusedist's ZeRO over a model wrapped in torch's DDP, its gradient check on and off (CPU, gloo).

    python benchmarks/bench_zero_over_torch_ddp.py                 # widths 64, 256, 1024; writes a result file
    python benchmarks/bench_zero_over_torch_ddp.py --quick --no-write

Under torch's DistributedDataParallel, fusedist's ZeroRedundancyOptimizer cannot see whether the model
averaged a step's gradients (``no_sync()`` on every micro-batch, ``require_backward_grad_sync`` left False),
so every step compares each parameter's gradient norm across the ranks, carried by a parameter all-gather the
step makes anyway (Note [gradients compared at every step] in fusedist/zero/carried_agreement.py). This
measures what that costs a step: three contenders over the same torch DDP model and Adam, in the same run --

* torch DDP + torch's ``torch.distributed.optim.ZeroRedundancyOptimizer`` (the reference),
* torch DDP + fusedist's ZeroRedundancyOptimizer (``FUSEDIST_CHECKS`` on: the comparison every step),
* the same with the comparison alone left out (checks on; a benchmark-only patch of
  ``fusedist.zero.grad_agreement.carries``): the difference to the row above is the comparison's cost,
* the same with ``FUSEDIST_CHECKS=0`` (no comparison, and none of the other per-step checks),

each timed for a block of ``zero_grad + forward + backward + step`` in turn within every round (the order
rotating), medians over rounds of wall and training-thread CPU ms/step. ``FUSEDIST_CHECKS`` is read at each
step, so the variable is set around each of its contender's blocks, alike on both ranks; whether a step of
each carried the norms is printed next to its figures. The model: two Linear(width, width) layers and a head,
batch 16. Wall time on a loaded machine is the critical path of two processes: compare within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import add_run_options, environment, record_results  # noqa: E402
from benchmarks.bench_ddp_step_overhead import _block  # noqa: E402 - one timing loop for both step benchmarks

CONTENDERS = ("torch ZeRO", "fusedist ZeRO, FUSEDIST_CHECKS=1", "fusedist ZeRO, norms not carried",
              "fusedist ZeRO, FUSEDIST_CHECKS=0")
#: checks on, the per-step comparison alone left out (``grad_agreement.carries`` answering no for it)
UNCARRIED = CONTENDERS[2]
BATCH = 16


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8))


@contextlib.contextmanager
def _checks(name: str):
    """``FUSEDIST_CHECKS`` as ``name``'s contender has it (unset: the default, on)."""
    before = os.environ.pop("FUSEDIST_CHECKS", None)
    if name.endswith("=0"):
        os.environ["FUSEDIST_CHECKS"] = "0"
    try:
        yield
    finally:
        os.environ.pop("FUSEDIST_CHECKS", None)
        if before is not None:
            os.environ["FUSEDIST_CHECKS"] = before




def _optimizer(name: str, params):
    if name == "torch ZeRO":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=1e-3)
    import fusedist

    return fusedist.ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=1e-3)


def _carries(opt) -> str:
    """Whether this optimizer's steps carry the gradient norms (fusedist's only)."""
    if not hasattr(opt, "_grads_agreed"):
        return "-"
    from fusedist.zero import grad_agreement

    return "yes" if grad_agreement.carries(opt) else "no"


def _leave_out_carrying(uncarried: set) -> None:
    """``grad_agreement.carries`` answers no for the optimizers in ``uncarried`` (by id), as before for others."""
    from fusedist.zero import grad_agreement

    carries = grad_agreement.carries
    grad_agreement.carries = lambda zero: id(zero) not in uncarried and carries(zero)


def _worker(rank, world, widths, rounds, steps):
    torch.set_num_threads(1)
    uncarried: set = set()
    _leave_out_carrying(uncarried)
    out = {}
    gen = torch.Generator().manual_seed(rank)
    for width in widths:
        x, y = torch.randn(BATCH, width, generator=gen), torch.randn(BATCH, 8, generator=gen)
        models, opts, carried = {}, {}, {}
        for name in CONTENDERS:
            with _checks(name):
                models[name] = nn.parallel.DistributedDataParallel(_model(width))
                opts[name] = _optimizer(name, models[name].parameters())
                if name == UNCARRIED:
                    uncarried.add(id(opts[name]))
                _block(models[name], opts[name], x, y, 3)  # warm-up (the first step's comparison included)
                carried[name] = _carries(opts[name])
        times = {name: [] for name in CONTENDERS}
        for r in range(rounds):
            for name in CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]:  # rotating order
                with _checks(name):
                    times[name].append(_block(models[name], opts[name], x, y, steps))
        params = sum(p.numel() for p in models[CONTENDERS[0]].parameters())
        out[width] = {"params": params, "carried": carried,
                      "ms": {n: tuple(statistics.median(v) for v in zip(*t)) for n, t in times.items()}}
    return out


def _rows(result) -> list[dict]:
    rows = []
    for width, found in result.items():
        ref_wall, ref_cpu = found["ms"]["torch ZeRO"]
        off_wall, off_cpu = found["ms"][CONTENDERS[-1]]
        for name, (wall, cpu) in found["ms"].items():
            rows.append({"width": width, "params": found["params"], "contender": name,
                         "norms carried": found["carried"][name], "wall ms/step": round(wall, 3),
                         "x torch ZeRO": round(wall / ref_wall, 2), "x CHECKS=0": round(wall / off_wall, 2),
                         "cpu ms/step": round(cpu, 3), "cpu x torch ZeRO": round(cpu / ref_cpu, 2),
                         "cpu x CHECKS=0": round(cpu / off_cpu, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", help="default 64 256 1024 (--quick: 64)")
    parser.add_argument("--rounds", type=int, help="default 9 (--quick: 2)")
    parser.add_argument("--steps", type=int, help="steps per block, default 20 (--quick: 3)")
    add_run_options(parser)
    args = parser.parse_args()
    # (--quick stands in for the defaults only: an option given with it keeps its value)
    defaults = ([64], 2, 3) if args.quick else ([64, 256, 1024], 9, 20)
    args.widths, args.rounds, args.steps = (given or default for given, default in
                                            zip((args.widths, args.rounds, args.steps), defaults))
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from fusedist.testing import run_distributed

    results = run_distributed(_worker, 2, args.widths, args.rounds, args.steps, timeout=1200)
    rows = _rows(results[0])
    for row in rows:
        print(f"width {row['width']:5d} ({row['params']:8d} params) {row['contender']:34s} "
              f"norms carried {row['norms carried']:3s} wall {row['wall ms/step']:7.3f} ms/step "
              f"({row['x torch ZeRO']:.2f}x torch ZeRO, {row['x CHECKS=0']:.2f}x CHECKS=0), "
              f"CPU {row['cpu ms/step']:7.3f} ({row['cpu x torch ZeRO']:.2f}x, {row['cpu x CHECKS=0']:.2f}x)")
    env = environment()
    notes = (f"2 gloo ranks on one machine, one torch thread each; rank 0's figures; medians over {args.rounds} "
             f"rounds of {args.steps}-step blocks, contenders rotating within each round; load average at the end: "
             f"{env['loadavg_1m']}. Model: Linear(w, w), Tanh, Linear(w, w), Tanh, Linear(w, 8) in torch's "
             f"DistributedDataParallel, batch {BATCH}, Adam.")
    record_results("zero_over_torch_ddp_cpu", rows, notes, args)


if __name__ == "__main__":
    main()
