"""Pipeline stages (fusedist/pipelining/__init__.py) as a training loop uses them, against torch's
optimizer on the unpipelined model, in one launch of 2 gloo ranks:

- gradient accumulation over two synchronized ``schedule.step()`` calls before one optimizer
  step (Note [accumulating over synchronized pipeline steps]), and over a synchronized, an
  accumulating (the user's own switch) and a synchronized step, on fully_shard, DDP,
  replicate and ZeRO-2 stages (pp 1 x dp 2, GPipe): the reference accumulates the global
  batches' mean losses. torch's per-step division of ``p.grad`` gave ``g1 / n + g2``.
- a stage with BatchNorm (pp 2, GPipe, 1F1B, interleaved 1F1B; plain, fully_shard and DDP
  stages), with an ``eval`` step between training steps: weights, running statistics and
  ``num_batches_tracked`` as the unpipelined model's run over the same micro-batches in order
  (a pipelined BatchNorm normalizes each micro-batch: that is the reference). torch's shape
  inference left running_var inf on the second stage (Note [shape inference leaves the stage
  as it was]).

Tolerance: 1e-6 for the accumulation (fp32, other summation orders: micro-batch means, then
the ranks); a lost or doubled division moves an SGD step (lr 0.1) by ~1e-2. For the BatchNorm
stages 1e-5, plus 1e-5 relative: a BatchNorm divides by its 4-row micro-batch's standard
deviation, which magnifies the fp32 rounding of the two runs' different graphs (seen: 1.4e-6),
and a running variance reaches ~10; a polluted statistic is inf, or a count off by one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline_stage_kinds import largest_difference, set_gradient_sync, stages_of_each_kind
from shared_rank_launch import launch_for_selected, results_of

WIDTH, MICRO_BATCHES = 8, 4


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def _mse(out, target):
    return (out - target).square().mean()


def _accumulation_worker(rank, world_size, seed, pattern):
    """pp 1 x dp 2 under GPipe: per stage kind, the weights' largest difference from torch's SGD
    on the global batches after two optimizer steps, each after the steps of ``pattern`` (True:
    synchronized, False: under the user's switch)."""
    out = {}
    for kind, ours, theirs, wrapped, schedule, opt, ref_opt in stages_of_each_kind(_mlp, seed, MICRO_BATCHES, _mse):
        g = torch.Generator().manual_seed(seed)
        for _ in range(2):
            for synchronize in pattern:
                set_gradient_sync(kind, wrapped, synchronize)
                xs = [torch.randn(8, WIDTH, generator=g) for _ in range(world_size)]
                ys = [torch.randn(8, WIDTH, generator=g) for _ in range(world_size)]
                schedule.step(xs[rank], target=ys[rank])
                _mse(theirs(torch.cat(xs)), torch.cat(ys)).backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        out[kind] = largest_difference(kind, wrapped, ours, theirs)
    return out


class _Normalized(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)

    def forward(self, x):
        return self.bn(self.lin(x)).tanh()


def _batch_norm_worker(rank, world_size, seed, kind, schedule_name):
    """pp 2 (dp 1): stages of one BatchNorm per block, 3 training steps with an eval step after
    the second, beside the unpipelined blocks run over the same micro-batches in order: the
    largest difference per state entry of this rank's stages."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    per_rank = 2 if schedule_name == "ScheduleInterleaved1F1B" else 1
    num_stages = 2 * per_rank
    torch.manual_seed(seed)
    blocks = [_Normalized() for _ in range(num_stages)]
    reference = copy.deepcopy(blocks)
    placement = [rank + 2 * k for k in range(per_rank)]
    wrapped = []
    for index in placement:
        if kind == "fully_shard":
            wrapped.append(fusedist.fully_shard(blocks[index], mesh=mesh["dp"]))
        elif kind == "DistributedDataParallel":
            wrapped.append(fusedist.DistributedDataParallel(blocks[index], process_group=mesh["dp"].get_group()))
        else:
            wrapped.append(blocks[index])
    stages = [PipelineStage(m, i, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for m, i in zip(wrapped, placement)]
    schedule = getattr(pipelining, schedule_name)(stages if per_rank > 1 else stages[0],
                                                  n_microbatches=MICRO_BATCHES, loss_fn=_mse)
    opt = torch.optim.SGD([p for m in wrapped for p in m.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([p for b in reference for p in b.parameters()], lr=0.1)

    def unpipelined(x):
        for block in reference:
            x = block(x)
        return x

    def run(call, x, y):
        return call(x) if rank == 0 else call(target=y, losses=[])

    g = torch.Generator().manual_seed(seed)
    for step in range(3):
        x, y = torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)
        run(schedule.step, x, y)
        opt.step()
        opt.zero_grad()
        sum(_mse(unpipelined(xm), ym) for xm, ym in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES))
            ).div(MICRO_BATCHES).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 1:  # an evaluation between training steps (the modules stay in train mode)
            x, y = torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)
            run(schedule.eval, x, y)
            with torch.no_grad():
                for xm in x.chunk(MICRO_BATCHES):
                    unpipelined(xm)
    diffs = {}
    for index, module in zip(placement, wrapped):
        ours = fusedist.fsdp.full_state_dict(module) if kind == "fully_shard" else blocks[index].state_dict()
        for name, want in reference[index].state_dict().items():
            got, want = ours[name].double(), want.double()  # (beyond fp32's relative rounding of large variances)
            diffs[f"stage {index} {name}"] = float(((got - want).abs() - 1e-5 * want.abs()).max())
    return diffs


def test_accumulating_over_synchronized_steps_gives_the_sum_of_the_batches_gradients(launched2):
    """Note [accumulating over synchronized pipeline steps]: two synchronized steps before one
    optimizer step give ``g1 + g2``, as two ``backward()`` of the unpipelined model; with an
    accumulating step between two synchronized ones, ``g1 + (g2 + g3)``."""
    for pattern in ("sync sync", "sync accumulate sync"):
        for rank, out in enumerate(results_of(launched2, pattern)):
            for kind, diff in out.items():
                assert diff < 1e-6, (launched2["seed"], pattern, rank, kind, out)


BATCH_NORM = [("plain", "ScheduleGPipe"), ("fully_shard", "Schedule1F1B"), ("DistributedDataParallel", "Schedule1F1B"),
              ("plain", "ScheduleInterleaved1F1B")]


@pytest.mark.parametrize("kind,schedule_name", BATCH_NORM)
def test_shape_inference_leaves_batch_norm_statistics_as_the_unpipelined_model(kind, schedule_name, launched2):
    """Note [shape inference leaves the stage as it was]: the running statistics and the batch
    count of BatchNorm stages follow the micro-batches only, across an eval step too."""
    for rank, diffs in enumerate(results_of(launched2, f"batch norm {kind} {schedule_name}")):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-5, (launched2["seed"], rank, worst, diffs)


@pytest.fixture(scope="module")
def launched2(request):
    seed = int(torch.randint(0, 10_000, ()).item())
    jobs = {
        "test_accumulating_over_synchronized_steps_gives_the_sum_of_the_batches_gradients": {
            "sync sync": (_accumulation_worker, (seed, (True, True))),
            "sync accumulate sync": (_accumulation_worker, (seed, (True, False, True)))},
        "test_shape_inference_leaves_batch_norm_statistics_as_the_unpipelined_model": {
            f"batch norm {kind} {name}": (_batch_norm_worker, (seed, kind, name)) for kind, name in BATCH_NORM},
    }
    return {"seed": seed, **launch_for_selected(request, jobs, 2, timeout=300)}
