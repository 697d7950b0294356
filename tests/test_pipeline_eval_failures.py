"""Eval steps of a pipeline over three ranks that fail (fusedist/pipelining/inference.py), on gloo, with a
process-group timeout of 45 s, so that an error within 20 s on every rank is one told, not timed out:

- Note [a shape inference that fails on one rank]: the shape inference of an eval set-up failing at stage
  ``k`` (a module returning a dict) raised on the ranks from ``k`` on only; the ranks before went on into
  the step and waited on their activation sends until the group's timeout. Every rank now raises the
  same message naming the stage at once, the group stays usable, and the next eval (the module fixed)
  gives the unpipelined model's outputs and losses.
- Note [a loss without a target]: ``eval(x)`` without ``target=`` on a schedule built with a ``loss_fn``
  raised torch's ``TypeError: 'NoneType' object is not subscriptable`` on the last rank only; every rank
  now raises the message naming the fix at once.

One launch of three ranks: the failing stage's notice has to be passed on by a rank that is told of it
(stage 2 failing: rank 1 is told, and tells rank 0). Tolerance of outputs and losses: fp32, the same
operations as the unpipelined model on the same rows, 1e-6.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

WIDTH, MICRO_BATCHES, WORLD = 8, 3, 3


def _mse(out, target):
    return (out - target).square().mean()


class _Block(nn.Module):
    """A stage module that can return what a stage cannot send (a dict)."""

    def __init__(self):
        super().__init__()
        self.lin, self.wrong = nn.Linear(WIDTH, WIDTH), False

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return {"hidden": h} if self.wrong else h


def _pipeline(rank, seed, loss_fn):
    from torch.distributed.pipelining import Schedule1F1B

    from fusedist.pipelining import PipelineStage

    torch.manual_seed(seed)
    blocks = [_Block() for _ in range(WORLD)]
    stage = PipelineStage(blocks[rank], rank, WORLD, torch.device("cpu"))
    return blocks, Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)


def _raised(call):
    began = time.monotonic()
    try:
        call()
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(e).__name__}: {e}", time.monotonic() - began
    return None, time.monotonic() - began


def _all_reduce_works() -> float:
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    return float(total)


def _eval_inference_fails_worker(rank, world, seed, bad_stage):
    """The first eval's shape inference fails at ``bad_stage``: what each rank raised and when; then, the
    module fixed, the next eval's largest difference from the unpipelined model (outputs, losses)."""
    blocks, schedule = _pipeline(rank, seed, _mse)
    torch.manual_seed(seed + 1)
    x, y = torch.randn(6, WIDTH), torch.randn(6, WIDTH)
    blocks[bad_stage].wrong = True
    last = rank == WORLD - 1
    raised, seconds = _raised(lambda: schedule.eval(x) if rank == 0 else schedule.eval(target=y) if last
                              else schedule.eval())
    total = _all_reduce_works()
    blocks[bad_stage].wrong = False
    losses = []
    out = schedule.eval(x) if rank == 0 else schedule.eval(target=y, losses=losses) if last else schedule.eval()
    difference = 0.0
    if last:
        with torch.no_grad():
            expected = nn.Sequential(*blocks)(x)
        pairs = zip(losses, expected.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES))
        difference = max(float((out - expected).abs().max()), *(abs(float(loss) - float(_mse(e, t)))
                                                                for loss, e, t in pairs))
    return raised, seconds, total, difference


def _eval_without_target_worker(rank, world, seed, after):
    """``eval`` without a target on a schedule with a loss_fn, first (in the eval set-up), after a training
    step (a set-up again) or after an eval with a target (none): what each rank raised and when."""
    blocks, schedule = _pipeline(rank, seed, _mse)
    torch.manual_seed(seed + 1)
    x, y = torch.randn(6, WIDTH), torch.randn(6, WIDTH)
    last = rank == WORLD - 1
    if after is not None:
        run = getattr(schedule, after)
        run(x) if rank == 0 else run(target=y) if last else run()
    raised, seconds = _raised(lambda: schedule.eval(x) if rank == 0 else schedule.eval())
    return raised, seconds, _all_reduce_works()


@pytest.mark.parametrize("bad_stage", [2, 1])
def test_a_failed_eval_shape_inference_fails_every_rank_at_once(bad_stage, launched):
    """Note [a shape inference that fails on one rank], eval set-up: every rank raises the failing stage's
    message within 20 s (the group's timeout is 45 s), the group still works, and the next eval gives the
    unpipelined model's outputs and losses."""
    results = results_of(launched, f"eval inference fails at {bad_stage}")
    for rank, (raised, seconds, total, difference) in enumerate(results):
        assert raised is not None and f"failed at stage {bad_stage} " in raised, (rank, raised)
        assert f"stage {bad_stage}'s module returned dict, not a tensor" in raised, (rank, raised)
        assert seconds < 20 and total == WORLD, (rank, seconds, total)
        assert difference < 1e-6, (launched["seed"], rank, difference)
    assert len({raised for raised, *_ in results}) == 1, results


@pytest.mark.parametrize("after", [None, "step", "eval"])
def test_eval_without_a_target_on_a_schedule_with_a_loss_fails_every_rank_at_once(after, launched):
    """Note [a loss without a target]: every rank raises the message naming the fix within 20 s, not
    torch's TypeError (from the schedule's code, naming neither cause nor fix) -- in the eval set-up's shape
    inference, or (after an eval with a target) at the step's micro-batch 0."""
    results = results_of(launched, f"eval without target after {after}")
    for rank, (raised, seconds, total) in enumerate(results):
        assert raised is not None and "was given no target" in raised, (rank, raised)
        assert "Pass target= to schedule.eval" in raised and "without loss_fn" in raised, (rank, raised)
        assert seconds < 20 and total == WORLD, (rank, seconds, total)


class _LastStage:
    """What the last stage's target check reads of a stage: its index, rank, and the schedule stepping it."""

    stage_index, group_rank, is_last = 2, 0, True


class _Schedule:
    """A schedule whose step runs the last stage's target check, as torch's does in its shape inference and
    its micro-batch 0 forward; ``_step_microbatches`` takes its targets under ``target_mbs``, as torch's."""

    _loss_fn, _has_backward = staticmethod(_mse), False

    def __init__(self, stage):
        self.stage = stage

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                           loss_kwargs=None):
        from fusedist.pipelining.inference import check_target_given

        check_target_given(self.stage)


class _RenamedTargets(_Schedule):
    """A schedule (a torch release, say) whose ``_step_microbatches`` names the targets otherwise."""

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, targets=None, losses=None, return_outputs=True,
                           loss_kwargs=None):
        return super()._step_microbatches(arg_mbs, kwarg_mbs, targets, losses, return_outputs, loss_kwargs)


def test_the_target_check_reads_the_steps_argument_and_refuses_a_step_without_it():
    """Note [the targets a step was given] (fusedist/pipelining/schedule_step.py): the check read the
    ``target_mbs`` local of the schedule's frame; under a schedule whose ``_step_microbatches`` names the
    targets otherwise, it found none and turned itself off silently. Now the wrapped step records its
    ``target_mbs`` argument: a step without targets is refused naming the fix, one with them runs, nothing
    is checked outside a step, and a ``_step_microbatches`` without ``target_mbs`` is refused at once, naming
    it (the check would be off), where the schedule has a loss_fn."""
    import weakref

    from fusedist.pipelining.inference import check_target_given
    from fusedist.pipelining.schedule_step import wrap_step

    stage = _LastStage()
    schedule = _Schedule(stage)
    stage._stepping = weakref.ref(schedule)
    wrap_step(schedule)
    with pytest.raises(RuntimeError, match=r"stage 2 \(the last, rank 0 of the pipeline's group\): schedule.eval"):
        schedule._step_microbatches([()], [{}], None)
    schedule._step_microbatches([()], [{}], [torch.zeros(1)])
    schedule._step_microbatches([()], [{}], target_mbs=[torch.zeros(1)])
    check_target_given(stage)  # (driven by hand: no step of the schedule running)
    renamed = _RenamedTargets(stage)
    stage._stepping = weakref.ref(renamed)
    with pytest.raises(RuntimeError, match=r"_RenamedTargets._step_microbatches takes .*no 'target_mbs'"):
        wrap_step(renamed)
    renamed._loss_fn = None  # (no loss, nothing to check: its steps run)
    wrap_step(renamed)
    renamed._step_microbatches([()], [{}], None)


@pytest.fixture(scope="module")
def launched(request):
    seed = int(torch.randint(0, 10_000, ()).item())
    jobs = {
        "test_a_failed_eval_shape_inference_fails_every_rank_at_once": {
            f"eval inference fails at {k}": (_eval_inference_fails_worker, (seed, k)) for k in (2, 1)},
        "test_eval_without_a_target_on_a_schedule_with_a_loss_fails_every_rank_at_once": {
            f"eval without target after {a}": (_eval_without_target_worker, (seed, a)) for a in (None, "step", "eval")},
    }
    results = launch_for_selected(request, jobs, WORLD, timeout=240, pg_timeout=45)
    results["seed"] = seed
    return results
