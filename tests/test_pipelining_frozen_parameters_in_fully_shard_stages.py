"""Pipeline stages of ``fully_shard`` modules holding frozen parameters (Note [frozen parameters
in backward] in fusedist/fsdp/state.py).

A LoRA-style stage (a frozen base ``Linear`` under each trainable block, the stage module's own
frozen weight) on 4 gloo ranks, 2 pipeline ranks x 2 data-parallel ranks, under schedules that
run several micro-batches' forwards before their backwards on a stage whose input needs a
gradient (GPipe's second stage; interleaved 1F1B's later stages). Before, the step's last
backward (the end of the first had forgotten the other micro-batches' calls) resharded such a
unit once its trainable gradients were in, and autograd then read the frozen weight from freed
storage for the input's gradient: every step failed.

Reference: the whole model in one process, trained by SGD on the global batch (every
data-parallel rank's rows), the loss the mean over the micro-batches' means. Tolerance 1e-6
(fp32, other summation orders); a micro-batch lost moves a weight by ~1e-3.
"""

from __future__ import annotations

import torch
from torch import nn

from fusedist.testing import run_distributed

WIDTH, BATCH, MICRO_BATCHES, STEPS = 8, 8, 4, 2


class _LoraBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.adapter = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.adapter(x))


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH).requires_grad_(False)  # the root unit's own frozen weight
        self.gain = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.blocks = nn.ModuleList(_LoraBlock() for _ in range(2))

    def forward(self, x):
        x = self.proj(x) * self.gain
        for block in self.blocks:
            x = block(x)
        return x


def _stages(seed: int, num_stages: int) -> list:
    torch.manual_seed(seed)
    return [_Stage() for _ in range(num_stages)]


def _loss(out, target):
    return (out - target).square().mean()


def _batches(seed: int, step: int, data_ranks: int) -> list:
    g = torch.Generator().manual_seed(seed * 100 + step)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
            for _ in range(data_ranks)]


def _reference(seed: int, num_stages: int, data_ranks: int) -> list:
    stages = _stages(seed, num_stages)
    whole = nn.Sequential(*stages)
    opt = torch.optim.SGD([p for p in whole.parameters() if p.requires_grad], lr=0.1)
    for step in range(STEPS):
        loss = 0
        for x, y in _batches(seed, step, data_ranks):
            for xm, ym in zip(x.tensor_split(MICRO_BATCHES), y.tensor_split(MICRO_BATCHES)):
                loss = loss + _loss(whole(xm), ym) / MICRO_BATCHES / data_ranks
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [s.state_dict() for s in stages]


def _frozen_worker(rank, world_size, seed):
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    r = pp.get_local_rank()
    out = {}
    for name, placement in (("ScheduleGPipe", [r]), ("ScheduleInterleaved1F1B", [r, r + 2])):
        num_stages = 2 * len(placement)
        every = _stages(seed, num_stages)
        modules, stages = [], []
        for index in placement:
            module = every[index]
            for block in module.blocks:
                fusedist.fully_shard(block, mesh=dp)
            fusedist.fully_shard(module, mesh=dp)
            modules.append(module)
            stages.append(PipelineStage(module, index, num_stages, torch.device("cpu"), group=pp.get_group()))
        schedule = getattr(pipelining, name)(stages if len(stages) > 1 else stages[0],
                                             n_microbatches=MICRO_BATCHES, loss_fn=_loss)
        opt = torch.optim.SGD([p for m in modules for p in m.parameters() if p.requires_grad], lr=0.1)
        for step in range(STEPS):
            x, y = _batches(seed, step, dp.size())[dp.get_local_rank()]
            args = (x,) if 0 in placement else ()
            schedule.step(*args, **(dict(target=y) if num_stages - 1 in placement else {}))
            opt.step()
            opt.zero_grad()
        reference = _reference(seed, num_stages, dp.size())
        whole = [fusedist.fsdp.full_state_dict(m) for m in modules]
        out[name] = max(float((got[k] - reference[i][k]).abs().max()) for got, i in zip(whole, placement)
                        for k in reference[i])
    return out


def test_stages_with_frozen_parameters_train_when_forwards_run_ahead_of_backwards():
    """GPipe and interleaved 1F1B over LoRA-style fully_shard stages train as the whole model on
    the global batch (before: the step's last backward read a frozen weight its unit had freed)."""
    seed = int(torch.randint(0, 10_000, ()).item())
    for rank, out in enumerate(run_distributed(_frozen_worker, 4, seed, timeout=120)):
        for name, diff in out.items():
            assert diff < 1e-6, (seed, rank, name, out)
