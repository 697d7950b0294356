"""Host-side Adam for offloaded optimizer state: one bucket at a time, as gradients land.

Why it exists: ZeRO-Offload keeps FP32 master weights and Adam state in (pinned) host memory
and runs the update on the CPU. Its speed comes from overlap: a bucket's gradient is copied
device-to-host as soon as it is reduced, the CPU update of that bucket runs while backward is
still producing the next buckets, and the new parameters go host-to-device right after.
``HostOffloadAdam`` is that per-bucket machinery, independent of how the buckets are reduced
(the ZeRO optimizer wires it to its reduce-scatter hooks); with CPU "device" tensors the same
code path runs without a GPU, which is how CI tests it.

Protocol per step (asserted, with messages stating the invariant)::

    off.begin_step()                      # once per optimizer step
    off.bucket_ready(k)                   # once per bucket, in any order, as grads are final
    off.finish()                          # waits: every param holds its updated value

Note [offload ordering]:
* D2H: the gradient copy is issued on a side stream that first waits for the current stream,
  so it sees the finished gradient; an event marks its completion.
* The CPU update runs on one worker thread (buckets are updated in the order they became
  ready; the kernel itself is multi-threaded). It waits for the D2H event before reading.
* H2D: issued from the worker on a dedicated stream after the update, ordered after every
  kernel queued before ``bucket_ready`` (it waits on the D2H event). The parameters of a ready
  bucket must therefore not be read by the rest of this backward -- true unless a weight is
  shared with a bucket that is not ready yet (put shared weights in the last bucket, or use
  ``defer=True``). ``finish`` makes the
  caller's current stream wait for it, so later kernels see the new parameters, and also
  blocks the host until all updates are done (the next step reuses the host buffers).
* Gradient unscaling / overflow skipping / clipping need a global view (every bucket's
  gradient) before any update: pass ``inv_scale`` to ``begin_step`` (applied inline per
  bucket); ``found_inf``/``clip_coef`` are only known after all buckets, so use
  ``bucket_ready(k, defer=True)`` for all buckets and ``finish(found_inf=..., clip_coef=...)``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import torch

from ._cpu_adam import adam_update

__all__ = ["HostOffloadAdam"]


class _Bucket:
    """Host buffers of one bucket: flat FP32 master/state plus staging for grads and params."""

    def __init__(self, params: Sequence[torch.Tensor], pin: bool, index: int):
        if not params:
            raise ValueError(f"bucket {index} is empty")
        first = params[0]
        for j, p in enumerate(params):
            if p.device != first.device or p.dtype != first.dtype:
                raise ValueError(
                    f"bucket {index}: param {j} is {p.dtype} on {p.device} but param 0 is "
                    f"{first.dtype} on {first.device}; a bucket needs one dtype and device"
                )
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise TypeError(f"bucket {index}: param {j} has unsupported dtype {p.dtype}")
        self.params = list(params)
        self.numels = [p.numel() for p in params]
        numel = sum(self.numels)
        self.device = first.device
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params]).to("cpu", torch.float32)
        self.master = torch.empty(numel, dtype=torch.float32, pin_memory=pin).copy_(flat)
        self.exp_avg = torch.zeros(numel, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32)
        self.host_grad = torch.empty(numel, dtype=first.dtype, pin_memory=pin)
        self.host_param = torch.empty(numel, dtype=first.dtype, pin_memory=pin)
        self.d2h_done = None  # CUDA event: the gradient is in host_grad
        self.h2d_done = None  # CUDA event: host_param has been read by the copy back

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [v.view_as(p) for v, p in zip(flat.split(self.numels), self.params)]


class HostOffloadAdam:
    """Adam/AdamW whose master weights and state live on the host, stepped per bucket.

    ``buckets``: lists of parameters (device tensors: CUDA, or CPU when testing the logic);
    all parameters of a bucket share a dtype (fp32/bf16/fp16) and device. Gradients are read
    from ``p.grad`` (or passed to ``bucket_ready``). Results equal ``adam_update`` applied to
    FP32 masters initialized from the parameters, bitwise.
    """

    def __init__(self, buckets: Sequence[Sequence[torch.Tensor]], *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw: bool = True, maximize: bool = False,
                 pin_memory: Optional[bool] = None):
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                          weight_decay=weight_decay, adamw=adamw, maximize=maximize)
        self.buckets = [_Bucket(b, pin_memory, i) for i, b in enumerate(buckets)]
        self.step_count = 0
        self._uses_cuda = any(b.device.type == "cuda" for b in self.buckets)
        # One stream each way, so D2H of bucket k+1 overlaps H2D of bucket k.
        self._d2h_stream = torch.cuda.Stream() if self._uses_cuda else None
        self._h2d_stream = torch.cuda.Stream() if self._uses_cuda else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusedist-offload")
        self._lock = threading.Lock()
        self._futures: dict[int, Future] = {}
        self._deferred: list[int] = []
        self._inv_scale: Optional[torch.Tensor] = None
        self._in_step = False

    # ------------------------------------------------------------------ protocol

    def begin_step(self, inv_scale: Optional[torch.Tensor] = None) -> None:
        """Start an optimizer step; ``inv_scale`` (1-element fp32 CPU tensor) unscales grads."""
        assert not self._in_step, "begin_step called twice without finish(): one step at a time"
        self.step_count += 1
        self._inv_scale = inv_scale
        self._futures.clear()
        self._deferred.clear()
        self._in_step = True

    def bucket_ready(self, index: int, grads: Optional[Sequence[torch.Tensor]] = None,
                     defer: bool = False) -> None:
        """Bucket ``index`` has its final gradient: copy it to the host and (unless
        ``defer``) queue its CPU update and the copy back. Returns without waiting."""
        assert self._in_step, "bucket_ready outside a step: call begin_step() first"
        if not 0 <= index < len(self.buckets):
            raise IndexError(f"bucket index {index} out of range (have {len(self.buckets)})")
        assert index not in self._futures and index not in self._deferred, (
            f"bucket {index} was made ready twice in step {self.step_count}: a bucket is "
            "ready once per step"
        )
        bucket = self.buckets[index]
        if grads is None:
            grads = [p.grad for p in bucket.params]
        for j, (g, p) in enumerate(zip(grads, bucket.params)):
            if g is None or g.shape != p.shape:
                raise ValueError(f"bucket {index}, param {j}: gradient missing or of the wrong shape")
        self._copy_grads_to_host(bucket, grads)
        if defer:
            self._deferred.append(index)
        else:
            self._futures[index] = self._worker.submit(self._update, bucket, None, None)

    def finish(self, found_inf: Optional[torch.Tensor] = None,
               clip_coef: Optional[torch.Tensor] = None) -> bool:
        """Run the deferred buckets (with ``found_inf``/``clip_coef``), wait for every update
        and copy back. Returns False when ``found_inf`` skipped the step."""
        assert self._in_step, "finish without begin_step"
        ready = set(self._futures) | set(self._deferred)
        missing = sorted(set(range(len(self.buckets))) - ready)
        if missing:
            # Wait for what is queued so no worker touches buffers after we return.
            for f in self._futures.values():
                f.result()
            self._in_step = False
            raise RuntimeError(
                f"step {self.step_count}: buckets {missing} were never made ready; every "
                "bucket must be ready once per step before finish()"
            )
        if self._futures and (found_inf is not None or clip_coef is not None):
            for f in self._futures.values():
                f.result()
            self._in_step = False
            raise RuntimeError("found_inf/clip_coef apply to deferred buckets only: use "
                               "bucket_ready(k, defer=True) for every bucket of such a step")
        for index in self._deferred:
            self._futures[index] = self._worker.submit(
                self._update, self.buckets[index], found_inf, clip_coef)
        try:
            for f in self._futures.values():
                f.result()
        finally:
            self._in_step = False
        if self._uses_cuda:
            torch.cuda.current_stream().wait_stream(self._h2d_stream)
        skipped = found_inf is not None and float(found_inf) != 0.0
        return not skipped

    def step(self, found_inf: Optional[torch.Tensor] = None, clip_coef: Optional[torch.Tensor] = None,
             inv_scale: Optional[torch.Tensor] = None) -> bool:
        """Non-overlapped convenience: all buckets at once from ``p.grad``."""
        self.begin_step(inv_scale)
        defer = found_inf is not None or clip_coef is not None
        for k in range(len(self.buckets)):
            self.bucket_ready(k, defer=defer)
        return self.finish(found_inf=found_inf, clip_coef=clip_coef)

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    # ------------------------------------------------------------------ internals

    def _copy_grads_to_host(self, bucket: _Bucket, grads) -> None:
        dst = bucket.views(bucket.host_grad)
        if bucket.device.type == "cuda":
            self._d2h_stream.wait_stream(torch.cuda.current_stream(bucket.device))
            with torch.cuda.stream(self._d2h_stream):
                for d, g in zip(dst, grads):
                    d.copy_(g, non_blocking=True)
                    g.record_stream(self._d2h_stream)
                bucket.d2h_done = torch.cuda.Event()
                bucket.d2h_done.record()
        else:
            # CPU "device": a plain copy; the grads may be overwritten once this returns.
            torch._foreach_copy_(dst, [g.detach() for g in grads])

    def _update(self, bucket: _Bucket, found_inf, clip_coef) -> None:
        if bucket.d2h_done is not None:
            bucket.d2h_done.synchronize()
        if bucket.h2d_done is not None:
            bucket.h2d_done.synchronize()  # last step's copy back may still read host_param
        adam_update([bucket.host_param], [bucket.host_grad], [bucket.exp_avg], [bucket.exp_avg_sq],
                    [bucket.master], step=self.step_count, inv_scale=self._inv_scale,
                    clip_coef=clip_coef, found_inf=found_inf, **self.hyper)
        if found_inf is not None and float(found_inf) != 0.0:
            return
        targets = [p.data for p in bucket.params]
        if bucket.device.type == "cuda":
            with torch.cuda.device(bucket.device), torch.cuda.stream(self._h2d_stream):
                # d2h_done was recorded after the D2H stream waited for the compute stream,
                # so kernels still reading these params (queued before bucket_ready) finish
                # before they are overwritten.
                self._h2d_stream.wait_event(bucket.d2h_done)
                torch._foreach_copy_(targets, bucket.views(bucket.host_param), non_blocking=True)
                bucket.h2d_done = torch.cuda.Event()
                bucket.h2d_done.record()
        else:
            with torch.no_grad():
                torch._foreach_copy_(targets, bucket.views(bucket.host_param))
