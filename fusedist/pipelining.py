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
    fusedist stages] in _pipeline_passes.py) the input pass is torch's, over the parameters
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
    (Note [zero-bubble passes of fusedist stages] in _pipeline_passes.py). The stage gives up
    overlap of its weight gradients with the bubbles, not correctness.

Note [micro-batches of another shape]
    torch's stages receive each micro-batch's activations into buffers allocated once, at the
    first step, from micro-batch 0's shapes. A batch that ``n_microbatches`` does not divide
    (``tensor_split`` makes micro-batches of 3, 3, 2, 2 rows), or a later batch of another
    size, then failed far from its cause: gloo aborted the receiving process ("Received data
    size doesn't match expected size"), or a smaller micro-batch landed in the first rows of a
    larger buffer and the last stage's loss failed ("size of tensor a (3) must match b (2)")
    -- or, with a loss that broadcasts, trained on the stale rows silently. Only the sender
    can see the mismatch: the first stage checks each micro-batch's inputs (it is given them),
    and any stage whose next stage is on another rank checks its outputs against the buffers
    there, before they are sent. Later stages see only their fixed buffers; they learn of the
    error when the first stage's process ends (gloo: "Connection closed by peer"), or at the
    group's timeout. In a first step the buffers are sized from micro-batch 0, the largest of an
    uneven split: the first smaller micro-batch is refused, the ones before it already sent.

Note [uneven micro-batches on one rank]
    A pipeline whose stages are all on one rank passes tensors as they are, so a later batch of
    another size (another sequence length) is right there and left alone. A batch that
    ``n_microbatches`` does not divide is not: torch's schedules ran it, and divided the sum of
    the micro-batches' gradients by ``n_microbatches``, weighting each micro-batch's loss alike
    -- with a mean loss the rows of the smaller micro-batches counted more than the others', a
    gradient the unpipelined model on that batch does not give (by ~lr-sized amounts), and a
    batch the same pipeline over several ranks refuses. The first stage of such a pipeline
    refuses, in a step with backward, a micro-batch whose inputs differ in shape from the
    step's micro-batch 0 (a forward-only step computes no gradient and is left alone). It can
    only see one micro-batch at a time, so the micro-batches before it have run; torch's
    schedule keeps their losses after any error in a step (and hands them to the next step's
    backwards): the message says to make a new schedule.

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
    torch's division at a step's end takes ``p.grad`` whole, what earlier steps left there
    included: two synchronized steps before one optimizer step (gradient accumulation, the
    way an unpipelined model accumulates two batches' ``backward()``) gave ``g1 / n + g2``,
    the first batch weighted ``n_microbatches`` times less than the second, silently (torch's
    stage alike, for every kind of stage module). A step with backward sets aside a copy of
    the gradients the division will reach (``p.grad``, ZeRO-2's shards) at its first
    forward, and after the division adds back what it took of them: ``g1 + g2``, as without
    pipelining. Under the user's own switch (Note [accumulating across pipeline steps]) the
    copy waits for the next synchronized step, whose division is then undone for it alone.
    The copy costs one gradient-sized buffer in a step that starts with gradients held; none
    when they were zeroed to None. A tensor no longer the gradient at the division (the user
    set the gradients to None meanwhile) gets nothing back; a step that raised before its
    division drops its copy (the next step sets aside anew). (A DDP stage's accumulating step
    after a synchronized one adds its undivided sum to the divided ``p.grad``: the copy taken
    before the accumulating step is what keeps the two apart.)
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Optional

import torch
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from ._pipeline_inference import over_copied_buffers
from ._pipeline_passes import _input_pass, _plain_weight_pass, _weight_pass, _weights

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
    than the first (Note [micro-batches of another shape]); it also trains a stage whose
    inputs need no gradient under zero-bubble schedules (Note [a stage whose inputs need no gradient]),
    refuses a step's micro-batches of unequal shapes on one rank (Note [uneven micro-batches on one rank]),
    and weights whose paths go around the inputs' (Note [weight paths around the inputs] in _pipeline_passes.py);
    torch's shape inference leaves its buffers as they were (Note [shape inference leaves the stage
    as it was] in _pipeline_inference.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _stages[next(_made)] = self

    def _forward_metadata_inference(self, *args, **kwargs):
        with over_copied_buffers(self.submod):  # Note [shape inference leaves the stage as it was]
            return super()._forward_metadata_inference(*args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id: int, args=(), *rest, **kwargs):
        if fwd_chunk_id == 0:  # a step begins: no backward of it has run yet
            self._backward_passes = 0
            if self.has_backward:  # Note [accumulating over synchronized pipeline steps]
                if not getattr(self, "_held_over", False):  # (nor after a step that raised: set aside anew)
                    self._held_before = _set_aside(self.submod)
                self._held_over = False
        # Note [micro-batches of another shape] (torch releases without the buffers' metadata: not checked)
        meta = getattr(self, "_stage_meta", None)
        if meta is not None and self.is_first and self.group_size > 1:
            _check_shapes(self, fwd_chunk_id, "input", meta.inputs, args)
        elif self.is_first and self.has_backward:  # Note [uneven micro-batches on one rank] (or no buffer metadata)
            _check_even_split(self, fwd_chunk_id, args)
        output = super().forward_one_chunk(fwd_chunk_id, args, *rest, **kwargs)
        if meta is not None and not self.is_last and _next_on_another_rank(self):
            _check_shapes(self, fwd_chunk_id, "output", meta.outputs, output)
        return output

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
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
            if backward_type == "input":  # Note [weight paths around the inputs] (_pipeline_passes.py)
                return _input_pass(self.submod, bwd_kwargs)
            _plain_weight_pass(self.submod, bwd_kwargs["param_groups"])
            return (), None
        if backward_type == "input":  # Note [zero-bubble passes of fusedist stages] (_pipeline_passes.py)
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
        super().scale_grads(grad_scale_factor)
        if grad_scale_factor != 1:
            for holder in _holders_outside_grad(self.submod):
                torch._foreach_div_(holder._fusedist_unscale_targets(), grad_scale_factor)
            _give_back(self.submod, held or [], grad_scale_factor)


def _divided(module) -> list:
    """The gradients a step's division reaches: ``p.grad`` of the module's parameters, and the
    shards of ZeRO-2 optimizers over them (Note [gradients held outside p.grad])."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return grads + [g for holder in _holders_outside_grad(module) for g in holder._fusedist_unscale_targets()]


def _set_aside(module) -> list:
    """Each gradient held before a step, with a copy of its value (Note [accumulating over
    synchronized pipeline steps])."""
    with torch.no_grad():
        return [(grad, grad.clone()) for grad in _divided(module)]


def _give_back(module, held: list, factor: int) -> None:
    """Add back to each gradient held before the step the part of its earlier value the step's
    division took, where it is still a gradient the division reached."""
    current = {id(grad) for grad in _divided(module)}
    with torch.no_grad():
        for grad, before in held:
            if id(grad) in current:
                grad.add_(before, alpha=1 - 1 / factor)


def _next_on_another_rank(stage) -> bool:
    ranks = getattr(stage, "stage_index_to_group_rank", None)
    return ranks is not None and ranks.get(stage.stage_index + 1, stage.group_rank) != stage.group_rank


def _check_shapes(stage, chunk: int, kind: str, metas, values) -> None:
    """Refuse a micro-batch whose tensors differ from the shapes the receive buffers were made
    for (Note [micro-batches of another shape]), naming the stage, the micro-batch and both shapes."""
    if metas is None:
        return
    values = values if isinstance(values, (tuple, list)) else (values,)
    for i, (meta, value) in enumerate(zip(metas, values)):
        if meta is None or not isinstance(value, torch.Tensor):
            continue
        local = getattr(value, "_local_tensor", value)  # a DTensor's metadata is its local shard's
        if tuple(local.shape) == tuple(meta.shape) and local.dtype == meta.dtype:
            continue
        if kind == "input":
            fix = (f"Give each step a batch of the same size, divisible by n_microbatches ({stage.chunks}) (with a "
                   "DataLoader: drop_last=True, so the last batch is not smaller)")
        else:
            fix = "Make the stage's outputs keep their shapes from micro-batch to micro-batch (pad or trim them)"
        raise RuntimeError(
            f"fusedist.pipelining.PipelineStage: stage {stage.stage_index}, micro-batch {chunk}: {kind} {i} has "
            f"shape {tuple(local.shape)} ({local.dtype}), expected {tuple(meta.shape)} ({meta.dtype}): the "
            "pipeline's stages receive into buffers sized from micro-batch 0 of its first step, so every "
            f"micro-batch of every step must have that shape. {fix}")


def _check_even_split(stage, chunk: int, args) -> None:
    """Refuse a micro-batch of another shape than the step's micro-batch 0 (Note [uneven
    micro-batches on one rank]), naming the stage, the micro-batch and both shapes."""
    args = args if isinstance(args, (tuple, list)) else (args,)
    shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args]
    if chunk == 0:
        stage._first_shapes = shapes
        return
    first = getattr(stage, "_first_shapes", None)
    for i, (shape, expected) in enumerate(zip(shapes, first or ())):
        if shape is None or expected is None or shape == expected:
            continue
        raise RuntimeError(
            f"fusedist.pipelining.PipelineStage: stage {stage.stage_index}, micro-batch {chunk}: input {i} has shape "
            f"{shape}, micro-batch 0 of this step {expected}: the step's batch does not split into {stage.chunks} "
            "equal micro-batches. torch's schedules divide the micro-batches' summed gradients by n_microbatches, "
            "weighting every micro-batch's loss alike, so with a mean loss the rows of the smaller micro-batches "
            "would count more than the others' and the gradient would not be the batch's. Give each step a batch "
            f"divisible by n_microbatches ({stage.chunks}) (with a DataLoader: drop_last=True). The micro-batches "
            "before this one may have been backpropagated and torch's schedule keeps their losses: to train on, zero "
            "the gradients and make a new schedule over the stages")


def stage_holders_outside_grad() -> list:
    """The distinct gradient holders keeping gradients outside ``p.grad`` (ZeRO stage 2) of
    this process's live stages' parameters, in the order the stages were made."""
    found: dict = {}
    for _, stage in sorted(_stages.items(), key=lambda item: item[0]):
        for holder in _holders_outside_grad(stage.submod):
            found.setdefault(id(holder), holder)
    return list(found.values())


def _check_root_sharded(module, stage_index: int) -> None:
    """A zero-bubble pass over a plain stage module holding ``fully_shard`` units would be
    torch's, over the units' pieces the graph never saw (Note [pipeline stages of fully_shard
    modules]): it failed inside torch with a KeyError of an ``AccumulateGrad`` node. Refuse it
    naming the fix instead."""
    from .fsdp import FullyShardedModule

    inner = next((name for name, m in module.named_modules() if isinstance(m, FullyShardedModule)), None)
    if inner is not None:
        raise RuntimeError(
            f"fusedist.pipelining.PipelineStage: stage {stage_index}'s module is not a fully_shard module itself, "
            f"but holds one ('{inner}'); zero-bubble schedules split its backward over the gathered parameters of "
            "a fully_shard stage only: shard the stage module too, fully_shard(stage_module, mesh=...) after its "
            "blocks (or use a schedule without weight passes)")


def _as_full(bwd_kwargs: dict) -> dict:
    """An input pass's arguments as a full pass's: torch wraps the last stage's loss in a tuple
    for the input pass, and a full pass skips a tuple without output gradients."""
    output = bwd_kwargs["stage_output"]
    if bwd_kwargs["output_grads"] is None and isinstance(output, tuple) and len(output) == 1:
        return {**bwd_kwargs, "stage_output": output[0]}
    return bwd_kwargs


def _weights_miss_the_inputs(module, input_values) -> bool:
    """An input pass would lose the weights' gradients: the stage has trainable weights but no
    input that requires a gradient (Note [a stage whose inputs need no gradient]). Modules of
    torch's own data parallelism are left to torch's stage, which switches their sync itself."""
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in input_values):
        return False
    if _torch_data_parallel(module):
        return False
    return bool(_weights(module))


def _holders_outside_grad(module) -> list:
    """The distinct gradient holders of ``module``'s parameters that keep the gradients where
    ``p.grad`` is not (ZeRO stage 2's shards; a ``fully_shard`` shard is ``p.grad`` itself)."""
    from .ownership import any_gradient_holder, gradient_holder

    found = {}
    for p in module.parameters() if any_gradient_holder() else ():
        holder = gradient_holder(p)
        in_user_view = getattr(holder, "_fusedist_grads_in_user_view", None)
        if in_user_view is not None and not in_user_view():
            found.setdefault(id(holder), holder)
    return list(found.values())


def _torch_data_parallel(module) -> bool:
    """A module of torch's own data parallelism, whose passes torch's stage runs (it switches
    their gradient sync itself)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    return isinstance(module, (FSDPModule, TorchDDP))


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
    module.set_requires_gradient_sync(last and _user_sync(module))
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
    from .ddp.replicate import wrapper_of
    from .fsdp import FullyShardedModule

    if isinstance(module, FullyShardedModule):
        return lambda last: _micro_batch(module, last)
    if isinstance(module, DistributedDataParallel):  # the user's no_sync() still holds
        return lambda last: _ddp_backward(module, last and _user_sync(module))
    engine = wrapper_of(module)  # a fusedist.replicate module's (built at its first forward)
    if engine is None:
        return None
    return lambda last: _ddp_backward(engine, last and _user_sync(module))


def _user_sync(module) -> Optional[bool]:
    """The user's own switch of a stage module fusedist reduces: False under
    ``set_requires_gradient_sync(False)`` or DDP's ``no_sync`` (accumulating across steps),
    None for a module fusedist does not reduce."""
    from .ddp import DistributedDataParallel
    from .ddp.replicate import _STATE, wrapper_of
    from .fsdp import FullyShardedModule

    if isinstance(module, FullyShardedModule):
        return all(st.grads.reduce_grads for st in module._fs_states() if st.grads is not None)
    if isinstance(module, DistributedDataParallel):
        return module.require_backward_grad_sync
    if wrapper_of(module) is None:
        return None
    return bool(module.__dict__[_STATE].requires_gradient_sync)


@contextlib.contextmanager
def _ddp_backward(engine, last: bool):
    """The DDP engine's next backward synchronizes only if it is the step's last: its switch is
    read when a backward begins, not at the forward, which a pipeline runs micro-batches ahead."""
    engine.reducer.next_backward_sync = last
    engine.reducer.prepared = True  # each micro-batch's forward prepared it, runs ago
    try:
        yield
    finally:
        engine.reducer.next_backward_sync = True
