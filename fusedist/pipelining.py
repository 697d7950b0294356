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
    ``ScheduleDualPipeV``) split each backward into an input pass (``B``) and a weight pass
    (``W``, later, to fill the pipeline's bubbles) that computes the weights' gradients with
    ``torch.autograd.grad`` and writes ``.grad`` itself, outside the gradient hooks a sharded
    unit reduces from: with torch's own ``PipelineStage`` such a stage loses its gradients
    (and torch 2.13's FSDP2 ends with other weights under them than under 1F1B). Here the
    input pass of a sharded stage runs the whole backward -- weights included, through the
    hooks -- and its weight pass has nothing left to do: right gradients, without the
    bubbles' savings (the ``W`` slots stay idle). A warning says so once per stage. Which
    backward is the step's last is counted rather than taken from the schedule: every
    micro-batch's backward is computed once, in a full pass or an input pass (the first
    stage, whose input pass torch skips, runs it in its weight pass), and the stage's
    ``n_microbatches``-th of a step -- counted from its forward of micro-batch 0 -- reduces the
    sum. (The schedules' own ``last_backward`` counts weight passes, which here compute
    nothing.)

Note [pipeline stages of DDP modules]
    A stage wrapped by ``fusedist.DistributedDataParallel`` (or a ``fusedist.replicate``
    module) is treated alike, through its engine's switch for the next backward: torch's
    ``no_sync`` is read at the forward, and a pipeline runs its forwards micro-batches ahead
    of their backwards (1F1B runs a stage's first forwards before its first backward), so the
    switch is set right before each backward instead -- accumulate, or (the step's last)
    all-reduce the sum. Zero-bubble schedules run as for sharded stages. (For
    torch's own DDP, torch's schedules reach into its reducer; under torch 2.13 they fail in
    its bucket rebuild at the first step.) Any other stage module is left to torch's stage.
"""

from __future__ import annotations

import contextlib
import warnings

from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

__all__ = ["PipelineStage"]


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` for a stage module sharded by ``fusedist.fully_shard`` or
    wrapped by fusedist's DDP: one gradient reduction per step (Note [pipeline stages of
    fully_shard modules], Note [pipeline stages of DDP modules])."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if fwd_chunk_id == 0:  # a step begins: no backward of it has run yet
            self._backward_passes = 0
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        sync_only_if = _sync_switch(self.submod)
        if sync_only_if is None:  # not a module of fusedist's data parallelism: torch's stage decides
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        if backward_type == "weight":
            if bwd_kwargs.get("param_groups") is not None:
                raise RuntimeError(f"fusedist.pipelining.PipelineStage (stage {self.stage_index}): a weight pass "
                                   "after an input pass this stage did not run")
            return (), None  # done by the input pass (Note [pipeline stages of fully_shard modules])
        # Each micro-batch's backward is computed once, in a full pass or an input pass: the
        # step's last one reduces the sum.
        self._backward_passes = getattr(self, "_backward_passes", 0) + 1
        last = self.chunks is None or self._backward_passes >= self.chunks
        if backward_type == "input":
            self._warn_input_pass_runs_whole_backward()
            backward_type = "full"
            bwd_kwargs = {key: bwd_kwargs[key] for key in ("stage_output", "output_grads", "input_values")}
            if bwd_kwargs["output_grads"] is None and isinstance(bwd_kwargs["stage_output"], tuple):
                (bwd_kwargs["stage_output"],) = bwd_kwargs["stage_output"]  # the last stage's loss
        with sync_only_if(last):
            grads, _ = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last)
        return grads, None

    def _warn_input_pass_runs_whole_backward(self) -> None:
        if not getattr(self, "_warned_input_pass", False):
            self._warned_input_pass = True
            warnings.warn(
                f"fusedist.pipelining.PipelineStage (stage {self.stage_index}): a zero-bubble schedule's input pass "
                "runs the whole backward of the stage (weight gradients included, through the gradient hooks "
                "fusedist reduces from) and its weight pass nothing: the gradients are right, the bubbles the "
                "weight passes would fill stay (Note [pipeline stages of fully_shard modules])", stacklevel=3)


@contextlib.contextmanager
def _micro_batch(module, last: bool):
    """Accumulate without communication, parameters kept gathered, unless it is the stage's
    last backward of the step (and the user has not switched gradient sync off); the module's
    own settings come back afterwards."""
    states = module._fs_states()
    saved = [(owner, name, getattr(owner, name)) for st in states
             for owner, names in ((st, ("requires_all_reduce",)), (st.grads, ("reduce_grads", "all_reduce_grads")),
                                  (st.unit, ("reshard_after_backward",)))
             if owner is not None for name in names]
    # the user's own set_requires_gradient_sync(False) (accumulating across steps) still holds
    user_sync = all(st.grads.reduce_grads for st in states if st.grads is not None)
    module.set_requires_gradient_sync(last and user_sync)
    module.set_reshard_after_backward(last)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _sync_switch(module):
    """How to make the next backward of a stage module synchronize its gradients or only
    accumulate them: a context manager taking ``last``, or None for a module fusedist does not
    reduce (Note [pipeline stages of fully_shard modules])."""
    from .ddp import DistributedDataParallel
    from .ddp.replicate import _STATE, wrapper_of
    from .fsdp import FullyShardedModule

    if isinstance(module, FullyShardedModule):
        return lambda last: _micro_batch(module, last)
    if isinstance(module, DistributedDataParallel):  # the user's no_sync() still holds
        return lambda last: _ddp_backward(module, last and module._no_sync_depth == 0)
    engine = wrapper_of(module)  # a fusedist.replicate module's (built at its first forward)
    if engine is None:
        return None
    return lambda last: _ddp_backward(engine, last and module.__dict__[_STATE].requires_gradient_sync)


@contextlib.contextmanager
def _ddp_backward(engine, last: bool):
    """The DDP engine's next backward synchronizes only if it is the step's last: its switch is
    read when a backward begins, not at the forward, which a pipeline runs micro-batches ahead."""
    engine.reducer.next_backward_sync = last
    try:
        yield
    finally:
        engine.reducer.next_backward_sync = True
