"""Benchmark: pipeline parallelism over sharded stages (torchtitan's PP + FSDP), 2 pipeline ranks x
2 data-parallel ranks, one training step = a 1F1B schedule step over the micro-batches + AdamW.

Contenders, the same model, blocks and wrapping (each block sharded, then the stage module):

  torch                    torch FSDP2 ``fully_shard`` + torch's ``PipelineStage`` (which
                           switches FSDP2's gradient sync off until the last micro-batch)
  fusedist                 ``fusedist.fully_shard`` + ``fusedist.pipelining.PipelineStage``
                           (the same, through the module's public switches)
  fusedist, torch's stage  ``fusedist.fully_shard`` + torch's ``PipelineStage``: torch leaves
                           a non-FSDP2 module alone, so every micro-batch's backward
                           reduce-scatters the stage's gradients

With ``--schedule zero-bubble`` each pipeline rank holds two stages (looped: stages r and r + 2)
under ``ScheduleInterleavedZeroBubble``, whose weight passes fill the bubbles, and the third
contender is instead

  fusedist, interleaved 1F1B  the same fusedist stages under ``ScheduleInterleaved1F1B``
                              (no separate weight passes): what the deferred weight passes save

(torch's FSDP2 under torch 2.13's zero-bubble schedules ends with other weights than under 1F1B;
its time is shown all the same.)

Timed interleaved (every contender once per repetition, all ranks barrier-aligned); ratio_paired
= median over repetitions of contender / torch (< 1: faster); reduce-scatters = those a stage's
data-parallel communicator issued per step (fusedist only: FSDP2's go through torch). Timings
are rank 0's (the first stage).

Usage: python benchmarks/bench_pipeline.py [--device cpu|cuda] [--quick] [--microbatches 8]
       [--schedule 1f1b|zero-bubble] [--dp 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, rank_device, time_interleaved, write_results  # noqa: E402
from bench_zero import _MLPBlock  # noqa: E402


def _config(device, quick: bool) -> dict:
    if device.type == "cuda":
        return dict(d=2048, blocks_per_stage=4, batch=(16, 512))
    return dict(d=128, blocks_per_stage=2, batch=(8, 16)) if quick else dict(d=256, blocks_per_stage=4, batch=(16, 32))


SCHEDULES = {"1f1b": ("Schedule1F1B", 1), "zero-bubble": ("ScheduleInterleavedZeroBubble", 2)}


def _contender(kind: str, cfg: dict, mesh, device, microbatches: int, schedule_name: str):
    """(one training step, the reduce-scatter counter or None) of contender ``kind``."""
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist
    from fusedist.pipelining import PipelineStage

    pp, dp = mesh["pp"], mesh["dp"]
    name, per_rank = SCHEDULES[schedule_name]
    if kind == "fusedist, interleaved 1F1B":
        name = "ScheduleInterleaved1F1B"
    placement = [pp.get_local_rank() + k * pp.size() for k in range(per_rank)]
    num_stages = pp.size() * per_rank
    modules, stages = [], []
    for stage_index in placement:
        torch.manual_seed(stage_index)
        module = torch.nn.Sequential(*[_MLPBlock(cfg["d"]) for _ in range(cfg["blocks_per_stage"])]).to(device)
        shard = torch_fully_shard if kind == "torch" else fusedist.fully_shard
        for block in module:
            shard(block, mesh=dp)
        shard(module, mesh=dp)
        stage_class = pipelining.PipelineStage if kind in ("torch", "fusedist, torch's stage") else PipelineStage
        modules.append(module)
        stages.append(stage_class(module, stage_index, num_stages, device, group=pp.get_group()))
    schedule = getattr(pipelining, name)(stages if per_rank > 1 else stages[0], n_microbatches=microbatches,
                                         loss_fn=lambda out, target: ((out - target) ** 2).mean())
    module = modules[0]
    first, last = 0 in placement, num_stages - 1 in placement
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-4)
    g = torch.Generator(device=device).manual_seed(dp.get_local_rank())
    x = torch.randn(*cfg["batch"], cfg["d"], device=device, generator=g)
    y = torch.randn(*cfg["batch"], cfg["d"], device=device, generator=g)
    counter = None
    if kind != "torch":
        from fusedist.fsdp.state import state_of

        comm = state_of(module[0]).unit.comm
        counter, issue = [0], comm.reduce_scatter

        def counted(*args, **kwargs):
            counter[0] += 1
            return issue(*args, **kwargs)

        comm.reduce_scatter = counted

    def step():
        schedule.step(*((x,) if first else ()), **(dict(target=y, losses=[]) if last else {}))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, counter


def _kinds(schedule_name: str) -> tuple:
    if schedule_name == "zero-bubble":
        return "torch", "fusedist", "fusedist, interleaved 1F1B"
    return "torch", "fusedist", "fusedist, torch's stage"


def _worker(rank, world_size, device_type, repeats, microbatches, quick, schedule_name):
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.comm import get_communicator

    device = rank_device(device_type, rank)
    cfg = _config(device, quick)
    mesh = init_device_mesh(device.type, (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    comm = get_communicator(None, device)
    kinds = _kinds(schedule_name)
    contenders = {kind: _contender(kind, cfg, mesh, device, microbatches, schedule_name) for kind in kinds}
    for step, _ in contenders.values():  # the first step infers the stages' shapes
        step()
    counts = {}
    for kind, (step, counter) in contenders.items():
        if counter is not None:
            before = counter[0]
            step()
            counts[kind] = counter[0] - before
    res = time_interleaved({kind: step for kind, (step, _) in contenders.items()}, device, comm,
                           warmup=1, repeats=repeats)
    samples = res.pop("_samples")
    rows = []
    for kind in kinds:
        ratios = [b / a for a, b in zip(samples["torch"], samples[kind])]
        rows.append({
            "contender": kind,
            "step_ms": res[kind][0], "p20_ms": res[kind][1], "p80_ms": res[kind][2],
            "ratio_paired": statistics.median(ratios),
            "reduce_scatters_per_step": counts.get(kind, "-"),
        })
    return {"rows": rows, "cfg": cfg}


def main():
    from fusedist.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=0)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks per stage (2 pipeline ranks)")
    parser.add_argument("--ranks-per-gpu", type=int, default=0,
                        help="with --device cuda: ranks sharing each GPU (FUSEDIST_TEST_RANKS_PER_GPU; NCCL over "
                             "sockets between them, so absolute bandwidth is not NVLink's, ratios are fair)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.ranks_per_gpu:
        from fusedist.testing import RANKS_PER_GPU_ENV

        os.environ[RANKS_PER_GPU_ENV] = str(args.ranks_per_gpu)  # read by every spawned rank
    backend = "nccl" if args.device == "cuda" else "gloo"
    repeats = args.repeats or (3 if args.quick else 15)
    world = 2 * args.dp
    out = run_distributed(_worker, world, args.device, repeats, args.microbatches, args.quick, args.schedule,
                          backend=backend, timeout=1800, pg_timeout=600)[0]
    rows, cfg = out["rows"], out["cfg"]
    env = environment()
    env.update(world_size=world, mesh=f"pp 2 x dp {args.dp}", backend=backend, torch_threads=1,
               ranks_per_gpu=args.ranks_per_gpu or 1)
    name, per_rank = SCHEDULES[args.schedule]
    notes = (f"{name} over {2 * per_rank} stages ({per_rank} per pipeline rank) of {cfg['blocks_per_stage']} MLP "
             f"blocks (d={cfg['d']}, each block sharded over the stage's {args.dp} data-parallel ranks, then the "
             f"stage module), {args.microbatches} micro-batches of a {cfg['batch']} batch, AdamW; interleaved, "
             f"{repeats} repetitions; ratio_paired = median over repetitions of contender / torch (< 1: faster); "
             "reduce-scatters per step of the first stage's data-parallel communicator (fusedist only).")
    worst = max(r["ratio_paired"] for r in rows if r["contender"] == "fusedist")
    print(f"fusedist stage / torch FSDP2 stage: {worst:.3f}x")
    for r in rows:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    if not args.no_write:
        suffix = "" if args.schedule == "1f1b" else "_zero_bubble"
        md, csv = write_results(f"pipeline{suffix}_{args.device}" + ("" if args.dp == 2 else f"_dp{args.dp}"), rows,
                                notes, env)
        print("wrote", md, csv)


if __name__ == "__main__":
    main()
