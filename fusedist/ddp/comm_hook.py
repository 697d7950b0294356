"""torch DDP's communication hooks -- PowerSGD, quantization, a user's own -- run on
fusedist's buckets.

Note [communication hooks]
    torch DDP hands each ready bucket to ``hook(state, bucket)``, where ``bucket`` is a
    ``dist.GradBucket``: ``buffer()`` (the bucket's gradients, flat, summed over nothing yet
    and divided by nothing), ``gradients()`` (each parameter's gradient as a view of that
    buffer, shaped like the parameter), ``parameters()``, ``index()``, ``is_last()`` and
    ``set_buffer()``. The hook starts its own collectives and returns a
    ``torch.futures.Future`` whose value is the reduced flat tensor; DDP copies that value
    back into the gradients. The hook decides the division (torch's hooks divide by the
    group's size), so buckets synchronized by a hook fold no division into the gradient
    copies (Note [division folded into the copy] in strategy.py).

    fusedist keeps the three hooks torch ships for plain averaging (all-reduce, fp16 and
    bf16 compression) on its own fused reduction (``reduce_dtype``); any other hook becomes
    the reducer's strategy (:class:`CommHookStrategy`) and sees :class:`HookBucket`, which
    answers every ``GradBucket`` call from the bucket's storage, without its trailing padding
    (a bucket is padded for ZeRO's equal shards; torch's buffer is exactly the gradients).
    The launches follow the buckets torch's DDP would hand the hook, before and after its one
    rebuild (Note [a hook's first buckets]). A joined rank's shadow backward runs the hook on
    zeroed buckets, as torch's join does. Sparse gradients (``nn.Embedding(sparse=True)``) are in no bucket: they
    are averaged over the model's group as without a hook (Note [sparse gradients] in
    sparse.py), where torch passes them to the hook; registering a hook on such a model warns.

    Every wait is bounded: the hook's collectives run on torch process groups fusedist does
    not see, so the reducer waits for the future itself, up to the collective timeout
    (``FUSEDIST_TIMEOUT_S``), and then raises a ``CollectiveError`` naming the hook, the
    bucket and the rank -- a hook whose future never completes does not hang the job.
    ZeRO stage 2 reduce-scatters the buckets itself, so it refuses a hook (and a hook
    refuses a model already synchronized by stage 2); a hook and ``reduce_dtype`` are one
    choice too.

Note [a hook's first buckets]
    Without ``find_unused_parameters`` (or with a static graph) torch's DDP cuts no buckets at
    wrapping: the first synchronized backward goes out in one bucket per dtype, its parameters in
    registration order (or in the buckets of ``bucket_cap_mb_list``, cut in registration order,
    the last parameters' first), and the buckets are rebuilt from the observed readiness order
    before the second (with a static graph: from the second backward's order, before the
    third). fusedist's reverse-order buckets of that first backward are equal for the
    fused reduction, but a hook sees them: a user's hook counts other buckets, ``is_last()``
    comes elsewhere, and PowerSGD (``start_powerSGD_iter=1``, or the batched hook) compresses
    other matrices. So the hook's registration cuts torch's first buckets, and the rebuild after
    the first synchronized backward (rebucket.py) gives torch's later ones. A
    ZeroRedundancyOptimizer built after the registration fixes the layout for good (Note [layout
    fixed by a sharded consumer]): it gets the usual reverse-order buckets, not one bucket with
    no overlap. With ``find_unused_parameters=True``, where torch's DDP never rebuilds, the
    registration cuts torch's buckets and keeps them (Note [buckets of find_unused_parameters]
    in layout.py).

Note [one hook at a time]
    A hook may issue collectives from its future's callbacks (PowerSGD chains three:
    ``fut.then(...)`` all-reduces P, then Q). With gloo those callbacks run on the backend's
    thread when the previous collective completes, so a collective issued meanwhile from the
    training thread -- the next bucket's hook, or fusedist's per-step check -- can reach the
    process group's queue before it on one rank and after it on another, and the ranks pair
    different collectives (measured: a PowerSGD run on 2 gloo ranks failed one time in two with
    "Connection reset by peer"). So the reducer launches the next bucket's hook, and issues
    its own end-of-backward collectives, only once the previous hook's future has completed
    (bounded by the timeout). With NCCL a collective's future completes when it is enqueued,
    so the callbacks run inside the hook call and the wait costs nothing; with gloo a bucket's
    communication overlaps the backward compute until the next bucket is ready, not the next
    bucket's communication.
"""

from __future__ import annotations

import datetime
import inspect
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from ..comm.base import CollectiveError
from .layout import Bucket, layout_of_groups, slot_view, torch_unused_groups
from .rebucket import switch_layout
from .._dtypes import real_pairs
from .strategy import AllReduceAverage, GradSyncStrategy

if TYPE_CHECKING:
    from .reducer import Reducer


def hook_name(hook) -> str:
    """The name errors give a hook (``functools.partial`` wrappers included)."""
    inner = getattr(hook, "func", hook)
    return getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None) or repr(inner)


class HookBucket:
    """One bucket as a communication hook sees it: the ``dist.GradBucket`` interface over
    fusedist's bucket storage (Note [communication hooks])."""

    def __init__(self, bucket: Bucket, reducer: "Reducer"):
        self._bucket = bucket
        used = sum(p.numel() for p in bucket.params)
        self._flat = bucket.data[:used]
        self._real = real_pairs(self._flat)  # what torch's GradBucket.buffer() is (Note [complex buckets])
        self._buffer = self._real
        self._layout = reducer.layout
        self._is_last = bucket.index == len(reducer.layout.buckets) - 1

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list:
        """Each parameter's gradient as a view of the current buffer (the bucket's, or one the hook
        set: a compression wrapper's), as torch's: views, not the ``p.grad`` slot tensors, so a hook
        keeping them across steps sees the buffer's values and is no holder of a gradient (Note
        [gradients the user holds] in held_grads.py)."""
        start, buffer = self._bucket.start, self._buffer
        if self._flat.is_complex() and not buffer.is_complex():  # a converted buffer of real pairs
            buffer = torch.view_as_complex(buffer.view(-1, 2))
        return [slot_view(buffer[off - start:off - start + p.numel()], p, record)
                for p, off, record in zip(self._bucket.params, self._bucket.offsets, self._bucket.orders)]

    def parameters(self) -> list:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._is_last

    def __repr__(self) -> str:
        return f"HookBucket(index={self.index()}, numel={self._flat.numel()}, params={len(self._bucket.params)})"


class HookHandle:
    """A hook's future as the reducer waits for it: ``is_completed`` never blocks, ``wait``
    is bounded by the collective timeout (Note [communication hooks])."""

    #: fusedist's communicator issued nothing for this bucket (the step check compares -1).
    seq = -1
    op = "comm hook"

    def __init__(self, future, hook_bucket: HookBucket, name: str, rank: int, timeout: datetime.timedelta):
        self.future = future
        self.hook_bucket = hook_bucket
        self.index = hook_bucket.index()
        self.tag = f"ddp bucket {self.index}"  # the reducer's own name for the bucket's collective
        self.name, self.rank, self.timeout = name, rank, timeout
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait_done(self) -> None:
        """Block until the future has completed, at most the collective timeout."""
        if not self._done.wait(self.timeout.total_seconds()):
            raise CollectiveError(
                f"fusedist DDP (rank {self.rank}): the communication hook {self.name} did not complete "
                f"bucket {self.index} within {self.timeout.total_seconds():.0f} s (FUSEDIST_TIMEOUT_S): a rank "
                "may have stopped, skipped this backward or run a different model, or the hook's future "
                "is never completed",
                op=self.op, tag=self.tag, rank=self.rank,
            )

    def wait(self) -> torch.Tensor:
        self.wait_done()
        try:
            value = self.future.wait()  # done: returns at once (on CUDA, orders the current stream)
        except Exception as exc:  # noqa: BLE001 - whatever the hook's collectives raised
            raise CollectiveError(
                f"fusedist DDP (rank {self.rank}): the communication hook {self.name} failed on bucket "
                f"{self.index}: {exc}", op=self.op, tag=self.tag, rank=self.rank,
            ) from exc
        return value


class CommHookStrategy(GradSyncStrategy):
    """Synchronize each bucket with a torch communication hook (Note [communication hooks])."""

    keeps_buckets = True  # PowerSGD keys its error feedback and projections by bucket index

    def __init__(self, state, hook):
        self.state, self.hook = state, hook
        self.name = hook_name(hook)
        self._previous: Optional[HookHandle] = None  # Note [one hook at a time]

    @property
    def description(self) -> str:
        return f"the communication hook {self.name}"

    def launch(self, reducer, bucket):
        self.quiesce(reducer)
        hook_bucket = HookBucket(bucket, reducer)
        future = self.hook(self.state, hook_bucket)
        if not isinstance(future, torch._C.Future):  # torch.futures.Future and the futures of collectives
            raise TypeError(
                f"fusedist DDP (rank {reducer.comm.rank}): the communication hook {self.name} returned "
                f"{type(future).__name__} for bucket {bucket.index}; a hook returns a "
                "torch.futures.Future of the reduced bucket (e.g. dist.all_reduce(..., async_op=True).get_future())"
            )
        self._previous = HookHandle(future, hook_bucket, self.name, reducer.comm.rank, reducer.comm.timeout)
        return self._previous

    def quiesce(self, reducer) -> None:
        """Note [one hook at a time]: wait until the last hook's future has completed, so no
        callback of it issues a collective after this point."""
        previous, self._previous = self._previous, None
        if previous is not None and not previous.is_completed():
            previous.wait_done()

    def finish(self, reducer, bucket, handle):
        real = handle.hook_bucket._real  # a complex bucket as its real pairs (Note [complex buckets])
        result = _the_tensor(handle.wait())
        if not isinstance(result, torch.Tensor) or result.numel() != real.numel():
            got = (f"a tensor of shape {tuple(result.shape)} and dtype {result.dtype} ({result.numel()} elements)"
                   if isinstance(result, torch.Tensor) else type(result).__name__)
            pairs = " (its complex gradients as real pairs)" if bucket.dtype.is_complex else ""
            raise ValueError(
                f"fusedist DDP (rank {reducer.comm.rank}): the communication hook {self.name} returned "
                f"{got} for bucket {bucket.index}, which holds {real.numel()} gradient elements{pairs}; the "
                "future's value must be the bucket's reduced buffer"
            )
        if result.data_ptr() != real.data_ptr() or result.dtype != real.dtype:
            real.copy_(result.reshape(-1))


def _the_tensor(value) -> Optional[object]:
    """A hook's result: a tensor, or (as torch also accepts) a list holding one."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return value[0]
    return value


# ---------------------------------------------------------------------- registration
def register_comm_hook(wrapper, state, hook) -> None:
    """``DistributedDataParallel.register_comm_hook``: torch's averaging hooks become the fused
    reduction's ``reduce_dtype``; any other hook the reducer's strategy (Note [communication
    hooks])."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    builtin = {
        default_hooks.allreduce_hook: None,
        default_hooks.fp16_compress_hook: torch.float16,
        default_hooks.bf16_compress_hook: torch.bfloat16,
    }
    if hook not in builtin:
        _set_hook_strategy(wrapper, state, hook)
        return
    world = dist.group.WORLD
    group = wrapper.process_group
    if not (state is None or state is group or (group is None and state is world)):
        raise ValueError(
            "fusedist.DistributedDataParallel.register_comm_hook: state must be None or this model's "
            f"process group for {hook_name(hook)} (fusedist runs it as its own fused reduction, on the "
            "model's group); for another group, wrap the hook in a function of your own"
        )
    _set_hook_dtype(wrapper, builtin[hook], getattr(hook, "__name__", "hook"))


def register_builtin_comm_hook(wrapper, comm_hook_type) -> None:
    """``DistributedDataParallel.register_builtin_comm_hook``: ALLREDUCE or FP16_COMPRESS."""
    dtypes = {dist.BuiltinCommHookType.ALLREDUCE: None, dist.BuiltinCommHookType.FP16_COMPRESS: torch.float16}
    if comm_hook_type not in dtypes:
        raise NotImplementedError(f"fusedist.DistributedDataParallel: builtin comm hook {comm_hook_type} "
                                  "is not supported")
    _set_hook_dtype(wrapper, dtypes[comm_hook_type], str(comm_hook_type))


def _set_hook_strategy(wrapper, state, hook) -> None:
    name = hook_name(hook)
    if not callable(hook):
        raise TypeError(f"fusedist.DistributedDataParallel.register_comm_hook: hook {name} is not callable")
    _check_hook_annotations(hook, name)
    _check_hook_allowed(wrapper)
    reducer = wrapper.reducer
    if wrapper.config.reduce_dtype is not None:
        raise ValueError(
            f"fusedist.DistributedDataParallel: the model was built with reduce_dtype="
            f"{wrapper.config.reduce_dtype} and the communication hook {name} reduces the buckets in their "
            "own dtype; pass one of them (a hook can cast the buffer itself)"
        )
    if not isinstance(reducer.strategy, AllReduceAverage):
        raise ValueError(
            f"fusedist.DistributedDataParallel.register_comm_hook: this model's gradients are already "
            f"synchronized by {reducer.strategy.description} (ZeRO stage 2 reduce-scatters "
            f"the buckets itself); the communication hook {name} cannot synchronize them too"
        )
    _warn_sparse_weights_bypass(wrapper, name)
    wrapper._comm_hook = name
    reducer.strategy = CommHookStrategy(state, hook)
    match_torch_buckets(reducer)


def _check_hook_annotations(hook, name: str) -> None:
    """torch's DDP refuses a hook whose annotations promise something else than it hands over and
    expects back (``bucket: dist.GradBucket``, ``-> torch.futures.Future[torch.Tensor]``), so
    these refuse it too. Annotations written as strings (``from __future__ import annotations``)
    are resolved first: torch compared the strings themselves and refused correct hooks; one that
    cannot be resolved is left to the check of what the hook returns."""
    try:
        signature = inspect.signature(hook, eval_str=True)
    except (NameError, SyntaxError, TypeError, ValueError, AttributeError):
        return
    bucket = signature.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket):
        raise ValueError(f"fusedist.DistributedDataParallel.register_comm_hook: hook {name}'s bucket is annotated "
                         f"{bucket.annotation!r}; Communication hook: bucket annotation should be dist.GradBucket.")
    returned = signature.return_annotation
    if returned is not inspect.Signature.empty and returned != torch.futures.Future[torch.Tensor]:
        raise ValueError(f"fusedist.DistributedDataParallel.register_comm_hook: hook {name} is annotated to return "
                         f"{returned!r}; Communication hook: return annotation should be "
                         "torch.futures.Future[torch.Tensor].")


def match_torch_buckets(reducer) -> None:
    """Cut the buckets as torch's DDP hands them to a hook (Note [a hook's first buckets]): with
    ``find_unused_parameters=True`` (no static graph) torch's buckets for good (Note [buckets of
    find_unused_parameters] in layout.py); otherwise torch's buckets of the first synchronized
    backward, one per dtype (or cut by ``bucket_cap_mb_list``), until the rebuild from the observed
    order. A layout already fixed (a ZeroRedundancyOptimizer built first, or rebuilt after a
    synchronized backward) stays.
    The listeners are not told: the only one a layout not yet fixed has is the cross-rank
    layout check, a collective, and torch's registration is none -- a hook registered on some
    ranks only must reach the first forward's check, which names it (Note [reduction settings
    across ranks] in agreement.py). The new layout follows from the parameters and settings
    that the construction compared."""
    config = reducer.config
    if reducer.layout_final:
        return
    final = config.find_unused_parameters and not config.static_graph
    caps = config.bucket_caps_bytes() if final or config.bucket_cap_mb_list else [sys.maxsize]
    params, names = reducer.params, reducer.names
    groups = torch_unused_groups(params, caps)
    new = layout_of_groups([[(params[i], names[i]) for i in g] for g in groups], world_size=reducer.world_size,
                           device=reducer.device, bucket_storage=reducer.layout.bucket_storage)
    switch_layout(reducer, new, notify=False, final=final)


def _warn_sparse_weights_bypass(wrapper, name: str) -> None:
    """torch's DDP hands a sparse gradient (``nn.Embedding(sparse=True)``) to the hook in a bucket
    of its own; here such weights are averaged outside the buckets (Note [sparse gradients] in
    sparse.py), so the hook never sees them. A hook that does not average over the model's group
    (the no-op hook, post-local SGD's subgroup phase, a custom compression) then gets numbers
    torch's would not: said at registration rather than left silent."""
    sparse = getattr(wrapper, "_sparse", None)
    if not sparse:
        return
    warnings.warn(
        f"fusedist.DistributedDataParallel (rank {wrapper.rank}): the communication hook {name} is not called "
        f"for the sparse gradients of {list(sparse.names)[:4]} (nn.Embedding/EmbeddingBag with sparse=True): "
        "fusedist averages them over the model's process group after the buckets, where torch's DDP passes "
        "them to the hook in a bucket of their own",
        stacklevel=5,  # the user's register_comm_hook call
    )


def _check_hook_allowed(wrapper) -> None:
    if wrapper._comm_hook is not None:
        raise RuntimeError(
            f"fusedist.DistributedDataParallel: a communication hook ({wrapper._comm_hook}) is already "
            "registered; register_comm_hook or register_builtin_comm_hook can only be called once"
        )
    if wrapper.reducer.in_backward:
        raise RuntimeError("fusedist.DistributedDataParallel: register_comm_hook was called during backward")


# Note [compression hooks divide first]
# torch's fp16_compress_hook / bf16_compress_hook (and the builtin FP16_COMPRESS) divide each
# bucket by the world size in the narrow dtype, then all-reduce the sum. fusedist runs them as
# its own reduction in that ``reduce_dtype``, whose fp16 division is otherwise split around
# the sum (FSDP2's rule: no overflowing sum where the average fits, fewer small gradients
# flushed to zero). Under the hook the user asked for torch's numerics, so the division comes
# first, whole: at 3 ranks an fp16 gradient of 50000 averaged to inf with the split (25000 x 3
# overflows) where torch's hook gives 49984, and results differed in rounding beyond 2 ranks.
def _set_hook_dtype(wrapper, dtype: Optional[torch.dtype], name: str) -> None:
    _check_hook_allowed(wrapper)
    current = wrapper.config.reduce_dtype
    if current is not None and current != dtype:
        wire = dtype if dtype is not None else "the gradients' dtype"
        raise ValueError(
            f"fusedist.DistributedDataParallel: the model was built with reduce_dtype={current} and "
            f"{name} reduces in {wire}; pass one of them"
        )
    wrapper._comm_hook = name
    wrapper.config.reduce_dtype = dtype
    wrapper.config.divide_first = dtype is not None  # Note [compression hooks divide first]
