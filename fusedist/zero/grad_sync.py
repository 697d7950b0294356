"""ZeRO stage 2: reduce-scatter each DDP bucket into the rank's gradient shard during backward.

Note [stage 2 gradients]
    Installed as the DDP reducer's ``GradSyncStrategy``; the reducer's layout is switched to
    per-bucket storage (Note [bucket storage] in ``fusedist/ddp/layout.py``): each bucket's
    full gradients live in their own tensor, allocated zeroed when the bucket's first gradient
    arrives. A bucket that becomes ready is pre-divided (as DDP's all-reduce does) and
    reduce-scattered. When the bucket is finished -- during backward as soon as its
    reduce-scatter has completed (Note [finishing buckets during backward] in
    ``fusedist/ddp/in_flight.py``), else at its end -- its output, the rank's slice of the
    averaged bucket, is copied (first backward after ``zero_grad``) or added (a further
    synchronized backward, torch's accumulation semantics) into the optimizer's flat FP32
    gradient shard, and the bucket's full gradients are released at once (its parameters'
    ``p.grad`` set to None). So during a synchronized backward a rank holds the full gradients
    of the few buckets between "first gradient arrived" and "reduce-scatter done" (the
    reducer's ``last_stats["peak_grad_bytes"]``), and between backward passes -- including the
    next forward, the activation peak -- only its gradient shard.

    How many: at most ``max_buckets_in_flight`` reduce-scatters (default
    ``DEFAULT_MAX_BUCKETS_IN_FLIGHT``, 2) are in flight at once; launching another first
    finishes the oldest (Note [buckets in flight] in ``fusedist/ddp/in_flight.py``). So a
    synchronized backward holds the full gradients of at most that many buckets plus those
    being filled, however slow the network -- unbounded, reduce-scatters that land after the
    next buckets' gradients kept every bucket to the end of backward (up to the whole
    model's gradients). A larger bound buys overlap for uneven collectives with memory;
    ``None`` lifts it.

    ``no_sync()`` backward passes accumulate into full buckets as in DDP (nothing is released);
    the next synchronized backward reduce-scatters the sums and releases them as it goes.

    Note [a converted bucket released at launch]
        With a ``reduce_dtype`` other than the gradients' own (bf16 reduction of FP32
        gradients), the reduce-scatter reads the bucket's converted copy only, so the bucket's
        full gradients are released as soon as the copy is made, at launch, not when the
        reduce-scatter is finished: the rank holds the narrow copies of the buckets in flight
        instead of both those and their full buckets (the peak drops by the in-flight buckets'
        full gradients; ``peak_grad_bytes`` counts both the full buckets and the copies on the
        wire). Nothing reads them later: every gradient of a launched bucket has arrived (its
        count includes the repeated arrivals of a static graph; one more raises), ``p.grad``
        is None after ``finish`` anyway, and the optimizer, its clip and ``gradient_slices()``
        read the shards. A bucket reduced in its own dtype is the wire itself and is kept
        until its reduce-scatter is finished.

    The bucket layout is fixed from the moment the optimizer registers with DDP (Note [layout
    fixed by a sharded consumer] in ``fusedist/ddp/rebucket.py``), so the first backward
    reduce-scatters like every other.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._dtypes import real_pairs
from ..ddp.strategy import GradSyncStrategy, divide_before_sum, divide_factors, pre_division_fold, to_wire


#: Reduce-scatters in flight at once by default (Note [stage 2 gradients]): one landing while
#: the next is on the wire, as DeepSpeed's double buffer and ``fully_shard``'s default.
DEFAULT_MAX_BUCKETS_IN_FLIGHT = 2


def check_max_buckets_in_flight(value, rank: Optional[int] = None) -> Optional[int]:
    """``value`` if it is a bound on the buckets in flight (an int >= 1, or None: no bound); refused
    naming ``rank`` where given."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    where = f" (rank {rank})" if rank is not None else ""
    raise ValueError(
        f"ZeroRedundancyOptimizer(stage=2){where}: max_buckets_in_flight must be an int >= 1 (the gradient buckets "
        f"whose reduce-scatter may be in flight at once, each holding its full gradients), or None for no "
        f"bound, got {value!r}")


class ReduceScatterToShard(GradSyncStrategy):
    """Note [stage 2 gradients]. Talks to its optimizer through three calls only:
    ``bucket_shard(index)`` (this rank's range of a bucket), ``store_reduced(index, value,
    post)`` and ``end_reduction(reducer)``; the shards themselves are the optimizer's."""

    def __init__(self, zero, max_buckets_in_flight: Optional[int] = DEFAULT_MAX_BUCKETS_IN_FLIGHT):
        self.zero = zero
        self._outputs: dict[int, torch.Tensor] = {}
        self.max_buckets_in_flight = max_buckets_in_flight

    @property
    def max_buckets_in_flight(self) -> Optional[int]:
        """The bound on buckets in flight (Note [buckets in flight] in ``fusedist/ddp/in_flight.py``):
        checked when set and read at each launch, so a change applies from the next one."""
        return self._max_in_flight

    @max_buckets_in_flight.setter
    def max_buckets_in_flight(self, value: Optional[int]) -> None:
        self._max_in_flight = check_max_buckets_in_flight(value)

    description = "ZeRO stage 2's reduce-scatter"

    def launch(self, reducer, bucket):
        lo, hi = self.zero.bucket_shard(bucket.index)
        reduce_dtype = reducer.config.reduce_dtype or bucket.data.dtype
        pre, _ = divide_factors(reducer.grad_divisor, reduce_dtype)
        wire = to_wire(bucket.data, reduce_dtype)  # a converted complex bucket: its real pairs
        divide_before_sum(bucket, wire, pre)
        # the real pairs of rank r's complex slice are rank r's slice of the real pairs
        out = torch.empty((hi - lo) * (wire.numel() // bucket.numel), dtype=reduce_dtype, device=wire.device)
        self._outputs[bucket.index] = out
        reducer.bucket_scratch[bucket.index] = wire  # keeps a converted copy alive until done
        if wire is not bucket.data:  # Note [a converted bucket released at launch]
            reducer.layout.account(wire.nbytes)  # (counted in peak_grad_bytes while on the wire)
            reducer.release_bucket(bucket)
        return reducer.comm.reduce_scatter(real_pairs(out), real_pairs(wire), async_op=True,  # Note [complex buckets]
                                           tag=f"zero2 bucket {bucket.index}")

    def fold_factor(self, reducer, bucket):
        return pre_division_fold(reducer, bucket)

    def finish(self, reducer, bucket, handle):
        handle.wait()
        wire = reducer.bucket_scratch.pop(bucket.index, None)
        if wire is not None and wire.dtype != bucket.dtype:  # a converted copy, no longer held
            reducer.layout.account(-wire.nbytes)
        out = self._outputs.pop(bucket.index)
        _, post = divide_factors(reducer.grad_divisor, out.dtype)
        if bucket.dtype.is_complex and not out.is_complex():  # Note [complex buckets] in ddp/strategy.py
            out = torch.view_as_complex(out.to(bucket.dtype.to_real()).view(-1, 2))
        self.zero.store_reduced(bucket.index, out, post)
        reducer.release_bucket(bucket)  # the shard holds this bucket's gradients now

    def after_sync(self, reducer) -> None:
        self.zero.end_reduction(reducer)
        reducer.release_gradients()
