"""Pipeline failures every rank learns of at once, on three gloo ranks (one stage each):

- Note [a first send that cannot be made, told upstream] (fusedist/pipelining/notice_back.py): with shapes
  given to the stages, a stage whose forward of micro-batch 0 raised told the ranks after it, but a rank
  holding only stages before it waited for micro-batch 0's gradient (or for its later activations to be
  taken) until the process group's timeout; so did every rank but the last when the last stage's loss_fn
  raised on micro-batch 0. Now every rank raises at once, naming the failing stage, its rank and its
  exception; the gradients stay untouched (None), the next step is refused, and a fresh pipeline on the
  same process group trains as the unpipelined model (no message of the failed step was left unmatched).
- Note [a failure told at the step's end] (fusedist/pipelining/step_status.py): a failure anywhere else -- a
  forward at a later micro-batch or step, a backward, the last stage's loss, any micro-batch of an eval step
  (micro-batch 0 too) -- still left the other ranks waiting until the timeout. Now every rank raises at once,
  the same message naming the stage, its rank, the micro-batch and the exception; no weight moved, the next
  step is refused, and a fresh pipeline on the group trains as the unpipelined model.
- Note [micro-batch counts that differ across ranks] (fusedist/pipelining/vote.py): one rank's schedule
  with another ``n_microbatches`` failed the shape inference with a size mismatch in the loss on one
  rank (the others then waited), or with shapes given left ranks waiting until the timeout. Now every
  rank raises at once at the set-up, naming both counts, and a schedule with the right count then trains
  the same stages as the unpipelined model.
- Note [a batch smaller than n_microbatches] (fusedist/pipelining/small_batch.py): a batch of 2 rows for 4
  micro-batches raised in torch's split on the first and last ranks, and the middle rank waited for the
  timeout. Now every rank raises at once, naming the rows, the count and the stage that took the batch; the next
  step's refusal says every rank raised that step (it said the peers were left waiting) and that new stages over
  the same modules work, which they do (Note [a refusal after a failure every rank raised] in
  fusedist/pipelining/step_failures.py).

Tolerances: fp32 gradients of micro-batch means summed in another order, 1e-6; a mispairing moves them by
1e-2 or more. The process group's timeout is 30 s here; prompt means under 5 s.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, refused as _refused, results_of

WIDTH, MICRO_BATCHES, BATCH = 8, 4, 8


class _Stage(nn.Module):
    """A linear layer whose forward raises while ``broken``, or at the forward (or the backward) of the
    micro-batch ``fail_forward`` (``fail_backward``) of a step, counted by ``calls``; the forwards that ran, by
    the buffer ``forwards`` (a batch count, as a BatchNorm's)."""

    def __init__(self):
        super().__init__()
        self.lin, self.broken = nn.Linear(WIDTH, WIDTH), False
        self.calls, self.fail_forward, self.fail_backward = 0, None, None
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        chunk, self.calls = self.calls, self.calls + 1
        if self.broken or chunk == self.fail_forward:
            raise ValueError("the stage module broke")
        self.forwards.add_(1)
        out = torch.tanh(self.lin(x))
        if chunk == self.fail_backward:
            out.register_hook(_broken_backward)
        return out


def _broken_backward(grad):
    raise ValueError("the backward broke")


def _mse(out, target):
    return (out - target).square().mean()


def _pipeline(rank, world, module, schedule_name, n_microbatches, static, loss_fn=_mse, **schedule_kwargs):
    from torch.distributed import pipelining

    from fusedist.pipelining import PipelineStage

    shapes = {}
    if static:
        example = torch.zeros(BATCH // MICRO_BATCHES, WIDTH)
        shapes = {"input_args": (example,), "output_args": (example,)}
    stage = PipelineStage(module, rank, world, torch.device("cpu"), **shapes)
    return stage, getattr(pipelining, schedule_name)(stage, n_microbatches=n_microbatches, loss_fn=loss_fn,
                                                     **schedule_kwargs)


def _step(schedule, rank, world, x, y):
    return schedule.step(x) if rank == 0 else schedule.step(target=y) if rank == world - 1 else schedule.step()


def _good_step_difference(rank, world, seed, schedule_name, static):
    """A fresh pipeline of a fresh model: one step; its gradients' largest difference from the unpipelined
    model's on the same batch."""
    torch.manual_seed(seed)
    whole = nn.Sequential(*[_Stage() for _ in range(world)])
    part = copy.deepcopy(whole[rank])
    _, schedule = _pipeline(rank, world, part, schedule_name, MICRO_BATCHES, static)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    _step(schedule, rank, world, x, y)
    _mse(whole(x), y).backward()
    return max(float((p.grad - q.grad).abs().max()) for p, q in zip(part.parameters(), whole[rank].parameters()))


def _told_upstream_worker(rank, world, seed, schedule_name, bad_stage):
    """Stage ``bad_stage``'s module raises at micro-batch 0 (shapes given; ``bad_stage`` None: the loss_fn
    raises there): what each rank raised and in how many seconds, whether its gradients are still None and its
    buffer counts no forward, whether an all_reduce works, what the next step raised, and a fresh pipeline's
    difference from the unpipelined model."""
    torch.manual_seed(seed)
    module = _Stage()
    module.broken = rank == bad_stage

    def loss_fn(out, target):
        if bad_stage is None and module.broken is None:
            raise ValueError("the loss broke")
        return _mse(out, target)

    if bad_stage is None:
        module.broken = None
    _, schedule = _pipeline(rank, world, module, schedule_name, MICRO_BATCHES, True, loss_fn)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    began = time.monotonic()
    raised = _refused(lambda: _step(schedule, rank, world, x, y))
    seconds = time.monotonic() - began
    untouched = all(p.grad is None for p in module.parameters()) and int(module.forwards) == 0
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    module.broken = False
    again = _refused(lambda: _step(schedule, rank, world, x, y))
    return raised, seconds, untouched, float(total), again, _good_step_difference(rank, world, seed, schedule_name,
                                                                                   True)


def _anywhere_worker(rank, world, seed, schedule_name, bad_stage, where, chunk, good_steps, static, evaluate):
    """Stage ``bad_stage``'s forward, backward or loss raises at micro-batch ``chunk`` of the step after
    ``good_steps`` good ones (training steps, or ``eval()`` steps): what each rank raised and in how many
    seconds, whether the weights and gradients stayed as the step found them, whether an all_reduce works,
    what the next step raised, and a fresh pipeline's difference from the unpipelined model."""
    torch.manual_seed(seed)
    module, losses = _Stage(), {"calls": 0, "fail": None}

    def loss_fn(out, target):
        losses["calls"] += 1
        if losses["calls"] - 1 == losses["fail"]:
            raise ValueError("the loss broke")
        return _mse(out, target)

    _, schedule = _pipeline(rank, world, module, schedule_name, MICRO_BATCHES, static, loss_fn)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step():
        module.calls = losses["calls"] = 0
        if not evaluate:
            return _step(schedule, rank, world, x, y)
        return schedule.eval(x) if rank == 0 else schedule.eval(target=y) if rank == world - 1 else schedule.eval()

    for _ in range(good_steps):
        step()
    weights = [p.detach().clone() for p in module.parameters()]
    grads = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
    if rank == bad_stage:
        module.fail_forward, module.fail_backward, losses["fail"] = (
            chunk if where == kind else None for kind in ("forward", "backward", "loss"))
    began = time.monotonic()
    raised = _refused(step)
    seconds = time.monotonic() - began
    kept = all(torch.equal(a, p) for a, p in zip(weights, module.parameters())) and all(
        (g is None and p.grad is None) or (g is not None and p.grad is not None and torch.equal(g, p.grad))
        for g, p in zip(grads, module.parameters()))
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    module.fail_forward = module.fail_backward = losses["fail"] = None
    again = _refused(step)
    return raised, seconds, kept, float(total), again, _good_step_difference(rank, world, seed, schedule_name,
                                                                             static)


def _counts_worker(rank, world, seed, schedule_name, static):
    """The last rank's schedule splits the batch into 8 micro-batches, the others' into 4: what each rank
    raised and in how many seconds; then a schedule of 4 over the same stages: its gradients' largest
    difference from the unpipelined model's."""
    torch.manual_seed(seed)
    whole = nn.Sequential(*[_Stage() for _ in range(world)])
    part = copy.deepcopy(whole[rank])
    count = 2 * MICRO_BATCHES if rank == world - 1 else MICRO_BATCHES
    stage, schedule = _pipeline(rank, world, part, schedule_name, count, static)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    began = time.monotonic()
    raised = _refused(lambda: _step(schedule, rank, world, x, y))
    seconds = time.monotonic() - began
    schedule = type(schedule)(stage, n_microbatches=MICRO_BATCHES, loss_fn=_mse)
    _step(schedule, rank, world, x, y)
    _mse(whole(x), y).backward()
    return raised, seconds, max(float((p.grad - q.grad).abs().max())
                                for p, q in zip(part.parameters(), whole[rank].parameters()))


@pytest.mark.parametrize("schedule_name,bad_stage", [
    ("ScheduleGPipe", 1), ("Schedule1F1B", 1), ("Schedule1F1B", 2), ("ScheduleGPipe", 2), ("Schedule1F1B", None)])
def test_a_failed_first_forward_fails_the_ranks_before_it_at_once(schedule_name, bad_stage, launched):
    """Note [a first send that cannot be made, told upstream]: every rank (those before the failing stage
    too: they waited for the group's timeout) raises within 5 s the same message, naming the stage, its
    rank and the module's exception (or the loss_fn's, on the last stage); nothing was applied (gradients
    None), and the buffers are as the step found them (a batch count the forwards before the failure moved,
    1 or 2 on the ranks before it, was kept); the group works; the next step is refused; a fresh pipeline on
    the group gives the unpipelined model's gradients (fp32: 1e-6)."""
    results = results_of(launched, f"upstream {schedule_name} {bad_stage}")
    told = (f"stage {bad_stage} (rank {bad_stage} of the pipeline's group) failed at micro-batch 0: "
            "ValueError: the stage module broke" if bad_stage is not None else
            "stage 2 (rank 2 of the pipeline's group) failed at micro-batch 0's loss: ValueError: the loss broke")
    assert len({raised for raised, *_ in results}) == 1, results
    for rank, (raised, seconds, untouched, total, again, diff) in enumerate(results):
        assert raised is not None and told in raised, (rank, raised)
        assert seconds < 5 and untouched and total == 3, (rank, seconds, untouched, total)
        assert again is not None and "the previous step raised before its end" in again, (rank, again)
        assert diff < 1e-6, (launched["seed"], rank, diff)


# (schedule, failing stage, where, micro-batch, good steps before, shapes given, eval steps): later
# micro-batches and steps, backwards and losses, eval steps (micro-batch 0 too), shapes given or inferred
_ANYWHERE = [("Schedule1F1B", 1, "forward", 2, 1, True, False), ("ScheduleGPipe", 0, "forward", 1, 1, False, False),
             ("Schedule1F1B", 1, "backward", 0, 0, True, False), ("ScheduleGPipe", 2, "loss", 3, 1, False, False),
             ("Schedule1F1B", 2, "backward", 1, 1, False, False), ("ScheduleGPipe", 2, "forward", 0, 0, True, True),
             ("Schedule1F1B", 1, "forward", 0, 1, False, True), ("ScheduleGPipe", 0, "forward", 3, 0, True, True)]


@pytest.mark.parametrize("case", _ANYWHERE, ids=["-".join(map(str, case)) for case in _ANYWHERE])
def test_a_failure_anywhere_in_a_step_fails_every_rank_at_once(case, launched):
    """Note [a failure told at the step's end] (fusedist/pipelining/step_status.py): a stage's forward at a
    later micro-batch or step, its backward, the last stage's loss, or any micro-batch of an eval step
    raises: the other ranks waited for the process group's timeout (30 s here). Now every rank raises
    within 5 s the same message naming the stage, its rank, the micro-batch (and loss or backward) and
    the exception; the weights and gradients are as the step found them (the zeros the failing rank sent
    in place of its messages were backpropagated); the group works; the next step is refused; a fresh
    pipeline on the group gives the unpipelined model's gradients (fp32: 1e-6; a message left unmatched
    would pair other micro-batches' tensors, 1e-2 off or more)."""
    _, bad_stage, where, chunk, *_ = case
    results = results_of(launched, "anywhere " + " ".join(map(str, case)))
    broke = "the loss broke" if where == "loss" else f"the {'stage module' if where == 'forward' else where} broke"
    part = {"forward": "", "backward": "'s backward", "loss": "'s loss"}[where]
    told = (f"stage {bad_stage} (rank {bad_stage} of the pipeline's group) failed at micro-batch {chunk}{part}: "
            f"ValueError: {broke}")
    assert len({raised for raised, *_ in results}) == 1, results
    for rank, (raised, seconds, kept, total, again, diff) in enumerate(results):
        assert raised is not None and told in raised, (rank, raised)
        assert seconds < 5 and kept and total == 3, (rank, seconds, kept, total)
        assert again is not None and "the previous step raised before its end" in again, (rank, again)
        assert diff < 1e-6, (launched["seed"], rank, diff)


@pytest.mark.parametrize("schedule_name,static", [("ScheduleGPipe", False), ("Schedule1F1B", True)])
def test_schedules_with_different_micro_batch_counts_fail_every_rank_at_once(schedule_name, static, launched):
    """Note [micro-batch counts that differ across ranks]: every rank raises the same message within 5 s,
    naming both counts and the stage; the same stages under a schedule with the right count then give the
    unpipelined model's gradients (fp32: 1e-6)."""
    results = results_of(launched, f"counts {schedule_name} {static}")
    for rank, (raised, seconds, diff) in enumerate(results):
        assert raised is not None and "n_microbatches=4 at stage 0 (rank 0" in raised, (rank, raised)
        assert "n_microbatches=8 at stage 2 (rank 2)" in raised, (rank, raised)
        assert seconds < 5 and diff < 1e-6, (launched["seed"], rank, seconds, diff)
    assert len({raised for raised, _, _ in results}) == 1, results


def _stage_counts_worker(rank, world, seed, schedule_name, wrong):
    """The last rank builds its stage with ``num_stages`` one more than the others (``wrong`` "count") or as
    stage 1, which rank 1 holds (``wrong`` "index"): what each rank raised and in how many seconds; then
    stages built right: their gradients' largest difference from the unpipelined model's."""
    from torch.distributed import pipelining

    from fusedist.pipelining import PipelineStage

    torch.manual_seed(seed)
    whole = nn.Sequential(*[_Stage() for _ in range(world)])
    part = copy.deepcopy(whole[rank])
    last = rank == world - 1
    index, count = (1 if last and wrong == "index" else rank), (world + 1 if last and wrong == "count" else world)
    schedule = getattr(pipelining, schedule_name)(
        PipelineStage(part, index, count, torch.device("cpu")), n_microbatches=MICRO_BATCHES, loss_fn=_mse)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    began = time.monotonic()
    raised = _refused(lambda: _step(schedule, rank, world, x, y))
    seconds = time.monotonic() - began
    _, schedule = _pipeline(rank, world, part, schedule_name, MICRO_BATCHES, False)
    _step(schedule, rank, world, x, y)
    _mse(whole(x), y).backward()
    return raised, seconds, max(float((p.grad - q.grad).abs().max())
                                for p, q in zip(part.parameters(), whole[rank].parameters()))


@pytest.mark.parametrize("schedule_name,wrong", [("ScheduleGPipe", "count"), ("Schedule1F1B", "index")])
def test_stage_counts_or_indices_that_differ_across_ranks_fail_every_rank_at_once(schedule_name, wrong, launched):
    """Note [stage counts that differ across ranks]: a rank built with another num_stages, or holding a stage
    index another rank holds, made the ranks wait on each other until the group's timeout (torch's stage too).
    Every rank raises the same message within 5 s (the group's timeout is 30 s), naming each rank's count and
    stages; stages built right then give the unpipelined model's gradients (fp32: 1e-6)."""
    results = results_of(launched, f"stage counts {schedule_name} {wrong}")
    last = 4 if wrong == "count" else 3
    stages = [0, 1, 1] if wrong == "index" else [0, 1, 2]
    for rank, (raised, seconds, diff) in enumerate(results):
        assert raised is not None and "the pipeline's stages do not agree" in raised, (rank, raised)
        assert f"rank 2: num_stages={last}, stages [{stages[2]}]" in raised, (rank, raised)
        assert "rank 0: num_stages=3, stages [0]; rank 1: num_stages=3, stages [1]" in raised, (rank, raised)
        assert seconds < 5 and diff < 1e-6, (launched["seed"], rank, seconds, diff)
    assert len({raised for raised, _, _ in results}) == 1, results


def _short_batch_worker(rank, world, seed, schedule_name, static, good_steps, short, evaluate):
    """After ``good_steps`` good steps, a step whose batch has 2 rows for 4 micro-batches (``short``: "both"
    the inputs and the target, or only the "target"; "empty ...": no rows; "spec ...": the schedule built with
    an args_chunk_spec): what each rank raised and in how many seconds, whether an all_reduce works, what the
    next step on the schedule and a new schedule over the same stage raise, and the difference from the
    unpipelined model of a step of new stages over the same modules."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    torch.manual_seed(seed)
    module = _Stage()
    spec = {"args_chunk_spec": (TensorChunkSpec(0),)} if short.startswith("spec") else {}
    stage, schedule = _pipeline(rank, world, module, schedule_name, MICRO_BATCHES, static, **spec)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    for _ in range(good_steps):
        _step(schedule, rank, world, x, y)
    rows = 0 if short.startswith("empty") else 2
    small_x = x[:rows] if short.endswith("both") else x
    run = schedule.eval if evaluate else schedule.step
    began = time.monotonic()
    raised = _refused(lambda: run(small_x) if rank == 0 else run(target=y[:rows]) if rank == world - 1 else run())
    seconds = time.monotonic() - began
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    again = _refused(lambda: _step(schedule, rank, world, x, y))  # (refused before any message)
    renewed = getattr(pipelining, schedule_name)(stage, n_microbatches=MICRO_BATCHES, loss_fn=_mse)
    same_stage = _refused(lambda: _step(renewed, rank, world, x, y))
    resumed = _resumed_difference(rank, world, seed, schedule_name, module)
    return raised, seconds, float(total), again, same_stage, resumed


def _resumed_difference(rank, world, seed, schedule_name, module):
    """New stages over the same modules (the same weights on every rank: built from one seed) and a new
    schedule: one step's largest gradient difference from the unpipelined model's."""
    whole = nn.Sequential(*[copy.deepcopy(module) for _ in range(world)])
    module.zero_grad()
    _, schedule = _pipeline(rank, world, module, schedule_name, MICRO_BATCHES, False)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    _step(schedule, rank, world, x, y)
    whole.zero_grad()
    _mse(whole(x), y).backward()
    return max(float((p.grad - q.grad).abs().max()) for p, q in zip(module.parameters(), whole[rank].parameters()))


# (schedule, shapes given, good steps before, what is short, eval step): the first step's notices (shapes given,
# or inferred), the step's-end exchange of a later step, an eval step; a later step's target of no rows
_SHORT = [("ScheduleGPipe", True, 0, "both", False), ("Schedule1F1B", False, 0, "both", False),
          ("Schedule1F1B", True, 1, "target", False), ("ScheduleGPipe", False, 1, "both", True),
          ("ScheduleGPipe", False, 1, "empty target", False), ("Schedule1F1B", False, 1, "spec both", False)]


@pytest.mark.parametrize("case", _SHORT, ids=["-".join(map(str, case)) for case in _SHORT])
def test_a_batch_smaller_than_n_microbatches_fails_every_rank_at_once(case, launched):
    """Note [a batch smaller than n_microbatches] (fusedist/pipelining/small_batch.py): torch's split raised on
    the first and last ranks before any message and the middle rank waited for the group's timeout (30 s
    here). Every rank raises within 5 s the same message naming the rows, n_microbatches and the stage (with
    its rank) that took the batch; the group works, and new stages over the same modules give the unpipelined
    model's gradients (fp32: 1e-6), as the refusal of the next step (and of a new schedule over the old stage)
    says (it said the peers were left waiting).
    Note [a target of no rows]: after a good step, a target of no rows (torch's
    split asserted on the last rank alone, with torch's stage too, and the others waited for the timeout) is
    refused alike. Note [inputs split along chunk specs]: with an args_chunk_spec torch's split handed back 2
    micro-batches, and the schedule's count check raised on rank 0 alone; refused alike."""
    _, static, good_steps, short, evaluate = case
    rows = 0 if short.startswith("empty") else 2
    results = results_of(launched, "short " + " ".join(map(str, case)))
    assert len({raised for raised, *_ in results}) == 1, results
    for rank, (raised, seconds, total, again, same_stage, diff) in enumerate(results):
        if short.startswith("spec"):
            assert "stage 0 (rank 0 of the pipeline's group): torch's split of the step's inputs along the " \
                "schedule's chunk specs gave 2 micro-batches, not n_microbatches=4" in str(raised) or (
                    "stage 2 (rank 2 of the pipeline's group): the step's target (shape (2, 8))" in str(raised)), raised
        elif short.endswith("target"):
            assert f"has {rows} rows, fewer than n_microbatches=4" in str(raised), (rank, raised)
            assert f"stage 2 (rank 2 of the pipeline's group): the step's target (shape ({rows}, 8))" in raised, raised
        else:
            assert f"has {rows} rows, fewer than n_microbatches=4" in str(raised), (rank, raised)
            assert "(rank 0 of the pipeline's group): the step's input 0 (shape (2, 8))" in raised or (
                "stage 2 (rank 2 of the pipeline's group): the step's target" in raised), raised
        assert seconds < 5 and total == 3, (rank, seconds, total)
        assert diff < 1e-6, (launched["seed"], rank, diff)
        # Note [a refusal after a failure every rank raised] (fusedist/pipelining/step_failures.py): the next step
        # said the peers "were left waiting"; every rank raised the same step, and new stages over the same modules
        # work (above), while a new schedule over the old stage is refused too. A step that infers the shapes (the
        # first, an eval after training) fails in the inference, which leaves nothing (Note [a step that raised]
        # in fusedist/pipelining/step_failures.py): the next step runs.
        if not static and (good_steps == 0 or evaluate):
            assert again is None and same_stage is None, (rank, again, same_stage)
            continue
        for refusal in (again, same_stage):
            assert "Every rank of the pipeline raised that step's failure at once" in str(refusal), (rank, refusal)
            assert "refuses every later step" in refusal, (rank, refusal)
            assert "build new PipelineStage objects over the same modules" in refusal, (rank, refusal)
            assert "left waiting" not in refusal, (rank, refusal)


@pytest.fixture(scope="module")
def launched(request):
    seed = int(torch.randint(0, 10_000, ()).item())
    jobs = {  # (the counts first: a scenario that fails may leave messages unmatched for those after it)
        "test_schedules_with_different_micro_batch_counts_fail_every_rank_at_once": {
            f"counts {name} {static}": (_counts_worker, (seed, name, static))
            for name, static in (("ScheduleGPipe", False), ("Schedule1F1B", True))},
        "test_stage_counts_or_indices_that_differ_across_ranks_fail_every_rank_at_once": {
            f"stage counts {name} {wrong}": (_stage_counts_worker, (seed, name, wrong))
            for name, wrong in (("ScheduleGPipe", "count"), ("Schedule1F1B", "index"))},
        "test_a_failed_first_forward_fails_the_ranks_before_it_at_once": {
            f"upstream {name} {bad}": (_told_upstream_worker, (seed, name, bad))
            for name, bad in (("ScheduleGPipe", 1), ("Schedule1F1B", 1), ("Schedule1F1B", 2), ("ScheduleGPipe", 2),
                              ("Schedule1F1B", None))},
        "test_a_failure_anywhere_in_a_step_fails_every_rank_at_once": {
            "anywhere " + " ".join(map(str, case)): (_anywhere_worker, (seed, *case)) for case in _ANYWHERE},
        "test_a_batch_smaller_than_n_microbatches_fails_every_rank_at_once": {
            "short " + " ".join(map(str, case)): (_short_batch_worker, (seed, *case)) for case in _SHORT},
    }
    return {"seed": seed, **launch_for_selected(request, jobs, 3, timeout=300, pg_timeout=30)}
