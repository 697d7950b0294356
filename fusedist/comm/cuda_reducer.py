"""Python face of the C++ bucket reducer (``fusedist._C.BucketReducer``).

The reducer owns the per-iteration state of bucketed gradient averaging: it counts ready
gradients per bucket, launches a bucket's all-reduce (or, for ZeRO stage 2, reduce-scatter into
a shard) on the communicator's comm stream as soon as the bucket (and every bucket before it)
is full, and ``finalize()`` orders the caller's
stream after all of them (and, by default, waits on the host with the collective timeout).
Counting, launching and scaling happen in C++, so a backward hook costs one call.

Intended use by a DDP wrapper (flat bucket buffers that the parameters' ``.grad`` views
alias)::

    reducer = CudaBucketReducer(comm, buckets, grads_per_bucket, tags=names)
    # in each parameter's post-accumulate-grad hook:
    reducer.mark_ready(bucket_of[param])
    # once per iteration, after backward:
    reducer.finalize()      # raises CollectiveError on timeout / NCCL error

See Note [bucket launch order] and Note [pre/post division] in ``csrc/cuda/bucket_reducer.h``.
"""

from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch

from .base import CollectiveError
from ._nccl_types import FLOATING_CODES, nccl_dtype
from .nccl_comm import NcclCommunicator

__all__ = ["CudaBucketReducer"]


class CudaBucketReducer:
    """All-reduce of flat gradient buckets, launched from C++ as buckets fill up.

    Args:
        communicator: the :class:`NcclCommunicator` whose NCCL communicator and comm stream
            run the reductions.
        buckets: flat, contiguous CUDA tensors on the communicator's device, reduced in place.
            The reducer keeps them alive; their storage must not be replaced.
        grads_per_bucket: how many ``mark_ready`` calls complete each bucket (its number of
            gradients).
        average: divide by the world size (DDP semantics); False sums.
        divide_factor: total division applied to the sum (default: world size if
            ``average`` else 1). DDP's ``gradient_divide_factor`` maps here.
        predivide_factor: the part of the division applied *before* the sum (Note [pre/post
            division]). Default: the whole ``divide_factor`` when a bucket is float16 (the fp16
            sum cannot overflow then), else 1 (exact sum-then-divide).
        tags: a name per bucket for error messages (default ``"bucket<i>"``).
        shards: ZeRO stage 2 instead of DDP: one tensor per bucket with ``numel / world_size``
            elements (same dtype and device) that receives this rank's slice of the reduced
            bucket through a reduce-scatter; the bucket itself is then left pre-scaled, not
            reduced. Bucket sizes must be multiples of the world size.
        timeout: bound on ``finalize()``'s wait (default: the communicator's timeout).
    """

    def __init__(
        self,
        communicator: NcclCommunicator,
        buckets: Sequence[torch.Tensor],
        grads_per_bucket: Sequence[int],
        *,
        average: bool = True,
        divide_factor: Optional[float] = None,
        predivide_factor: Optional[float] = None,
        tags: Optional[Sequence[str]] = None,
        timeout: Optional[datetime.timedelta] = None,
        shards: Optional[Sequence[torch.Tensor]] = None,
    ):
        if not isinstance(communicator, NcclCommunicator):
            raise TypeError(
                f"CudaBucketReducer needs an NcclCommunicator, got {type(communicator).__name__}; "
                "reduce through the Communicator interface on other backends"
            )
        if len(buckets) != len(grads_per_bucket):
            raise ValueError(
                f"CudaBucketReducer: {len(buckets)} buckets but {len(grads_per_bucket)} gradient counts"
            )
        tags = list(tags) if tags is not None else [f"bucket{i}" for i in range(len(buckets))]
        if len(tags) != len(buckets):
            raise ValueError(f"CudaBucketReducer: {len(tags)} tags for {len(buckets)} buckets")
        codes = []
        for i, b in enumerate(buckets):
            if b.device != communicator.device or not b.is_contiguous():
                raise ValueError(
                    f"CudaBucketReducer: bucket {i} [{tags[i]}] must be a contiguous tensor on "
                    f"{communicator.device}, got device {b.device}, contiguous={b.is_contiguous()}"
                )
            codes.append(nccl_dtype(b.dtype, f"bucket {i} [{tags[i]}]"))
        if shards is not None:
            shards = list(shards)
            if len(shards) != len(buckets):
                raise ValueError(f"CudaBucketReducer: {len(shards)} shards for {len(buckets)} buckets")
            world = communicator.world_size
            for i, (b, s) in enumerate(zip(buckets, shards)):
                if b.numel() % world or s.numel() != b.numel() // world or s.dtype != b.dtype \
                        or s.device != b.device or not s.is_contiguous():
                    raise ValueError(
                        f"CudaBucketReducer: shard {i} [{tags[i]}] must be a contiguous {b.dtype} "
                        f"tensor of bucket numel / world_size = {b.numel()} / {world} elements on "
                        f"{b.device} (bucket numel a multiple of world_size); got {s.numel()} "
                        f"{s.dtype} elements on {s.device}"
                    )
        if divide_factor is None:
            divide_factor = float(communicator.world_size) if average else 1.0
        if predivide_factor is None:
            predivide_factor = divide_factor if torch.float16 in {b.dtype for b in buckets} else 1.0
        if divide_factor != 1.0 and any(c not in FLOATING_CODES for c in codes):
            raise TypeError("CudaBucketReducer: averaging/dividing needs floating-point buckets")
        self.communicator = communicator
        self.buckets = list(buckets)  # keep the memory alive for the C++ side
        self.shards = shards
        self.tags = tags
        self.divide_factor = float(divide_factor)
        self.predivide_factor = float(predivide_factor)
        self.timeout = timeout or communicator.timeout
        self._impl = communicator._comm_extension().BucketReducer(
            communicator._comm, communicator._stream,
            [b.data_ptr() for b in buckets], [b.numel() for b in buckets], codes,
            [int(n) for n in grads_per_bucket], tags, self.predivide_factor, self.divide_factor,
            [s.data_ptr() for s in shards] if shards is not None else [],
        )
        for b in self.buckets + (shards or []):
            # Ordering 3 of Note [comm stream ordering]: the buckets are used on the comm stream.
            b.record_stream(communicator.torch_stream)

    @property
    def num_buckets(self) -> int:
        return self._impl.num_buckets

    @property
    def launched_count(self) -> int:
        """Buckets launched so far in this iteration."""
        return self._impl.launched_count

    def ready_count(self, bucket: int) -> int:
        return self._impl.ready_count(bucket)

    def mark_ready(self, bucket: int) -> list[int]:
        """One gradient of ``bucket`` is final on the current stream. Returns the buckets this
        call launched (in order; usually empty or ``[bucket]``)."""
        stream = torch.cuda.current_stream(self.communicator.device).cuda_stream
        return self._guard("all_reduce", lambda: self._impl.mark_ready(bucket, stream))

    def finalize(self, blocking: bool = True) -> None:
        """All buckets must have launched. Orders the current stream after every bucket's
        reduction and resets the counts for the next iteration; with ``blocking`` also waits
        on the host (bounded by ``timeout``), so a failure raises here.

        Raises:
            RuntimeError: a bucket is incomplete (the message lists them).
            CollectiveError: a reduction failed or timed out (names the bucket and the rank);
                the communicator is then aborted.
        """
        stream = torch.cuda.current_stream(self.communicator.device).cuda_stream
        seconds = self.timeout.total_seconds()
        self._guard("all_reduce", lambda: self._impl.finalize(stream, seconds, blocking))

    def reset(self) -> None:
        """Abandon a partial iteration (e.g. after an exception in backward)."""
        self._guard("all_reduce", lambda: self._impl.reset(self.timeout.total_seconds()))

    def _guard(self, op: str, fn):
        C = self.communicator._comm_extension()
        try:
            return fn()
        except (C.NcclError, C.CudaError) as exc:
            comm = self.communicator
            raise CollectiveError(
                f"fusedist bucket reducer on rank {comm.rank} of {comm.world_size}: {exc}",
                op=op, tag="buckets", rank=comm.rank,
            ) from exc
