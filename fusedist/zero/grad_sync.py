"""ZeRO stage 2: reduce-scatter each DDP bucket into the rank's gradient shard during backward.

Note [stage 2 gradients]
    Installed as the DDP reducer's ``GradSyncStrategy``; the reducer's layout is switched to
    per-bucket storage (Note [bucket storage] in ``fusedist/ddp/layout.py``): each bucket's
    full gradients live in their own tensor, allocated zeroed when the bucket's first gradient
    arrives. A bucket that becomes ready is pre-divided (as DDP's all-reduce does) and
    reduce-scattered. When the bucket is finished -- during backward as soon as its
    reduce-scatter has completed (Note [finishing buckets during backward] in
    ``fusedist/ddp/reducer.py``), else at its end -- its output, the rank's slice of the
    averaged bucket, is copied (first backward after ``zero_grad``) or added (a further
    synchronized backward, torch's accumulation semantics) into the optimizer's flat FP32
    gradient shard, and the bucket's full gradients are released at once (its parameters'
    ``p.grad`` set to None). So during a synchronized backward a rank holds the full gradients
    of the few buckets between "first gradient arrived" and "reduce-scatter done" (the
    reducer's ``last_stats["peak_grad_bytes"]``), and between backward passes -- including the
    next forward, the activation peak -- only its gradient shard.

    ``no_sync()`` backward passes accumulate into full buckets as in DDP (nothing is released);
    the next synchronized backward reduce-scatters the sums and releases them as it goes.

    The DDP layout is rebuilt once, at the end of the first synchronized backward (from the
    observed readiness order). That backward all-reduces instead (the shards of the old layout
    would not match the new one) and keeps every bucket until its end, and the rank's slice is
    taken from the full averaged gradient in the new layout in ``after_sync``.
"""

from __future__ import annotations

import torch

from ..ddp.strategy import AllReduceAverage, GradSyncStrategy, divide_factors
from .grow import store_caught_up


def release_grad_buffers(reducer) -> None:
    """Drop every full gradient: ``p.grad = None`` and release each bucket's storage (the
    layout is switched to per-bucket storage first if it is still flat)."""
    for p in reducer.params:
        p.grad = None
    layout = reducer.layout
    if layout.bucket_storage:
        layout.release_all()
    else:
        layout.use_bucket_storage()


def release_bucket(reducer, bucket) -> None:
    """Drop one bucket's full gradients (its reduced shard is stored)."""
    for p in bucket.params:
        p.grad = None  # views of the bucket: they would keep its memory alive
    reducer.layout.release(bucket)


def grad_buffers_allocated(reducer) -> bool:
    return reducer.layout.allocated_bytes > 0


class ReduceScatterToShard(GradSyncStrategy):
    """Note [stage 2 gradients]."""

    def __init__(self, zero):
        self.zero = zero
        self._all_reduce = AllReduceAverage()
        self._full_this_backward = False
        self._accumulate = False
        self._outputs: dict[int, torch.Tensor] = {}

    def begin_backward(self, reducer) -> None:
        # Bucket storage is allocated by the reducer as gradients arrive (Note [bucket storage]).
        if reducer.sync:
            self._full_this_backward = not reducer.layout_final
            self._accumulate = self.zero._grads_present

    def launch(self, reducer, bucket):
        if self._full_this_backward:
            return self._all_reduce.launch(reducer, bucket)
        part = self.zero._ensure_partition()
        bs = part.bucket_shards[bucket.index]
        reduce_dtype = reducer.config.reduce_dtype or bucket.data.dtype
        pre, _ = divide_factors(reducer.grad_divisor, reduce_dtype)
        wire = bucket.data.to(reduce_dtype) if reduce_dtype != bucket.data.dtype else bucket.data
        wire.div_(pre)
        out = torch.empty(bs.hi - bs.lo, dtype=reduce_dtype, device=wire.device)
        self._outputs[bucket.index] = out
        reducer.bucket_scratch[bucket.index] = wire  # keeps a converted copy alive until done
        return reducer.comm.reduce_scatter(out, wire, async_op=True, tag=f"zero2 bucket {bucket.index}")

    def finish(self, reducer, bucket, handle):
        if self._full_this_backward:
            return self._all_reduce.finish(reducer, bucket, handle)
        handle.wait()
        reducer.bucket_scratch.pop(bucket.index, None)
        out = self._outputs.pop(bucket.index)
        _, post = divide_factors(reducer.grad_divisor, out.dtype)
        bs = self.zero._partition.bucket_shards[bucket.index]
        self._store(bs, out, post)
        release_bucket(reducer, bucket)  # the shard holds this bucket's gradients now

    def _store(self, bs, value: torch.Tensor, post: float = 1.0) -> None:
        offload = self.zero._offload
        if offload is not None:
            offload.before_grad_write(bs)
        dst = self.zero._grad_shards[bs.bucket.dtype][bs.pos:bs.pos + bs.hi - bs.lo]
        if self._accumulate:
            value = value.to(dst.dtype)
            if post != 1.0:
                value = value / post
            dst.add_(value)
        else:
            dst.copy_(value)
            if post != 1.0:
                dst.div_(post)
        if offload is not None:
            offload.grad_ready(bs)  # Note [offload pipeline]: down while backward goes on

    def after_sync(self, reducer) -> None:
        # Parameters no rank used this iteration (DDP left their grad None, Note [unused
        # parameters]); their shard slices hold zeros.
        without = set(reducer.params_without_grad)
        self.zero._note_params_without_grad([i for i, p in enumerate(self.zero._params) if p in without])
        if self._full_this_backward:
            part = self.zero._ensure_partition()
            for bs in part.bucket_shards:
                data = reducer.layout.allocate(bs.bucket)  # (allocated: every bucket was reduced)
                self._store(bs, data[bs.lo:bs.hi])
            self._full_this_backward = False
        # Parameters DDP took on in this backward (Note [growing the partition] in grow.py).
        store_caught_up(self.zero, reducer, self._accumulate)
        release_grad_buffers(reducer)
        self.zero._grads_present = True
