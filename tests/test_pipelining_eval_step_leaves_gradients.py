"""Pipeline stages (fusedist/pipelining/__init__.py): a forward-only ``schedule.eval`` leaves the
gradients a step's backwards produced as they are (Note [an eval step divides nothing]).

torch's schedules end every step, an eval one included, by dividing the stage's gradients by
the micro-batch count: an evaluation between a step's backwards and its optimizer step divided
them once more, and the update came out ``n_microbatches`` times too small. Here, on pp 1 x dp
2 (gloo), a fully_shard, a fusedist DDP (with torch's SGD, and with ZeRO-2, whose gradient
shards the division reached too) and a plain stage under GPipe: the gradients after an eval
equal those before it (DDP and plain stages, whose ``p.grad`` shows them), and the SGD
step after it equals torch's SGD on the global batch (tolerance 1e-6, fp32 summation orders; a
division by 4 moves a weight by ~1e-2).
"""

from __future__ import annotations

import torch
from torch import nn

from fusedist.testing import run_distributed

WIDTH, MICRO_BATCHES = 8, 4


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def _eval_worker(rank, world_size, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import ScheduleGPipe

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    out = {}
    for kind in ("fully_shard", "DistributedDataParallel", "ZeRO-2", "plain"):
        ours, theirs = _model(seed), _model(seed)
        if kind == "fully_shard":
            wrapped = fusedist.fully_shard(ours, mesh=mesh["dp"])
        elif kind == "plain":
            wrapped = ours
        else:
            wrapped = fusedist.DistributedDataParallel(ours, process_group=mesh["dp"].get_group())
        opt = (fusedist.ZeroRedundancyOptimizer(list(ours.parameters()), torch.optim.SGD,
                                                process_group=mesh["dp"].get_group(), stage=2, lr=0.5)
               if kind == "ZeRO-2" else torch.optim.SGD(ours.parameters(), lr=0.5))
        ref_opt = torch.optim.SGD(theirs.parameters(), lr=0.5)
        stage = PipelineStage(wrapped, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES, loss_fn=lambda o, t: (o - t).square().mean())
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(8, WIDTH, generator=g) for _ in range(world_size)]
        ys = [torch.randn(8, WIDTH, generator=g) for _ in range(world_size)]
        schedule.step(xs[rank], target=ys[rank])
        shown = kind in ("DistributedDataParallel", "plain")
        before = [p.grad.clone() for p in ours.parameters()] if shown else []
        schedule.eval(xs[rank], target=ys[rank], losses=[])
        # (a fully_shard root keeps its parameters gathered after a forward, as FSDP2's, and
        # ZeRO-2 holds its gradients in its shards: the weights below cover those)
        changed = max([float((p.grad - b).abs().max()) for p, b in zip(ours.parameters(), before)] + [0.0])
        opt.step()
        if kind == "plain":  # no data parallelism: this rank's batch only
            (theirs(xs[rank]) - ys[rank]).square().mean().backward()
        else:
            (theirs(torch.cat(xs)) - torch.cat(ys)).square().mean().backward()
        ref_opt.step()
        whole = fusedist.fsdp.full_state_dict(wrapped) if kind == "fully_shard" else ours.state_dict()
        out[kind] = (changed, max(float((whole[k] - v).abs().max()) for k, v in theirs.state_dict().items()))
    return out


def test_an_eval_step_leaves_the_gradients_of_the_step_before_it():
    seed = int(torch.randint(0, 10_000, ()).item())
    for rank, out in enumerate(run_distributed(_eval_worker, 2, seed, timeout=120)):
        for kind, (changed, weights) in out.items():
            assert changed == 0.0 and weights < 1e-6, (seed, rank, kind, out)


def _two_stage_eval_worker(rank, world_size, seed):
    """pp 2 x dp 2, fully_shard stages under 1F1B (their roots resharded by the schedule): a
    step, an eval, the SGD step; the weights' largest difference from the whole model's SGD
    step on the global batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"]
    parts, theirs = [_model(seed + i) for i in range(2)], [_model(seed + i) for i in range(2)]
    ours = parts[pp]
    for layer in (ours[0], ours[2]):
        fusedist.fully_shard(layer, mesh=dp)
    fusedist.fully_shard(ours, mesh=dp)
    stage = PipelineStage(ours, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=lambda o, t: (o - t).square().mean())
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(8, WIDTH, generator=g) for _ in range(dp.size())]
    ys = [torch.randn(8, WIDTH, generator=g) for _ in range(dp.size())]
    io = ((xs[dp.get_local_rank()],), {}) if pp == 0 else ((), dict(target=ys[dp.get_local_rank()], losses=[]))
    schedule.step(*io[0], **io[1])
    schedule.eval(*io[0], **io[1])
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    opt.step()
    whole = nn.Sequential(*theirs)
    (whole(torch.cat(xs)) - torch.cat(ys)).square().mean().backward()
    torch.optim.SGD(whole.parameters(), lr=0.5).step()
    full = fusedist.fsdp.full_state_dict(ours)
    return max(float((full[k] - v).abs().max()) for k, v in theirs[pp].state_dict().items())


def test_an_eval_step_between_backward_and_step_leaves_fully_shard_stages_right():
    seed = int(torch.randint(0, 10_000, ()).item())
    for rank, diff in enumerate(run_distributed(_two_stage_eval_worker, 4, seed, timeout=120)):
        assert diff < 1e-6, (seed, rank, diff)
