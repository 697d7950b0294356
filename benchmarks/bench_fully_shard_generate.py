"""Benchmark: a generation loop -- many forwards under ``torch.no_grad()`` -- through
``fusedist.fully_shard`` against torch's FSDP2 ``fully_shard``, same model and wrapping.

The model is bench_zero.py's stage-3 stack (8 transformer-MLP blocks, width 320 on CPU),
each block sharded, then the root (``reshard_after_forward=None``: the root keeps its
parameters, torch's default). One sample is a loop of 32 no_grad forwards of a small batch
(4 sequences x 1 new token: decoding, where the all-gathers dominate), timed interleaved with the other
contender in every repetition; ratio_paired = median over repetitions of fusedist / torch
(< 1: fusedist faster). Two wrappings of the blocks:

  blocks reshard   ``reshard_after_forward=True``: every block gathered at every forward
  blocks keep      ``reshard_after_forward=False`` (what an evaluation or sampling loop sets):
                   every block gathered once for the loop, after a reshard() of every module
                   at the start of each sample (so each sample pays its gathers once)

with the all-gathers each contender issued per loop (FSDP2: one per parameter group,
fusedist: one per unit). Every rank runs the same loop; timings are rank 0's.

Usage: python benchmarks/bench_fully_shard_generate.py [--world-size 2] [--device cpu|cuda] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, rank_device, time_interleaved, write_results  # noqa: E402
from bench_zero import _MLPBlock, _stage3_config  # noqa: E402

FORWARDS = 32


def _model(kind: str, cfg: dict, keep: bool, mesh, device):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_MLPBlock(cfg["d"]) for _ in range(cfg["layers"])]).to(device)
    shard = torch_fully_shard if kind == "torch" else fusedist.fully_shard
    for block in model:
        shard(block, mesh=mesh, reshard_after_forward=not keep)
    shard(model, mesh=mesh, reshard_after_forward=None)
    return model


def _loop(model, x):
    for m in [model, *model]:
        m.reshard()  # each sample starts sharded, as a loop after a training step does
    with torch.no_grad():
        for _ in range(FORWARDS):
            model(x)


def _count_gathers(models, x) -> dict:
    """All-gathers of one loop per contender (FSDP2's per parameter group, fusedist's per unit)."""
    from fusedist.testing.gathers import counting_gathers

    with counting_gathers() as counts:
        for m in models.values():
            _loop(m, x)
    return {"torch": counts["fsdp2"], "fusedist": counts["fusedist"]}


def _worker(rank, world_size, device_type, repeats):
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.comm import get_communicator

    device = rank_device(device_type, rank)
    cfg = _stage3_config(device)
    mesh = init_device_mesh(device.type, (world_size,))
    comm = get_communicator(None, device)
    x = torch.randn(4, 1, cfg["d"], device=device)  # one new token per sequence (decoding)
    rows = []
    for keep in (False, True):
        models = {kind: _model(kind, cfg, keep, mesh, device) for kind in ("torch", "fusedist")}
        gathers = _count_gathers(models, x)
        res = time_interleaved({k: (lambda m=m: _loop(m, x)) for k, m in models.items()}, device, comm,
                               warmup=2, repeats=repeats)
        samples = res.pop("_samples")
        ratios = [b / a for a, b in zip(samples["torch"], samples["fusedist"])]
        rows.append({
            "case": f"{FORWARDS} no_grad forwards, {cfg['layers']} blocks d={cfg['d']}, "
                    f"blocks {'keep' if keep else 'reshard'}",
            "torch_fsdp2_ms": res["torch"][0], "fusedist_ms": res["fusedist"][0],
            "fusedist_p20_ms": res["fusedist"][1], "fusedist_p80_ms": res["fusedist"][2],
            "ratio_paired": statistics.median(ratios),
            "gathers_torch": gathers["torch"], "gathers_fusedist": gathers["fusedist"],
        })
        for m in models.values():
            for sub in [m, *m]:
                sub.reshard()
    return rows


def main():
    from fusedist.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=0)
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    repeats = args.repeats or (4 if args.quick else 11)
    rows = run_distributed(_worker, args.world_size, args.device, repeats, backend=backend, timeout=1800,
                           pg_timeout=600)[0]
    env = environment()
    env.update(world_size=args.world_size, backend=backend, torch_threads=1)
    notes = ("Generation loop: fusedist.fully_shard vs torch FSDP2 fully_shard, same wrapping (each block with "
             "the row's reshard_after_forward, then the root with None), 32 forwards under torch.no_grad() per "
             "sample (every module resharded first), interleaved; ratio_paired = median over repetitions of "
             "fusedist / torch (< 1: fusedist faster); gathers = all-gathers per loop (FSDP2: per parameter group, "
             "fusedist: per unit).")
    md, csv = write_results(f"fully_shard_generate_{args.device}_ws{args.world_size}", rows, notes, env)
    for r in rows:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    print("wrote", md, csv)


if __name__ == "__main__":
    main()
