"""The pipeline stage class: torch's ``PipelineStage`` with its forward, backward and step hooks
overridden. What it does and why is told in the package's Notes (__init__.py); the parts it calls
live in the package's other modules, one job each."""

from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from .inference import (
    InferenceFailed, PeerFailedFirstSend, PeerInferenceFailed, activations_carry_gradients, arm_first_sends,
    check_even_split, check_sent_outputs, check_shapes, check_stage_outputs, failing_inference, failure_message,
    next_on_another_rank, notice_recv_ops, notice_send_ops, over_copied_buffers, read_notice, send_failure)
from .notice_back import (
    PeerFailedFirstSendAfter, arm_back, back_recv_ops, back_send_ops, guard_first_loss, read_back_notice,
    tell_upstream)
from .passes import _as_full, _check_root_sharded, _input_pass, _plain_weight_pass, _weight_pass, _weights
from .placement import check_placement
from .small_batch import refuse_short_batch, restore_count, wrap_split
from .step_failures import Step, after_the_last_step, kept_buffers, last_schedule, schedule_stepping
from .schedule_step import wrap_step
from .set_aside import _divided, _give_back, _holders_outside_grad, _SetAside
from .step_status import (
    backward_failure_told, began, micro_batches, publish_first_step_failure, put_back_buffers, several_armed,
    single_armed, status_armed, step_end_failure, told_at_step_end)
from .step_verdict import StepVerdicts, raise_told, read_now
from .sync_switch import _sync_switch, _torch_data_parallel, _user_sync
from .told_peers import step_began, wait_until_told
from .vote import backward_result, forward_vote
from ..reliability import failed_elsewhere

__all__ = ["PipelineStage"]

# The live stages of this process, in the order they were made (the same on every rank of a
# stage's data-parallel group): whose gradients a clip across the stages measures (Note
# [torchtitan's clip across pipeline stages of stage 2] in fusedist/optim/torch_clip.py).
_stages: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_made = itertools.count()


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` for a stage module sharded by ``fusedist.fully_shard`` or
    wrapped by fusedist's DDP: one gradient reduction per step (Note [pipeline stages of
    fully_shard modules], Note [pipeline stages of DDP modules]); it refuses a micro-batch of another shape
    than the first (Note [micro-batches of another shape] in inference.py); it also trains a stage whose
    inputs need no gradient under zero-bubble schedules (Note [a stage whose inputs need no gradient]),
    refuses a step's micro-batches of unequal shapes on one rank (Note [uneven micro-batches on one rank]),
    leaves no trace of a step that raised, or refuses the next (Note [a step that raised]; also where its own part
    of the step had ended: Note [a stage that ended in a step that raised] in step_failures.py),
    fails a first send it
    cannot make on the receiving rank too (Note [a first send that cannot be made] in inference.py),
    and on the ranks before it (Note [a first send that cannot be made, told upstream] in
    notice_back.py), fails every rank at once after a failure anywhere in a step (Note [a failure
    told at the step's end] in step_status.py), and every data-parallel peer too (Note [a first-step
    failure told to the data-parallel peers] there), refuses schedules of different micro-batch counts on
    every rank at once (Note [micro-batch counts that differ across ranks] in vote.py), and stage counts
    or placements that differ (Note [stage counts that differ across ranks] in placement.py),
    and weights whose paths go around the inputs' (Note [weight paths around the inputs] in passes.py);
    torch's shape inference leaves its buffers as they were (Note [shape inference leaves the stage
    as it was] in inference.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _stages[next(_made)] = self

    def _forward_metadata_inference(self, args, kwargs=None, has_backward: bool = False):
        with over_copied_buffers(self.submod):  # Note [shape inference leaves the stage as it was]
            # Note [a shape inference that fails on one rank] (inference.py)
            return failing_inference(self, lambda: _refusing_short_batches(self, lambda: super(
                PipelineStage, self)._forward_metadata_inference(args, kwargs, has_backward)),
                backward=False, has_backward=has_backward, told=self._told)

    def _backward_metadata_inference(self, *args, **kwargs):
        return failing_inference(self, lambda: super(PipelineStage, self)._backward_metadata_inference(
            *args, **kwargs), backward=True, has_backward=True, told=self._told)

    def _told(self) -> None:
        """Every rank learned of the step's failed shape inference, before any of the step's own
        messages: the step left nothing unmatched (Note [a step that raised])."""
        schedule = last_schedule(self)
        for stage in [getattr(schedule, "_stage", None), *getattr(schedule, "_stages", ())]:
            if getattr(stage, "_step", None) is not None:
                stage._step.ended = True

    def _compute_outputs(self, *args, module, **kwargs):
        outputs = super()._compute_outputs(*args, module=module, **kwargs)
        check_stage_outputs(self, outputs)
        return outputs

    def _recv_meta(self, src_stage: int):
        meta = super()._recv_meta(src_stage)
        if isinstance(meta, InferenceFailed):
            raise PeerInferenceFailed(meta)
        return meta

    def _send_meta(self, meta, dst_stage: int) -> None:
        self._fusedist_meta_sent = True
        super()._send_meta(meta, dst_stage)

    def _warmup_forward_vote(self, has_backward: bool, received_acc=None):
        if received_acc is None:  # this rank's first stage in the set-up's vote
            schedule = schedule_stepping(self)
            found = (getattr(schedule, "_stage", None), *getattr(schedule, "_stages", ()))
            stages = [s for s in found if s is not None]
            try:  # Note [stage counts that differ across ranks] (placement.py)
                check_placement(self, stages or [self])
            except RuntimeError as e:  # (told to the data-parallel peers too: Note [a first-step failure told...)
                publish_first_step_failure(self, str(e))
                self._told()
                raise
        return forward_vote(self, has_backward, received_acc)  # Note [micro-batch counts that differ across ranks]

    def _warmup_backward_result(self, received_result=None):
        return backward_result(self, received_result)  # (vote.py)

    def _prepare_forward_infra(self, *args, **kwargs):
        refusal, self._counts_differ = getattr(self, "_counts_differ", None), None
        if refusal is not None:  # every rank raises here, before the step's first message
            publish_first_step_failure(self, refusal)  # (and its data-parallel peers learn it: step_status.py)
            self._told()
            raise RuntimeError(refusal)
        if getattr(getattr(self, "_inference_mode", None), "value", None) == "static":
            activations_carry_gradients(self)  # Note [examples that need no gradient] (inference.py)
        out = super()._prepare_forward_infra(*args, **kwargs)
        arm_first_sends(self)  # Note [a first send that cannot be made] (inference.py)
        # Note [a first send that cannot be made, told upstream] (notice_back.py)
        arm_back(self, kwargs.get("has_backward", args[3] if len(args) > 3 else False))
        return out

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        getattr(self, "_fwd_recvs_made", set()).add(fwd_chunk_id)
        return notice_recv_ops(self, fwd_chunk_id) + super().get_fwd_recv_ops(fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        getattr(self, "_fwd_sends_made", set()).add(fwd_chunk_id)
        return notice_send_ops(self, fwd_chunk_id) + super().get_fwd_send_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        getattr(self, "_bwd_recvs_made", set()).add(bwd_chunk_id)
        return back_recv_ops(self, bwd_chunk_id) + super().get_bwd_recv_ops(bwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        getattr(self, "_bwd_sends_made", set()).add(bwd_chunk_id)
        return back_send_ops(self, bwd_chunk_id) + super().get_bwd_send_ops(bwd_chunk_id)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        try:  # Note [a first send that cannot be made, told upstream] (notice_back.py)
            read_back_notice(self, bwd_chunk_id)
        except PeerFailedFirstSendAfter as e:
            publish_first_step_failure(self, str(e))  # Note [a first-step failure told to the data-parallel peers]
            tell_upstream(self, bwd_chunk_id, str(e), told=True)
            put_back_buffers(self)  # Note [the buffers a failed step puts back] (step_failures.py)
            raise RuntimeError(str(e)) from None
        with backward_failure_told(self, bwd_chunk_id):  # Note [a failure told at the step's end]
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        with backward_failure_told(self, bwd_chunk_id):  # (step_status.py)
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id: int, args=(), *rest, **kwargs):
        try:  # Note [a first send that cannot be made] (inference.py)
            read_notice(self, fwd_chunk_id)
            return self._forward_one_chunk(fwd_chunk_id, args, *rest, **kwargs)
        except Exception as e:
            told = fwd_chunk_id == 0 and (getattr(self, "_notice_to", False) or getattr(self, "_back_notice_to", False))
            if not isinstance(e, PeerFailedFirstSend) and not (told and getattr(self, "_back_armed", False)) \
                    and (failed := told_at_step_end(self, fwd_chunk_id, e, "", False)) is not None:
                raise failed from e  # Note [a failure told at the step's end] (step_status.py)
            put_back_buffers(self)  # Note [the buffers a failed step puts back] (step_failures.py)
            # a wait failed by a data-parallel peer's failure tells that failure (Note [a first-step failure told
            # to the data-parallel peers] in step_status.py), and this rank publishes what it raises
            elsewhere = None if isinstance(e, PeerFailedFirstSend) else failed_elsewhere.failure_told(e)
            message = elsewhere or (str(e) if isinstance(e, PeerFailedFirstSend) else failure_message(
                self, fwd_chunk_id, e))
            if told or isinstance(e, PeerFailedFirstSend):
                publish_first_step_failure(self, message)
            send_failure(self, fwd_chunk_id, e, message)
            if isinstance(e, PeerFailedFirstSend):
                raise RuntimeError(message) from None
            tell_upstream(self, fwd_chunk_id, message, told=False)  # (notice_back.py)
            if (told or elsewhere) and message != str(e):  # the message the other ranks raise: stage and cause
                raise RuntimeError(message) from e
            raise

    def _forward_one_chunk(self, fwd_chunk_id: int, args=(), *rest, **kwargs):
        step = getattr(self, "_step", None)  # Note [a step that raised]
        if fwd_chunk_id == 0:  # a step begins: no backward of it has run yet
            self._backward_passes = 0
            if step is not None and (self.group_size == 1 or status_armed(self)):  # what a failed step puts back
                step.buffers = kept_buffers(self).began(self.submod)
            if self.has_backward:  # Note [accumulating over synchronized pipeline steps]
                held_over = getattr(self, "_held_over", False)
                if not held_over:
                    self._held_before = _SetAside(_divided(self.submod))
                self._held_over = False
                if step is not None:
                    step.began(self.submod, held_over)
        if fwd_chunk_id == 0:  # Note [a batch smaller than n_microbatches] (small_batch.py)
            refuse_short_batch(self, "inputs")
            refuse_short_batch(self, "target")
        # Note [micro-batches of another shape] (torch releases without the buffers' metadata: not checked)
        meta = getattr(self, "_stage_meta", None)
        if meta is not None and self.is_first and self.group_size > 1:
            check_shapes(self, fwd_chunk_id, "input", meta.inputs, args)
        elif self.is_first and self.has_backward and _divides_the_sum(self):
            check_even_split(self, fwd_chunk_id, args)  # Note [uneven micro-batches on one rank] (or no metadata)
        output = super().forward_one_chunk(fwd_chunk_id, args, *rest, **kwargs)
        if meta is not None and not self.is_last and next_on_another_rank(self):
            check_sent_outputs(self, fwd_chunk_id, output)
            check_shapes(self, fwd_chunk_id, "output", meta.outputs, output)
        if step is not None:
            step.forwards += 1
            if not self.has_backward and step.forwards >= micro_batches(self) and not status_armed(self):
                step.end()  # (else at the status exchange: Note [a failure told at the step's end])
        return output

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if getattr(self, "_step", None) is not None:  # Note [a step that raised]
            self._step.backwards += 1
        if getattr(self, "_held_before", None) is not None:  # copied before the step's passes change them
            self._held_before.pairs()
        sync_only_if = _sync_switch(self.submod)
        if sync_only_if is None and backward_type != "full" and not getattr(self, "_root_checked", False):
            _check_root_sharded(self.submod, self.stage_index)
            self._root_checked = True
        if backward_type == "input" and _weights_miss_the_inputs(self.submod, bwd_kwargs["input_values"]):
            # Note [a stage whose inputs need no gradient]
            with sync_only_if(False) if sync_only_if is not None else contextlib.nullcontext():
                grads, _ = super().backward_maybe_with_nosync("full", _as_full(bwd_kwargs), last_backward=False)
            return grads, []
        if sync_only_if is None:  # not a module of fusedist's data parallelism
            if backward_type == "full" or _torch_data_parallel(self.submod):  # torch's stage decides
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
            if backward_type == "input":  # Note [weight paths around the inputs] (passes.py)
                return _input_pass(self.submod, bwd_kwargs)
            _plain_weight_pass(self.submod, bwd_kwargs["param_groups"])
            return (), None
        if backward_type == "input":  # Note [zero-bubble passes of fusedist stages] (passes.py)
            with sync_only_if(False):
                return _input_pass(self.submod, bwd_kwargs)
        # Each micro-batch's weight gradients are computed once, in a full pass or a weight
        # pass: the step's last one reduces the sum.
        self._backward_passes = getattr(self, "_backward_passes", 0) + 1
        last = self.chunks is None or self._backward_passes >= self.chunks
        with sync_only_if(last):
            if backward_type == "weight":
                _weight_pass(self.submod, bwd_kwargs["param_groups"])
                return (), None
            grads, _ = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last)
        return grads, None

    def clear_runtime_states(self) -> None:
        """torch's clearing at a step's beginning; after a step that raised before its end, the
        stage is put back as that step found it, or every later step is refused (Note [a step
        that raised])."""
        schedule, gave_up = schedule_stepping(self), None
        if schedule is not None:
            restore_count(schedule)  # (a count lent to a split that raised: Note [a batch smaller than ...])
            plain = self._plain_stage = _sync_switch(self.submod) is None and not _torch_data_parallel(self.submod)
            after_the_last_step(self, schedule, plain)
            self._step, self._stepping = Step(), weakref.ref(schedule)
            step_began(self)  # (its number, for the errors of Note [the next step waits until the peers...])
            if self.is_last:
                guard_first_loss(schedule)  # Note [a first send that cannot be made, told upstream]
            wrap_step(schedule)  # Note [the targets a step was given] (schedule_step.py)
            wrap_split(schedule)  # Note [a batch smaller than n_microbatches] (small_batch.py)
            if getattr(self, "_published_elsewhere", None):  # (the last step published its failure)
                gave_up = wait_until_told(self, self._published_elsewhere)  # Note [the next step waits until the...
        began(self, schedule is not None)  # Note [a failure told at the step's end] (step_status.py)
        self._peers_gave_up_on = gave_up
        super().clear_runtime_states()

    def perform_reduce_grad(self, grad_scale_factor: int):
        if several_armed(self):  # Note [a failure told at the step's end, several stages per rank]
            if getattr(self, "_plain_stage", False):  # (a division only: after the rank's exchange)
                self._reduce_held = grad_scale_factor
                return
            return super().perform_reduce_grad(grad_scale_factor)
        # Note [the step check's verdict read at the step's end] (step_verdict.py)
        if self.group_size == 1:
            read_now(self)
        verdicts = StepVerdicts([self]) if single_armed(self) and not getattr(self, "_status_told", False) else None
        # Note [a failure told at the step's end] (step_status.py)
        failure = step_end_failure(self, verdicts)
        if failure is not None:
            raise_told(failure, verdicts)
        if getattr(self, "_step", None) is not None:  # the step's messages are all exchanged
            self._step.end()
        super().perform_reduce_grad(grad_scale_factor)

    def _step_told_ended(self) -> None:
        """No rank failed in the step (several stages per rank): the division held back, the step's end."""
        factor, self._reduce_held = getattr(self, "_reduce_held", None), None
        if factor is not None:
            super().perform_reduce_grad(factor)
        if getattr(self, "_step", None) is not None:
            self._step.end()

    def scale_grads(self, grad_scale_factor: int) -> None:
        """torch's division of the step's gradients by the micro-batch count, also of those a
        sharded optimizer holds outside ``p.grad`` (Note [gradients held outside p.grad]); none
        in a step that only accumulates, under the user's own switch (Note [accumulating across
        pipeline steps]); none in a forward-only step (Note [an eval step divides nothing]); and
        none of the gradients earlier steps left (Note [accumulating over synchronized pipeline steps])."""
        if not self.has_backward:
            return
        if _user_sync(self.submod) is False:
            self._held_over = True  # the set-aside waits for the synchronized step
            return
        held, self._held_before = getattr(self, "_held_before", None), None
        if getattr(self, "_step", None) is not None:  # Note [a stage that ended in a step that raised]
            self._step.set_aside = held
        super().scale_grads(grad_scale_factor)
        if grad_scale_factor != 1:
            for holder in _holders_outside_grad(self.submod):
                torch._foreach_div_(holder._fusedist_unscale_targets(), grad_scale_factor)
            _give_back(self.submod, held.pairs() if held is not None else [], grad_scale_factor)


def stage_holders_outside_grad() -> list:
    """The distinct gradient holders keeping gradients outside ``p.grad`` (ZeRO stage 2) of
    this process's live stages' parameters, in the order the stages were made."""
    found: dict = {}
    for _, stage in sorted(_stages.items(), key=lambda item: item[0]):
        for holder in _holders_outside_grad(stage.submod):
            found.setdefault(id(holder), holder)
    return list(found.values())


def _refusing_short_batches(stage, infer):
    """The stage's shape inference, refusing a step's batch too short to split (Note [a batch smaller than
    n_microbatches] in small_batch.py): the first stage's inputs before it runs on them, the last
    stage's target after its inference, where a failure of its own forward would be."""
    refuse_short_batch(stage, "inputs", named=False)
    result = infer()
    refuse_short_batch(stage, "target", named=False)
    return result


def _divides_the_sum(stage) -> bool:
    """The schedule stepping the stage divides the micro-batches' summed gradients by their count
    (``scale_grads=True``, torch's default; assumed when the stage is driven by hand). Under
    ``scale_grads=False`` (a loss that sums, as torch's schedules document) an uneven split gives the
    batch's gradient, and is not refused (Note [uneven micro-batches on one rank])."""
    schedule = last_schedule(stage)
    return schedule is None or getattr(schedule, "scale_grads", True) is not False


def _weights_miss_the_inputs(module, input_values) -> bool:
    """An input pass would lose the weights' gradients: the stage has trainable weights but no
    input that requires a gradient (Note [a stage whose inputs need no gradient]). Modules of
    torch's own data parallelism are left to torch's stage, which switches their sync itself."""
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in input_values):
        return False
    if _torch_data_parallel(module):
        return False
    return bool(_weights(module))
