"""Pipeline steps that fail, and the set-aside of a step's gradients (fusedist/pipelining/__init__.py,
fusedist/pipelining/inference.py, fusedist/pipelining/step_failures.py), on gloo:

- Note [a step that raised]: torch's schedules keep the losses of a step that raised and hand
  them to the next step's backwards. On a pipeline whose stages are all on one rank the next
  step now runs as a fresh schedule's (reference: a fresh schedule over a fresh copy of the
  model on the same batches); torch's stage, the same way, was off by ~0.1. On a pipeline over
  two ranks, every rank refuses its later steps instead of pairing its messages with the
  other's leftovers.
- Note [a shape inference that fails on one rank]: a stage module returning something other
  than tensors was refused on its own rank only (so was a target of the wrong shape in the first
  step, by the last stage's loss); the other rank waited for its metadata until the process
  group's timeout. Both ranks now raise at once, with the same message naming the stage (and
  the type), the process group stays usable, and the next good step trains.
- Note [accumulating over synchronized pipeline steps]: after ``zero_grad(set_to_none=False)``
  nothing is copied (counted), which gradients are zeros is read at the step's first backward,
  not its first forward, and the weights still follow torch's SGD on the unpipelined model.
- Note [a first send that cannot be made]: with user-given shapes, a stage returning what it
  cannot send fails both ranks at once (the receiver waited for the group's timeout), and the
  status message ahead of the first activations leaves training and eval as unpipelined.
- Note [a step that raised], one rank: the BatchNorm statistics are put back too (torch's stage
  kept the failed step's update), and the schedule is still found under a stage class with three
  ``clear_runtime_states`` overrides and with a second schedule over the same stage.
- Note [the buffers a failed step puts back]: a large fixed buffer is no longer copied at every step, and a
  buffer first updated in the failing step is put back too (from its snapshot), BatchNorm statistics alike; on a
  pipeline over both ranks (one stage per rank, or two) a failure told to every rank now puts every rank's
  buffers back as the step found them, where the forwards' updates were kept.
- Note [examples that need no gradient] (fusedist/pipelining/inference.py): user-given examples made without
  ``requires_grad`` broke the first training step (a backward error on one rank, the other waiting); the
  pipeline now trains and evaluates as the unpipelined model.
- Note [a failure told at the step's end, several stages per rank] (fusedist/pipelining/schedule_step.py): with two
  stages per rank (interleaved 1F1B, looped BFS, ZBV), a failing forward, backward or loss left the other rank
  waiting for the group's timeout; every rank now raises at once, and Note [the failure told, of several]
  (fusedist/pipelining/step_status.py): the message told is the failure on real inputs, not one on the zeros sent.

Tolerances: fp32 gradients of the same terms summed in another order (micro-batch means), 1e-6;
the defects move them by 1e-2 or more.
"""

from __future__ import annotations

import copy
import sys
import time

import pytest
import torch
from torch import nn

from pipeline_stage_kinds import largest_difference, stages_of_each_kind
from shared_rank_launch import launch_for_selected, refused as _refused, results_of

WIDTH, MICRO_BATCHES = 8, 4


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())


def _cross_entropy(out, target):
    return nn.functional.cross_entropy(out, target)


def _mse(out, target):
    return (out - target).square().mean()


def _one_rank_pipeline(stage_cls, seed, schedule_name, group):
    """The model split over 2 stages on this rank (interleaved 1F1B), or 1 stage (GPipe)."""
    from torch.distributed import pipelining

    model = _model(seed)
    if schedule_name == "ScheduleGPipe":
        stage = stage_cls(model, 0, 1, torch.device("cpu"), group=group)
        return model, pipelining.ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES, loss_fn=_cross_entropy)
    stages = [stage_cls(model[2 * i:2 * i + 2], i, 2, torch.device("cpu"), group=group) for i in range(2)]
    return model, pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES, loss_fn=_cross_entropy)


def _step_after_a_failed_one_worker(rank, world_size, seed, schedule_name):
    """Each rank a pipeline of its own (a one-rank group): per stage class, one good step before
    (or none), a step whose target has a class out of range in micro-batch 2, then a good step;
    the gradients' largest difference from a fresh schedule's good steps on the same batches."""
    from torch.distributed.pipelining import PipelineStage as TorchStage

    from fusedist.pipelining import PipelineStage

    group = [torch.distributed.new_group([r]) for r in range(world_size)][rank]
    g = torch.Generator().manual_seed(seed + rank)
    out = {}
    for before in (0, 1):
        batches = [(torch.randn(8, WIDTH, generator=g), torch.randint(0, WIDTH, (8,), generator=g))
                   for _ in range(before + 1)]
        bad_x, bad_y = torch.randn(8, WIDTH, generator=g), torch.randint(0, WIDTH, (8,), generator=g)
        bad_y[5] = WIDTH  # micro-batch 2 (rows 4, 5): its loss raises after two losses were kept
        fresh_model, fresh = _one_rank_pipeline(PipelineStage, seed, schedule_name, group)
        for x, y in batches:
            fresh.step(x, target=y)
        for name, cls in (("torch", TorchStage), ("fusedist", PipelineStage)):
            model, schedule = _one_rank_pipeline(cls, seed, schedule_name, group)
            for x, y in batches[:-1]:
                schedule.step(x, target=y)
            raised = _refused(lambda: schedule.step(bad_x, target=bad_y))
            assert raised is not None and "out of bounds" in raised, raised
            good = _refused(lambda: schedule.step(batches[-1][0], target=batches[-1][1]))
            if good is not None:  # (torch's stage may backpropagate a kept loss twice: that raises)
                assert name == "torch", good
                out[name, before] = float("inf")
                continue
            out[name, before] = max(float((p.grad - q.grad).abs().max())
                                    for p, q in zip(model.parameters(), fresh_model.parameters()))
    return out


def _fails_on_every_rank_worker(rank, world_size, schedule_name, bad_stage):
    """A 2-rank pipeline one of whose stages returns something other than tensors: what each rank
    raised, in how many seconds, whether the process group still works afterwards, and what the
    next step raised once the module returns a tensor."""
    from torch.distributed import pipelining

    from fusedist.pipelining import PipelineStage

    class Returns(nn.Module):
        def __init__(self, wrong: bool):
            super().__init__()
            self.lin, self.wrong = nn.Linear(WIDTH, WIDTH), wrong

        def forward(self, x):
            h = self.lin(x)
            return {"hidden": h} if self.wrong else h

    per_rank = 2 if schedule_name == "ScheduleInterleaved1F1B" else 1
    indices = [rank + 2 * k for k in range(per_rank)]
    stages = [PipelineStage(Returns(i == bad_stage), i, 2 * per_rank, torch.device("cpu")) for i in indices]
    schedule = getattr(pipelining, schedule_name)(stages if per_rank > 1 else stages[0],
                                                  n_microbatches=MICRO_BATCHES, loss_fn=_mse)
    began = time.monotonic()
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    raised = _refused(lambda: schedule.step(x) if rank == 0 else schedule.step(target=y))
    seconds = time.monotonic() - began
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    for stage in stages:  # the module fixed: the next step runs (its inference again)
        stage.submod.wrong = False
    again = _refused(lambda: schedule.step(x) if rank == 0 else schedule.step(target=y))
    return raised, seconds, float(total), again


def _bad_first_target_worker(rank, world_size, seed):
    """A 2-rank GPipe pipeline whose first step has a target of the wrong width: what each rank
    raised and in how many seconds; then a good step's gradients against the unpipelined model's."""
    from torch.distributed.pipelining import ScheduleGPipe

    from fusedist.pipelining import PipelineStage

    whole, model = _model(seed), _model(seed)
    part = model[2 * rank:2 * rank + 2]
    schedule = ScheduleGPipe(PipelineStage(part, rank, 2, torch.device("cpu")), n_microbatches=MICRO_BATCHES,
                             loss_fn=_mse)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
    began = time.monotonic()
    raised = _refused(lambda: schedule.step(x) if rank == 0 else schedule.step(target=torch.randn(8, WIDTH + 1)))
    seconds = time.monotonic() - began
    schedule.step(x) if rank == 0 else schedule.step(target=y)
    _mse(whole(x), y).backward()
    diff = max(float((p.grad - q.grad).abs().max())
               for p, q in zip(part.parameters(), whole[2 * rank:2 * rank + 2].parameters()))
    return raised, seconds, diff


def _sharded_stage_after_a_failed_step_worker(rank, world_size, seed):
    """pp 1 x dp 2, a fully_shard stage under 1F1B: a step whose loss raises on micro-batch 2 on
    both data-parallel ranks, after two backwards accumulated unreduced; what the next step
    raised, and whether it left the gradients as they were."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    model = fusedist.fully_shard(_model(seed), mesh=mesh["dp"])
    schedule = Schedule1F1B(PipelineStage(model, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group()),
                            n_microbatches=MICRO_BATCHES, loss_fn=_cross_entropy)
    g = torch.Generator().manual_seed(seed + rank)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randint(0, WIDTH, (8,), generator=g)
    bad = y.clone()
    bad[5] = WIDTH
    first = _refused(lambda: schedule.step(x, target=bad))
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    second = _refused(lambda: schedule.step(x, target=y))
    same = all((a is None and p.grad is None) or (a is not None and torch.equal(a, p.grad))
               for a, p in zip(grads, model.parameters()))
    return first, second, same


def _count_forward(module, args) -> None:
    module.forwards.add_(1)


def _ended_stage_in_a_failed_step_worker(rank, world_size, seed):
    """pp 1 x dp 2, two stages on the rank (interleaved 1F1B), the same batches on both ranks; stage 1's module
    plain, fusedist's or torch's fully_shard: a good step, then (accumulating) a step whose stage 0 raises in
    its backward of the last micro-batch (after stage 1's part of the step ended), then a good step. Per kind:
    what the failed and the next step raised, and (a plain stage 1) the gradients' largest difference from the
    unpipelined model's on the good batches and its forwards counted by a buffer, or (a sharded one) whether
    the refused step left its gradients as they were."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    wraps = {"plain": lambda m: m, "fully_shard": lambda m: fusedist.fully_shard(m, mesh=mesh["dp"]),
             "torch fully_shard": lambda m: torch_fully_shard(m, mesh=mesh["dp"])}
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)) for _ in range(3)]
    out = {}
    for kind, wrap in wraps.items():
        model = _model(seed)
        if kind == "plain":  # a buffer each forward of stage 1 updates (the failed step's are put back)
            model[2].register_buffer("forwards", torch.zeros((), dtype=torch.int64))
            model[2].register_forward_pre_hook(_count_forward)
        stages = [PipelineStage(m, i, 2, torch.device("cpu"), group=mesh["pp"].get_group())
                  for i, m in enumerate((model[:2], wrap(model[2:])))]
        schedule = pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES, loss_fn=_mse)
        schedule.step(batches[0][0], target=batches[0][1])  # (its gradients kept: the failed step finds them)
        breaking = model[0].weight.register_hook(_breaking_at(MICRO_BATCHES - 1))  # stage 0's last backward
        failed = _refused(lambda: schedule.step(batches[1][0], target=batches[1][1]))
        breaking.remove()
        held = [None if p.grad is None else p.grad.clone() for p in model[2:].parameters()]
        following = _refused(lambda: schedule.step(batches[2][0], target=batches[2][1]))
        if kind == "plain":
            whole = _model(seed)
            for x, y in (batches[0], batches[2]):  # (equal micro-batches: the mean of their means)
                _mse(whole(x), y).backward()
            outcome = (max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(),
                                                                                  whole.parameters())),
                       int(model[2].forwards))
        else:
            outcome = all((a is None and p.grad is None) or (a is not None and torch.equal(a, p.grad))
                          for a, p in zip(held, model[2:].parameters()))
        out[kind] = (failed, following, outcome)
    return out


def _zeroed_gradients_worker(rank, world_size, seed):
    """pp 1 x dp 2 under GPipe, per stage kind: two optimizer steps, each after a step that
    starts from gradients zeroed in place and a second step accumulating; per step, the number of
    gradients its set-aside copied and the stage's forwards before the host first read tensor
    values in the step; and the weights' difference from torch's SGD."""
    import fusedist.pipelining.set_aside as set_aside
    import fusedist.pipelining.stage as pipelining

    taken, reads = [], []
    pairs, tolist = pipelining._SetAside.pairs, torch.Tensor.tolist

    def counted(self):
        first = self._pairs is None
        out = pairs(self)
        if first:
            taken.append(sum(before is not None for _, before in out))
        return out

    def read(tensor):  # a host read of tensor values by the pipeline stage's own code
        stage = current[0]
        if stage is not None and stage._step is not None and sys._getframe(1).f_code.co_filename in own_files:
            reads.append(stage._step.forwards)
        return tolist(tensor)

    current, own_files = [None], {pipelining.__file__, set_aside.__file__}
    pipelining._SetAside.pairs, torch.Tensor.tolist = counted, read
    out = {}
    try:
        for kind, ours, theirs, wrapped, schedule, opt, ref_opt in stages_of_each_kind(
                _model, seed, MICRO_BATCHES, _mse):
            g = torch.Generator().manual_seed(seed)
            taken.clear()
            first_reads = []
            current[0] = schedule._stage
            for _ in range(2):
                for _ in range(2):
                    xs = [torch.randn(8, WIDTH, generator=g) for _ in range(world_size)]
                    ys = [torch.randn(8, WIDTH, generator=g) for _ in range(world_size)]
                    reads.clear()
                    schedule.step(xs[rank], target=ys[rank])
                    first_reads.append(min(reads, default=None))
                    _mse(theirs(torch.cat(xs)), torch.cat(ys)).backward()
                for o in (opt, ref_opt):
                    o.step()
                    o.zero_grad(set_to_none=False)
            current[0] = None
            out[kind] = (list(taken), first_reads, largest_difference(kind, wrapped, ours, theirs))
    finally:
        pipelining._SetAside.pairs, torch.Tensor.tolist = pairs, tolist
    return out


class _Returns(nn.Module):
    """A linear layer whose forward returns the kind of value ``wrong`` names (a tensor if None)."""

    def __init__(self, wrong=None):
        super().__init__()
        self.lin, self.wrong = nn.Linear(WIDTH, WIDTH), wrong

    def forward(self, x):
        h = self.lin(x)
        return {"dict": {"hidden": h}, "none": None, "tuple": (h, 3), "two": (h, h)}.get(self.wrong, h)


def _user_shapes_schedule(rank, schedule_name, modules, grads_in=True, grads_out=True):
    """A 2-rank pipeline of ``modules`` (stage ``i`` on rank ``i % 2``), every stage given its shapes: the
    examples of later stages' inputs require a gradient if ``grads_in``, of the outputs if ``grads_out``."""
    from torch.distributed import pipelining

    from fusedist.pipelining import PipelineStage

    def example(requires_grad):  # (torch took from it whether a gradient is sent back for the tensor)
        return torch.zeros(8 // MICRO_BATCHES, WIDTH, requires_grad=requires_grad)

    stages = [PipelineStage(modules[i], i, len(modules), torch.device("cpu"), input_args=(example(i > 0 and grads_in),),
                            output_args=(example(grads_out),)) for i in range(rank, len(modules), 2)]
    return getattr(pipelining, schedule_name)(stages if len(stages) > 1 else stages[0],
                                              n_microbatches=MICRO_BATCHES, loss_fn=_mse)


def _first_send_fails_worker(rank, world_size, schedule_name, wrong):
    """Note [a first send that cannot be made]: stage 0 of a 2-rank pipeline with user-given shapes
    returns what ``wrong`` names; what each rank raised, in how many seconds, and whether an
    all_reduce afterwards still works."""
    schedule = _user_shapes_schedule(rank, schedule_name, [_Returns(wrong), _Returns()])
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    began = time.monotonic()
    raised = _refused(lambda: schedule.step(x) if rank == 0 else schedule.step(target=y))
    seconds = time.monotonic() - began
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    return raised, seconds, float(total)


def _user_shapes_train_worker(rank, world_size, seed, schedule_name, grads_in=True, grads_out=True, frozen=False):
    """A 2-rank pipeline with user-given shapes (no inference; the examples needing a gradient as
    ``grads_in``/``grads_out`` say; stage 0 frozen if ``frozen``): a training step, an eval step (the stages
    set up anew) and a training step; the gradients' and the eval outputs' largest differences from the
    unpipelined model's on the same batches."""
    n = 4 if schedule_name == "ScheduleInterleaved1F1B" else 2
    torch.manual_seed(seed)
    whole = nn.Sequential(*[_Returns() for _ in range(n)])
    whole[0].requires_grad_(not frozen)
    modules = [copy.deepcopy(whole[i]) for i in range(n)]
    schedule = _user_shapes_schedule(rank, schedule_name, modules, grads_in, grads_out)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)) for _ in range(2)]
    out = []
    for i, (x, y) in enumerate(batches):
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        _mse(whole(x), y).backward()
        if i == 0:
            evaluated = schedule.eval(x) if rank == 0 else schedule.eval(target=y)
            if rank == 1:
                with torch.no_grad():
                    out.append(float((evaluated - whole(x)).abs().max()))
    out.append(max(float((modules[i].lin.weight.grad - whole[i].lin.weight.grad).abs().max())
                   if whole[i].lin.weight.requires_grad else float(modules[i].lin.weight.grad is not None)
                   for i in range(rank, n, 2)))
    return out


def _batch_norm_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh())


def _batch_norm_after_a_failed_step_worker(rank, world_size, seed, schedule_name):
    """Each rank a pipeline of its own (a one-rank group) of a model with BatchNorm, per stage class:
    a step whose micro-batch 2 has a target out of range, then a good step; the largest differences
    of the running statistics (and batch counts) and of the gradients from the unpipelined model's
    on the good step's micro-batches alone."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage as TorchStage

    from fusedist.pipelining import PipelineStage

    group = [torch.distributed.new_group([r]) for r in range(world_size)][rank]
    g = torch.Generator().manual_seed(seed + rank)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randint(0, WIDTH, (8,), generator=g)
    bad_x, bad_y = torch.randn(8, WIDTH, generator=g) * 3 + 1, torch.randint(0, WIDTH, (8,), generator=g)
    bad_y[5] = WIDTH  # micro-batch 2 (rows 4, 5): its loss raises after the forwards ran
    reference = _batch_norm_model(seed)
    for xm, ym in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
        (_cross_entropy(reference(xm), ym) / MICRO_BATCHES).backward()
    out = {}
    for name, cls in (("torch", TorchStage), ("fusedist", PipelineStage)):
        model = _batch_norm_model(seed)
        if schedule_name == "ScheduleGPipe":
            schedule = pipelining.ScheduleGPipe(cls(model, 0, 1, torch.device("cpu"), group=group),
                                                n_microbatches=MICRO_BATCHES, loss_fn=_cross_entropy)
        else:
            stages = [cls(model[3 * i:3 * i + 3], i, 2, torch.device("cpu"), group=group) for i in range(2)]
            schedule = pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES,
                                                          loss_fn=_cross_entropy)
        raised = _refused(lambda: schedule.step(bad_x, target=bad_y))
        assert raised is not None and "out of bounds" in raised, raised
        good = _refused(lambda: schedule.step(x, target=y))
        if good is not None:  # (torch's stage may backpropagate a kept loss twice: that raises)
            assert name == "torch", good
            out[name] = (float("inf"), float("inf"))
            continue
        stats = max(float((a.double() - b.double()).abs().max())
                    for a, b in zip(model.buffers(), reference.buffers()))
        grads = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
        out[name] = (stats, grads)
    return out


class _Counting(nn.Module):
    """A linear layer scaled by a large fixed buffer it only reads (a rotary-like cache), and a count it
    updates in place only while ``counting`` is set (from the failing step on: a buffer first updated there)."""

    def __init__(self):
        super().__init__()
        self.lin, self.counting = nn.Linear(WIDTH, WIDTH), False
        self.register_buffer("cache", torch.rand(64, WIDTH) + 0.5)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.counting:
            self.count.add_(1)
        return self.lin(x) * self.cache[: x.shape[0]]


def _counting_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(_Counting(), nn.BatchNorm1d(WIDTH), nn.Tanh(), _Counting(), nn.BatchNorm1d(WIDTH), nn.Tanh())


def _buffers_after_a_failed_step_worker(rank, world_size, seed, schedule_name):
    """Note [the buffers a failed step puts back]: each rank a pipeline of its own of ``_counting_model``: a
    good step, the counts switched on, a step whose micro-batch 2 has a target out of range, then a good step
    (gradients zeroed after the first); the largest differences of the buffers and gradients from the
    unpipelined model's on the good steps' micro-batches, and the copies of the fixed caches taken in the
    last two steps."""
    from torch.distributed import pipelining

    from fusedist.pipelining import PipelineStage

    group = [torch.distributed.new_group([r]) for r in range(world_size)][rank]
    g = torch.Generator().manual_seed(seed + rank)
    batches = [(torch.randn(8, WIDTH, generator=g), torch.randint(0, WIDTH, (8,), generator=g)) for _ in range(3)]
    batches[1][1][5] = WIDTH  # micro-batch 2 (rows 4, 5): its loss raises after the forwards ran
    model, reference = _counting_model(seed), _counting_model(seed)
    if schedule_name == "ScheduleGPipe":
        schedule = pipelining.ScheduleGPipe(PipelineStage(model, 0, 1, torch.device("cpu"), group=group),
                                            n_microbatches=MICRO_BATCHES, loss_fn=_cross_entropy)
    else:
        stages = [PipelineStage(model[3 * i:3 * i + 3], i, 2, torch.device("cpu"), group=group) for i in range(2)]
        schedule = pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES, loss_fn=_cross_entropy)
    clone, cache_copies = torch.Tensor.clone, []

    def counted(tensor, *args, **kwargs):
        if tensor.shape == (64, WIDTH):
            cache_copies.append(tuple(tensor.shape))
        return clone(tensor, *args, **kwargs)

    try:
        for i, (x, y) in enumerate(batches):
            if i == 1:
                for m in (model, reference):
                    m.zero_grad(set_to_none=True)
                    m[0].counting = m[3].counting = True
                torch.Tensor.clone = counted
            raised = _refused(lambda: schedule.step(x, target=y))
            assert (raised is None) == (i != 1) and (i != 1 or "out of bounds" in raised), (i, raised)
            if i != 1:
                for xm, ym in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
                    (_cross_entropy(reference(xm), ym) / MICRO_BATCHES).backward()
    finally:
        torch.Tensor.clone = clone
    stats = max(float((a.double() - b.double()).abs().max()) for a, b in zip(model.buffers(), reference.buffers()))
    grads = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
    return stats, grads, len(cache_copies), int(model[0].count)


def _counting_blocks(seed: int, n: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(_Counting(), nn.BatchNorm1d(WIDTH), nn.Tanh()) for _ in range(n)])


def _buffers_across_ranks_worker(rank, world_size, seed, schedule_name):
    """Note [the buffers a failed step puts back], a pipeline over both ranks (one stage per rank, or two): a good
    step, the counts switched on, a step whose micro-batch 2 has a target out of range; what the rank raised, the
    largest difference of its stage modules' buffers from those the failed step found, their counts, and the
    copies of the fixed caches the failed step took."""
    several = schedule_name not in ("ScheduleGPipe", "Schedule1F1B")
    n = 2 * world_size if several else world_size
    blocks = _counting_blocks(seed, n)
    indices = _stage_indices(schedule_name, rank, world_size) if several else [rank]
    if several:
        stages, schedule = _several_stages(schedule_name, rank, world_size, {i: blocks[i] for i in indices},
                                           _cross_entropy)
    else:
        from torch.distributed import pipelining

        from fusedist.pipelining import PipelineStage

        stages = [PipelineStage(blocks[rank], rank, n, torch.device("cpu"))]
        schedule = getattr(pipelining, schedule_name)(stages[0], n_microbatches=MICRO_BATCHES,
                                                      loss_fn=_cross_entropy)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, WIDTH, generator=g), torch.randint(0, WIDTH, (8,), generator=g)) for _ in range(2)]
    batches[1][1][5] = WIDTH  # micro-batch 2 (rows 4, 5): the last stage's loss raises
    assert _refused(lambda: _several_stages_step(schedule, stages, *batches[0])) is None
    for i in indices:
        blocks[i][0].counting = True
    before = [b.clone() for i in indices for b in blocks[i].buffers()]
    clone, cache_copies = torch.Tensor.clone, []

    def counted(tensor, *args, **kwargs):
        if tensor.shape == (64, WIDTH):
            cache_copies.append(tuple(tensor.shape))
        return clone(tensor, *args, **kwargs)

    torch.Tensor.clone = counted
    try:
        raised = _refused(lambda: _several_stages_step(schedule, stages, *batches[1]))
    finally:
        torch.Tensor.clone = clone
    after = [b for i in indices for b in blocks[i].buffers()]
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(before, after))
    counts = [int(blocks[i][1].num_batches_tracked) for i in indices] + [int(blocks[i][0].count) for i in indices]
    return raised, diff, counts, len(cache_copies)


def _overridden_clearing_worker(rank, world_size, seed):
    """A one-rank pipeline (Schedule1F1B) whose stage class overrides ``clear_runtime_states`` three
    times over fusedist's (a user's subclass of two mixins, each calling ``super()``), and a second
    schedule over the same stage: per schedule order, a step whose micro-batch 2's loss raises, an
    eval step of the other schedule, then a good step; the gradients' largest difference from the
    unpipelined model's on the good batch."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from fusedist.pipelining import PipelineStage

    class Logging(PipelineStage):
        def clear_runtime_states(self):
            self.cleared = getattr(self, "cleared", 0) + 1
            super().clear_runtime_states()

    class Timing(Logging):
        def clear_runtime_states(self):
            super().clear_runtime_states()

    class UserStage(Timing):
        def clear_runtime_states(self):
            super().clear_runtime_states()

    group = [torch.distributed.new_group([r]) for r in range(world_size)][rank]
    g = torch.Generator().manual_seed(seed + rank)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randint(0, WIDTH, (8,), generator=g)
    bad = y.clone()
    bad[5] = WIDTH
    reference = _model(seed)
    _cross_entropy(reference(x), y).backward()
    out = []
    for train_first in (True, False):
        model = _model(seed)
        stage = UserStage(model, 0, 1, torch.device("cpu"), group=group)
        train = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=_cross_entropy)
        other = ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES, loss_fn=_cross_entropy)
        failing, evaluating = (train, other) if train_first else (other, train)
        raised = _refused(lambda: failing.step(x, target=bad))
        assert raised is not None and "out of bounds" in raised, raised
        evaluating.eval(x, target=y)
        train.step(x, target=y)
        out.append(max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(),
                                                                          reference.parameters())))
    return out


def test_a_step_after_a_failed_one_on_one_rank_is_a_fresh_schedules(launched):
    """Note [a step that raised]: micro-batch 2's loss raises (a class out of range), after the
    schedule kept two losses; the next good step gives a fresh schedule's gradients (from None
    gradients, and on top of an earlier good step's), under GPipe and interleaved 1F1B (which
    has run backwards before the failure). torch's stage backpropagated the kept losses: wrong
    gradients, or (a loss already backpropagated) an error (counted as inf)."""
    seed = launched["seed"]
    for schedule_name in ("ScheduleGPipe", "ScheduleInterleaved1F1B"):
        for rank, out in enumerate(results_of(launched, f"after a failed step {schedule_name}")):
            for before in (0, 1):
                assert out["fusedist", before] < 1e-6, (seed, schedule_name, rank, before, out)
                assert out["torch", before] > 1e-3, (seed, schedule_name, rank, before, out)


@pytest.mark.parametrize("schedule_name,bad_stage", [("ScheduleGPipe", 0), ("ScheduleInterleaved1F1B", 2)])
def test_a_stage_output_that_is_not_a_tensor_fails_every_rank_at_once(schedule_name, bad_stage, launched):
    """Note [a shape inference that fails on one rank]: the stage returning a dict raises, and
    the rank waiting for its metadata raises too, at once (the group's timeout is 30 s), with
    the same message naming the stage and the type; an all_reduce afterwards still works, and so
    does the next step once the module returns a tensor (nothing of the failed step is left)."""
    results = results_of(launched, f"not a tensor {schedule_name}")
    for rank, (raised, seconds, total, again) in enumerate(results):
        assert again is None, (rank, again)
        assert raised is not None and f"failed at stage {bad_stage} " in raised, (rank, raised)
        assert f"stage {bad_stage}'s module returned dict, not a tensor" in raised, (rank, raised)
        assert seconds < 20 and total == 2, (rank, seconds, total)
    assert results[0][0] == results[1][0], results


def test_a_bad_target_in_the_first_step_fails_every_rank_and_the_next_step_trains(launched):
    """Note [a shape inference that fails on one rank]: the last stage's loss raises in torch's
    shape inference (a target of the wrong width); the first stage's rank, waiting for the input
    gradients' metadata, raises at once with the same message (it waited for the group's
    timeout). The step left nothing unmatched, so the next step runs, and its gradients are the
    unpipelined model's (fp32, micro-batch means: 1e-6)."""
    seed = launched["seed"]
    results = results_of(launched, "bad first target")
    for rank, (raised, seconds, diff) in enumerate(results):
        assert raised is not None and "shape inference (backward) failed at stage 1 (rank 1" in raised, (rank, raised)
        assert seconds < 20 and diff < 1e-6, (seed, rank, seconds, diff)
    assert results[0][0] == results[1][0], results


def test_a_sharded_stage_after_a_failed_step_with_backwards_is_refused(launched):
    """Note [a step that raised]: on one pipeline rank a fully_shard stage's failed step had
    accumulated two micro-batches' gradients unreduced, which fusedist cannot put back: the next
    step is refused, naming the stage and what the step did, and leaves the gradients alone
    (torch's stage handed the kept losses to the next step's backwards)."""
    for rank, (first, second, same) in enumerate(results_of(launched, "sharded stage after a failed step")):
        assert first is not None and "out of bounds" in first, (rank, first)
        assert second is not None and "stage 0 (rank" in second and "2 backward passes" in second, (rank, second)
        assert "cannot be put back" in second and "restart from the last checkpoint" in second, second
        assert same, rank


def test_a_stage_whose_part_ended_in_a_failed_step_is_put_back_or_refused(launched):
    """Note [a stage that ended in a step that raised]: two stages on the rank, stage 0 raising in its backward of
    the last micro-batch after stage 1's part of the step had ended (its gradients reduced and divided). That
    stage kept the failed step's gradients and the next step added its own, silently (1e-2 to 1e-1 off),
    whatever its module. Now a plain stage 1 gets them back (the good step's, set aside) and the next step
    gives the unpipelined model's gradients of the two good batches (fp32, the same terms in another order:
    1e-6), its buffers those of the good steps; a fully_shard one (fusedist's or torch's) refuses the next
    step, naming why, and leaves its gradients as they were."""
    seed = launched["seed"]
    for rank, out in enumerate(results_of(launched, "ended stage in a failed step")):
        for kind, (failed, following, outcome) in out.items():
            assert failed is not None and "stage backward" in failed, (seed, rank, kind, failed)  # (torch's words)
            if kind == "plain":
                assert following is None and outcome[0] < 1e-6, (seed, rank, kind, following, outcome)
                assert outcome[1] == 2 * MICRO_BATCHES, (rank, outcome)  # the good steps' forwards only
                continue
            assert following is not None and "stage 1 (rank" in following, (seed, rank, kind, following)
            assert "raised at another stage of this rank after this stage's part of it had ended" in following \
                and "cannot be put back" in following, (rank, kind, following)
            assert outcome, (seed, rank, kind)


def test_zeroed_gradients_are_not_copied_at_a_step(launched):
    """Note [accumulating over synchronized pipeline steps]: a step starting from gradients
    zeroed in place copies none; the next step, accumulating, copies each gradient it reaches
    (so the count is of something); the weights follow torch's SGD on the unpipelined model.
    Which gradients are zeros is read at the step's first backward (GPipe: after its 4 forwards),
    not at its first forward, where the read made the host wait for the device every step
    (counted: host reads of tensor values by the stage's own code, fusedist/pipelining/stage.py and
    fusedist/pipelining/set_aside.py)."""
    seed = launched["seed"]
    for rank, out in enumerate(results_of(launched, "zeroed gradients")):
        for kind, (copies, first_reads, diff) in out.items():
            assert diff < 1e-6, (seed, rank, kind, diff)
            assert copies[0] == copies[2] == 0 and copies[1] > 0 and copies[3] > 0, (rank, kind, copies)
            # (None: a step with no gradients to read -- the first; ZeRO-2's zero_grad drops its shards)
            assert set(first_reads) <= {None, MICRO_BATCHES} and MICRO_BATCHES in first_reads, (rank, kind, first_reads)


@pytest.mark.parametrize("schedule_name,wrong,got", [
    ("ScheduleGPipe", "dict", "its module returned a dict"), ("Schedule1F1B", "none", "its module returned None"),
    ("ScheduleGPipe", "tuple", "output 1 of the tuple its module returned is an int"),
    ("Schedule1F1B", "two", "its module returned 2 tensors")])
def test_a_first_send_that_cannot_be_made_fails_every_rank_at_once(schedule_name, wrong, got, launched):
    """Note [a first send that cannot be made]: with shapes given to the stages (no inference),
    stage 0 returning something it cannot send raised on its own rank only (torch's stage: an
    AttributeError from inside the send), and the next rank waited for the activations until the
    group's timeout (30 s). Both ranks now raise at once the same message, naming the stage, what
    it returned and the output_args expected; the process group still works."""
    results = results_of(launched, f"first send {schedule_name} {wrong}")
    for rank, (raised, seconds, total) in enumerate(results):
        assert raised is not None and "stage 0 (rank 0 of the pipeline's group), micro-batch 0: " in raised, raised
        assert got in raised and "expected 1 tensor ((2, 8) torch.float32, the stage's output_args)" in raised, raised
        assert seconds < 10 and total == 2, (rank, seconds, total)
    assert results[0][0] == results[1][0], results


@pytest.mark.parametrize("schedule_name", ["Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_user_given_shapes_train_and_evaluate_as_the_unpipelined_model(schedule_name, launched):
    """Note [a first send that cannot be made]: the status message ahead of the first activations
    of each set-up (a training step, then an eval step, which sets the stages up anew) leaves the
    results the unpipelined model's: gradients of two steps accumulated, the eval's outputs
    (fp32, micro-batch means summed in another order: 1e-6)."""
    for rank, out in enumerate(results_of(launched, f"user shapes {schedule_name}")):
        assert max(out) < 1e-6, (launched["seed"], rank, out)


@pytest.mark.parametrize("schedule_name,grads_in,grads_out,frozen", [
    ("Schedule1F1B", False, False, False), ("ScheduleInterleaved1F1B", False, False, False),
    ("Schedule1F1B", False, True, False), ("ScheduleGPipe", True, False, False), ("Schedule1F1B", False, False, True)])
def test_user_given_examples_that_need_no_gradient_train_as_the_unpipelined_model(
        schedule_name, grads_in, grads_out, frozen, launched):
    """Note [examples that need no gradient]: with ``output_args`` (and later stages' ``input_args``)
    examples made by ``torch.zeros(shape)``, torch's stage expected no gradient back: the stage's backward
    failed ("grad can be implicitly created only for scalar outputs") and the next rank waited (or, the two
    sides disagreeing, a rank waited for a gradient never sent, until the group's timeout). Now a training
    step, an eval step and a training step give the unpipelined model's gradients and outputs (fp32,
    micro-batch means summed in another order: 1e-6); with stage 0 frozen too (which worked before: its
    output needs no gradient, and the one now sent back is dropped)."""
    scenario = f"no-gradient examples {schedule_name} {grads_in} {grads_out} {frozen}"
    for rank, out in enumerate(results_of(launched, scenario)):
        assert max(out) < 1e-6, (launched["seed"], rank, out)


@pytest.mark.parametrize("schedule_name", ["ScheduleGPipe", "ScheduleInterleaved1F1B"])
def test_a_failed_step_leaves_the_batch_norm_statistics_as_before(schedule_name, launched):
    """Note [a step that raised]: the failed step's forwards updated the BatchNorm running statistics
    (and batch counts), and torch's stage keeps that update; the step after it now starts from the
    statistics the failed step found, as the gradients do: the good step's statistics and gradients
    are the unpipelined model's over the same micro-batches (fp32: 1e-6; the failed step's batch is
    drawn from another distribution, moving the statistics by ~0.1 or more)."""
    seed = launched["seed"]
    for rank, out in enumerate(results_of(launched, f"batch norm after a failed step {schedule_name}")):
        assert max(out["fusedist"]) < 1e-6, (seed, rank, out)
        assert out["torch"][0] > 1e-2, (seed, rank, out)


@pytest.mark.parametrize("schedule_name", ["ScheduleGPipe", "ScheduleInterleaved1F1B"])
def test_a_failed_step_puts_back_buffers_without_copying_fixed_ones_each_step(schedule_name, launched):
    """Note [the buffers a failed step puts back]: every buffer was copied at each step's first forward, a
    large fixed cache too (4 copies of the two caches in the last two steps). Now a cache no step
    updates is not copied again, and the guarantee holds: after a failed step that updated BatchNorm
    statistics and, first there, a count, the next good step's buffers and gradients are the unpipelined
    model's on the good steps' micro-batches (fp32: 1e-6; the count exact)."""
    seed = launched["seed"]
    for rank, out in enumerate(results_of(launched, f"buffers after a failed step {schedule_name}")):
        stats, grads, cache_copies, count = out
        assert stats < 1e-6 and grads < 1e-6 and count == MICRO_BATCHES, (seed, rank, out)
        assert cache_copies == 0, (rank, out)


@pytest.mark.parametrize("schedule_name", ["Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_a_failed_step_across_ranks_puts_back_the_buffers_on_every_rank(schedule_name, launched):
    """Note [the buffers a failed step puts back] on a pipeline over two ranks (one stage per rank, or two): a
    failed step told to every rank left the forwards' updates in the buffers (BatchNorm running statistics and
    batch counts, 4 -> 8 or so; a count first updated in that step). Now every rank's stage modules hold the
    buffers the failed step found, exactly, and the step copied none of the fixed caches (their snapshots were
    taken once, in the first step)."""
    results = results_of(launched, f"buffers across ranks {schedule_name}")
    assert len({raised for raised, *_ in results}) == 1, results
    for rank, (raised, diff, counts, cache_copies) in enumerate(results):
        assert raised is not None and "out of bounds" in raised, (rank, raised)
        k = len(counts) // 2  # (BatchNorm counts: the good step's micro-batches; the counts switched on after it)
        assert diff == 0 and counts == [MICRO_BATCHES] * k + [0] * k, (launched["seed"], rank, diff, counts)
        assert cache_copies == 0, (rank, cache_copies)


def test_a_step_after_a_failed_one_is_found_through_overrides_and_a_second_schedule(launched):
    """Note [a step that raised]: the stage finds the schedule whose step begins by walking out of
    ``clear_runtime_states``; a fixed depth lost it under a stage class with three overrides, and
    the good step after a failed one then backpropagated the failed step's kept losses (off by
    ~0.1, or an error). Now the good step gives the unpipelined model's gradients (fp32: 1e-6),
    also with a second schedule over the same stage stepping in between (either one failing)."""
    for rank, out in enumerate(results_of(launched, "overridden clearing")):
        assert max(out) < 1e-6, (launched["seed"], rank, out)


@pytest.fixture(scope="module")
def launched(request):
    seed = int(torch.randint(0, 10_000, ()).item())
    jobs = {
        "test_a_step_after_a_failed_one_is_found_through_overrides_and_a_second_schedule": {
            "overridden clearing": (_overridden_clearing_worker, (seed,))},
        "test_a_failed_step_puts_back_buffers_without_copying_fixed_ones_each_step": {
            f"buffers after a failed step {name}": (_buffers_after_a_failed_step_worker, (seed, name))
            for name in ("ScheduleGPipe", "ScheduleInterleaved1F1B")},
        "test_a_failed_step_across_ranks_puts_back_the_buffers_on_every_rank": {
            f"buffers across ranks {name}": (_buffers_across_ranks_worker, (seed, name))
            for name in ("Schedule1F1B", "ScheduleInterleaved1F1B")},
        "test_a_failed_step_leaves_the_batch_norm_statistics_as_before": {
            f"batch norm after a failed step {name}": (_batch_norm_after_a_failed_step_worker, (seed, name))
            for name in ("ScheduleGPipe", "ScheduleInterleaved1F1B")},
        "test_a_first_send_that_cannot_be_made_fails_every_rank_at_once": {
            f"first send {name} {wrong}": (_first_send_fails_worker, (name, wrong))
            for name, wrong in (("ScheduleGPipe", "dict"), ("Schedule1F1B", "none"), ("ScheduleGPipe", "tuple"),
                                ("Schedule1F1B", "two"))},
        "test_user_given_shapes_train_and_evaluate_as_the_unpipelined_model": {
            f"user shapes {name}": (_user_shapes_train_worker, (seed, name))
            for name in ("Schedule1F1B", "ScheduleInterleaved1F1B")},
        "test_user_given_examples_that_need_no_gradient_train_as_the_unpipelined_model": {
            f"no-gradient examples {name} {grads_in} {grads_out} {frozen}": (
                _user_shapes_train_worker, (seed, name, grads_in, grads_out, frozen))
            for name, grads_in, grads_out, frozen in (
                ("Schedule1F1B", False, False, False), ("ScheduleInterleaved1F1B", False, False, False),
                ("Schedule1F1B", False, True, False), ("ScheduleGPipe", True, False, False),
                ("Schedule1F1B", False, False, True))},
        "test_a_stage_output_that_is_not_a_tensor_fails_every_rank_at_once": {
            f"not a tensor {name}": (_fails_on_every_rank_worker, (name, bad))
            for name, bad in (("ScheduleGPipe", 0), ("ScheduleInterleaved1F1B", 2))},
        "test_a_step_after_a_failed_one_on_one_rank_is_a_fresh_schedules": {
            f"after a failed step {name}": (_step_after_a_failed_one_worker, (seed, name))
            for name in ("ScheduleGPipe", "ScheduleInterleaved1F1B")},
        "test_a_bad_target_in_the_first_step_fails_every_rank_and_the_next_step_trains": {
            "bad first target": (_bad_first_target_worker, (seed,))},
        "test_a_sharded_stage_after_a_failed_step_with_backwards_is_refused": {
            "sharded stage after a failed step": (_sharded_stage_after_a_failed_step_worker, (seed,))},
        "test_zeroed_gradients_are_not_copied_at_a_step": {"zeroed gradients": (_zeroed_gradients_worker, (seed,))},
        "test_a_stage_whose_part_ended_in_a_failed_step_is_put_back_or_refused": {
            "ended stage in a failed step": (_ended_stage_in_a_failed_step_worker, (seed,))},
        "test_a_step_after_one_that_raised_across_ranks_is_refused_on_every_rank": {
            "failed across ranks": (_failed_across_ranks_worker, (seed,))},
        "test_a_failure_with_several_stages_per_rank_fails_every_rank_at_once": {
            "several stages " + " ".join(map(str, case)): (_several_stages_failure_worker, (seed, *case))
            for case in _SEVERAL},
        "test_the_failure_told_is_the_one_on_real_inputs_not_one_on_the_zeros_sent": {
            "several stages zeros": (_several_stages_failure_worker,
                                     (seed, "ScheduleInterleaved1F1B", 1, "forward", 1, 2, False))},
    }
    return {"seed": seed, **launch_for_selected(request, jobs, 2, timeout=300)}


def _failed_across_ranks_worker(rank, world_size, seed):
    """A 2-rank pipeline (1F1B, stage ``rank`` on rank ``rank``) whose last stage's loss raises on
    micro-batch 2: what each rank's step raised, then what its next step raised, and whether the
    next step left the stage's gradients as they were."""
    from torch.distributed.pipelining import Schedule1F1B

    from fusedist.pipelining import PipelineStage

    part = _model(seed)[2 * rank:2 * rank + 2]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=_cross_entropy)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randint(0, WIDTH, (8,), generator=g)
    bad = y.clone()
    bad[5] = WIDTH

    def step(target):
        return schedule.step(x) if rank == 0 else schedule.step(target=target)

    began = time.monotonic()
    first = _refused(lambda: step(bad))
    seconds = time.monotonic() - began
    grads = [None if p.grad is None else p.grad.clone() for p in part.parameters()]
    second = _refused(lambda: step(y))
    same = all((a is None and p.grad is None) or (a is not None and torch.equal(a, p.grad))
               for a, p in zip(grads, part.parameters()))
    return first, seconds, second, same


def test_a_step_after_one_that_raised_across_ranks_is_refused_on_every_rank(launched):
    """Note [a step that raised]: the last stage's loss raises mid-step; the first stage's rank
    waited for that step's gradients until the group's timeout: now both ranks raise within 5 s the
    same message, naming the stage, the micro-batch and the loss's exception (Note [a failure told
    at the step's end] in fusedist/pipelining/step_status.py). Each rank's next step is refused,
    naming the stage and what the failed step had done, without touching the gradients -- not run
    against the other rank's leftover messages."""
    results = results_of(launched, "failed across ranks")
    for rank, (first, seconds, second, same) in enumerate(results):
        assert first is not None and seconds < 5, (launched["seed"], rank, first, seconds)
        assert "stage 1 (rank 1 of the pipeline's group) failed at micro-batch 2's loss: IndexError" in first, first
        assert second is not None and f"stage {rank} (rank {rank}): the previous step raised before its end" \
            in second, (launched["seed"], rank, second)
        assert "refuses every later step" in second and same, (launched["seed"], rank, second, same)
    assert "out of bounds" in results[1][0] and results[0][0] == results[1][0], results


def test_the_set_aside_measures_gradients_of_several_devices_and_dtypes():
    """Note [accumulating over synchronized pipeline steps]: which gradients held at a step's first forward
    are all zeros (nothing to copy) was measured by stacking every gradient's norm into one tensor: with a
    stage's gradients on several devices that stack raised at the step's first forward. The norms are now
    stacked per device; a gradient with no values to read (meta) counts as not all zeros (copied, never
    read); dtypes mix. Reference: each gradient's own count of nonzeros (NaN is nonzero)."""
    from fusedist.pipelining.set_aside import _SetAside

    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    grads = [torch.zeros(3), torch.randn(4, generator=g).to(torch.bfloat16), torch.zeros(5, device="meta"),
             torch.zeros(2, 3, dtype=torch.float16), torch.tensor([0.0, float("nan")], dtype=torch.float64),
             torch.randn(3, generator=g).to(torch.float16), torch.zeros(0)]
    pairs = _SetAside(grads).pairs()
    assert [grad is held for grad, (held, _) in zip(grads, pairs)] == [True] * len(grads)
    for grad, (_, copy_) in zip(grads, pairs):
        if grad.device.type == "meta":
            assert copy_ is not None and copy_.device.type == "meta"
            continue
        assert (copy_ is None) == (int(torch.count_nonzero(grad)) == 0), (grad, copy_)
        if copy_ is not None:
            assert copy_ is not grad and copy_.dtype == grad.dtype
            assert torch.equal(copy_.nan_to_num(), grad.nan_to_num()), (grad, copy_)


class _Breaking(nn.Module):
    """A linear layer whose forward (or backward) raises at micro-batch ``fail_forward`` (``fail_backward``) of
    a step, counted by ``calls``; with ``refuse_zeros``, whose forward raises on an input of all zeros (a
    user's check of its activations)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.calls, self.fail_forward, self.fail_backward, self.refuse_zeros = 0, None, None, False

    def forward(self, x):
        chunk, self.calls = self.calls, self.calls + 1
        if chunk == self.fail_forward:
            raise ValueError("the stage module broke")
        if self.refuse_zeros and not bool(x.any()):
            raise ValueError("its input was all zeros")
        out = torch.tanh(self.lin(x))
        if chunk == self.fail_backward:
            out.register_hook(_broken_backward)
        return out


def _broken_backward(grad):
    raise ValueError("the backward broke")


def _breaking_at(chunk: int):
    """A weight's gradient hook that raises at its ``chunk``-th call (counted from 0)."""
    calls = iter(range(1 << 30))

    def hook(grad):
        if next(calls) == chunk:
            raise ValueError("the weight's backward broke")

    return hook


def _stage_indices(schedule_name, rank, world_size):
    """The stages rank ``rank`` holds: two per rank, looped (interleaved) or V-shaped (ZBV)."""
    stages = 2 * world_size
    return [rank, stages - 1 - rank] if schedule_name == "ScheduleZBVZeroBubble" else [rank, rank + world_size]


def _several_stages(schedule_name, rank, world_size, modules, loss_fn):
    from torch.distributed import pipelining

    from fusedist.pipelining import PipelineStage

    stages = [PipelineStage(modules[i], i, 2 * world_size, torch.device("cpu")) for i in sorted(modules)]
    return stages, getattr(pipelining, schedule_name)(stages, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)


def _several_stages_step(schedule, stages, x, y, evaluate=False):
    run = schedule.eval if evaluate else schedule.step
    kwargs = {"target": y} if any(s.is_last for s in stages) else {}
    return run(x, **kwargs) if any(s.is_first for s in stages) else run(**kwargs)


def _several_stages_failure_worker(rank, world_size, seed, schedule_name, bad_stage, where, chunk, zeros_stage,
                                   evaluate):
    """Two stages per rank; after a good step, stage ``bad_stage``'s forward, backward or the loss raises at
    micro-batch ``chunk`` (``zeros_stage``: a stage whose forward refuses an all-zeros input): what each rank
    raised and in how many seconds, whether the weights and gradients stayed as the step found them, whether
    an all_reduce works, what the next step raised, and a fresh pipeline's difference from the unpipelined
    model on the same group."""
    torch.manual_seed(seed)
    whole = nn.Sequential(*[_Breaking() for _ in range(2 * world_size)])
    indices = _stage_indices(schedule_name, rank, world_size)
    modules, losses = {i: copy.deepcopy(whole[i]) for i in indices}, {"calls": 0, "fail": None}

    def loss_fn(out, target):
        losses["calls"] += 1
        if losses["calls"] - 1 == losses["fail"]:
            raise ValueError("the loss broke")
        return _mse(out, target)

    stages, schedule = _several_stages(schedule_name, rank, world_size, modules, loss_fn)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)

    def step():
        for module in modules.values():
            module.calls = 0
        losses["calls"] = 0
        return _several_stages_step(schedule, stages, x, y, evaluate)

    step()
    weights = [p.detach().clone() for m in modules.values() for p in m.parameters()]
    grads = [None if p.grad is None else p.grad.clone() for m in modules.values() for p in m.parameters()]
    if bad_stage in modules:
        module = modules[bad_stage]
        module.fail_forward = chunk if where == "forward" else None
        module.fail_backward = chunk if where == "backward" else None
        if where == "weight":  # (zero-bubble: the weight pass of the stage's micro-batch ``chunk``)
            module.lin.weight.register_hook(_breaking_at(chunk))
        losses["fail"] = chunk if where == "loss" else None
    if zeros_stage in modules:
        modules[zeros_stage].refuse_zeros = True
    began = time.monotonic()
    raised = _refused(step)
    seconds = time.monotonic() - began
    now = [p for m in modules.values() for p in m.parameters()]
    kept = all(torch.equal(a, p) for a, p in zip(weights, now)) and all(
        (g is None and p.grad is None) or (g is not None and p.grad is not None and torch.equal(g, p.grad))
        for g, p in zip(grads, now))
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    again = _refused(step)
    fresh = {i: copy.deepcopy(whole[i]) for i in indices}
    fresh_stages, fresh_schedule = _several_stages(schedule_name, rank, world_size, fresh, _mse)
    _several_stages_step(fresh_schedule, fresh_stages, x, y)
    for xm, ym in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
        (_mse(whole(xm), ym) / MICRO_BATCHES).backward()
    diff = max(float((p.grad - q.grad).abs().max()) for i in indices
               for p, q in zip(fresh[i].parameters(), whole[i].parameters()))
    return raised, seconds, kept, float(total), again, diff


# (schedule, failing stage, where, micro-batch, a stage refusing zeros, eval steps; torch's ZBV runs no eval):
# stages 0, 2 on rank 0 and 1, 3 on rank 1 (interleaved, looped); 0, 3 and 1, 2 (ZBV, a V)
_SEVERAL = [("ScheduleInterleaved1F1B", 1, "forward", 2, None, False),
            ("ScheduleInterleaved1F1B", 2, "backward", 1, None, False),
            ("ScheduleInterleaved1F1B", 3, "loss", 3, None, False),
            ("ScheduleZBVZeroBubble", 2, "backward", 0, None, False),
            ("ScheduleZBVZeroBubble", 1, "weight", 2, None, False),
            ("ScheduleLoopedBFS", 1, "forward", 3, None, True)]


@pytest.mark.parametrize("case", _SEVERAL, ids=["-".join(map(str, case)) for case in _SEVERAL])
def test_a_failure_with_several_stages_per_rank_fails_every_rank_at_once(case, launched):
    """Note [a failure told at the step's end, several stages per rank] (fusedist/pipelining/schedule_step.py):
    with two stages per rank (interleaved 1F1B, looped BFS, ZBV zero-bubble), a stage's forward, its backward
    (a zero-bubble weight pass too) or the last stage's loss raising left the other rank waiting for the process
    group's timeout (30 s here). Now every rank raises within 5 s the same message naming the stage, its rank,
    the micro-batch (and loss or backward) and the exception; the weights and gradients are as the step found
    them (nothing divided or applied); the group works; the next step is refused; a fresh pipeline on the group
    gives the unpipelined model's gradients (fp32, micro-batch means summed in another order: 1e-6; a message
    left unmatched would pair other micro-batches' tensors, 1e-2 off or more)."""
    schedule_name, bad_stage, where, chunk, *_ = case
    results = results_of(launched, "several stages " + " ".join(map(str, case)))
    bad_rank = next(r for r in range(2) if bad_stage in _stage_indices(schedule_name, r, 2))
    broke = {"forward": "the stage module broke", "backward": "the backward broke", "loss": "the loss broke",
             "weight": "the weight's backward broke"}[where]
    part = {"forward": "", "backward": "'s backward", "loss": "'s loss", "weight": "'s backward"}[where]
    told = (f"stage {bad_stage} (rank {bad_rank} of the pipeline's group) failed at micro-batch {chunk}{part}: "
            f"ValueError: {broke}")
    assert len({raised for raised, *_ in results}) == 1, results
    for rank, (raised, seconds, kept, total, again, diff) in enumerate(results):
        assert raised is not None and told in raised, (rank, raised)
        assert seconds < 5 and kept and total == 2, (rank, seconds, kept, total)
        assert again is not None and "the previous step raised before its end" in again, (rank, again)
        assert diff < 1e-6, (launched["seed"], rank, diff)


def test_the_failure_told_is_the_one_on_real_inputs_not_one_on_the_zeros_sent(launched):
    """Note [the failure told, of several] (fusedist/pipelining/step_status.py): stage 1 (rank 1) raises at
    micro-batch 1's forward and sends zeros in place of its activations; stage 2 (rank 0) checks its inputs
    and raises on the zeros. The lowest failing rank's message won: every rank raised stage 2's "input was
    all zeros", not the cause. Now every rank raises stage 1's failure, within 5 s, and the group works."""
    results = results_of(launched, "several stages zeros")
    assert len({raised for raised, *_ in results}) == 1, results
    for rank, (raised, seconds, kept, total, again, diff) in enumerate(results):
        assert raised is not None and ("stage 1 (rank 1 of the pipeline's group) failed at micro-batch 1: "
                                       "ValueError: the stage module broke") in raised, (rank, raised)
        assert seconds < 5 and kept and total == 2 and again is not None, (rank, seconds, kept, total, again)
        assert diff < 1e-6, (launched["seed"], rank, diff)
