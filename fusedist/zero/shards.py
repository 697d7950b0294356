"""This rank's shards of a ZeroRedundancyOptimizer and its masters kept in step with the
parameters.

The flat partition and the gradient shards are built at construction, over the buckets of the
DDP model's gradient engine (whose layout is fixed from the moment the optimizer registers with
it: Note [layout fixed by a sharded consumer] in ``fusedist/ddp/rebucket.py``) or, without DDP,
over buckets of its own. The optimizer state proper -- the flat parameter buffers, the FP32
masters (FP64 for FP64 parameters), the pieces and the inner optimizer -- is created when first
needed (the first ``step()`` or a ``load_state_dict``), as torch's optimizers create theirs.
Afterwards the masters are the truth the updates start from; parameters changed outside the
optimizer are noticed through their version counters (Note [parameters changed outside the
optimizer]) and copied back. A mixin: these methods build and refresh the optimizer's core state.
"""

from __future__ import annotations

import torch

from .._dtypes import compute_dtype
from ..ddp.layout import converted_param
from . import grow, wiring
from . import state as zstate
from .shard_store import ShardStore, bucket_grad_slice, own_tensors
from .offload import HostShardOffload
from .partition import FlatParams, FlatPartition, bucketize


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a ``dtype`` shard's masters and gradients: ``compute_dtype``; a complex
    one keeps its own (complex32 widens to complex64), as torch's optimizers keep complex
    parameters and states complex (fusedist/optim/_complex.py). A real master would cast the
    imaginary parts away."""
    if dtype.is_complex:
        return torch.complex64 if dtype == torch.complex32 else dtype
    return compute_dtype(dtype)


class ShardsMixin:
    """Building the shards, masters and inner optimizer; syncing masters from the parameters."""

    def _build_partition(self) -> FlatPartition:
        """The partition and the gradient shards, at construction."""
        grow.refresh_sharded(self)  # Note [growing the partition]
        if self.ddp is not None:
            buckets = self.ddp.reducer.layout.buckets
        else:
            names = [f"param {i}" for i in self._trainable]
            buckets = bucketize(self._trainable_params(), names, cap_bytes=self.bucket_cap_bytes,
                                world_size=self.world_size)
        part = FlatPartition(buckets, self._params, self._group_of, self.rank, self.world_size,
                             sharded=self._trainable)
        self._grad_shards = own_tensors(part, self._own_grad_dtypes(part), self._master_dtype, self._device,
                                        torch.zeros)
        self._grad_store = ShardStore(part, bucket_grad_slice, self._grad_shards)
        self._partition = part
        return part

    # Note [the buckets of a newer wrapper]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # When the module is wrapped again, the newer wrapper takes the buckets over (Note [an
    # optimizer over a module wrapped again] in fusedist/ddp/succession.py): new bucket objects
    # over the same ranges, with the newer wrapper's storage. The partition still referred to the
    # retired wrapper's, and in stage 1 (gradients aliased to the buckets: Note [shards aliasing
    # the parameters and gradients]) each step copied the averaged ``p.grad`` into the retired
    # storage, which the inner optimizer's pieces stepped from: a second copy of every gradient,
    # held until the optimizer was rebuilt. So the step first takes up the buckets of the model it
    # follows now and re-cuts the pieces' gradient views from them.
    def _follow_model_buckets(self) -> None:
        """Note [the buckets of a newer wrapper]."""
        if self.ddp is None or not self._partition.follow_buckets(self.ddp.reducer.layout.buckets):
            return
        if self.inner is not None:
            self._restore_piece_grads(self._pieces)

    # Masters and gradient shards: fp64 stays fp64, every other real dtype is fp32.
    _master_dtype = staticmethod(master_dtype)

    # Note [shards aliasing the parameters and gradients]: which dtypes need copies.
    def _own_master_dtypes(self, part: FlatPartition) -> list:
        return [dt for dt in part.shard_numel if self.offload or self._master_dtype(dt) != dt]

    def _own_grad_dtypes(self, part: FlatPartition) -> list:
        aliasable = self.stage == 1 and self.ddp is not None and not self.offload
        return [dt for dt in part.shard_numel if not aliasable or self._master_dtype(dt) != dt]

    # Note [parameters converted after the optimizer was built]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # ``model.double()`` / ``.half()`` / ``.to(dtype)`` keep the Parameter objects and swap their
    # data. The partition and gradient shards were cut for the old dtypes, and after the first
    # step the parameters are no longer the flat buffer's views the step writes and gathers:
    # the first step after a conversion failed with a KeyError, a later one silently stopped
    # updating the parameters. As fusedist DDP does (Note [parameters replaced after wrapping]
    # in ddp/trainable.py), each step compares the first parameter of every bucket with the
    # bucket's dtype (a whole-module conversion, no per-parameter cost), and the step that
    # builds the state compares every parameter.
    def _check_not_converted(self, every: bool = False) -> None:
        """Raise, naming the parameter, if a trainable one changed dtype since its bucket was
        cut (Note [parameters converted after the optimizer was built])."""
        converted = converted_param(self._partition.buckets, every)
        if converted is None:
            return
        bucket, position = converted
        p = bucket.params[position]
        index = next(i for i, q in enumerate(self._params) if q is p)
        raise RuntimeError(
            f"ZeroRedundancyOptimizer (rank {self.rank}): {self._param_name(index)} is now "
            f"{p.dtype}, but the optimizer was built with it as {bucket.dtype}: the module was "
            "converted after the optimizer was built (e.g. model.double(), model.to(dtype)). Its "
            "shards keep the dtypes they were built with; convert the module first, then build "
            "the optimizer (and the DDP model)")

    def _ensure_state(self) -> None:
        self._check_not_converted(every=self.inner is None)
        if self.inner is not None:
            return
        part = self._partition
        device = self._device
        self._flat_params = FlatParams(part, self._params, device)
        if self.offload:
            self._offload = HostShardOffload(self)
            self._masters = ShardStore(part, self._flat_params.shard_view, self._offload.masters)
            self._piece_grads = ShardStore(part, bucket_grad_slice, self._offload.host_grads)
        else:  # Note [shards aliasing the parameters and gradients]
            own = own_tensors(part, self._own_master_dtypes(part), self._master_dtype, device)
            self._masters = ShardStore(part, self._flat_params.shard_view, own)
            self._piece_grads = self._grad_store
        self.sync_master_from_params()
        self._pieces = []
        groups: list[dict] = [dict(zstate.hyperparameters(g), params=[]) for g in self.param_groups]
        for piece in part.pieces:
            t = self._masters.slice(piece.dtype, piece.start, piece.end)
            t.grad = self._piece_grads.slice(piece.dtype, piece.start, piece.end)
            self._pieces.append(t)
            groups[piece.group]["params"].append(t)
        self.inner = self._optimizer_factory(groups, **self._inner_defaults)
        if self.overlap_param_gather:
            self._gatherer.install(self.ddp, part.bucket_shards)
            wiring.release_hooks_with(self)

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Copy the current parameter values into this rank's master shards (needed after
        parameters were changed outside the optimizer, e.g. by ``model.load_state_dict``)."""
        if self._flat_params is None:
            return  # masters are built from the parameters at the first step
        self.wait_for_params()
        if self._offload is not None:
            self._offload.wait_host_buffers()
        self._take_up_moved_params()  # Note [parameters moved off the flat buffer]
        self._masters.copy_own_from_views(self._partition.bucket_shards)
        self._record_param_versions()

    @torch.no_grad()
    def _sync_masters_of(self, indices) -> None:
        """Copy the parameters ``indices`` into their ranges of this rank's master shards
        (Note [parameters changed outside the optimizer])."""
        self.wait_for_params()
        if self._offload is not None:
            self._offload.wait_host_buffers()
        entry_of = self._partition.entry_of
        entries = [entry_of[i] for i in indices if i in entry_of]  # elements this rank owns
        self._masters.copy_own_from_view_ranges((e.dtype, e.pos, e.pos + e.numel) for e in entries)
        self._sharded_state.take_matching_masters(entries)  # Note [loaded masters that do not match ...]
        self._record_param_versions()

    # Note [parameters changed outside the optimizer]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Each rank updates FP32 master shards, not the parameters, and then writes the parameters
    # from them. Parameters the program changes between steps -- ``model.load_state_dict``,
    # an in-place ``p.copy_()`` / ``p.clamp_()`` under ``no_grad`` -- would be overwritten by
    # the next step from the stale masters (measured: loaded weights silently reverted), where
    # torch's optimizers, its ZeroRedundancyOptimizer too, update whatever the parameters hold.
    # Such writes bump the parameter's version counter, which the optimizer's own writes never
    # do (they go through the flat buffer the parameters were re-pointed into, which has its
    # own counter). So ``step()`` compares each parameter's version with the one recorded
    # after the optimizer's last write and copies only the parameters whose version moved into
    # the masters: this rank's range of each (``FlatPartition.entry_of``; a parameter lies in
    # one bucket). Refreshing every master instead would round the FP32 masters of the
    # parameters nobody wrote to their bf16/fp16 values, losing the precision the masters are
    # kept for (fusedist.optim's FusedAdamW refreshes only the written ones too, Note [masters
    # and writes from outside]). Aliased masters (fp32/fp64 parameters without offload, Note
    # [shards aliasing the parameters and gradients]) are the parameters: nothing to copy. A
    # parameter without a recorded version (it joined the partition since) counts as written.
    # In-place writes through ``p.data`` bypass the counter: call :meth:`sync_master_from_params`
    # (every master). (Replacing the storage is seen: Note [parameters moved off the flat buffer].)
    def _record_param_versions(self, indices=None) -> None:
        """Record the versions of the parameters ``indices`` (default: every trainable one) as
        those after the optimizer's last write."""
        if indices is None:
            self._param_versions = {i: self._params[i]._version for i in self._trainable}
        elif self._param_versions is not None:
            self._param_versions.update((i, self._params[i]._version) for i in indices)

    def _params_written_outside(self) -> list:
        """The trainable parameters whose version moved since it was recorded, or whose
        storage was replaced (Note [parameters moved off the flat buffer])."""
        recorded = self._param_versions
        if recorded is None:
            return []
        self._take_up_moved_params()
        return [i for i in self._trainable if recorded.get(i) != self._params[i]._version]

    # Note [parameters moved off the flat buffer]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The first step points every parameter at its slot of a flat buffer (``FlatParams``), and
    # each step all-gathers the updated shards into those buffers. A program that *replaces* a
    # parameter's storage between steps -- ``p.set_(t)`` under no_grad, a parametrization's
    # setter (``orthogonal``, ``weight_norm``: ``module.weight = Q`` calls ``original.set_``),
    # ``p.data = t`` -- left the parameter off the buffer: the masters never saw the new values,
    # and every later all-gather landed in the slot while the model computed with the replaced
    # tensor, frozen at the values set (measured: 0.1 away from torch after two steps), where
    # torch's optimizers, its ZeroRedundancyOptimizer too, update whatever tensor the parameter
    # holds. So each step (and :meth:`sync_master_from_params`) compares each parameter's
    # data_ptr with its slot's; a moved one is copied into its slot, pointed back at it, and
    # counts as written, so its master takes the new values. A replacement of another shape or
    # dtype cannot fit the slot and raises, naming the parameter.
    def _take_up_moved_params(self) -> None:
        """Note [parameters moved off the flat buffer]."""
        moved = self._flat_params.take_up_moved(
            self._params, lambda i: f"{self._param_name(i)} on rank {self.rank}")
        if moved and self._param_versions is not None:
            for i in moved:
                self._param_versions.pop(i, None)  # counts as written (no recorded version)
