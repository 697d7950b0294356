"""How a bucket's gradients are combined across ranks: the reducer's strategy interface and
its default, averaging with one all-reduce (ZeRO stage 2 installs a reduce-scatter strategy,
``fusedist/zero/grad_sync.py``).

Note [division folded into the copy]
    Averaging divides every gradient by the world size before the sum (``divide_factors``).
    Done at launch, that is one more pass over each bucket. But a gradient
    that arrives as a fresh tensor (after ``zero_grad(set_to_none=True)``, the common case)
    is copied into its bucket view by the hook anyway, so the hook multiplies by ``1 / pre``
    on the way (torch DDP scales while copying too) and the bucket needs no pass of its own.
    At the start of each synchronized backward the strategy gives every bucket its ``fold``
    factor (None: nothing folded -- no_sync backwards, a ``reduce_dtype`` conversion, or a
    bucket of small parameters, where the dispatch of a multiply-copy costs more than the
    pass it saves). Gradients that land in a folding bucket another way -- accumulated in
    place into the view (after no_sync backwards, or ``zero_grad(set_to_none=False)``), or
    left from an earlier backward by an unused parameter -- are listed in the bucket's
    ``unfolded`` and scaled at launch, view by view. Either way each gradient is multiplied
    by ``1 / pre`` exactly once, so the result does not depend on the path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .._dtypes import fp16_divisors, real_pairs
from ..comm import CommHandle
from .layout import Bucket

if TYPE_CHECKING:
    from .reducer import Reducer


class GradSyncStrategy:
    """How a bucket's gradients are combined across ranks.

    ``launch`` starts the (asynchronous) collective and returns its handle; ``finish`` waits
    for it and leaves the bucket's result where the consumer expects it. ``finish`` runs once
    per bucket, in bucket order, either in a gradient hook once the collective has completed
    or at the end of backward (Note [finishing buckets during backward]). The default
    averages with an all-reduce; ZeRO stage 2 installs a reduce-scatter strategy.
    """

    #: Launched buckets allowed unfinished at once (Note [buckets in flight] in in_flight.py); None: no bound.
    max_buckets_in_flight: Optional[int] = None
    #: Whether state outside the reducer follows the buckets' indices and sizes (a communication
    #: hook's, e.g. PowerSGD's error feedback), so a trainable-set change must keep them
    #: (Note [trainable set changes] in trainable.py).
    keeps_buckets: bool = False

    @property
    def description(self) -> str:
        """What synchronizes the buckets, for errors."""
        return type(self).__name__

    def launch(self, reducer: "Reducer", bucket: Bucket) -> CommHandle:
        raise NotImplementedError

    def finish(self, reducer: "Reducer", bucket: Bucket, handle: CommHandle) -> None:
        raise NotImplementedError

    def fold_factor(self, reducer: "Reducer", bucket: Bucket) -> Optional[float]:
        """The factor the gradient hooks may multiply fresh gradients by while copying them
        into ``bucket`` in a synchronized backward (Note [division folded into the copy]);
        None: the launch scales the whole bucket. The default folds nothing."""
        return None

    def quiesce(self, reducer: "Reducer") -> None:
        """Called after the last launch of a synchronized backward, before the reducer or its
        observers issue a collective of their own: a strategy whose launches keep issuing
        collectives in the background (a communication hook's callbacks) lets them finish."""

    # For a strategy that manages the gradient buffers itself (ZeRO stage 2 releases them
    # between backward passes); the default does nothing, so the all-reduce path is unchanged.
    def after_sync(self, reducer: "Reducer") -> None:
        """Called at the end of every synchronized backward, after every bucket finished and
        after the one-time layout rebuild (so ``reducer.layout`` is the current layout)."""


# Note [complex buckets]
#     A complex parameter's gradient gets a complex bucket, as in torch's DDP. Its collectives
#     carry it as its real pairs (``real_pairs``), as torch's process groups do: a sum or an
#     average acts on both parts alike, and NCCL has no complex dtypes. Anything that converts a
#     bucket (a ``reduce_dtype``, and torch's fp16/bf16 compression hooks, which map onto it)
#     converts those real pairs, as torch's DDP does: its hooks get a complex bucket's
#     ``buffer()`` as its real pairs, so ``fp16_compress_hook`` sends both parts in fp16. A plain
#     ``.to(reduce_dtype)`` of the complex bucket would drop its imaginary parts. A
#     communication hook sees the real pairs too (``HookBucket.buffer()`` in comm_hook.py).


def to_wire(data: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
    """``data`` as reduced in ``reduce_dtype``: itself, or a converted copy (Note [complex buckets])."""
    return data if reduce_dtype == data.dtype else real_pairs(data).to(reduce_dtype)


def from_wire(data: torch.Tensor, wire: torch.Tensor) -> None:
    """Copy the reduced ``wire`` back into ``data`` unless it is ``data`` itself."""
    if wire.data_ptr() != data.data_ptr() or wire.dtype != data.dtype:
        real_pairs(data).copy_(real_pairs(wire))


def bucket_divide_factors(reducer: "Reducer", dtype: torch.dtype) -> tuple[float, float]:
    """:func:`divide_factors` for a DDP model's buckets: all before the sum where a compression
    hook asked for torch's division (``DDPConfig.divide_first``)."""
    if reducer.config.divide_first:
        return float(reducer.grad_divisor), 1.0
    return divide_factors(reducer.grad_divisor, dtype)


def divide_factors(world_size: int, dtype: torch.dtype) -> tuple[float, float]:
    """(pre, post) divisors whose product is ``world_size``.

    fp32/bf16: divide fully before the sum (torch DDP's numerics). fp16: split the division
    around the sum (``fp16_divisors``, torch FSDP2's rule) so neither the sum can overflow nor
    small gradients underflow to zero.
    """
    if dtype == torch.float16:
        return fp16_divisors(world_size)
    return float(world_size), 1.0


#: A bucket folds its division into the gradient copies only if its parameters average at
#: least this many elements: a multiply-copy costs ~1.3 us more to dispatch than a plain
#: copy, and the pass it saves (a multiply over the bucket) costs about that per 32K
#: elements on a CPU core, far less per element on a GPU.
FOLD_MIN_ELEMENTS_PER_PARAM = 32768


def pre_division_fold(reducer: "Reducer", bucket: Bucket) -> Optional[float]:
    """``1 / pre`` for a bucket reduced in its own dtype whose parameters are large enough
    to be worth folding (``FOLD_MIN_ELEMENTS_PER_PARAM``); else None."""
    reduce_dtype = reducer.config.reduce_dtype or bucket.dtype
    if reduce_dtype != bucket.dtype or bucket.numel < FOLD_MIN_ELEMENTS_PER_PARAM * len(bucket.params):
        return None
    pre, _ = bucket_divide_factors(reducer, reduce_dtype)
    return 1.0 / pre if pre != 1.0 else None


def divide_before_sum(bucket: Bucket, wire: torch.Tensor, pre: float) -> None:
    """Divide ``wire`` (the bucket's data, or its ``reduce_dtype`` copy) by ``pre`` before
    the collective sums it: only the views the hooks did not scale when the bucket folds
    its division (Note [division folded into the copy]), else all of it.
    A multiplication by ``1 / pre`` either way (as torch DDP scales its buckets), so a
    gradient gets the same bits whichever path it took."""
    if bucket.fold is not None and wire is bucket.data:
        for view in bucket.unfolded:
            view.mul_(bucket.fold)
    elif pre != 1.0:
        wire.mul_(1.0 / pre)


class AllReduceAverage(GradSyncStrategy):
    """Average a bucket with one all-reduce, optionally in a narrower ``reduce_dtype``."""

    def launch(self, reducer, bucket):
        data = bucket.data
        reduce_dtype = reducer.config.reduce_dtype or data.dtype
        pre, _ = bucket_divide_factors(reducer, reduce_dtype)
        wire = to_wire(data, reduce_dtype)
        divide_before_sum(bucket, wire, pre)
        carrier = reducer.check_carrier
        tail = None
        if bucket.index == len(reducer.layout.buckets) - 1 and carrier is not None and carrier.carries(reducer):
            # Note [the check carried by the last bucket] in fusedist/reliability/carried_check.py
            tail = carrier.carry_tail(reducer, wire.dtype)
            message = torch.empty(wire.numel() + tail.numel(), dtype=wire.dtype, device=wire.device)
            message[:wire.numel()].copy_(wire.view(-1))
            message[wire.numel():].copy_(tail)
            wire, tail = message[:wire.numel()], message[wire.numel():]
        reducer.bucket_scratch[bucket.index] = wire
        # The buckets' layout is checked across ranks and their op is fixed: no fingerprints (Note [parts a
        # caller checked] in fusedist/comm/base.py). A joined rank's shadow of a bucket comes through here too.
        handle = reducer.comm.all_reduce(real_pairs(wire) if tail is None else message, async_op=True,
                                         tag=f"ddp bucket {bucket.index}", parts_checked=True)
        if tail is not None:
            carrier.carried(reducer, handle, tail)
        return handle

    def fold_factor(self, reducer, bucket):
        return pre_division_fold(reducer, bucket)

    def finish(self, reducer, bucket, handle):
        handle.wait()
        wire = reducer.bucket_scratch.pop(bucket.index)
        reduce_dtype = reducer.config.reduce_dtype or bucket.data.dtype
        _, post = bucket_divide_factors(reducer, reduce_dtype)
        from_wire(bucket.data, wire)
        if post != 1.0:
            bucket.data.div_(post)
