"""A pipeline-parallel training job stopped and resumed at another pipeline split, end to end.

torchtitan's PP + FSDP recipe in small on 4 gloo ranks, 2 pipeline ranks x 2 data-parallel
ranks: a model of 8 layers, each stage cut from the whole model with the other layers removed
(the whole model's names kept), every layer and then the stage sharded with
``fusedist.fully_shard`` over the stage's data-parallel group, ``fusedist.pipelining
.PipelineStage``, AdamW with a warmup ``LambdaLR`` per part, and a ``Checkpointer`` with
``pipeline=True`` saving every 2 steps, asynchronously, while training goes on.

The first launch runs 1F1B over 2 stages (4 layers each) for STEPS steps. The second launch
(fresh processes) is another split: 4 stages of 2 layers, two per pipeline rank, under
interleaved 1F1B; it restores the step-SAVE_AT checkpoint and trains to STEPS. Each step's data
depends only on the step and the data-parallel rank, and every layer computes the same
operations on the same values in either split (the same units, the same reductions), so the
resumed run must end with the uninterrupted run's weights bit for bit; its losses too.
"""

from __future__ import annotations

import torch
from torch import nn

from fusedist.testing import run_distributed

LAYERS, WIDTH, MICRO, STEPS, SAVE_AT = 8, 16, 4, 6, 2


class _Part(nn.Module):
    """Layers ``ids`` of the whole model, under their names in it."""

    def __init__(self, ids):
        super().__init__()
        torch.manual_seed(0)
        every = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(LAYERS)]
        self.layers = nn.ModuleDict({str(i): every[i] for i in ids})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def _batch(step: int, dp_rank: int) -> tuple:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


def _job(rank, world_size, root, stages_per_rank, resume_from):
    from torch.distributed import pipelining
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.checkpoint import Checkpointer
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    num_stages = 2 * stages_per_rank
    per_stage = LAYERS // num_stages
    placement = [pp.get_local_rank() + k * 2 for k in range(stages_per_rank)]
    parts, stages = [], []
    for index in placement:
        part = _Part(range(index * per_stage, (index + 1) * per_stage))
        for layer in part.layers.values():
            fusedist.fully_shard(layer, mesh=dp)
        fusedist.fully_shard(part, mesh=dp)
        parts.append(part)
        stages.append(PipelineStage(part, index, num_stages, torch.device("cpu"), group=pp.get_group()))
    name = "Schedule1F1B" if stages_per_rank == 1 else "ScheduleInterleaved1F1B"
    schedule = getattr(pipelining, name)(stages if stages_per_rank > 1 else stages[0], n_microbatches=MICRO,
                                         loss_fn=lambda out, target: ((out - target) ** 2).mean())
    optimizers = [torch.optim.AdamW(part.parameters(), lr=1e-2) for part in parts]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: min(1.0, (step + 1) / 4)) for o in optimizers]
    ckpt = Checkpointer(root, every_steps=2, process_group=dp, pipeline=True)
    start = ckpt.restore(parts if len(parts) > 1 else parts[0], optimizers, lr_scheduler=schedulers,
                         step=resume_from)
    losses = []
    for step in range(start, STEPS):
        x, y = _batch(step, dp.get_local_rank())
        step_losses = []
        schedule.step(*((x,) if 0 in placement else ()),
                      **(dict(target=y, losses=step_losses) if num_stages - 1 in placement else {}))
        for o, s in zip(optimizers, schedulers):
            o.step()
            o.zero_grad()
            s.step()
        losses.append([float(v) for v in step_losses])
        ckpt.maybe_save(step + 1)
    ckpt.close()
    full = StateDictOptions(full_state_dict=True)
    weights = {k: v for part in parts for k, v in get_model_state_dict(part, options=full).items()}
    return {"start": start, "weights": weights, "losses": losses, "lr": [s.get_last_lr() for s in schedulers]}


def test_a_pipelined_job_resumes_at_another_split_bit_for_bit(tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_distributed(_job, 4, root, 1, None, timeout=300)
    resumed = run_distributed(_job, 4, root, 2, SAVE_AT, timeout=300)
    whole = {k: v for out in first for k, v in out["weights"].items()}
    assert len(whole) == 2 * LAYERS
    for rank, out in enumerate(resumed):
        assert out["start"] == SAVE_AT, out["start"]
        assert all(torch.equal(v, whole[k]) for k, v in out["weights"].items()), rank
        assert out["lr"] == [first[rank]["lr"][0]] * 2, (out["lr"], first[rank]["lr"])
        if rank >= 2:  # the last stage's ranks: the losses of the steps after the restore
            assert out["losses"] == first[rank]["losses"][SAVE_AT:], (out["losses"], first[rank]["losses"])
