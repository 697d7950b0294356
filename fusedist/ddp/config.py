"""Configuration of :class:`fusedist.DistributedDataParallel`."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Optional

import torch

from .layout import MiB


@dataclasses.dataclass
class DDPConfig:
    bucket_cap_mb: float = 25.0
    """Target bucket size. Large enough to amortize per-collective latency, small enough that
    the first buckets are ready (and launched) early in backward. Same default as torch.
    A negative cap is no cap (Note [a negative bucket cap])."""

    first_bucket_cap_mb: float = 1.0
    """The first bucket (the last layers, whose gradients are ready first) is small so that
    communication starts as early as possible in backward. torch's rule for the wrapper's
    default: 1 MiB when ``bucket_cap_mb`` is left at its default, else ``bucket_cap_mb``
    itself (:func:`first_bucket_cap`)."""

    bucket_cap_mb_list: Optional[tuple] = None
    """torch DDP's per-bucket caps: the k-th bucket of each dtype (in readiness order) holds up
    to ``bucket_cap_mb_list[k]`` MiB, the last entry serving every later bucket; replaces
    ``bucket_cap_mb`` and ``first_bucket_cap_mb`` when given."""

    broadcast_buffers: bool = True
    """Broadcast buffers (e.g. BatchNorm running stats) from rank 0 at a forward that follows
    a synchronized training forward (torch's rule and default), so every rank evaluates with
    the same statistics (Note [when buffers are broadcast] in buffer_broadcast.py)."""

    find_unused_parameters: bool = False
    """Tolerate parameters that receive no gradient in an iteration: their bucket slots are
    zero-filled and reduced at the end of backward (costs one small extra all-reduce of a
    used-map and less overlap for those buckets). Off by default: unused parameters are
    then reported as an error after backward instead of hanging the next step."""

    gradient_as_bucket_view: bool = True
    """``param.grad`` are slots of the flat bucket buffers: no per-step copy and no second
    copy of the gradients in memory. A gradient tensor the user holds (kept across
    ``zero_grad()``, or assigned by hand) still behaves as under torch's default ``False``
    (Note [gradients the user holds] in held_grads.py). False: each gradient a tensor of its own."""

    static_graph: bool = False
    """torch's ``static_graph``: every iteration runs the same graph, so a parameter's gradient
    may arrive more than once per backward (a module called twice under reentrant activation
    checkpointing); the first synchronized backward counts the arrivals and launches every
    bucket at its end (Note [gradients that arrive twice] in static_graph.py)."""

    reduce_dtype: Optional[torch.dtype] = None
    """Reduce in this dtype (e.g. bfloat16 to halve the bytes on the wire); the result is
    written back in the gradient's dtype. None: reduce in the gradient's dtype."""

    divide_first: bool = False
    """Divide by the whole world size before the sum whatever ``reduce_dtype`` is, as torch's
    ``fp16_compress_hook`` / ``bf16_compress_hook`` do (set when one is registered; Note
    [compression hooks divide first] in comm_hook.py). False: an fp16 reduce splits the
    division around the sum (``strategy.divide_factors``)."""

    @property
    def tolerates_unused(self) -> bool:
        """Whether parameters without a gradient are settled (Note [unused parameters] in
        unused.py) rather than refused: with ``find_unused_parameters``, and with
        ``static_graph``, which torch documents for models with unused parameters (its first
        iteration finds them, no ``find_unused_parameters`` needed)."""
        return self.find_unused_parameters or self.static_graph

    def bucket_caps_bytes(self) -> list[int]:
        """The caps of the k-th bucket of each dtype, in bytes, the last serving every later
        bucket: ``bucket_cap_mb_list``, else ``first_bucket_cap_mb`` then ``bucket_cap_mb``."""
        caps = self.bucket_cap_mb_list or (self.first_bucket_cap_mb, self.bucket_cap_mb)
        return [int(c * MiB) if c >= 0 else sys.maxsize for c in caps]

    def __post_init__(self):
        # A cap of 0 is torch's too: every bucket closes at its first parameter (one bucket per
        # parameter); a negative one is no cap (Note [a negative bucket cap]).
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"DistributedDataParallel: {name} must be a number of MiB "
                                 f"(0: one bucket per parameter), got {value!r}")
        if self.bucket_cap_mb_list is not None:
            caps = tuple(self.bucket_cap_mb_list)
            if not caps or not all(_is_number(c) and c >= 0 for c in caps):
                raise ValueError("DistributedDataParallel: bucket_cap_mb_list must be a non-empty list of numbers "
                                 f"of MiB >= 0 (torch refuses a negative entry too), got {self.bucket_cap_mb_list!r}")
            self.bucket_cap_mb_list = caps
        if self.reduce_dtype is not None and not (
            isinstance(self.reduce_dtype, torch.dtype) and self.reduce_dtype.is_floating_point
        ):
            raise ValueError(f"DistributedDataParallel: reduce_dtype must be a floating dtype, "
                             f"got {self.reduce_dtype!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def first_bucket_cap(bucket_cap_mb: Optional[float], first_bucket_cap_mb: Optional[float]) -> float:
    """The first bucket's cap, as torch DDP chooses it: the one given, else 1 MiB
    (``_DEFAULT_FIRST_BUCKET_BYTES``) while ``bucket_cap_mb`` is left at its default and
    ``bucket_cap_mb`` itself once it is given -- a job that sets 100 MiB buckets gets a first
    bucket of 100 MiB from torch, and the same collectives here."""
    if first_bucket_cap_mb is not None:
        return first_bucket_cap_mb
    return 1.0 if bucket_cap_mb is None else bucket_cap_mb


# Note [a negative bucket cap]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's DDP takes ``bucket_cap_mb=-1`` and trains: the negative byte cap reaches its C++
# reducer as an unsigned size, i.e. no cap, and every gradient of a dtype travels in one bucket
# (2.13 on gloo, observed with a comm hook: one call per backward). Scripts that pass it run
# the same here: a negative ``bucket_cap_mb`` (and the first-bucket cap it gives) is no cap.
# (torch's ``find_unused_parameters=True`` path fails on it with a TypeError from its bucket
# assignment binding; here it is no cap there too.) A negative entry of ``bucket_cap_mb_list``
# torch refuses on every path, so it is refused here, with the reason.
