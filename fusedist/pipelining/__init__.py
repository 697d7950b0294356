"""Pipeline parallelism over sharded (or DDP) stages: torch's ``PipelineStage`` that reduces a
stage's gradients once per step, not once per micro-batch.

Note [pipeline stages of fully_shard modules]
    torch's pipeline schedules (``torch.distributed.pipelining``) run one backward per
    micro-batch. For a stage module sharded by torch's FSDP2 they switch its gradient sync
    off for every micro-batch and reduce the accumulated gradients after the last one,
    reaching into FSDP2's internals to do so; any other module is left alone. A
    ``fusedist.fully_shard`` stage is such another module: the schedules are right with it
    (GPipe, 1F1B, interleaved 1F1B and looped BFS give FSDP2's weights), but each of the ``n``
    micro-batch backwards reduce-scatters the stage's gradients: ``n`` times the traffic of
    one step.

    This ``PipelineStage`` (the same constructor as torch's) does for a ``fully_shard``
    stage what the schedules do for FSDP2, through the module's public switches: every
    micro-batch backward but the stage's last runs with ``set_requires_gradient_sync(False)``
    (the gradients accumulate unsharded, in ``reduce_dtype``) and
    ``set_reshard_after_backward(False)`` (the parameters stay gathered for the next
    micro-batch's backward); the step's last one (counted, below) reduce-scatters the sum
    once and reshards. So one reduce-scatter per unit and step, as
    FSDP2's. The user's own switch still holds: under ``set_requires_gradient_sync(False)``
    (accumulating across steps; DDP's ``no_sync`` likewise) the last backward accumulates
    too. A step that runs fewer backwards than micro-batches (a custom schedule) leaves
    the gradients unreduced, and the optimizer step after it is refused by the step guard
    rather than stepping on partial gradients.

    Zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
    ``ScheduleDualPipeV``) split each backward into an input pass (``B``: the gradients of the
    stage's inputs, sent upstream at once) and a weight pass (``W``, later, filling the
    pipeline's bubbles). torch's stage finds the weights' gradient paths from
    ``submod.parameters()`` and writes ``.grad`` itself in the weight pass, outside the
    gradient hooks a sharded unit reduces from: for a ``fully_shard`` stage those are the
    pieces, which the graph never saw (the forward used the gathered parameters), so with
    torch's own ``PipelineStage`` such a stage loses its gradients (and torch 2.13's FSDP2
    ends with other weights under them than under 1F1B). Here (Note [zero-bubble passes of
    fusedist stages] in passes.py) the input pass is torch's, over the parameters
    the graph holds -- the units' gathered parameters -- accumulating nothing; the weight
    pass is a backward from the intermediates the input pass saved to those parameters, so
    their gradients arrive through the usual hooks and the unit reduces (or accumulates)
    them as after any backward. Which backward is the step's last is counted rather than
    taken from the schedule: each micro-batch's weight gradients are computed once, in a full
    pass or a weight pass (the first stage, whose input pass torch skips, runs a full pass in
    its weight slot), and the stage's ``n_microbatches``-th of a step -- counted from its
    forward of micro-batch 0 -- reduces the sum.

Note [a stage whose inputs need no gradient]
    torch's input pass (zero-bubble schedules) keeps, for the weight pass, the intermediates
    where the weights' gradient paths meet the stage inputs' -- and then cuts the graph. A
    stage none of whose inputs requires a gradient (the stage after a frozen one: a frozen
    embedding or encoder being fine-tuned past; the first stage, which torch special-cases, is
    such a stage) has no such meeting point: torch's weight pass then computed nothing and the
    stage's weights silently got no gradient at all. Here such a stage runs its whole backward
    in the input slot (gradient sync off, so it only accumulates), and its weight pass, with
    nothing left to compute, counts the micro-batch and in the step's last reduces the sums
    (Note [zero-bubble passes of fusedist stages] in passes.py). The stage gives up
    overlap of its weight gradients with the bubbles, not correctness.

Note [pipeline stages of DDP modules]
    A stage wrapped by ``fusedist.DistributedDataParallel`` (or a ``fusedist.replicate``
    module) is treated alike, through its engine's switch for the next backward: torch's
    ``no_sync`` is read at the forward, and a pipeline runs its forwards micro-batches ahead
    of their backwards (1F1B runs a stage's first forwards before its first backward), so the
    switch is set right before each backward instead -- accumulate, or (the step's last)
    all-reduce the sum. Zero-bubble schedules run as for sharded stages. (For
    torch's own DDP, torch's schedules reach into its reducer; under torch 2.13 they fail in
    its bucket rebuild at the first step.) Any other stage module is left to torch's stage.

Note [gradients held outside p.grad]
    After a step's backwards torch's schedules divide the stage's gradients by the number of
    micro-batches (``scale_grads``, the loss being each micro-batch's mean), through
    ``p.grad`` of ``submod.parameters()``. A ``ZeroRedundancyOptimizer(stage=2)`` over a DDP
    stage keeps them elsewhere: the reduce-scatter writes its shards and leaves ``p.grad``
    None, so torch's division missed them and the step took ``n_microbatches`` times the
    gradient (SGD moved that much too far; a clip saw that norm). The stage divides the shards
    of such holders too -- what a scaler's unscale writes -- once per step, as torch does
    ``p.grad``.

Note [accumulating across pipeline steps]
    Under the user's ``set_requires_gradient_sync(False)`` or DDP's ``no_sync`` a step only
    accumulates (above), and the next synchronized step reduces the sum of both. torch's
    division of ``p.grad`` at each step's end would then divide the first step's part twice
    for a DDP stage, whose ``p.grad`` holds it (``g1 / n**2 + g2 / n``), and not at all for a
    ``fully_shard`` stage, whose unsharded sum is not ``p.grad`` yet (``(g1 + g2) / n``, the
    gradient of the two steps' losses, as without pipelining). So a step that only
    accumulates divides nothing, and the synchronized step divides the whole sum once: every
    fusedist stage gives ``(g1 + g2) / n``.

Note [an eval step divides nothing]
    torch's schedules end every step, ``schedule.eval(...)`` (forward only) included, with the
    division of the stage's gradients by the micro-batch count. An evaluation run between a
    step's backwards and its optimizer step thus divided the gradients held then once more
    (ZeRO-2's shards too): the update came out ``n_microbatches`` times too small, silently.
    A forward-only step computes no gradient, so it divides none.

Note [accumulating over synchronized pipeline steps]
    In set_aside.py: a step takes, and divides, only its own part of the gradients held.

Note [a step that raised]
    In step_failures.py: after a step that raised before its end, the next step on a
    one-rank pipeline drops what it left (losses, gradients, buffers), and on several ranks is refused.

Note [several devices in one stage]
    In set_aside.py.

Note [a batch smaller than n_microbatches]
    In small_batch.py: a step's batch with fewer rows than ``n_microbatches`` is refused on every rank
    at once, naming the rows, the count and the stage that took it.

Note [the step check's verdict read at the step's end]
    In step_verdict.py: a DDP or ``fully_shard`` stage's data-parallel peers that diverged in a step
    are named at the step's end, on every rank, before any optimizer step; and Note [a retried step paired with
    a late peer's] there.
"""

from . import stage as _stage
from .stage import PipelineStage

__all__ = ["PipelineStage"]

# (read by a clip across the stages from the loaded package: Note [torchtitan's clip across pipeline
# stages of stage 2] in fusedist/optim/torch_clip.py)
stage_holders_outside_grad = _stage.stage_holders_outside_grad
