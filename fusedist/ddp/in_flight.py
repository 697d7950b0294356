"""Launching a backward's gradient buckets in order (Note [bucket readiness] in reducer.py)
and finishing them: early where their collectives have landed, and within a bound.

Note [finishing buckets during backward]
    A bucket is *finished* when the strategy has waited for its collective and left the
    result where the consumer expects it (averaged gradients; for ZeRO stage 2, the rank's
    shard, after which the bucket's full gradients are released and ZeRO-Offload starts the
    shard's copy down). After each launch and in every gradient hook of a synchronized
    backward, launched buckets whose collective has already completed
    (``CommHandle.is_completed()``, a non-blocking query) are finished, oldest first,
    stopping at the first one still in flight; the end-of-backward callback finishes the
    rest. So the work that follows a collective overlaps the rest of backward's compute
    instead of queuing up behind the last gradient, and stage 2 holds only the few buckets
    between "first gradient arrived" and "reduce-scatter done" (Note [bucket storage] in
    ``layout.py``).

    Finishing issues no collective, so ranks may finish different buckets early without
    affecting the collective order. ``is_completed`` never synchronizes the host: gloo work
    reads a completion flag; torch's NCCL work queries its end CUDA event (and NCCL's
    asynchronous error state); the direct-NCCL handle queries its done event
    (``cudaEventQuery``). A collective that *failed* is not raised from a gradient hook: the
    early path stops, and the end-of-backward loop waits for that bucket again -- ``wait()``
    re-raises the recorded error there, where failures surfaced before.

    What it depends on: a bucket is finished early only if its collective has completed by a
    later gradient hook. On CPU (gloo) and on a GPU whose backward is host-bound, that is the
    common case. When the GPU is the bottleneck the host enqueues all of backward (and runs
    every hook) long before the device gets there, so few buckets complete in time and the
    end-of-backward loop finishes most of them, as before; a strategy that must bound the
    memory bounds the buckets in flight instead (Note [buckets in flight]).

Note [buckets in flight]
    A strategy whose launched buckets hold memory until finished (ZeRO stage 2: each bucket's
    full gradients, and its ``reduce_dtype`` copy) sets ``max_buckets_in_flight``: before a
    launch that would exceed it, the oldest launched bucket is waited for and finished (its
    full gradients released). Without it, a backward whose collectives land later than its
    gradients arrive (a slow network, small buckets, a device-bound GPU) holds every
    launched bucket to its end: up to every gradient of the model, the memory stage 2 is
    meant to save. With it, at most that many buckets are in flight, plus those being filled
    (a bucket's first gradient arrived, not all of them) -- DeepSpeed's reduction double
    buffer, and ``fully_shard``'s bound on its reduce-scatters (``MAX_IN_FLIGHT`` in
    ``fusedist/fsdp/grads.py``). The price is overlap: the backward goes on only once the
    oldest collective has landed, which a bound of 2 rarely costs, since collectives run one
    after the other on the wire anyway (the next is queued behind the one awaited). Measured
    (2 ranks, gloo, 2-core CPU, 12 buckets of 1 MiB): unbounded, a step's peak held 58-71% of
    the gradients; bounded to 2, 25%, and the step took 338 ms against 406 ms.

    The wait is the strategy's ``finish`` (``CommHandle.wait``), which the end of backward
    would run anyway: on gloo the host blocks; on CUDA the direct NCCL communicator orders
    the current stream after the collective and the host does not wait (no synchronization
    is added; torch's NCCL work, the fallback, blocks the host in a wait with a timeout, at
    the end of backward as here). The released bucket's memory then goes back to the caching
    allocator stream-ordered (the direct NCCL communicator ``record_stream``-s it on its comm
    stream; torch's NCCL work holds it until waited for), so a host far ahead of the device
    may see it reusable only once the collective has run -- when memory runs short, the
    allocator waits for those events before it grows. Finishing issues no collective, so
    ranks may wait at different points. A collective that failed is left to the
    end-of-backward loop (as the early finishing leaves it), whose ``wait()`` raises its error.
    The default all-reduce sets no bound: its buckets are views of one flat buffer that stays
    allocated.

Note [buckets allocated at launch]
    With per-bucket storage (ZeRO stage 2) a bucket is allocated when its first gradient
    arrives -- or, if none arrives, at its launch, zeroed: a bucket whose parameters are all
    frozen since the layout was fixed (inactive: sent as zeros), all unused, or a joined
    rank's shadow backward, where no gradient arrives at all. The end of backward writes
    only the slots that hold something (an earlier gradient); a slot without one is the
    allocation's zero. So such buckets are allocated one launch at a time, within the bound
    (Note [buckets in flight]), not all at the end of backward at once -- a joined rank held
    the whole model's gradients in every shadow step -- and a bucket of frozen parameters is
    launched like any other (it reached the launch unallocated and failed).
"""

from __future__ import annotations

from .._timeline import now_us
from .layout import Bucket


def launch_in_order(reducer, in_hook: bool = True, final: bool = False) -> None:
    """Launch the ready buckets that come next in bucket order (none past one still pending).
    ``final``: at the end of the backward; before it, a last bucket that carries the step check
    is held back (Note [the check carried by the last bucket] in
    fusedist/reliability/carried_check.py)."""
    buckets = reducer.layout.buckets
    limit = reducer.strategy.max_buckets_in_flight  # Note [buckets in flight]
    while reducer.next_launch < len(buckets) and reducer.pending[reducer.next_launch] == 0:
        if (not final and reducer.next_launch == len(buckets) - 1 and reducer.check_carrier is not None
                and reducer.check_carrier.carries(reducer)):
            reducer.holding_last = True
            return
        if limit is not None and reducer.next_launch - reducer.next_finish >= limit:
            finish_oldest(reducer, in_hook)
        if reducer._early_finish_stopped:
            # a collective failed: launching more would only meet the communicator's refusal
            # ("can no longer run collectives"); the end of backward raises the failure itself
            return
        bucket = buckets[reducer.next_launch]
        if bucket.data is None:  # Note [buckets allocated at launch]
            reducer.layout.allocate(bucket)
        reducer.t_launch[bucket.index] = now_us()
        reducer.handles[bucket.index] = reducer.strategy.launch(reducer, bucket)
        reducer.next_launch += 1


def finish_completed(reducer) -> None:
    """Finish launched buckets whose collective has completed, oldest first, stopping at
    the first still in flight (Note [finishing buckets during backward])."""
    if reducer._early_finish_stopped:
        return
    buckets = reducer.layout.buckets
    while reducer.next_finish < reducer.next_launch:
        handle = reducer.handles[reducer.next_finish]
        try:
            if not handle.is_completed():
                return
            handle.wait()  # completed: returns at once (orders the current CUDA stream)
        except Exception:  # noqa: BLE001 - re-raised by the end-of-backward wait
            reducer._early_finish_stopped = True
            return
        finish_bucket(reducer, buckets[reducer.next_finish])
        reducer.finished_in_hooks += 1


def finish_oldest(reducer, in_hook: bool) -> None:
    """Wait for the oldest launched bucket's collective and finish it, to launch another
    within the strategy's bound (Note [buckets in flight]). A collective that failed is
    left to the end-of-backward loop, which raises its error, as in ``finish_completed``."""
    if reducer._early_finish_stopped:
        return
    handle = reducer.handles[reducer.next_finish]
    try:
        handle.wait()
    except Exception:  # noqa: BLE001 - re-raised by the end-of-backward wait
        reducer._early_finish_stopped = True
        return
    finish_bucket(reducer, reducer.layout.buckets[reducer.next_finish])
    reducer.finished_in_hooks += in_hook


def finish_bucket(reducer, bucket: Bucket) -> None:
    """Wait for ``bucket``'s collective and hand its result over (the strategy's finish)."""
    reducer.strategy.finish(reducer, bucket, reducer.handles[bucket.index])
    if not reducer.config.gradient_as_bucket_view and reducer.layout.is_allocated(bucket):
        for p in bucket.params:
            if p.grad is not None and p not in reducer.inactive:
                p.grad.copy_(reducer.layout.grad_view(p))
    reducer.next_finish = bucket.index + 1
    t_done = reducer.t_done[bucket.index] = now_us()
    reducer.timeline.span(f"{type(reducer.strategy).__name__} bucket {bucket.index}",
                          reducer.t_launch[bucket.index], t_done, tid=1, numel=bucket.numel)
