"""The parameter all-gathers of a ZeroRedundancyOptimizer, and the waits for them.

After each step every rank holds its updated slice of each bucket; the all-gathers (one per
bucket, in forward order) make the parameters whole again. :class:`ParamGatherer` owns what
that needs beyond the shards themselves: the handles of the gathers in flight, and -- with
``overlap_param_gather=True`` -- the forward pre-hooks, state-dict hooks and compiled-forward
waiter that wait for them. Kept apart from the optimizer because it has its own state and a
narrow interface: the optimizer (and the offload pipeline) hand it bucket shards to gather,
everything else only asks it to wait.

Note [overlapped parameter gathers]
    With ``overlap_param_gather=True`` a parameter read between ``step()`` and the next
    forward races with its bucket's all-gather: it sees this rank's slice updated and the
    other ranks' slices either old or new. Measured (2 ranks, stage 2, 8 layers of 256x256,
    parameters copied right after each of 20 steps): 87 and 124 of 320 copies differed from
    the final values -- an EMA or SWA average built from them is silently wrong, and only
    sometimes. torch's, DeepSpeed's and Megatron's sharded optimizers return final
    parameters by default (Megatron's overlap_param_gather is opt-in too), so a drop-in
    must: the overlap is opt-in, and the forward pre-hooks, ``state_dict`` hooks and the
    compiled-forward waiter exist only with it. Its gain is what the gathers cost the
    iteration (benchmarks/bench_zero.py, rows 'zero2' and 'zero2 overlapped gather').

Note [a model pickled under overlapped gathers]
    ``torch.save(model)`` (and ``pickle.dumps`` or ``copy.deepcopy``) of a DDP model works under torch's
    ZeroRedundancyOptimizer, which installs no hook on the model. The waits above are hooks on the model's
    modules, so they are pickled with it: each is a :class:`GatherWait`, whose pickled form waits for the
    gathers in flight first (``torch.save`` writes the tensors' data after pickling the whole model, so it
    writes the final parameters) and loads as a hook that waits for nothing -- the copy has no gathers, and
    no optimizer of its own until one is built for it. A module's own parameters are pickled before its
    hooks, so the DDP wrapper's copy and pickle wait for every gather first (Note [a copy under overlapped
    gathers] in fusedist/ddp/copies.py).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

ROWS_ALONE = -1  # the key of the fingerprint rows' own all-gather among the bucket indices


class ParamGatherer:
    """All-gathers of updated parameter slices per bucket, and the waits for them
    (Note [overlapped parameter gathers])."""

    def __init__(self, comm, world_size: int, overlap: bool):
        self.comm = comm
        self.world_size = world_size
        self.overlap = overlap
        self.handles: dict[int, object] = {}  # bucket index -> all-gather in flight
        self.hooks: list = []  # removable handles of the hooks installed on the model
        self.compiled_inside = False
        self.orphaned = False  # its optimizer is gone: the hooks come off before the next forward
        # Note [gradients compared at every step] in carried_agreement.py: this step's rows to carry,
        # the verdict on the rows gathered, and the steps counted (the error names the step).
        self.rows = None
        self.refusal: Optional[RuntimeError] = None
        self.steps = 0
        self.carrier_buffers: dict = {}

    # ------------------------------------------------------------------ gathers
    def gather(self, flat_params, bs) -> None:
        """Start the all-gather of bucket shard ``bs`` into the parameters' flat buffer (with the
        step's gradient fingerprints behind the slice where this bucket carries them)."""
        index, rows, tag = bs.bucket.index, self.rows, f"zero param gather bucket {bs.bucket.index}"
        if rows is not None and rows.carrier == index:
            self.rows = None
            self.handles[index] = rows.gather_with(self.comm, self.world_size, flat_params.bucket_view(bs),
                                                   flat_params.shard_view(bs), tag, self.carrier_buffers)
            return
        self.handles[index] = self.comm.all_gather(
            flat_params.bucket_view(bs), flat_params.shard_view(bs), async_op=True, tag=tag)
        if rows is not None and rows.carrier is None:  # (no bucket small enough: the rows' own gather)
            self.rows = None
            self.handles[ROWS_ALONE] = rows.gather_alone(self.comm, self.world_size, self.carrier_buffers)

    @torch.no_grad()
    def publish(self, partition, flat_params, masters) -> None:
        """Write the updated master copies into the parameters' slices (aliased masters are
        them already) and all-gather them, bucket by bucket, in forward order (DDP's buckets
        are in backward order); without overlap, wait for them."""
        masters.copy_own_to_views(partition.bucket_shards)
        if self.world_size == 1:
            return
        for bs in reversed(partition.bucket_shards):
            self.gather(flat_params, bs)
        if not self.overlap:
            self.wait_all()

    def wait(self, indices) -> None:
        """Block until the gathers of the buckets ``indices`` have landed."""
        for i in indices:
            handle = self.handles.pop(i, None)
            if handle is not None:
                handle.wait()

    def wait_all(self) -> None:
        self.wait(list(self.handles))

    # ------------------------------------------------------------------ hooks (overlap only)
    def install(self, ddp, shards) -> None:
        """The waits of an overlapped gather, on the DDP model: forward pre-hooks per bucket,
        the compiled-forward waiter and the model's state-dict hooks."""
        self.hook_buckets(ddp.module, shards)
        # Note [hooks inside compiled modules]: where hooks may not fire, the DDP wrapper waits.
        self.compiled_inside = _uses_compile(ddp.module)
        ddp.add_param_waiter(self.wait_before_forward)
        # model.state_dict() (and so torch.save of the model) sees the updated parameters too,
        # and model.load_state_dict() is not overwritten by an all-gather still in flight.
        self.hooks.append(ddp.module.register_state_dict_pre_hook(GatherWait(self)))
        self.hooks.append(ddp.module.register_load_state_dict_pre_hook(GatherWait(self)))

    def release(self) -> None:
        """Wait for the gathers in flight, then take the hooks off the model: its optimizer is
        gone or replaced (Note [an optimizer built again] in ``wiring.py``); left in place, every
        optimizer ever built for the model added its hooks to each forward."""
        self.wait_all()
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def orphan(self) -> None:
        """Its optimizer was collected. Only a mark: the garbage collector runs this at any
        point, on any thread (inside a hook loop of the model, during a collective); the hooks
        come off in :meth:`wait_before_forward`, where the DDP wrapper calls it before a forward."""
        self.orphaned = True

    def hook_buckets(self, root: torch.nn.Module, shards) -> None:
        """Forward pre-hooks: each module of ``root`` waits for the gathers of the buckets of
        ``shards`` holding its parameters (also for buckets that join later)."""
        buckets_of: dict = {}
        for bs in shards:
            for p in bs.bucket.params:
                buckets_of.setdefault(p, set()).add(bs.bucket.index)
        for module in root.modules():
            needed = set()
            for p in module._parameters.values():
                if p is not None and p in buckets_of:
                    needed |= buckets_of[p]
            if needed:
                indices = sorted(needed)
                self.hooks.append(module.register_forward_pre_hook(GatherWait(self, indices)))

    def wait_before_forward(self, traced: bool) -> None:
        """Called by the DDP wrapper before each forward of its module (Note [hooks inside
        compiled modules]): wait for every all-gather when the forward is compiled. An orphaned
        gatherer takes its hooks off here (:meth:`orphan`)."""
        if self.orphaned:
            self.release()
        elif traced or self.compiled_inside:
            self.wait_all()


class GatherWait:
    """A hook on the model that waits for the gathers of ``indices`` (all of them when None). An object
    rather than a lambda, so that the model pickles (Note [a model pickled under overlapped gathers])."""

    def __init__(self, gatherer, indices=None):
        self.gatherer = gatherer
        self.indices = indices

    def __call__(self, *_args, **_kwargs) -> None:
        if self.gatherer is None:
            return
        if self.indices is None:
            self.gatherer.wait_all()
        else:
            self.gatherer.wait(self.indices)

    def __reduce__(self):
        if self.gatherer is not None:
            self.gatherer.wait_all()  # (what the copy holds is the parameters' final values)
        return type(self), (None, self.indices)


def _uses_compile(root: torch.nn.Module) -> bool:
    """Whether ``root`` holds a ``torch.compile``-d module: an ``OptimizedModule``, or one
    compiled in place with ``Module.compile()``."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded once anything was compiled
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and any(
        isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None for m in root.modules())
