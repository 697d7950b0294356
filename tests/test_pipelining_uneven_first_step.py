"""A pipeline's first step on a batch that ``n_microbatches`` does not divide (Note [micro-batches
of another shape] in fusedist/pipelining.py): torch's stages size their receive buffers from
micro-batch 0 of the first step, the largest of ``tensor_split``'s uneven split (3, 3, 2, 2 rows
of 10), so the first smaller micro-batch did not fit them. Under torch's own stage the last
stage's loss failed on it ("The size of tensor a (3) must match the size of tensor b (2)"), far
from the cause, or gloo aborted the receiver.

Reference: the refusal comes from the first stage before that micro-batch is sent, names it and
both shapes; the stage's weights are untouched (GPipe runs every forward before any backward:
no gradient was accumulated). The next stage, blocked on the micro-batch that never comes, ends
when the first stage's process does.
"""

from __future__ import annotations

import torch
from torch import nn

from fusedist.testing import run_distributed

WIDTH, MICRO_BATCHES = 8, 4


def _first_step_worker(rank, world_size, seed):
    """A 2-stage GPipe pipeline (stage ``rank`` on rank ``rank``) whose first step gets 10 rows:
    what the step raised, whether any gradient was written, whether a weight moved."""
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
    try:
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        raised = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        raised = f"{type(e).__name__}: {e}"
    written = any(p.grad is not None for p in part.parameters())
    moved = any(not torch.equal(before[k], v) for k, v in part.state_dict().items())
    return raised, written, moved


def test_an_uneven_first_step_is_refused_by_the_first_stage_naming_the_micro_batch():
    """Its own launch: the refusal leaves the second stage waiting for a micro-batch that never
    comes, so its rank's process group ends broken (no other scenario can follow it there)."""
    seed = int(torch.randint(0, 10_000, ()).item())
    (first, written, moved), (second, _, _) = run_distributed(_first_step_worker, 2, seed, timeout=120, pg_timeout=30)
    assert f"stage 0, micro-batch 2: input 0 has shape (2, {WIDTH})" in first, (seed, first)
    assert f"expected (3, {WIDTH})" in first and f"divisible by n_microbatches ({MICRO_BATCHES})" in first, first
    assert "drop_last=True" in first, first
    assert not written and not moved, (seed, written, moved)
    # the second stage never computed a loss on a micro-batch that did not fit its buffers
    assert second != "no error" and "must match the size" not in second, (seed, second)
