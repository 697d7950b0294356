"""Pipeline parallelism over ``fully_shard`` stages: torch's ``PipelineStage`` that reduces a
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
    micro-batch's backward); the last one -- the schedules say which: ``last_backward`` --
    reduce-scatters the sum once and reshards. So one reduce-scatter per unit and step, as
    FSDP2's. A schedule that never marks a last backward (a custom one) leaves the gradients
    unreduced, and the optimizer step after it is refused by the step guard, naming the
    unit, rather than stepping on partial gradients.

    Zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
    ``ScheduleDualPipeV``) split each backward into an input pass and a weight pass that
    computes the weights' gradients with ``torch.autograd.grad`` and writes ``.grad``
    itself, outside the gradient hooks a sharded unit reduces from: refused here by name.
    (With torch's own ``PipelineStage`` they lose the gradients of such stages; torch
    2.13's FSDP2 gets other weights from them than from 1F1B as well.)

    Any other stage module (plain, or fusedist's DDP) is left to torch's stage as it is.
"""

from __future__ import annotations

import contextlib

from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

__all__ = ["PipelineStage"]


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` for a stage module sharded by ``fusedist.fully_shard``: one
    gradient reduction per step (Note [pipeline stages of fully_shard modules])."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        from .fsdp import FullyShardedModule

        if not isinstance(self.submod, FullyShardedModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        if backward_type != "full":
            raise NotImplementedError(
                f"fusedist.pipelining.PipelineStage (stage {self.stage_index}): a {backward_type!r} backward "
                f"pass of a fully_shard stage ({type(self.submod).__name__}). Zero-bubble schedules compute "
                "the weights' gradients with torch.autograd.grad outside the hooks a sharded unit reduces its "
                "gradients from; use a schedule with full backwards (ScheduleGPipe, Schedule1F1B, "
                "ScheduleInterleaved1F1B, ScheduleLoopedBFS)")
        with _micro_batch(self.submod, last=bool(last_backward)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)


@contextlib.contextmanager
def _micro_batch(module, last: bool):
    """Accumulate without communication, parameters kept gathered, unless it is the stage's
    last backward of the step; the module's own settings come back afterwards."""
    saved = [(owner, name, getattr(owner, name)) for st in module._fs_states()
             for owner, names in ((st, ("requires_all_reduce",)), (st.grads, ("reduce_grads", "all_reduce_grads")),
                                  (st.unit, ("reshard_after_backward",)))
             if owner is not None for name in names]
    module.set_requires_gradient_sync(last)
    module.set_reshard_after_backward(last)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
