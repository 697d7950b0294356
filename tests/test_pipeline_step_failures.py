"""Pipeline steps that fail, and the set-aside of a step's gradients (fusedist/pipelining.py,
fusedist/_pipeline_inference.py), on gloo:

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
  nothing is copied (counted), and the weights still follow torch's SGD on the unpipelined model.

Tolerances: fp32 gradients of the same terms summed in another order (micro-batch means), 1e-6;
the defects move them by 1e-2 or more.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed
from pipeline_stage_kinds import largest_difference, stages_of_each_kind
from shared_rank_launch import launch_for_selected, results_of

WIDTH, MICRO_BATCHES = 8, 4


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())


def _cross_entropy(out, target):
    return nn.functional.cross_entropy(out, target)


def _mse(out, target):
    return (out - target).square().mean()


def _refused(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        return f"{type(e).__name__}: {e}"
    return None


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


def _zeroed_gradients_worker(rank, world_size, seed):
    """pp 1 x dp 2 under GPipe, per stage kind: two optimizer steps, each after a step that
    starts from gradients zeroed in place and a second step accumulating; the number of
    gradients copied by each step's set-aside, and the weights' difference from torch's SGD."""
    import fusedist.pipelining as pipelining

    copies = []
    set_aside = pipelining._set_aside

    def counted(module):
        held = set_aside(module)
        copies.append(sum(before is not None for _, before in held))
        return held

    pipelining._set_aside = counted
    out = {}
    try:
        for kind, ours, theirs, wrapped, schedule, opt, ref_opt in stages_of_each_kind(
                _model, seed, MICRO_BATCHES, _mse):
            g = torch.Generator().manual_seed(seed)
            copies.clear()
            for _ in range(2):
                for _ in range(2):
                    xs = [torch.randn(8, WIDTH, generator=g) for _ in range(world_size)]
                    ys = [torch.randn(8, WIDTH, generator=g) for _ in range(world_size)]
                    schedule.step(xs[rank], target=ys[rank])
                    _mse(theirs(torch.cat(xs)), torch.cat(ys)).backward()
                for o in (opt, ref_opt):
                    o.step()
                    o.zero_grad(set_to_none=False)
            out[kind] = (list(copies), largest_difference(kind, wrapped, ours, theirs))
    finally:
        pipelining._set_aside = set_aside
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


def test_zeroed_gradients_are_not_copied_at_a_step(launched):
    """Note [accumulating over synchronized pipeline steps]: a step starting from gradients
    zeroed in place copies none; the next step, accumulating, copies each gradient it reaches
    (so the count is of something); the weights follow torch's SGD on the unpipelined model."""
    seed = launched["seed"]
    for rank, out in enumerate(results_of(launched, "zeroed gradients")):
        for kind, (copies, diff) in out.items():
            assert diff < 1e-6, (seed, rank, kind, diff)
            assert copies[0] == copies[2] == 0 and copies[1] > 0 and copies[3] > 0, (rank, kind, copies)


@pytest.fixture(scope="module")
def launched(request):
    seed = int(torch.randint(0, 10_000, ()).item())
    jobs = {
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

    first = _refused(lambda: step(bad))
    grads = [None if p.grad is None else p.grad.clone() for p in part.parameters()]
    second = _refused(lambda: step(y))
    same = all((a is None and p.grad is None) or (a is not None and torch.equal(a, p.grad))
               for a, p in zip(grads, part.parameters()))
    return first, second, same


def test_a_step_after_one_that_raised_across_ranks_is_refused_on_every_rank():
    """Note [a step that raised]: the last stage's loss raises mid-step; the first stage's rank
    waits for that step's gradients. Each rank's next step is
    refused, naming the stage and what the failed step had done, without touching the gradients
    -- not run against the other rank's leftover messages. (The first stage's step ends when the
    last stage's process does, else at the group's timeout, 5 s here.) Its own launch: the failed
    step leaves the process group's messages unmatched."""
    seed = int(torch.randint(0, 10_000, ()).item())
    results = run_distributed(_failed_across_ranks_worker, 2, seed, timeout=120, pg_timeout=5)
    for rank, (first, second, same) in enumerate(results):
        assert first is not None, (seed, rank)
        assert second is not None and f"stage {rank} (rank {rank}): the previous step raised before its end" \
            in second, (seed, rank, second)
        assert "refuses every later step" in second and same, (seed, rank, second, same)
    assert "out of bounds" in results[1][0], results[1][0]
