"""Pipeline parallelism over ``fully_shard`` stages (Note [pipeline stages of fully_shard modules]
in fusedist/pipelining/__init__.py): torchtitan's PP + FSDP recipe on 4 gloo ranks, 2 pipeline ranks x 2
data-parallel ranks, against torch's FSDP2 with torch's ``PipelineStage``.

For GPipe and 1F1B (one stage per rank) and interleaved 1F1B (two stages per rank), 4
micro-batches, 2 AdamW steps after a first one (whose metadata inference runs a backward of its
own): the stages' whole parameters equal FSDP2's, with fusedist's ``PipelineStage`` and with
torch's; fusedist's stage issues one reduce-scatter per unit and step, torch's stage one per
micro-batch; blocks compiled with torch.compile take the same steps. Zero-bubble schedules
(interleaved, ZBV, DualPipeV) train as the unsharded model does on the global batch, every
weight gradient computed in a weight pass, none in an input pass (Note [zero-bubble passes of
fusedist stages]); with compiled, checkpointed or custom-function blocks as interleaved 1F1B
does, bit for bit; a weight pass after another micro-batch's forward gathers the blocks again.
A Checkpointer per stage (``process_group=`` the stage's data-parallel group) saves and
restores its stage exactly, as ``fusedist.checkpoint.save(..., process_group=)`` a stage its
ranks hold whole; one Checkpointer for the whole job is refused without ``pipeline=True``. And
the 3-D recipes on 8 ranks (pp x dp x tp, pp x HSDP): equal to FSDP2's under 1F1B, each stage
restored exactly by a Checkpointer over the stage's mesh, and by one pipelined Checkpointer for
the job, whose checkpoint a plain copy of the whole model on every rank reads whole.

Tolerance: fusedist's stage reduces the micro-batches' sum once, as FSDP2 does: the same fp32
reductions (1e-6). Under torch's stage each micro-batch's gradient is reduced apart and the
averages summed, another order, which AdamW's normalization magnifies for elements whose
gradients nearly cancel (1e-4). A micro-batch's gradient lost or counted twice moves the weights
by about lr = 1e-2.
"""

from __future__ import annotations

import functools
import itertools
import time

import pytest
import torch
from torch import nn

from fusedist.pipelining.told_peers import MARGIN_S
from fusedist.testing import run_distributed
from shared_rank_launch import launch_for_selected, results_of, under_env, with_fresh_compiler

WIDTH, BLOCKS_PER_STAGE, MICRO_BATCHES, STEPS = 16, 2, 4, 2


def _adamw(params):
    """The optimizer of every run here: AdamW with an eps (1e-3) that bounds its magnification of a
    rounding difference to lr / eps (10x) where an element's gradient nearly cancels; torch's
    1e-8 turned a 1e-9 difference into a step of ~lr on some seeds."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def _stage_module(stage: int, num_stages: int, seed: int) -> nn.Sequential:
    """Stage ``stage`` of one model of ``num_stages * BLOCKS_PER_STAGE`` blocks, the same on every rank."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(num_stages * BLOCKS_PER_STAGE)]
    return nn.Sequential(*blocks[stage * BLOCKS_PER_STAGE:(stage + 1) * BLOCKS_PER_STAGE])


def _train(schedule_name, shard, stage_class, mesh, stages_per_rank, seed):
    """Whole parameters of this rank's stages after 1 + STEPS steps, and the reduce-scatters
    issued in the last STEPS (None for torch's FSDP2, whose collectives go through torch)."""
    from torch.distributed import pipelining
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    pp, dp = mesh["pp"], mesh["dp"]
    num_stages = pp.size() * stages_per_rank
    placement = [pp.get_local_rank() + k * pp.size() for k in range(stages_per_rank)]
    modules, stages = [], []
    for index in placement:
        module = _stage_module(index, num_stages, seed)
        for block in module:
            shard(block, mesh=dp)
        shard(module, mesh=dp)
        modules.append(module)
        stages.append(stage_class(module, index, num_stages, torch.device("cpu"), group=pp.get_group()))
    schedule = getattr(pipelining, schedule_name)(stages if stages_per_rank > 1 else stages[0],
                                                  n_microbatches=MICRO_BATCHES,
                                                  loss_fn=lambda out, target: ((out - target) ** 2).mean())
    opt = _adamw([p for m in modules for p in m.parameters()])
    counted = None if shard.__module__.startswith("torch") else _count_reduce_scatters(modules[0])
    g = torch.Generator().manual_seed(seed + dp.get_local_rank())
    _run_steps(schedule, opt, g, placement, num_stages,
               before=lambda step: counted.clear() if step == 1 and counted is not None else None)
    full = StateDictOptions(full_state_dict=True)
    return [get_model_state_dict(m, options=full) for m in modules], None if counted is None else len(counted)


def _count_reduce_scatters(module) -> list:
    from fusedist.fsdp.state import state_of

    comm = state_of(module[0]).unit.comm  # the stage's units share the data-parallel communicator
    issued, issue = [], comm.reduce_scatter

    def counted(*args, **kwargs):
        issued.append(1)
        return issue(*args, **kwargs)

    comm.reduce_scatter = counted
    return issued


def _max_diff(ours: list, theirs: list) -> float:
    return max(float((a[k] - b[k]).abs().max()) for a, b in zip(ours, theirs) for k in b)


def _run_steps(schedule, opt, g, placement, num_stages, before=lambda step: None) -> None:
    """1 + STEPS training steps: each data-parallel rank draws its batch from ``g``; the rank
    holding stage 0 feeds it, the one holding the last stage takes the target (a V placement
    holds both)."""
    for step in range(1 + STEPS):
        before(step)
        x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
        args = (x,) if 0 in placement else ()
        schedule.step(*args, **(dict(target=y, losses=[]) if num_stages - 1 in placement else {}))
        if opt is not None:
            opt.step()
            opt.zero_grad()


def _worker(rank, world_size, seed, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    out = {}
    for name, stages_per_rank in (("ScheduleGPipe", 1), ("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2)):
        theirs, _ = _train(name, torch_fully_shard, TorchPipelineStage, mesh, stages_per_rank, seed)
        ours, ours_issued = _train(name, fusedist.fully_shard, PipelineStage, mesh, stages_per_rank, seed)
        plain, plain_issued = _train(name, fusedist.fully_shard, TorchPipelineStage, mesh, stages_per_rank, seed)
        out[name] = {"ours": _max_diff(ours, theirs), "torch's stage": _max_diff(plain, theirs),
                     "issued": ours_issued, "issued by torch's stage": plain_issued}
    # (blocks compiled as torchtitan compiles them: test_zero_bubble_with_compiled_or_checkpointed_blocks_...)

    out["checkpointer"] = _checkpointer_per_stage(mesh, seed, root)

    return out


def test_pipeline_stages_of_fully_shard_reduce_once_per_step_and_match_fsdp2(launched4):
    seed, per_rank = launched4["seed"], results_of(launched4, "stages")
    for rank, out in enumerate(per_rank):
        for name, stages_per_rank in (("ScheduleGPipe", 1), ("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2)):
            got = out[name]
            assert got["ours"] < 1e-6 and got["torch's stage"] < 1e-4, (seed, rank, name, got)
            units = BLOCKS_PER_STAGE * stages_per_rank  # the stage modules' roots hold no parameters
            assert got["issued"] == units * STEPS, (rank, name, got)
            assert got["issued by torch's stage"] == units * STEPS * MICRO_BATCHES, (rank, name, got)
        checkpointer = out["checkpointer"]
        assert "give each stage a Checkpointer of its own" in checkpointer["one root"], checkpointer
        assert checkpointer["restored"] == [0, 1, 0, 1] and checkpointer["equal"], (rank, checkpointer)
        assert checkpointer["plain equal"], (rank, checkpointer)
        overlapping = checkpointer["overlapping"]
        assert "do not split the job into disjoint groups (rank 1 is in [[0, 1], [1, 2]])" in overlapping, overlapping
        assert checkpointer["files"] == ["common.pt", "manifest.json", "rank-00000.pt", "rank-00001.pt"], checkpointer


def _checkpointer_per_stage(mesh, seed, root) -> dict:
    """One Checkpointer for the whole job is refused (its stages hold other models); one per
    stage, over the stage's data-parallel group, saves and restores that stage exactly (Note [a
    Checkpointer per pipeline stage] in fusedist/checkpoint/_writer.py)."""
    import os

    import fusedist

    stage = mesh["pp"].get_local_rank()

    def build(shift):
        module = _stage_module(stage, 2, seed)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(shift)  # another model each time, all overwritten by the restore
        for block in module:
            fusedist.fully_shard(block, mesh=mesh["dp"])
        fusedist.fully_shard(module, mesh=mesh["dp"])
        return module, _adamw(module.parameters())

    out = {"restored": []}
    # groups that do not split the job: rank 1 would be in two
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([1, 2]), dist.new_group([2, 3])]
    with pytest.raises(ValueError) as refused:
        fusedist.checkpoint.Checkpointer(os.path.join(root, "overlapping"),
                                         process_group=pairs[min(dist.get_rank(), 2)])
    out["overlapping"] = str(refused.value)
    module, opt = build(0.0)
    whole_job = fusedist.checkpoint.Checkpointer(os.path.join(root, "one root"))
    with pytest.raises(ValueError) as refused:
        whole_job.restore(module, opt)
    whole_job.close()
    out["one root"] = str(refused.value)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed + mesh["dp"].get_local_rank()))
    module(x).square().mean().backward()  # each stage trained on its own: the optimizer holds state
    opt.step()
    opt.zero_grad()
    where = os.path.join(root, f"stage{stage}")
    for shift in (0.0, 1.0):
        if shift:
            module, opt = build(shift)
        periodic = fusedist.checkpoint.Checkpointer(where, process_group=mesh["dp"].get_group(), async_save=False)
        out["restored"].append(periodic.restore(module, opt))
        if not shift:
            periodic.save(1)
            saved = (fusedist.fsdp.full_state_dict(module), _optimizer_state(module, opt))
        periodic.close()
    restored = (fusedist.fsdp.full_state_dict(module), _optimizer_state(module, opt))
    out["equal"] = all(torch.equal(a[k], b[k]) for a, b in zip(restored, saved) for k in b)
    out["files"] = sorted(os.listdir(os.path.join(where, "step-00000001")))

    # a stage module its ranks hold whole (no data-parallel wrapper): saved over the stage's group
    plain, other = _stage_module(stage, 2, seed), _stage_module(stage, 2, seed + 1)
    where = os.path.join(root, f"plain-stage{stage}")
    fusedist.checkpoint.save(where, plain, process_group=mesh["dp"].get_group())
    fusedist.checkpoint.load(where, other, process_group=mesh["dp"].get_group())
    out["plain equal"] = all(torch.equal(a, b)
                             for a, b in zip(plain.state_dict().values(), other.state_dict().values()))
    # and by a Checkpointer per stage, with its optimizer (pure pipeline parallelism: no wrapper)
    plain_opt, other_opt = _adamw(plain.parameters()), torch.optim.AdamW(other.parameters())
    plain(torch.ones(2, WIDTH)).sum().backward()
    plain_opt.step()
    where = os.path.join(root, f"plain-periodic-stage{stage}")
    for module, opt in ((plain, plain_opt), (other, other_opt)):
        periodic = fusedist.checkpoint.Checkpointer(where, process_group=mesh["dp"], async_save=False)
        out["restored"].append(periodic.restore(module, opt))
        if module is plain:
            periodic.save(1)
        periodic.close()
    out["plain equal"] &= all(torch.equal(a, b)
                              for a, b in zip(plain.state_dict().values(), other.state_dict().values()))
    a, b = plain_opt.state_dict(), other_opt.state_dict()
    out["plain equal"] &= a["state"].keys() == b["state"].keys() and all(
        torch.equal(torch.as_tensor(a["state"][i][k]), torch.as_tensor(b["state"][i][k]))
        for i in a["state"] for k in a["state"][i]) and a["param_groups"] == b["param_groups"]
    return out


def _optimizer_state(module, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(module, opt, options=StateDictOptions(full_state_dict=True))["state"]
    return {f"{name}/{k}": v.clone() for name, st in state.items() for k, v in st.items()}


# ---------------------------------------------- 3-D: pipeline x tensor parallelism, x HSDP
class _TensorParallelBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class _Stage(nn.Module):
    """Blocks of one model under their names in the whole model (torchtitan's split), run in order."""

    def __init__(self, blocks: dict):
        super().__init__()
        self.layers = nn.ModuleDict(blocks)

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


def _blocks_3d(kind: str, seed: int) -> list:
    """The whole model's blocks, the same on every rank."""
    torch.manual_seed(seed)
    if kind == "tp":
        return [_TensorParallelBlock() for _ in range(2 * BLOCKS_PER_STAGE)]
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(2 * BLOCKS_PER_STAGE)]


def _stage_3d(kind: str, shard, mesh, seed):
    """This rank's stage of torchtitan's 3-D recipes in small: ``"tp"``, a column-/row-wise plan
    on mesh["tp"] and fully_shard on mesh["dp"]; ``"hsdp"``, fully_shard on
    mesh["dp_replicate", "dp_shard"]. Returns the module and its data-parallel rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    stage = mesh["pp"].get_local_rank()
    ids = range(stage * BLOCKS_PER_STAGE, (stage + 1) * BLOCKS_PER_STAGE)
    module = _Stage({str(i): block for i, block in enumerate(_blocks_3d(kind, seed)) if i in ids})
    if kind == "tp":
        dp, data_rank = mesh["dp"], mesh["dp"].get_local_rank()
    else:
        dp = mesh["dp_replicate", "dp_shard"]
        data_rank = mesh["dp_replicate"].get_local_rank() * 2 + mesh["dp_shard"].get_local_rank()
    for block in module.layers.values():
        if kind == "tp":
            parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        shard(block, mesh=dp)
    shard(module, mesh=dp)
    return module, data_rank


def _train_3d(kind: str, shard, stage_class, mesh, seed):
    """1 + STEPS AdamW steps of 1F1B over mesh["pp"]: the stage module and its optimizer."""
    from torch.distributed import pipelining

    pp = mesh["pp"]
    module, data_rank = _stage_3d(kind, shard, mesh, seed)
    stage = stage_class(module, pp.get_local_rank(), 2, torch.device("cpu"), group=pp.get_group())
    schedule = pipelining.Schedule1F1B(stage, n_microbatches=MICRO_BATCHES,
                                       loss_fn=lambda out, target: ((out - target) ** 2).mean())
    opt = _adamw(module.parameters())
    _run_steps(schedule, opt, torch.Generator().manual_seed(seed + data_rank), [pp.get_local_rank()], 2)
    return module, opt


def _worker_3d(rank, world_size, kind, seed, root):
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.pipelining import PipelineStage as TorchPipelineStage

    import fusedist
    from fusedist.pipelining import PipelineStage

    names = ("pp", "dp", "tp") if kind == "tp" else ("pp", "dp_replicate", "dp_shard")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
    ours, opt = _train_3d(kind, fusedist.fully_shard, PipelineStage, mesh, seed)
    theirs, _ = _train_3d(kind, torch_fully_shard, TorchPipelineStage, mesh, seed)
    saved = (fusedist.fsdp.full_state_dict(ours), _optimizer_state(ours, opt))
    out = {"diff": _max_diff([saved[0]], [_full_model(theirs)])}

    # a Checkpointer per stage over the stage's mesh: a tensor-parallel or HSDP checkpoint is
    # written by every rank of it (Note [a Checkpointer per pipeline stage])
    stage_mesh = mesh[names[1], names[2]]
    where = os.path.join(root, f"stage{mesh['pp'].get_local_rank()}")
    periodic = fusedist.checkpoint.Checkpointer(where, process_group=stage_mesh)
    out["restored"] = [periodic.restore(ours, opt)]
    periodic.save(3)
    periodic.close()
    fresh, fresh_opt = _train_3d(kind, fusedist.fully_shard, PipelineStage, mesh, seed + 1)
    periodic = fusedist.checkpoint.Checkpointer(where, process_group=stage_mesh)
    out["restored"].append(periodic.restore(fresh, fresh_opt))
    periodic.close()
    restored = (fusedist.fsdp.full_state_dict(fresh), _optimizer_state(fresh, fresh_opt))
    out["equal"] = all(torch.equal(a[k], b[k]) for a, b in zip(restored, saved) for k in b)

    # one root for both stages (Note [pipelined checkpoints]): restored exactly, and read whole
    # by a job without pipeline parallelism (each rank a plain copy of the whole model)
    where = os.path.join(root, "pipelined")
    for module, optimizer in ((ours, opt), _train_3d(kind, fusedist.fully_shard, PipelineStage, mesh, seed + 2)):
        periodic = fusedist.checkpoint.Checkpointer(where, process_group=stage_mesh, pipeline=True)
        out["restored"].append(periodic.restore(module, optimizer))
        if module is ours:
            periodic.save(3)
        periodic.close()
    restored = (fusedist.fsdp.full_state_dict(module), _optimizer_state(module, optimizer))
    out["pipelined equal"] = all(torch.equal(a[k], b[k]) for a, b in zip(restored, saved) for k in b)
    # the same with save and load over the stage's mesh (flattened to one group)
    fusedist.checkpoint.save(os.path.join(root, "saved"), ours, opt, process_group=stage_mesh, pipeline=True)
    fresh, fresh_opt = _train_3d(kind, fusedist.fully_shard, PipelineStage, mesh, seed + 4)
    fusedist.checkpoint.load(os.path.join(root, "saved"), fresh, fresh_opt, process_group=stage_mesh, pipeline=True)
    restored = (fusedist.fsdp.full_state_dict(fresh), _optimizer_state(fresh, fresh_opt))
    out["pipelined equal"] &= all(torch.equal(a[k], b[k]) for a, b in zip(restored, saved) for k in b)
    whole = _Stage({str(i): block for i, block in enumerate(_blocks_3d(kind, seed + 3))})
    fusedist.checkpoint.load(os.path.join(where, "step-00000003"), whole)
    every = [None] * world_size
    torch.distributed.all_gather_object(every, saved[0])
    expected = {k: v for part in every for k, v in part.items()}
    out["whole equal"] = (sorted(expected) == sorted(whole.state_dict())
                          and all(torch.equal(v, expected[k]) for k, v in whole.state_dict().items()))
    return out


def _full_model(module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))


@pytest.mark.parametrize("kind", ["tp", "hsdp"])
def test_3d_pipeline_stages_match_fsdp2(kind, launched8):
    """8 ranks, (pp 2, dp 2, tp 2) or (pp 2, dp_replicate 2, dp_shard 2): fusedist's stages equal
    FSDP2's under 1F1B (tolerance as above), and a Checkpointer per stage, over the stage's
    mesh, restores its stage exactly."""
    seed, per_rank = launched8["seed"], results_of(launched8, kind)
    for rank, out in enumerate(per_rank):
        assert out["diff"] < 1e-6, (seed, rank, out)
        assert out["restored"] == [0, 3, 0, 3] and out["equal"], (seed, rank, out)
        assert out["pipelined equal"] and out["whole equal"], (seed, rank, out)


# ------------------------------------------------------------------ zero-bubble schedules
def _unsharded_reference(seed, steps, data_ranks, num_stages: int = 4, frozen=()) -> list:
    """The whole model of ``num_stages`` stages trained on the global batch (every data-parallel
    rank's micro-batches) with AdamW in one process: each stage's state dict after ``steps`` steps
    (the stages ``frozen`` left untrained)."""
    modules = [_stage_module(i, num_stages, seed).requires_grad_(i not in frozen) for i in range(num_stages)]
    whole = nn.Sequential(*modules)
    opt = _adamw([p for p in whole.parameters() if p.requires_grad])
    generators = [torch.Generator().manual_seed(seed + r) for r in range(data_ranks)]
    for _ in range(steps):
        batches = [(torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)) for g in generators]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        ((whole(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [m.state_dict() for m in modules]


def _zero_bubble_worker(rank, world_size, seed):
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    r = pp.get_local_rank()
    reference = _unsharded_reference(seed, 1 + STEPS, dp.size())
    out = {}
    accumulated, watch = _count_weight_gradients_by_pass()
    for name, placement in (("ScheduleInterleavedZeroBubble", (r, r + 2)), ("ScheduleZBVZeroBubble", (r, 3 - r)),
                            ("ScheduleDualPipeV", (r, 3 - r))):
        modules, stages = _fusedist_stages(placement, mesh, seed)
        for module in modules:
            watch(module)
        accumulated.clear()
        issued = _train_counting(name, modules, stages, placement, mesh, seed)
        ours = [fusedist.fsdp.full_state_dict(m) for m in modules]
        out[name] = {"diff": _max_diff(ours, [reference[i] for i in placement]), "issued": issued,
                     "accumulated": dict(accumulated)}
    return out


def _fusedist_stages(placement, mesh, seed, prepare_block=lambda block: None, finish_block=lambda block: None):
    """fusedist stages ``placement`` of a 4-stage ``_stage_module`` model: each block sharded over
    mesh["dp"] (``prepare_block`` before, ``finish_block`` after), then the stage module."""
    import fusedist
    from fusedist.pipelining import PipelineStage

    modules, stages = [], []
    for index in placement:
        module = _stage_module(index, 4, seed)
        for block in module:
            prepare_block(block)
            fusedist.fully_shard(block, mesh=mesh["dp"])
            finish_block(block)
        fusedist.fully_shard(module, mesh=mesh["dp"])
        modules.append(module)
        stages.append(PipelineStage(module, index, 4, torch.device("cpu"), group=mesh["pp"].get_group()))
    return modules, stages


def _train_counting(schedule_name, modules, stages, placement, mesh, seed) -> int:
    """1 + STEPS AdamW steps of the stages under ``schedule_name``; the reduce-scatters of the
    last STEPS."""
    from torch.distributed import pipelining

    schedule = getattr(pipelining, schedule_name)(stages, n_microbatches=MICRO_BATCHES,
                                                  loss_fn=lambda o, t: ((o - t) ** 2).mean())
    opt = _adamw([p for m in modules for p in m.parameters()])
    counted = _count_reduce_scatters(modules[0])
    _run_steps(schedule, opt, torch.Generator().manual_seed(seed + mesh["dp"].get_local_rank()), placement, 4,
               before=lambda step: counted.clear() if step == 1 else None)
    return len(counted)


def _count_weight_gradients_by_pass() -> tuple:
    """How many weight gradients autograd accumulates in input passes, weight passes and
    full passes of fusedist's stages: the counts, and what puts the counting hook on a stage
    module's gathered parameters."""
    import fusedist.pipelining.stage as stages

    counts, phase = {}, ["full"]

    def counting(pass_fn, name):
        def run(module, *args):
            phase[0] = name
            try:
                return pass_fn(module, *args)
            finally:
                phase[0] = "full"
        return run

    def watch(module) -> None:
        for w in stages._weights(module):
            w.register_post_accumulate_grad_hook(lambda _: counts.__setitem__(phase[0], counts.get(phase[0], 0) + 1))

    stages._input_pass = counting(stages._input_pass, "input")
    stages._weight_pass = counting(stages._weight_pass, "weight")
    return counts, watch


def test_zero_bubble_schedules_train_as_the_unsharded_model(launched4):
    """Zero-bubble schedules over fully_shard stages (Note [zero-bubble passes of fusedist
    stages]): the input pass accumulates no weight gradient, the weight pass all of them
    through the units' hooks, the step's last one reduces the sum. 4 stages over 2 pipeline
    ranks (looped and V placements) x 2
    data-parallel ranks, against the unsharded 4-stage model trained on the global batch:
    another summation order (micro-batch means averaged, then over the ranks), magnified by
    AdamW where gradients nearly cancel (1e-4, as above); one reduce-scatter per unit and step.
    (torch 2.13's FSDP2 under these schedules ends with weights 2-4e-2 away from 1F1B's; with
    torch's own PipelineStage a fusedist stage loses its gradients.)"""
    seed, per_rank = launched4["seed"], results_of(launched4, "zero bubble")
    for rank, out in enumerate(per_rank):
        for name, got in out.items():
            assert got["diff"] < 1e-4, (seed, rank, name, got)
            assert got["issued"] == BLOCKS_PER_STAGE * 2 * STEPS, (rank, name, got)
            # the weights' gradients come in weight passes (stage 0's in full passes: torch skips
            # its input pass), each weight once per micro-batch and step; none in input passes
            weights = 2 * BLOCKS_PER_STAGE * (1 + STEPS) * MICRO_BATCHES  # per stage: 2 blocks x (weight, bias)
            stages_with_input_passes = 2 - (rank < 2)  # ranks 0, 1 (pp rank 0) hold stage 0
            passes = got["accumulated"]
            assert passes.get("input", 0) == 0 and passes.get("weight", 0) + passes.get("full", 0) == 2 * weights, \
                (rank, name, got)
            if name == "ScheduleDualPipeV":  # it runs some backwards whole (overlapped with forwards)
                assert passes.get("weight", 0) > 0, (rank, name, got)
            else:
                assert passes.get("weight", 0) == weights * stages_with_input_passes, (rank, name, got)


def _after_a_frozen_stage_worker(rank, world_size, seed):
    """Interleaved zero bubble, 4 stages over pp x dp = 2 x 2, stage 0 frozen (stage 1's inputs
    need no gradient) or stages 0-2 (the last stage's, whose input pass starts from the loss).
    Each wrap's stages after 1 + STEPS AdamW steps, against the unsharded model with those stages
    frozen; a plain stage module (fusedist's stage) is averaged over dp by hand."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    r = pp.get_local_rank()
    placement, num_stages = (r, r + 2), 4
    out = {}
    for frozen, wrap in itertools.product(((0,), (0, 1, 2)), ("fully_shard", "DistributedDataParallel", "plain")):
        reference = _unsharded_reference(seed, 1 + STEPS, dp.size(), num_stages, frozen=frozen)
        modules, stages = [], []
        for index in placement:
            module = _stage_module(index, num_stages, seed).requires_grad_(index not in frozen)
            wrapped = {"fully_shard": lambda m: fusedist.fully_shard(m, mesh=dp),
                       "DistributedDataParallel": lambda m: fusedist.DistributedDataParallel(
                           m, process_group=dp.get_group()),
                       "plain": lambda m: m}[wrap](module)
            modules.append(module)
            stages.append(PipelineStage(wrapped, index, num_stages, torch.device("cpu"), group=pp.get_group()))
        schedule = pipelining.ScheduleInterleavedZeroBubble(
            stages, n_microbatches=MICRO_BATCHES, loss_fn=lambda o, t: ((o - t) ** 2).mean())
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        opt = _adamw(params) if params else None  # (pp rank 0 holds only frozen stages 0 and 2)
        if wrap == "plain" and params:
            _average_by_hand(opt, params, dp.get_group())
        g = torch.Generator().manual_seed(seed + dp.get_local_rank())
        _run_steps(schedule, opt, g, placement, num_stages)
        ours = [fusedist.fsdp.full_state_dict(m) if wrap == "fully_shard" else m.state_dict() for m in modules]
        out[f"{wrap}, stages {frozen} frozen"] = _max_diff(ours, [reference[i] for i in placement])
    return out


def test_zero_bubble_trains_a_stage_after_a_frozen_one(launched4):
    """A stage none of whose inputs requires a gradient (the stage after a frozen one, the last
    stage included) under a zero-bubble schedule (Note [a stage whose inputs need no gradient]):
    torch's input pass finds no point where the weights' paths meet the inputs', so its weight
    pass computed nothing and the stage never trained, silently (torch's own PipelineStage too).
    fusedist stages (fully_shard, DDP, a plain module) train as the unsharded model with
    the same stages frozen does (tolerance as above; a lost gradient is a ~lr difference)."""
    seed, per_rank = launched4["seed"], results_of(launched4, "after a frozen stage")
    for rank, out in enumerate(per_rank):
        for wrap, diff in out.items():
            assert diff < 1e-4, (seed, rank, wrap, diff)


class _AroundStage(nn.Module):
    """Stage ``index`` of a 4-stage model passing (h, m, c) along: m a frozen embedding's output
    (no gradient), c a side stream. A middle stage's ``m_only`` reaches only the output c, whose
    path never meets an input that requires a gradient; ``both`` reaches h and c."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index
        if index == 0:
            self.a, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
            self.emb = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        elif index < 3:
            self.h, self.both, self.m_only = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        else:
            self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, *args):
        if self.index == 0:
            (x,) = args
            return self.a(x), self.emb(x), self.c(x)
        h, m, c = args
        if self.index == 3:
            return self.o(h) * m + c
        both = self.both(m)
        return torch.tanh(self.h(h)) + both + c, m.clone(), torch.tanh(self.m_only(m)) + both


def _around_model(seed: int) -> list:
    torch.manual_seed(seed)
    return [_AroundStage(i) for i in range(4)]


def _average_by_hand(opt, params, group) -> None:
    """Average a plain stage's gradients over the data-parallel group before each step, as DDP
    would (a gradient lost counts as a zero: the test then names the wrap)."""
    def average(opt, args, kwargs):
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            torch.distributed.all_reduce(p.grad, group=group)
            p.grad /= torch.distributed.get_world_size(group)
    opt.register_step_pre_hook(average)


def _around_the_inputs_worker(rank, world_size, seed):
    """Zero-bubble schedules (interleaved, ZBV, DualPipeV) over 4 ``_AroundStage`` stages, pp x dp = 2 x 2,
    each wrap: the stages after 1 + STEPS AdamW steps against the unpipelined model trained on
    the global batch."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    r = pp.get_local_rank()
    reference = _around_model(seed)
    whole_opt = _adamw([p for m in reference for p in m.parameters() if p.requires_grad])
    generators = [torch.Generator().manual_seed(seed + d) for d in range(dp.size())]
    for _ in range(1 + STEPS):
        batches = [(torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)) for g in generators]
        out = torch.cat([b[0] for b in batches])
        for module in reference:
            out = module(*(out if isinstance(out, tuple) else (out,)))
        ((out - torch.cat([b[1] for b in batches])) ** 2).mean().backward()
        whole_opt.step()
        whole_opt.zero_grad()
    found = {}
    for name, placement in (("ScheduleInterleavedZeroBubble", (r, r + 2)), ("ScheduleZBVZeroBubble", (r, 3 - r)),
                            ("ScheduleDualPipeV", (r, 3 - r))):
        for wrap in ("fully_shard", "DistributedDataParallel", "plain"):
            modules = [_around_model(seed)[i] for i in placement]
            wrapped = [{"fully_shard": lambda m: fusedist.fully_shard(m, mesh=dp),
                        "DistributedDataParallel": lambda m: fusedist.DistributedDataParallel(
                            m, process_group=dp.get_group()),
                        "plain": lambda m: m}[wrap](m) for m in modules]
            stages = [PipelineStage(w, i, 4, torch.device("cpu"), group=pp.get_group())
                      for w, i in zip(wrapped, placement)]
            schedule = getattr(pipelining, name)(stages, n_microbatches=MICRO_BATCHES,
                                                 loss_fn=lambda o, t: ((o - t) ** 2).mean())
            params = [p for m in modules for p in m.parameters() if p.requires_grad]
            opt = _adamw(params)
            if wrap == "plain":
                _average_by_hand(opt, params, dp.get_group())
            _run_steps(schedule, opt, torch.Generator().manual_seed(seed + dp.get_local_rank()), placement, 4)
            ours = [fusedist.fsdp.full_state_dict(w) if wrap == "fully_shard" else m.state_dict()
                    for w, m in zip(wrapped, modules)]
            found[f"{name}, {wrap}"] = _max_diff(ours, [reference[i].state_dict() for i in placement])
    return found


def test_zero_bubble_trains_weights_whose_paths_go_around_the_inputs(launched4):
    """Note [weight paths around the inputs]: a middle stage's weight whose path reaches an
    output without meeting an input that requires a gradient (``m_only``) got no gradient under
    zero-bubble schedules, and one that reaches both kinds of outputs (``both``) only part of it:
    torch's input pass saves the gradients where the weights' paths meet the inputs', and its
    weight pass starts from those alone (torch's own PipelineStage too). Every wrap trains as
    the unpipelined model (tolerance as above; a lost gradient is a ~lr difference)."""
    seed, per_rank = launched4["seed"], results_of(launched4, "around the inputs")
    for rank, out in enumerate(per_rank):
        for case, diff in out.items():
            assert diff < 1e-4, (seed, rank, case, diff)


class _ScaleFunction(torch.autograd.Function):
    """``x * w`` whose backward computes both gradients from the saved ``w`` and ``x``, as a
    custom kernel's does: a weight pass re-running it reads the weight."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).reshape(-1, w.numel()).sum(0)


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x):
        return _ScaleFunction.apply(x, self.weight)


def _blocks_variant_worker(rank, world_size, seed):
    """Whole parameters after 1 + STEPS steps under interleaved zero-bubble minus those under
    interleaved 1F1B, fusedist stages of blocks compiled, activation-checkpointed, or with a
    custom function whose backward reads the weight; and under interleaved 1F1B, compiled blocks
    (torchtitan compiles each block) minus eager ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.checkpoint import checkpoint

    import fusedist

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    placement = (mesh["pp"].get_local_rank(), mesh["pp"].get_local_rank() + 2)

    def prepare(variant):
        return lambda block: block.append(_Scale()) if variant == "custom function" else None

    def finish(variant):
        def apply(block):
            if variant == "compiled":
                block.compile(backend="aot_eager")
            elif variant == "checkpointed":
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        return apply

    def train(schedule_name, variant):
        modules, stages = _fusedist_stages(placement, mesh, seed, prepare(variant), finish(variant))
        issued[(schedule_name, variant)] = _train_counting(schedule_name, modules, stages, placement, mesh, seed)
        return [fusedist.fsdp.full_state_dict(m) for m in modules]

    issued, variants = {}, ("compiled", "checkpointed", "custom function")
    one_f_one_b = {variant: train("ScheduleInterleaved1F1B", variant) for variant in (*variants, "eager")}
    out = {variant: _max_diff(train("ScheduleInterleavedZeroBubble", variant), one_f_one_b[variant])
           for variant in variants}
    out["compiled against eager"] = _max_diff(one_f_one_b["compiled"], one_f_one_b["eager"])
    return out, issued


def test_zero_bubble_with_compiled_or_checkpointed_blocks_trains_as_1f1b(launched4):
    """The weight pass re-enters a compiled block's backward, a checkpointed block's
    recomputation, or a custom function's backward that reads the weight (the block gathered
    again: another micro-batch's forward resharded it since the input pass): the same weights
    as interleaved 1F1B over the same stages, bit for bit (each micro-batch's gradients are
    accumulated in the same order), with one reduce-scatter per unit and step: a custom
    function's node is both an intermediate of the weight pass and the maker of its unit's
    output, whose backward hook must not start a backward of the unit there. Compiled blocks take the
    same steps as eager ones under interleaved 1F1B, bit for bit."""
    seed = launched4["seed"]
    for rank, (out, issued) in enumerate(results_of(launched4, "block variants")):
        assert out == {"compiled": 0.0, "checkpointed": 0.0, "custom function": 0.0,
                       "compiled against eager": 0.0}, (seed, rank, out)
        # one reduce-scatter per unit and step, in either schedule (2 stages of 2 blocks per rank)
        assert set(issued.values()) == {2 * BLOCKS_PER_STAGE * STEPS}, (rank, issued)


def _weight_pass_after_a_forward_worker(rank, world_size, seed):
    """An input pass, a forward of another micro-batch (which reshards the blocks), then the
    weight pass: the gradients of the unsharded model's backward."""
    import fusedist
    from fusedist.pipelining import sync_switch
    from fusedist.pipelining import stage as stages

    def build():
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), _Scale(), nn.Tanh()) for _ in range(2)])

    ours, theirs = build(), build()
    for block in ours:
        fusedist.fully_shard(block)
    fusedist.fully_shard(ours)
    x = torch.randn(4, WIDTH, requires_grad=True)
    out = ours(x)
    grad = torch.randn_like(out)
    with sync_switch._micro_batch(ours, last=False):
        dx, groups = stages._input_pass(ours, {"stage_output": (out,), "output_grads": (grad,), "input_values": [x]})
    with torch.no_grad():
        ours(torch.randn(4, WIDTH))  # the next micro-batch: each block reshards after its forward
    resharded = sum(not block._fs_states()[0].unit.is_unsharded for block in ours)
    with sync_switch._micro_batch(ours, last=True):
        stages._weight_pass(ours, groups)
    x2 = x.detach().clone().requires_grad_(True)
    theirs(x2).backward(grad)
    diffs = [float((a.grad - b.grad).abs().max()) for a, b in zip(ours.parameters(), theirs.parameters())]
    return {"resharded": resharded, "dx": float((dx[0] - x2.grad).abs().max()), "weights": max(diffs)}


def test_a_weight_pass_after_another_forward_gathers_the_resharded_units():
    """Under a schedule that runs another micro-batch's forward between a micro-batch's input
    and weight passes, the blocks (``reshard_after_forward``) are resharded when the weight pass
    begins, and a backward that reads the weight (a custom function's) needs them gathered:
    the weight pass gathers them again (Note [zero-bubble passes of fusedist stages])."""
    out = run_distributed(_weight_pass_after_a_forward_worker, 1, 5, timeout=120)[0]
    assert out["resharded"] == 2 and out["dx"] < 1e-6 and out["weights"] < 1e-6, out


def _empty_weight_pass_worker(rank, world_size, seed, wrap):
    """Micro-batch 1 through the blocks (a full backward, accumulated); micro-batch 2, the
    step's last, around them (its weight pass computes nothing): the pieces' gradients against
    the unsharded model's for micro-batch 1. ``wrap``: fully_shard, or fusedist's DDP."""
    import fusedist
    from fusedist.pipelining import stage as stages

    class Bypass(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(2)])
            self.around = False

        def forward(self, x):
            return x * 2 if self.around else self.blocks(x)

    def build():
        torch.manual_seed(seed)
        return Bypass()

    ours, theirs = build(), build()
    if wrap == "fully_shard":
        for block in ours.blocks:
            fusedist.fully_shard(block)
        stage = fusedist.fully_shard(ours)
    else:
        stage = fusedist.DistributedDataParallel(ours)
    switch = stages._sync_switch(stage)
    g = torch.Generator().manual_seed(seed + rank)
    x, grad = torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)
    out = stage(x)
    with switch(False):  # (around the backward only, as the stage sets it: a DDP forward resets it)
        out.backward(grad)
    ours.around = True
    x2 = torch.randn(4, WIDTH, requires_grad=True)
    out = stage(x2)
    with switch(False):  # (as the stage runs input passes)
        stages._input_pass(stage, {"stage_output": (out,), "output_grads": (grad,), "input_values": [x2]})
    with switch(True):
        stages._weight_pass(stage, [])
    for r in range(world_size):  # the data-parallel mean of micro-batch 1's gradients
        gr = torch.Generator().manual_seed(seed + r)
        xr, gradr = torch.randn(4, WIDTH, generator=gr), torch.randn(4, WIDTH, generator=gr)
        theirs(xr).backward(gradr / world_size)
    got = [p.grad is not None for p in ours.parameters()]
    for m in (ours, theirs):  # (the step guard lets the step run: the sums were reduced)
        torch.optim.SGD(m.parameters(), lr=1.0).step()
    whole = fusedist.fsdp.full_state_dict(ours) if wrap == "fully_shard" else ours.state_dict()
    return got, _max_diff([whole], [theirs.state_dict()])


@pytest.mark.parametrize("wrap", ["fully_shard", "DistributedDataParallel"])
def test_a_last_weight_pass_that_computes_nothing_still_reduces_the_sum(wrap, launched2):
    """A micro-batch whose output does not depend on the stage's weights (it goes around its
    blocks) has a weight pass with no gradient to compute; when it is the step's last, the
    units (the DDP buckets) still reduce what the earlier micro-batches accumulated (before, no
    backward ran, nothing was reduced, and the step guard refused the optimizer step)."""
    for rank, (got, diff) in enumerate(results_of(launched2, f"empty weight pass {wrap}")):
        assert all(got) and diff < 1e-6, (rank, got, diff)


class _SkipsInLastMicroBatch(nn.Module):
    """Two blocks; the second is skipped in the step's last micro-batch (``calls`` counts the
    step's forwards with gradients): a unit that takes no part in the synchronized backward."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.calls = 0

    def forward(self, x):
        skip = self.calls == MICRO_BATCHES - 1
        if torch.is_grad_enabled():
            self.calls += 1
        for i, block in enumerate(self.blocks):
            if not (skip and i == 1):
                x = torch.tanh(block(x))
        return x


def _skipping_worker(rank, world_size, seed, schedule_name, stages_per_rank):
    """Whole parameters of this rank's stages minus the unsharded model's, trained alike with SGD
    on the global batch, after 3 steps (the first at lr 0: its shape inference runs a forward
    of its own, which shifts the skipped micro-batch)."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    num_stages = 2 * stages_per_rank
    placement = [pp.get_local_rank() + 2 * k for k in range(stages_per_rank)]

    def build(index):
        torch.manual_seed(seed)
        blocks = [nn.Linear(WIDTH, WIDTH) for _ in range(2 * num_stages)]
        return _SkipsInLastMicroBatch(blocks[2 * index:2 * index + 2])

    modules, stages = [], []
    for index in placement:
        module = build(index)
        for block in module.blocks:
            fusedist.fully_shard(block, mesh=dp)
        fusedist.fully_shard(module, mesh=dp)
        modules.append(module)
        stages.append(PipelineStage(module, index, num_stages, torch.device("cpu"), group=pp.get_group()))
    schedule = getattr(pipelining, schedule_name)(stages if stages_per_rank > 1 else stages[0],
                                                  n_microbatches=MICRO_BATCHES,
                                                  loss_fn=lambda o, t: ((o - t) ** 2).mean())
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
    reference = [build(i) for i in range(num_stages)]
    reference_opt = torch.optim.SGD([p for m in reference for p in m.parameters()], lr=0.1)
    for step in range(3):
        batches = [_skipping_batch(step, r) for r in range(dp.size())]
        x, y = batches[dp.get_local_rank()]
        for module in modules:
            module.calls = 0
        schedule.step(*((x,) if 0 in placement else ()),
                      **(dict(target=y, losses=[]) if num_stages - 1 in placement else {}))
        loss = 0.0
        for bx, by in batches:
            for m in reference:
                m.calls = 0
            for xm, ym in zip(bx.chunk(MICRO_BATCHES), by.chunk(MICRO_BATCHES)):
                out = xm
                for m in reference:
                    out = m(out)
                loss = loss + ((out - ym) ** 2).mean() / (MICRO_BATCHES * dp.size())
        loss.backward()
        for o in (opt, reference_opt):
            o.param_groups[0]["lr"] = 0.0 if step == 0 else 0.1
            o.step()
            o.zero_grad()
    return _max_diff([fusedist.fsdp.full_state_dict(m) for m in modules],
                     [reference[i].state_dict() for i in placement])


def _skipping_batch(step: int, dp_rank: int) -> tuple:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


@pytest.mark.parametrize("schedule_name, stages_per_rank", [("Schedule1F1B", 1), ("ScheduleInterleavedZeroBubble", 2)])
def test_a_block_skipped_in_the_last_micro_batch_still_reduces_its_sum(schedule_name, stages_per_rank, launched4):
    """Note [accumulated units a synchronized backward does not reach]: a block that runs in the
    first micro-batches of a step and not in the last (whose backward, or weight pass, is the
    synchronized one) reduces what it accumulated, as the unsharded model's gradients say
    (before, its gradients stayed in the accumulator and its weights were not stepped)."""
    assert SKIPPING[schedule_name] == stages_per_rank
    for rank, diff in enumerate(results_of(launched4, f"skipping {schedule_name}")):
        assert diff < 1e-6, (rank, schedule_name, diff)


# ------------------------------------------------------- stages wrapped by fusedist's DDP
def _counting(issue, issued: list):
    """``issue`` (a communicator's all_reduce), recording each call's tag in ``issued``."""
    def counted(*args, **kwargs):
        issued.append(kwargs.get("tag", ""))
        return issue(*args, **kwargs)

    return counted


def _count_all_reduces(engine) -> list:
    issued = []
    engine.comm.all_reduce = _counting(engine.comm.all_reduce, issued)
    return issued


def _ddp_worker(rank, world_size, seed):
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.ddp.replicate import wrapper_of
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    r = pp.get_local_rank()
    out = {}
    cases = (("DistributedDataParallel", "Schedule1F1B", (r,)), ("replicate", "Schedule1F1B", (r,)),
             ("DistributedDataParallel", "ScheduleInterleavedZeroBubble", (r, r + 2)))
    for wrap, name, placement in cases:
        num_stages = 2 * len(placement)
        modules, stages = [], []
        for index in placement:
            module = _stage_module(index, num_stages, seed)
            wrapped = (fusedist.DistributedDataParallel(module, process_group=dp.get_group())
                       if wrap == "DistributedDataParallel" else fusedist.replicate(module, device_mesh=dp))
            modules.append(module)
            stages.append(PipelineStage(wrapped, index, num_stages, torch.device("cpu"), group=pp.get_group()))
        schedule = getattr(pipelining, name)(stages if len(stages) > 1 else stages[0],
                                             n_microbatches=MICRO_BATCHES, loss_fn=lambda o, t: ((o - t) ** 2).mean())
        opt = _adamw([p for m in modules for p in m.parameters()])
        g = torch.Generator().manual_seed(seed + dp.get_local_rank())
        issued = []

        def count_from_step_1(step):
            if step == 1:  # (a replicated module's engine is built at its first forward)
                engine = stages[0].submod if wrap == "DistributedDataParallel" else wrapper_of(modules[0])
                engine.comm.all_reduce = _counting(engine.comm.all_reduce, issued)

        _run_steps(schedule, opt, g, placement, num_stages, before=count_from_step_1)
        reference = _unsharded_reference(seed, 1 + STEPS, dp.size(), num_stages)
        out[f"{wrap}, {name}"] = {"diff": _max_diff([m.state_dict() for m in modules],
                                                    [reference[i] for i in placement]),
                                  "buckets": sum(t.startswith("ddp bucket") for t in issued)}
    return out


def test_stages_of_fusedist_ddp_reduce_once_per_step(launched4):
    """Stage modules wrapped by fusedist.DistributedDataParallel or fusedist.replicate: the
    engine's switch is set for each backward (its forwards run micro-batches ahead), so the
    stage's last backward all-reduces the sum, once per step (torch's own stage: once per
    micro-batch, and torch's DDP under torch 2.13's schedules fails in its bucket rebuild on the
    first step); 1F1B and interleaved zero-bubble, against the unsharded model on the global
    batch (tolerance as above)."""
    seed, per_rank = launched4["seed"], results_of(launched4, "ddp")
    for rank, out in enumerate(per_rank):
        for case, got in out.items():
            assert got["diff"] < 1e-4, (seed, rank, case, got)
            # one bucket per stage, once a step (a rank's stages share the data-parallel communicator)
            assert got["buckets"] == (2 if "ZeroBubble" in case else 1) * STEPS, (rank, case, got)



def _dp_peer_failure_worker(rank, world_size, seed, micro_batch=2, cases=(("DistributedDataParallel", False),
                                                                          ("fully_shard", False)), pp_size=2):
    """pp=``pp_size`` x dp; the last stage of pipeline 0 (global rank 2 of pp=2 x dp=2, rank 0 of pp=1 x dp=2)
    fails in its loss at ``micro_batch`` of the first step (each rank catches the error and goes on), per case:
    the stage module's wrapper, and whether the stages are given their shapes (else the first step infers them).
    Each rank's error and how long after the step began it came."""
    out = {}
    for wrap, shapes_given in cases:
        pp, dp, schedule = _dp_pipeline(seed, pp_size, wrap, shapes_given, micro_batch)
        x, y = _dp_batch(seed, dp)
        if rank == world_size - world_size // pp_size:
            y[2 * micro_batch:2 * micro_batch + 2] = 777  # the micro-batch's rows
        torch.distributed.barrier()
        began, raised, collective = time.monotonic(), None, None
        try:
            _dp_step(schedule, pp, x, y)
        except Exception as e:  # (a one-rank pipeline raises the loss's own ValueError)
            raised, collective = str(e), _collective_error_in_chain(e)
        out[wrap + (", shapes given" if shapes_given else "")] = (
            time.monotonic() - began, raised, _failure_entries_left(), collective, _failures_counted(schedule))
    return out


def _dp_setup_refusal_worker(rank, world_size, seed):
    """pp=2 x dp=2: pipeline 0's last stage (global rank 2) is stepped by a schedule of twice the micro-batches,
    so pipeline 0 refuses its set-up (Note [micro-batch counts that differ across ranks]); DDP stages, shapes
    inferred or given: each rank's error and how long after the step began it came (the refusing ranks stay
    alive, in a barrier)."""
    from torch.distributed import pipelining

    out = {}
    for wrap, shapes_given in (("DistributedDataParallel", False), ("DistributedDataParallel", True)):
        pp, dp, schedule = _dp_pipeline(seed, 2, wrap, shapes_given, None)
        if rank == 2:
            schedule = pipelining.Schedule1F1B(schedule._stage, n_microbatches=2 * MICRO_BATCHES,
                                               loss_fn=schedule._loss_fn)
        x, y = _dp_batch(seed, dp)
        torch.distributed.barrier()
        began, raised = time.monotonic(), None
        try:
            _dp_step(schedule, pp, x, y)
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            raised = str(e)
        out[wrap + (", shapes given" if shapes_given else "")] = (time.monotonic() - began, raised)
        torch.distributed.barrier()
    return out


def test_a_pipelines_set_up_refusal_fails_its_data_parallel_peers_promptly(launched4):
    """Note [micro-batch counts that differ across ranks] with data-parallel peers: pipeline 0's ranks refused
    the set-up at once, but the other pipeline's ranks waited in reductions pipeline 0 never issues, learning
    only at the refusing process's end (a StallError naming no cause) or the collective timeout (20 s here).
    The refusal is published to the data-parallel peers (Note [a first-step failure told to the data-parallel
    peers]): every rank raises the refusal's message within 5 s."""
    for rank, out in enumerate(results_of(launched4, "dp peer set-up refusal")):
        for wrap, (seconds, raised) in out.items():
            assert raised is not None and "split the batch into different numbers of micro-batches: " \
                "n_microbatches=4 at stage 0 (rank 0 of the pipeline's group), n_microbatches=8 at stage 1" \
                in raised, (rank, wrap, raised)
            assert seconds < 5, (rank, wrap, seconds, raised)


def _failures_counted(schedule) -> int:
    """The failed steps this rank counted in its stage's data-parallel group, for a peer's wait (Note [the next
    step waits until the peers were told] in fusedist/pipelining/told_peers.py)."""
    from fusedist.pipelining import told_peers
    from fusedist.reliability import monitor

    comm = told_peers.reduction_comms(schedule._stage.submod)[0]
    dp_monitor = next(m for m in list(monitor._monitors) if m.comm is comm)
    return told_peers._published(dp_monitor, comm.rank)


def _dp_pipeline(seed, pp_size, wrap, shapes_given, refused):
    """A pp=``pp_size`` x dp mesh's stage under fusedist DDP or fully_shard over dp, and its 1F1B schedule, whose
    loss refuses a micro-batch of targets all 777."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.pipelining import PipelineStage

    world = torch.distributed.get_world_size()
    if pp_size == 1:  # (init_device_mesh's dp dim would be the default group, given up by an earlier case)
        from torch.distributed.device_mesh import DeviceMesh

        singles = [torch.distributed.new_group([r]) for r in range(world)]
        groups = [singles[torch.distributed.get_rank()], torch.distributed.new_group(list(range(world)))]
        mesh = DeviceMesh.from_group(groups, "cpu", mesh=torch.arange(world).view(1, world),
                                     mesh_dim_names=("pp", "dp"))
    else:
        mesh = init_device_mesh("cpu", (pp_size, world // pp_size), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    module = _stage_module(pp.get_local_rank(), pp_size, seed)
    wrapped = (fusedist.DistributedDataParallel(module, process_group=dp.get_group())
               if wrap == "DistributedDataParallel" else fusedist.fully_shard(module, mesh=dp))
    shapes = {"input_args": (torch.empty(2, WIDTH),), "output_args": (torch.empty(2, WIDTH),)}
    stage = PipelineStage(wrapped, pp.get_local_rank(), pp_size, torch.device("cpu"), group=pp.get_group(),
                          **(shapes if shapes_given else {}))

    def loss_fn(o, t):
        if bool((t == 777).all()):
            raise ValueError(f"the target of micro-batch {refused} is refused")
        return ((o - t) ** 2).mean()

    return pp, dp, pipelining.Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)


def _dp_batch(seed, dp):
    g = torch.Generator().manual_seed(seed + dp.get_local_rank())
    return torch.randn(2 * MICRO_BATCHES, WIDTH, generator=g), torch.randn(2 * MICRO_BATCHES, WIDTH, generator=g)


def _dp_step(schedule, pp, x, y):
    """One step of the schedule: the first stage takes the inputs, the last the targets."""
    first, last = pp.get_local_rank() == 0, pp.get_local_rank() == pp.size() - 1
    return schedule.step(*((x,) if first else ()), **({"target": y} if last else {}))


def _collective_error_in_chain(error):
    """The text of the fusedist collective's error that ``error`` was raised from, else None."""
    from fusedist.comm import CollectiveError

    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, CollectiveError):
            return str(error)
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _failure_entries_left():
    """Which of this rank's groups still hold its entry of a failure told elsewhere (the store key the
    divergence probe reads)."""
    import json

    from fusedist.reliability import monitor, stall_report

    left = []
    for m in list(monitor._monitors):
        key = stall_report._key(m.group_name, m.generation, m.comm.rank)
        if m.store is not None and m.store.check([key]) and "failed_elsewhere" in json.loads(m.store.get(key)):
            left.append(m.group_name)
    return left


def test_a_failure_in_one_pipeline_fails_every_data_parallel_pipeline_promptly(launched4):
    """pp=2 x dp=2, stage modules under fusedist DDP or fully_shard over dp; global rank 2 (stage 1 of
    pipeline 0) fails in its loss at micro-batch 2. Its data-parallel peer waited in a reduction it never
    issues, and every rank in a cycle behind it, until the collective timeout (20 s here); now every rank
    raises the failure's own message (stage, ranks, micro-batch, exception) shortly after the divergence
    probe's delay (0.5 s here), and no entry of it is left in the store."""
    told = ("stage 1 (rank 1 of the pipeline's group, global rank 2) failed at micro-batch 2's loss: ValueError: "
            "the target of micro-batch 2 is refused")
    for rank, out in enumerate(results_of(launched4, "dp peer failure")):
        for wrap, (seconds, raised, left, collective, counted) in out.items():
            assert raised is not None and told in raised, (rank, wrap, raised)
            # every rank failed the step (told at its end): counted once, so that a peer that published it does
            # not wait for this one at its next step -- but the peer that gave the group up when told, whose
            # failure entry there answers that wait
            assert counted == (0 if rank == 3 else 1), (rank, wrap, counted)
            assert seconds < 6, (rank, wrap, seconds, raised)
            assert left == [], (rank, wrap, left)  # withdrawn once told: a later wait is probed as before
            if rank == 3:  # (the failed rank's data-parallel peer: its reduction's wait ended by the probe)
                # Note [a peer that failed elsewhere, in the divergence probe]: the peer's failure, not "diverged"
                verdict, _, report = (collective or "").partition("\nStall report")
                assert "cannot complete on rank 1 of 2 (global rank 3): rank 0 (global rank 2) failed elsewhere: " \
                    in verdict and told in verdict and "programs diverged" not in verdict, (wrap, collective)
                # the report lists the failed peer as failed, not as a rank at a collective or one behind
                assert "FAILED outside this group's collectives" in report and "programs diverged" not in report \
                    and "behind" not in report, (wrap, collective)


def test_a_first_step_failure_at_micro_batch_0_fails_every_data_parallel_pipeline_promptly(launched4):
    """As above, at micro-batch 0 of the first step, which the pipeline tells by its shape inference's notices
    (Note [a shape inference that fails on one rank]) or, where the stages were given their shapes, by the
    first sends' (Note [a first send that cannot be made, told upstream]): global ranks 2 and 0 raised at once,
    while their data-parallel peers waited in reductions they never issue until the collective timeout (20 s
    here; the process's end where it does not catch the error). The ranks raising from those notices publish
    the failure first (Note [a first-step failure told to the data-parallel peers]): every rank raises the
    failure's own message shortly after the probe's delay (0.5 s here); the peers' waits were ended by the
    probe, naming it."""
    cause = "ValueError: the target of micro-batch 0 is refused"
    told = {"DistributedDataParallel": "shape inference (backward) failed at stage 1 (rank 1 of the pipeline's "
                                       f"group): {cause}",
            "fully_shard, shapes given": "stage 1 (rank 1 of the pipeline's group, global rank 2) failed at "
                                         f"micro-batch 0's loss: {cause}"}
    per_rank = results_of(launched4, "dp peer first step failure")
    for rank, out in enumerate(per_rank):
        assert set(out) == set(told), (rank, out)
        for case, (seconds, raised, left, collective, counted) in out.items():
            assert counted == (1 if rank in (0, 2) else 0), (rank, case, counted)  # (published; the peers gave up)
            assert raised is not None and told[case] in raised, (rank, case, raised)
            assert raised == per_rank[2][case][1], (rank, case, raised)  # the failing rank's own message
            assert seconds < 10, (rank, case, seconds, raised)  # (the collective timeout: 20 s)
            if rank in (1, 3):  # (the failing pipeline's data-parallel peers)
                assert "failed elsewhere: " in (collective or "") and told[case] in collective, (rank, case, collective)
            else:  # kept: the pipeline refuses every later step, and each peer that read it gave the group up
                assert left, (rank, case, left)


def _recovered_first_step_worker(rank, world_size, seed):
    """pp=2 x dp=2 under fusedist DDP, the stages' shapes inferred by the first step: every pipeline's last stage
    refuses micro-batch 0 of the first step (the shape inference fails; each rank catches the error and goes
    on); then a step every rank takes; then one global rank 3 begins twice the probe's delay late, its
    data-parallel peer (global rank 2) waiting for it in the reduction. Per step, this rank's error; whether
    its data-parallel group still holds its failure entry after the good step; the third step's seconds."""
    pp, dp, schedule = _dp_pipeline(seed, 2, "DistributedDataParallel", False, 0)
    suffix = f"-pg{dp.get_group().group_name}"
    out = {"errors": []}
    for step in range(3):
        x, y = _dp_batch(seed + step, dp)
        if step == 0 and pp.get_local_rank() == 1:
            y[:2] = 777  # micro-batch 0's rows, on both pipelines
        torch.distributed.barrier()
        if step == 1 and dp.get_local_rank() == 0:
            time.sleep(0.3 * float(PROMPT_PROBE["FUSEDIST_DIVERGENCE_PROBE_S"]))  # (pipeline 1 retries first)
        if step == 2 and rank == 3:
            time.sleep(2 * float(PROMPT_PROBE["FUSEDIST_DIVERGENCE_PROBE_S"]))  # a slow data loader
        began = time.monotonic()
        try:
            _dp_step(schedule, pp, x, y)
            out["errors"].append(None)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            out["errors"].append(str(e))
        if step == 1:
            out["left"] = [name for name in _failure_entries_left() if name.endswith(suffix)]
            out["retry seconds"] = time.monotonic() - began
        out["seconds"] = time.monotonic() - began
    return out


def test_a_caught_first_step_failure_is_not_told_to_the_peers_once_training_goes_on(launched4):
    """Note [a failure entry withdrawn at the next launch] (fusedist/reliability/failed_elsewhere.py): every
    pipeline's shape inference fails at the first step, every rank catches the error and trains on. Each rank's
    failure entry stayed in its data-parallel group for good: a later wait blocked past the probe's delay (a
    peer 1 s late, the delay 0.5 s) was told the old failure, "rank 1 (global rank 3) failed elsewhere", and
    gave the group up. Now the next step's reductions withdraw the entries, and the late step completes on every
    rank, as torch's DDP waits for a late peer."""
    cause = "ValueError: the target of micro-batch 0 is refused"
    per_rank = results_of(launched4, "recovered first step")
    for rank, out in enumerate(per_rank):
        first, good, late = out["errors"]
        assert first is not None and cause in first and "shape inference" in first, (rank, first)
        assert good is None and late is None, (rank, good, late)
        assert out["left"] == [], (rank, out["left"])
        # every pipeline failed alike: no retry waits for its peers to be told (Note [the next step waits until
        # the peers were told] in fusedist/pipelining/told_peers.py)
        assert out["retry seconds"] < float(PROMPT_PROBE["FUSEDIST_DIVERGENCE_PROBE_S"]) + MARGIN_S, (rank, out)
    assert per_rank[2]["seconds"] > float(PROMPT_PROBE["FUSEDIST_DIVERGENCE_PROBE_S"]), per_rank[2]  # it waited


def _retry_racing_peer_worker(rank, world_size, seed, steps=2, late_s=0.0):
    """pp=2 x dp=2 under fusedist DDP, the stages' shapes inferred by the first step: pipeline 0 (global ranks 0
    and 2) refuses micro-batch 0 of the first step (its shape inference fails), catches the error and takes the
    next step at once, while pipeline 1 is still in its first step's reductions -- or, with ``late_s``, still
    computing it: its loss of micro-batch 1 takes ``late_s`` seconds more. Per step, this rank's error (None
    where the step returned and the optimizer stepped) and its seconds; the stage's parameters after the last
    step, and the unpipelined model's after no step and after one mixing pipeline 0's second step with pipeline
    1's first."""
    pp, dp, schedule = _dp_pipeline(seed, 2, "DistributedDataParallel", False, 0)
    module = schedule._stage.submod.module
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    out = {"errors": [], "seconds": []}
    if late_s and dp.get_local_rank() == 1 and pp.get_local_rank() == 1:
        schedule._loss_fn = _late_at_call(schedule._loss_fn, 3, late_s)  # (the inference's call, micro-batches 0, 1)
    for step in range(steps):
        x, y = _dp_batch(seed + step, dp)
        if step == 0 and dp.get_local_rank() == 0 and pp.get_local_rank() == 1:
            y[:2] = 777  # micro-batch 0's rows, pipeline 0 only
        began = time.monotonic()
        try:
            _dp_step(schedule, pp, x, y)
            opt.step()
            out["errors"].append(None)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            out["errors"].append(str(e))
        opt.zero_grad()
        out["seconds"].append(time.monotonic() - began)
    stage = pp.get_local_rank()
    out["params"] = [p.detach().clone() for p in module.parameters()]
    out["untrained"], out["offset"] = _sgd_reference(seed, stage, []), _sgd_reference(seed, stage, [(1, 0)])
    return out


def _late_at_call(loss_fn, call: int, seconds: float):
    """``loss_fn``, ``seconds`` slower at its ``call``-th call."""
    calls = itertools.count(1)

    def late(output, target):
        if next(calls) == call:
            time.sleep(seconds)
        return loss_fn(output, target)

    return late


def _sgd_reference(seed, stage, pairs) -> list:
    """Stage ``stage``'s parameters of the 2-stage model trained unpipelined with SGD (lr 0.1), one step per pair
    (pipeline 0's step, pipeline 1's step) on those steps' batches, as _dp_batch gives them."""
    modules = [_stage_module(i, 2, seed) for i in range(2)]
    whole = nn.Sequential(*modules)
    opt = torch.optim.SGD(whole.parameters(), lr=0.1)
    for steps in pairs:
        batches = [_dp_batch(seed + s, _DataRank(r)) for r, s in enumerate(steps)]
        (sum(((whole(x) - y) ** 2).mean() for x, y in batches) / len(batches)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in modules[stage].parameters()]


class _DataRank:
    """What _dp_batch reads of a data-parallel mesh dimension: data rank ``r``."""

    def __init__(self, r):
        self.r = r

    def get_local_rank(self):
        return self.r


def test_a_first_step_failure_retried_at_once_is_told_before_the_next_reductions(launched4):
    """Note [the next step waits until the peers were told] (fusedist/pipelining/told_peers.py): pipeline 0's
    failed first step is caught and retried at once. Its retry's reductions withdrew its failure entry before
    pipeline 1's probe (0.5 s) read it and paired with pipeline 1's reductions of the failed step: pipeline 1's
    first step returned, every rank applied one step mixing pipeline 0's second batch with pipeline 1's first
    (the parameters matched that unpipelined step to 1e-8), and only the next forward's step check named it.
    Now the retry waits until the peers were told: every rank's first step raises the failure, the retry fails
    at once naming it, and no rank applies a step (its parameters are the unpipelined model's, untrained)."""
    cause = "shape inference (backward) failed at stage 1 (rank 1 of the pipeline's group): ValueError: the target " \
            "of micro-batch 0 is refused"
    for rank, out in enumerate(results_of(launched4, "retry racing peer")):
        first, retry = out["errors"]
        assert first is not None and cause in first, (rank, first)
        assert retry is not None, (rank, out["errors"])
        if rank in (0, 2):  # (pipeline 0: its retry's reductions meet peers that gave the group up)
            assert "had given their group up when told of its failure in the step before" in retry \
                and cause in retry, (rank, retry)
        else:
            assert "the previous step raised before its end" in retry, (rank, retry)
        assert max(out["seconds"]) < 10, (rank, out["seconds"])  # (the collective timeout: 20 s)
        assert all(torch.equal(p, q) for p, q in zip(out["params"], out["untrained"])), (
            rank, max((p - q).abs().max().item() for p, q in zip(out["params"], out["offset"])))


def test_a_retried_step_is_refused_on_every_rank_where_a_peer_reaches_its_reductions_late(launched4):
    """Note [the next step waits until the peers were told] (fusedist/pipelining/told_peers.py): as above, but
    pipeline 1 reaches its first step's reductions a second after the wait's former bound (the probe's 0.5 s and
    MARGIN_S). Pipeline 0's retry went on at that bound, its reductions paired with pipeline 1's of the failed
    step: both steps returned, every rank applied one optimizer step mixing pipeline 0's second batch with
    pipeline 1's first, and the next forward's step check named it by a count of forwards. Now the retry waits
    until pipeline 1 reaches its reductions and is told: every rank's first step raises the failure, the retry
    raises naming both steps, and no rank applies a step."""
    cause = "shape inference (backward) failed at stage 1 (rank 1 of the pipeline's group): ValueError: the target " \
            "of micro-batch 0 is refused"
    for rank, out in enumerate(results_of(launched4, "retry past the wait")):
        first, retry = out["errors"]
        assert first is not None and cause in first, (rank, first)
        assert retry is not None, (rank, out["errors"])
        if rank in (0, 2):
            assert "had given their group up when told of its failure in the step before (step #1; this is step #2" \
                in retry and cause in retry, (rank, retry)
        else:
            assert "the previous step raised before its end" in retry, (rank, retry)
        assert max(out["seconds"]) < 10, (rank, out["seconds"])  # (the collective timeout: 20 s)
        assert all(torch.equal(p, q) for p, q in zip(out["params"], out["untrained"])), (
            rank, max((p - q).abs().max().item() for p, q in zip(out["params"], out["offset"])))


def test_a_one_rank_pipelines_failure_fails_its_data_parallel_peers_promptly(launched2):
    """Note [a one-rank pipeline's failure told to its data-parallel peers]: pp=1 x dp=2 (each rank a pipeline of
    one stage), rank 0's loss refuses micro-batch 0 of the first step, inferring the shapes (DDP) or given them
    (fully_shard), and it catches the error. Its peer waited in a reduction rank 0 never issues until the
    collective timeout (20 s here); now it fails shortly after the probe's delay (0.5 s), its error naming rank
    0's failure."""
    told = {"DistributedDataParallel": "shape inference (backward) failed at stage 0 (rank 0 of the pipeline's "
                                       "group): ValueError: the target of micro-batch 0 is refused",
            "fully_shard, shapes given": "stage 0 (rank 0 of the pipeline's group) failed at micro-batch 0's loss: "
                                         "ValueError: the target of micro-batch 0 is refused"}
    per_rank = results_of(launched2, "one-rank pipeline failure")
    for rank, out in enumerate(per_rank):
        assert set(out) == set(told), (rank, out)
        for case, (seconds, raised, left, collective, counted) in out.items():
            assert counted == (1 if rank in (0, 2) else 0), (rank, case, counted)  # (published; the peers gave up)
            assert raised is not None, (rank, case)
            assert seconds < 10, (rank, case, seconds, raised)  # (the collective timeout: 20 s)
            if rank == 1:
                assert "cannot complete on rank 1 of 2: rank 0 failed elsewhere: " in (collective or "") \
                    and told[case] in collective, (case, collective)


def _no_sync_worker(rank, world_size, seed):
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    out = {}
    from fusedist.ddp.replicate import wrapper_of

    for wrap in ("fully_shard", "DistributedDataParallel", "replicate"):
        module = _stage_module(pp.get_local_rank(), 2, seed)
        if wrap == "fully_shard":
            for block in module:
                fusedist.fully_shard(block, mesh=dp)
            stage_module = fusedist.fully_shard(module, mesh=dp)
        elif wrap == "replicate":
            stage_module = fusedist.replicate(module, device_mesh=dp)
        else:
            stage_module = fusedist.DistributedDataParallel(module, process_group=dp.get_group())
        stage = PipelineStage(stage_module, pp.get_local_rank(), 2, torch.device("cpu"), group=pp.get_group())
        schedule = pipelining.Schedule1F1B(stage, n_microbatches=MICRO_BATCHES,
                                           loss_fn=lambda o, t: ((o - t) ** 2).mean())
        g = torch.Generator().manual_seed(seed + dp.get_local_rank())

        def step():
            x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
            schedule.step(x) if pp.get_local_rank() == 0 else schedule.step(target=y, losses=[])

        step()  # (the first step infers the stages' shapes)
        if wrap == "fully_shard":
            issued = _count_reduce_scatters(module)
            stage_module.set_requires_gradient_sync(False)
            step()
            stage_module.set_requires_gradient_sync(True)
        elif wrap == "replicate":
            issued = _count_all_reduces(wrapper_of(module))
            stage_module.set_requires_gradient_sync(False)
            step()
            stage_module.set_requires_gradient_sync(True)
        else:
            issued = _count_all_reduces(stage_module)
            with stage_module.no_sync():
                step()
        out[wrap] = [sum(1 for t in issued if t != "ddp step check")]
        step()  # synchronized: the sum of both steps reduced once
        out[wrap].append(sum(1 for t in issued if t != "ddp step check"))
    return out


def test_a_users_own_no_sync_holds_over_the_pipeline_step(launched4):
    """Accumulating across steps (``set_requires_gradient_sync(False)``, DDP's ``no_sync``) is
    the user's: fusedist's stage does not reduce at the step's last backward then; the next
    synchronized step reduces the sum once per unit or bucket."""
    per_rank = results_of(launched4, "no sync")
    for rank, out in enumerate(per_rank):
        assert out == {"fully_shard": [0, BLOCKS_PER_STAGE], "DistributedDataParallel": [0, 1],
                       "replicate": [0, 1]}, (rank, out)


def _short_step_worker(rank, world_size, wrap):
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    if wrap == "fully_shard":
        wrapped = fusedist.fully_shard(m, mesh=mesh["dp"])
    else:
        wrapped = fusedist.DistributedDataParallel(m, process_group=mesh["dp"].get_group())
    stage = PipelineStage(wrapped, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = pipelining.ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda o, t: (o - t).square().mean())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    schedule.step(x, target=y, losses=[])
    opt.step()
    opt.zero_grad()
    stage.clear_runtime_states()  # a step of 4 forwards and 3 backwards: the last never synchronizes
    losses = [(stage.forward_one_chunk(i, (x[2 * i:2 * i + 2],), {}) - y[2 * i:2 * i + 2]).square().mean()
              for i in range(4)]
    for i in range(3):
        stage.backward_one_chunk(i, loss=losses[i], last_backward=False)
    with pytest.raises(RuntimeError, match="In a pipeline stage: the schedule's step ran fewer backwards than micro"):
        opt.step()


@pytest.mark.parametrize("wrap", ["fully_shard", "ddp"])
def test_a_step_short_of_its_last_backward_is_refused_naming_the_pipeline(wrap, launched2):
    """README: a step that runs fewer backwards than micro-batches leaves the gradients
    unreduced, and the optimizer step is refused -- with advice a pipeline user can act on."""
    results_of(launched2, f"short step {wrap}")


def _refused(call):
    """The message of the RuntimeError ``call()`` raised, or None."""
    try:
        call()
    except RuntimeError as e:
        return str(e)
    return None


def _uneven_worker(rank, world_size, seed, schedule_name):
    """A 2-stage pipeline (stage ``rank`` on rank ``rank``): a good step, a batch the buffers
    were not sized for (refused on the first stage, before anything is sent), a micro-batch and
    an output of another shape by hand, then a step on the first stage again, refused: its last
    step raised before its end (Note [a step that raised]). Returns the errors and the stage's
    weights against the unpipelined model's after the good step."""
    from torch.distributed import pipelining

    from fusedist.pipelining import PipelineStage

    def build():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())

    whole, model = build(), build()
    part = model[2 * rank:2 * rank + 2]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))

    def mse(out, target):
        return (out - target).square().mean()

    schedule = getattr(pipelining, schedule_name)(stage, n_microbatches=MICRO_BATCHES, loss_fn=mse)
    opt, ref_opt = torch.optim.SGD(part.parameters(), lr=0.1), torch.optim.SGD(whole.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    errors = []

    def batch(rows):
        return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)

    def good_step():
        x, y = batch(8)
        schedule.step(*((x,) if rank == 0 else ()), **({} if rank == 0 else {"target": y, "losses": []}))
        opt.step()
        opt.zero_grad()
        mse(whole(x), y).backward()  # micro-batches of equal size: the mean of their means
        ref_opt.step()
        ref_opt.zero_grad()

    good_step()
    x, y = batch(10)  # 4 micro-batches of 3, 3, 2, 2 rows; the buffers hold 2
    began = time.monotonic()
    errors.append(_refused(lambda: schedule.step(x) if rank == 0 else schedule.step(target=y)))
    errors.append(time.monotonic() - began)
    if rank == 0:  # (the stage after it only ever sees its fixed buffers: it skips these)
        stage.clear_runtime_states()
        stage.forward_one_chunk(0, (x[:2],), {})  # (no schedule: nothing is sent)
        errors.append(_refused(lambda: stage.forward_one_chunk(1, (x[2:5],), {})))
        stage.clear_runtime_states()
        trim = part.register_forward_hook(lambda module, args, out: out[:1])  # an output of another shape
        errors.append(_refused(lambda: stage.forward_one_chunk(0, (x[:2],), {})))
        trim.remove()
        stage.clear_runtime_states()
        assert all(p.grad is None for p in part.parameters())
    errors.append(_refused(good_step))  # (refused before anything is sent, on both ranks)
    return errors, _max_diff([part.state_dict()], [whole[2 * rank:2 * rank + 2].state_dict()])


@pytest.mark.parametrize("schedule_name", ["ScheduleGPipe", "Schedule1F1B"])
def test_a_micro_batch_of_another_shape_is_refused_naming_stage_and_shapes(schedule_name, launched2):
    """torch's stages receive into buffers sized from micro-batch 0 of the first step: a batch
    that n_microbatches does not divide (or a later batch of another size) failed far away
    (gloo aborting the receiver, or the loss's "size of tensor a (3) must match b (2)"). The
    first stage refuses it before sending, naming the stage, the micro-batch, both shapes and
    the fix; the good step before it trains as the unpipelined model (fp32 sums of the same terms
    in another order: 1e-6). The second stage's rank, in the same step, raises the same refusal
    within 5 s (it waited for the group's timeout: Note [a failure told at the step's end]), and
    each rank's next step is refused (Note [a step that raised])."""
    seed = launched2["seed"]
    steps = set()
    for rank, (errors, diff) in enumerate(results_of(launched2, f"uneven {schedule_name}")):
        assert diff < 1e-6, (rank, diff, seed)
        step, seconds, *by_hand_and_output, later = errors
        steps.add(step)
        assert None not in errors and seconds < 5, errors  # (Note [a failure told at the step's end])
        assert f"stage {rank} (rank {rank}): the previous step raised before its end" in later, later
        assert "refuses every later step" in later, later
        if rank == 1:
            assert by_hand_and_output == []
            continue
        by_hand, output = by_hand_and_output
        assert f"stage 0, micro-batch 0: input 0 has shape (3, {WIDTH})" in step, step
        assert f"expected (2, {WIDTH})" in step and f"divisible by n_microbatches ({MICRO_BATCHES})" in step, step
        assert "drop_last=True" in step, step
        assert f"stage 0, micro-batch 1: input 0 has shape (3, {WIDTH})" in by_hand, by_hand
        assert f"stage 0, micro-batch 0: output 0 has shape (1, {WIDTH})" in output, output
    assert len(steps) == 1, steps  # the second stage's rank raises the first stage's refusal


def _uneven_first_step_worker(rank, world_size, seed):
    """A 2-stage GPipe pipeline (stage ``rank`` on rank ``rank``) whose first step gets 10 rows:
    what the step raised and in how many seconds, whether any gradient was written, whether a
    weight moved."""
    from torch.distributed.pipelining import ScheduleGPipe

    from fusedist.pipelining import PipelineStage

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
    part = model[2 * rank:2 * rank + 2]
    before = {k: v.clone() for k, v in part.state_dict().items()}
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES, loss_fn=lambda o, t: (o - t).square().mean())
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(10, WIDTH, generator=g), torch.randn(10, WIDTH, generator=g)
    began = time.monotonic()
    raised = _refused(lambda: schedule.step(x) if rank == 0 else schedule.step(target=y))
    seconds = time.monotonic() - began
    written = any(p.grad is not None for p in part.parameters())
    moved = any(not torch.equal(before[k], v) for k, v in part.state_dict().items())
    return raised, seconds, written, moved


def test_an_uneven_first_step_is_refused_by_the_first_stage_naming_the_micro_batch(launched2):
    """torch's stages size their receive buffers from micro-batch 0 of the first step, the largest
    of ``tensor_split``'s uneven split (3, 3, 2, 2 rows of 10), so the first smaller micro-batch did
    not fit them: under torch's own stage the last stage's loss failed on it ("The size of tensor a
    (3) must match the size of tensor b (2)"), far from the cause, or gloo aborted the receiver. The
    refusal comes from the first stage before that micro-batch is sent, names it and both shapes;
    the first stage's weights are untouched (GPipe runs every forward before any backward: no
    gradient was written). The second stage's rank, which waited for the group's timeout, raises the
    same refusal within 5 s (Note [a failure told at the step's end] in
    fusedist/pipelining/step_status.py), not the loss's mismatch on the zeros it was sent."""
    seed = launched2["seed"]
    (first, seconds, written, moved), (second, seconds_after, _, moved_after) = results_of(
        launched2, "uneven first step")
    assert f"stage 0, micro-batch 2: input 0 has shape (2, {WIDTH})" in first, (seed, first)
    assert f"expected (3, {WIDTH})" in first and f"divisible by n_microbatches ({MICRO_BATCHES})" in first, first
    assert "drop_last=True" in first, first
    assert not written and not moved and not moved_after, (seed, written, moved, moved_after)
    assert second == first and seconds < 5 and seconds_after < 5, (seed, second, seconds, seconds_after)


def _one_rank_uneven_worker(rank, world_size, seed):
    """Each rank a pipeline of its own (2 stages, interleaved 1F1B, a one-rank group): a batch of
    10 rows (micro-batches of 3, 3, 2, 2) through torch's stages and through fusedist's, then
    fusedist's (the same schedule) with batches of 8 and 12 rows. Returns fusedist's refusal, torch's gradients
    against the batch's and against the mean of the micro-batches' means, and fusedist's
    gradients after the good steps against the batch's."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage as TorchStage

    from fusedist.pipelining import PipelineStage

    group = [torch.distributed.new_group([r]) for r in range(world_size)][rank]
    g = torch.Generator().manual_seed(seed + rank)

    def build():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())

    def mse(out, target):
        return (out - target).square().mean()

    def pipeline(cls):
        model = build()
        stages = [cls(model[2 * i:2 * i + 2], i, 2, torch.device("cpu"), group=group) for i in range(2)]
        return model, stages, pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES, loss_fn=mse)

    def grads_against(model, x, y, split: bool) -> float:
        whole = build()
        if split:  # what torch's schedule computes: the mean of the micro-batches' means
            for xc, yc in zip(x.tensor_split(MICRO_BATCHES), y.tensor_split(MICRO_BATCHES)):
                (mse(whole(xc), yc) / MICRO_BATCHES).backward()
        else:
            mse(whole(x), y).backward()
        return max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), whole.parameters()))

    x, y = torch.randn(10, WIDTH, generator=g), torch.randn(10, WIDTH, generator=g)
    theirs_model, _, theirs = pipeline(TorchStage)
    theirs.step(x, target=y)
    torch_vs_batch, torch_vs_means = (grads_against(theirs_model, x, y, split) for split in (False, True))
    model, stages, ours = pipeline(PipelineStage)
    refused = _refused(lambda: ours.step(x, target=y))
    after = []
    for rows in (8, 12):  # (a later batch of another size is passed as it is: left alone)
        model.zero_grad(set_to_none=True)
        x, y = torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)
        ours.step(x, target=y)
        after.append(grads_against(model, x, y, False))
    return refused, torch_vs_batch, torch_vs_means, max(after)


def test_uneven_micro_batches_on_one_rank_are_refused(launched2):
    """Note [uneven micro-batches on one rank]: torch's schedules run a batch that n_microbatches
    does not divide when every stage is on one rank, weighting each micro-batch's mean loss
    alike (the sum of their gradients divided by n_microbatches): not the batch's gradient, by
    ~1e-2 here, and a batch the same pipeline over several ranks refuses. fusedist's first stage
    refuses it naming the micro-batch and both shapes; batches that split evenly, of any size,
    then give the batch's gradient (fp32, the same terms summed in another order: 1e-6)."""
    seed = launched2["seed"]
    for rank, (refused, torch_vs_batch, torch_vs_means, after) in enumerate(
            results_of(launched2, "uneven on one rank")):
        assert torch_vs_means < 1e-6 and torch_vs_batch > 1e-3, (seed, rank, torch_vs_means, torch_vs_batch)
        assert refused is not None, (seed, rank)
        assert f"stage 0, micro-batch 2: input 0 has shape (2, {WIDTH}), micro-batch 0 of this step (3, {WIDTH})" \
            in refused, refused
        assert f"divisible by n_microbatches ({MICRO_BATCHES})" in refused and "drop_last=True" in refused, refused
        assert "the next step drops their losses" in refused, refused
        assert after < 1e-6, (seed, rank, after)


def _one_rank_summed_loss_worker(rank, world_size, seed):
    """Each rank a pipeline of its own (2 stages, interleaved 1F1B, a one-rank group, ``scale_grads=False``,
    a loss that sums): a batch of 10 rows (micro-batches of 3, 3, 2, 2) through torch's stages and through
    fusedist's. Returns, per stage class, the largest gradient difference from the unpipelined model's on
    the batch relative to its largest gradient, or the message of a refusal."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage as TorchStage

    from fusedist.pipelining import PipelineStage

    group = [torch.distributed.new_group([r]) for r in range(world_size)][rank]
    g = torch.Generator().manual_seed(seed + rank)
    x, y = torch.randn(10, WIDTH, generator=g), torch.randn(10, WIDTH, generator=g)

    def build():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())

    def summed(out, target):
        return (out - target).square().sum()

    whole = build()
    summed(whole(x), y).backward()
    largest = max(float(q.grad.abs().max()) for q in whole.parameters())
    out = {}
    for name, cls in (("torch", TorchStage), ("fusedist", PipelineStage)):
        model = build()
        stages = [cls(model[2 * i:2 * i + 2], i, 2, torch.device("cpu"), group=group) for i in range(2)]
        schedule = pipelining.ScheduleInterleaved1F1B(
            stages, n_microbatches=MICRO_BATCHES, loss_fn=summed, scale_grads=False)
        refused = _refused(lambda: schedule.step(x, target=y))
        out[name] = refused if refused is not None else max(
            float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), whole.parameters())) / largest
    return out


def test_uneven_micro_batches_of_a_summed_loss_on_one_rank_give_the_batchs_gradient(launched2):
    """Note [uneven micro-batches on one rank]: a schedule built with ``scale_grads=False`` divides
    nothing, so with a loss that sums (as torch's schedules document for it) micro-batches of 3, 3, 2
    and 2 rows add up to the batch's gradient: torch's stage gives it, and fusedist's did not run the
    step (it refused the uneven split as for a mean loss). fp32, the same terms summed in another
    order: 1e-6 of the largest gradient."""
    seed = launched2["seed"]
    for rank, out in enumerate(results_of(launched2, "summed loss on one rank")):
        assert isinstance(out["torch"], float) and out["torch"] < 1e-6, (seed, rank, out)
        assert isinstance(out["fusedist"], float) and out["fusedist"] < 1e-6, (seed, rank, out)


# ----------------------------------------------------------------------------- shared spawns
# One spawn per world size runs the scenarios of the tests selected (a 4-rank spawn costs
# ~8 s of starting ranks), each with a fresh dynamo (compiled blocks recompile as in a spawn
# of their own). One random seed per spawn, named in the failures.
SKIPPING = {"Schedule1F1B": 1, "ScheduleInterleavedZeroBubble": 2}
PROMPT_PROBE = {"FUSEDIST_DIVERGENCE_PROBE_S": "0.5", "FUSEDIST_TIMEOUT_S": "20"}  # (the failure scenarios, last)


@pytest.fixture(scope="module")
def launched4(request, tmp_path_factory):
    seed = int(torch.randint(0, 10_000, ()).item())
    root = str(tmp_path_factory.mktemp("stages"))
    jobs = with_fresh_compiler({
        "test_pipeline_stages_of_fully_shard_reduce_once_per_step_and_match_fsdp2": {"stages": (_worker, seed, root)},
        "test_zero_bubble_schedules_train_as_the_unsharded_model": {"zero bubble": (_zero_bubble_worker, seed)},
        "test_zero_bubble_with_compiled_or_checkpointed_blocks_trains_as_1f1b": {
            "block variants": (_blocks_variant_worker, seed)},
        "test_a_block_skipped_in_the_last_micro_batch_still_reduces_its_sum": {
            f"skipping {name}": (_skipping_worker, 11, name, n) for name, n in SKIPPING.items()},
        "test_stages_of_fusedist_ddp_reduce_once_per_step": {"ddp": (_ddp_worker, seed)},
        "test_a_users_own_no_sync_holds_over_the_pipeline_step": {"no sync": (_no_sync_worker, seed)},
        "test_zero_bubble_trains_a_stage_after_a_frozen_one": {
            "after a frozen stage": (_after_a_frozen_stage_worker, seed)},
        "test_zero_bubble_trains_weights_whose_paths_go_around_the_inputs": {
            "around the inputs": (_around_the_inputs_worker, seed)},
        "test_a_failure_in_one_pipeline_fails_every_data_parallel_pipeline_promptly": {  # (last: it fails a step)
            "dp peer failure": (under_env, PROMPT_PROBE, _dp_peer_failure_worker, seed)},
        "test_a_first_step_failure_at_micro_batch_0_fails_every_data_parallel_pipeline_promptly": {  # (it too)
            "dp peer first step failure": (under_env, PROMPT_PROBE, _dp_peer_failure_worker, seed, 0,
                                           (("DistributedDataParallel", False), ("fully_shard", True)))},
        "test_a_caught_first_step_failure_is_not_told_to_the_peers_once_training_goes_on": {  # (it too)
            "recovered first step": (under_env, PROMPT_PROBE, _recovered_first_step_worker, seed)},
        "test_a_first_step_failure_retried_at_once_is_told_before_the_next_reductions": {  # (it too)
            "retry racing peer": (under_env, PROMPT_PROBE, _retry_racing_peer_worker, seed)},
        "test_a_retried_step_is_refused_on_every_rank_where_a_peer_reaches_its_reductions_late": {  # (it too)
            "retry past the wait": (under_env, PROMPT_PROBE, _retry_racing_peer_worker, seed, 2,
                                    float(PROMPT_PROBE["FUSEDIST_DIVERGENCE_PROBE_S"]) + MARGIN_S + 1.0)},
        "test_a_pipelines_set_up_refusal_fails_its_data_parallel_peers_promptly": {  # (it too)
            "dp peer set-up refusal": (under_env, PROMPT_PROBE, _dp_setup_refusal_worker, seed)},
    })
    return {"seed": seed, **launch_for_selected(request, jobs, 4, timeout=600)}


@pytest.fixture(scope="module")
def launched8(request, tmp_path_factory):
    seed = int(torch.randint(0, 10_000, ()).item())
    root = tmp_path_factory.mktemp("stages_3d")
    for kind in ("tp", "hsdp"):
        (root / kind).mkdir()
    jobs = with_fresh_compiler({"test_3d_pipeline_stages_match_fsdp2": {
        kind: (_worker_3d, kind, seed, str(root / kind)) for kind in ("tp", "hsdp")}})
    return {"seed": seed, **launch_for_selected(request, jobs, 8, timeout=500)}


@pytest.fixture(scope="module")
def launched2(request):
    seed = int(torch.randint(0, 10_000, ()).item())
    jobs = with_fresh_compiler({
        "test_a_last_weight_pass_that_computes_nothing_still_reduces_the_sum": {
            f"empty weight pass {wrap}": (_empty_weight_pass_worker, 3, wrap)
            for wrap in ("fully_shard", "DistributedDataParallel")},
        "test_a_step_short_of_its_last_backward_is_refused_naming_the_pipeline": {
            f"short step {wrap}": (_short_step_worker, wrap) for wrap in ("fully_shard", "ddp")},
        "test_a_micro_batch_of_another_shape_is_refused_naming_stage_and_shapes": {
            f"uneven {name}": (_uneven_worker, seed, name) for name in ("ScheduleGPipe", "Schedule1F1B")},
        "test_uneven_micro_batches_on_one_rank_are_refused": {
            "uneven on one rank": (_one_rank_uneven_worker, seed)},
        "test_uneven_micro_batches_of_a_summed_loss_on_one_rank_give_the_batchs_gradient": {
            "summed loss on one rank": (_one_rank_summed_loss_worker, seed)},
        "test_an_uneven_first_step_is_refused_by_the_first_stage_naming_the_micro_batch": {
            "uneven first step": (_uneven_first_step_worker, seed)},
        "test_a_one_rank_pipelines_failure_fails_its_data_parallel_peers_promptly": {  # (last: it fails a step)
            "one-rank pipeline failure": (under_env, PROMPT_PROBE, _dp_peer_failure_worker, seed, 0,
                                          (("DistributedDataParallel", False), ("fully_shard", True)), 1)},
    })
    return {"seed": seed, **launch_for_selected(request, jobs, 2, timeout=300)}
