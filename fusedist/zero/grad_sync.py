"""ZeRO stage 2: reduce-scatter each DDP bucket into the rank's gradient shard during backward.

Note [stage 2 gradients]
    Installed as the DDP reducer's ``GradSyncStrategy``. A bucket that becomes ready is
    pre-divided (as DDP's all-reduce does) and reduce-scattered; its output, the rank's slice
    of the averaged bucket, is copied (first backward after ``zero_grad``) or added (a further
    synchronized backward, torch's accumulation semantics) into the optimizer's flat FP32
    gradient shard. At the end of the synchronized backward every ``p.grad`` is set to None and
    the full gradient buffers are released (their storage resized to zero); they are
    re-allocated, zeroed, when the next backward starts. So between a synchronized backward and
    the next backward -- including the next forward, the activation peak -- a rank holds only
    its gradient shard.

    ``no_sync()`` backward passes accumulate into the (re-allocated) full buffers as in DDP;
    the next synchronized backward reduce-scatters the sum.

    The DDP layout is rebuilt once, at the end of the first synchronized backward (from the
    observed readiness order). That backward all-reduces instead (the shards of the old layout
    would not match the new one), and the rank's slice is taken from the full averaged
    gradient in the new layout in ``after_sync``.
"""

from __future__ import annotations

import torch

from ..ddp.reducer import AllReduceAverage, GradSyncStrategy, divide_factors


def release_grad_buffers(reducer) -> None:
    """Drop the full gradients: ``p.grad = None`` and free the buffers' memory."""
    for p in reducer.params:
        p.grad = None
    for buf in reducer.layout.buffers.values():
        buf.untyped_storage().resize_(0)


def grad_buffers_allocated(reducer) -> bool:
    return any(buf.untyped_storage().nbytes() > 0 for buf in reducer.layout.buffers.values())


class ReduceScatterToShard(GradSyncStrategy):
    """Note [stage 2 gradients]."""

    def __init__(self, zero):
        self.zero = zero
        self._all_reduce = AllReduceAverage()
        self._full_this_backward = False
        self._accumulate = False
        self._outputs: dict[int, torch.Tensor] = {}

    def begin_backward(self, reducer) -> None:
        for buf in reducer.layout.buffers.values():
            storage = buf.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(buf.numel() * buf.element_size())
                buf.zero_()  # padding and slots of unused parameters must read as zero
        if reducer.sync:
            self._full_this_backward = not reducer.layout_final
            self._accumulate = self.zero._grads_present

    def launch(self, reducer, bucket):
        if self._full_this_backward:
            return self._all_reduce.launch(reducer, bucket)
        part = self.zero._ensure_partition()
        bs = part.bucket_shards[bucket.index]
        reduce_dtype = reducer.config.reduce_dtype or bucket.data.dtype
        pre, _ = divide_factors(reducer.world_size, reduce_dtype)
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
        _, post = divide_factors(reducer.world_size, out.dtype)
        bs = self.zero._partition.bucket_shards[bucket.index]
        self._store(bs, out, post)

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
        self.zero._note_params_without_grad(
            [i for i, p in enumerate(self.zero._params) if p.grad is None])
        if self._full_this_backward:
            part = self.zero._ensure_partition()
            layout = reducer.layout
            for bs in part.bucket_shards:
                b = bs.bucket
                self._store(bs, layout.buffers[b.dtype][b.start + bs.lo:b.start + bs.hi])
            self._full_this_backward = False
        release_grad_buffers(reducer)
        self.zero._grads_present = True
