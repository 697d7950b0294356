"""``fully_shard`` over tensor-parallel modules: FSDP2's 2-D parallelism (tensor parallelism within
a group, sharding across groups).

Note [tensor-parallel parameters]
---------------------------------
torchtitan's recipe: ``parallelize_module(model, mesh["tp"], plan)`` makes the parameters
DTensors on the tensor-parallel mesh (``ColwiseParallel``: ``Shard(0)``, ``RowwiseParallel``:
``Shard(1)`` and a ``Replicate()`` bias), then ``fully_shard(block, mesh=mesh["dp"])`` shards
each rank's *local* tensor across the data-parallel group. A unit here does exactly that: its
flat buffers hold the local tensors (``TensorParallelSpec.local``), so the gathers,
reduce-scatters and pieces are those of plain parameters of the local shapes. What changes:

* While gathered, the modules hold DTensor parameters over the gathered local tensors
  (``wrap``: the same storage), so the tensor-parallel plan's hooks and DTensor's ops run as
  under FSDP2. Their gradients are DTensors: before the unit's reduction each is redistributed
  to the parameter's placements (a ``Partial`` gradient is summed over the tensor-parallel
  group, as FSDP2 does) and its local tensor becomes the gradient the unit reduces -- at the
  unit's post-backward, and across unsynchronized backwards only then (Note [tensor-parallel
  gradients across micro-batches]).
* Global gradient quantities span both groups (``holder.py``): a norm sums each piece's share
  over the data-parallel group and then the tensor-parallel one, a parameter replicated across
  the tensor-parallel ranks (a ``Replicate()`` bias) counted once; the found-inf flag is the
  maximum over both. A plain unit sharded beside tensor-parallel ones joins their holder (Note
  [plain units beside tensor-parallel ones] in holder.py), and the clip checks that what the
  ranks hold alike is alike (Note [checking what is held alike] in held_alike.py).
* State dicts give each piece's region of the *global* parameter (``offsets``): its region of
  the local tensor moved by where the local tensor sits in the global one -- the chunks torch's
  distributed checkpoint reads and writes, interchangeable with FSDP2's 2-D DTensors; full
  state dicts assemble the global parameter over the tensor-parallel group. A parameter the
  tensor-parallel ranks hold alike (``Replicate()``, or plain) is written by the first of them
  only: the unit's layout on each rank cuts it where that rank's local tensors put it, so with
  local tensors of unequal sizes (13 rows over 2 ranks) the ranks' pieces of it overlap
  without coinciding, which the checkpoint's plan refuses.
* HSDP composes unchanged (torchtitan's 3-D mesh: ``fully_shard(..., mesh=mesh["dp_replicate",
  "dp_shard"])``): the replicas' all-reduce runs on the reduce-scattered pieces of the local
  tensors, the norm spans the shard and tensor-parallel groups (replicas hold copies), the
  found-inf flag all three groups, and the replicas' identical chunks are written once (DCP's
  planner keeps one of equal write items).
* ``CPUOffloadPolicy`` composes too: the pieces live in host memory and the gathered local
  tensors on the compute device, where the DTensors are made.

Note [tensor-parallel gradients across micro-batches]
-----------------------------------------------------
A gradient that arrives with other placements than its parameter's (``Partial``: the weight of
a ``SequenceParallel`` norm, a ``Replicate()`` bias) needs a sum over the tensor-parallel group.
FSDP2 does it once, when the unit reduces: under ``set_requires_gradient_sync(False)`` it keeps
the un-summed DTensor gradient, cast to ``reduce_dtype`` after each backward, adds the next
backward's to it, and redistributes the total in the synchronized one. Summing each
micro-batch's gradient over the group at once instead rounds every partial sum to the
parameter dtype (bf16 under ``param_dtype=bf16``) before the float32 accumulation: a few bf16
roundings more than FSDP2 per step, which a trained model shows. So such a gradient is kept by
its spec (``pending``) and settled at the unit's post-backward (:func:`settle_pending_grads`):
redistributed into the local gradients the unit reduces in a synchronized backward, kept in
``reduce_dtype`` otherwise -- FSDP2's order and dtypes, so the same bits. A gradient that
arrives with its parameter's placements (``Shard``) needs no collective and is taken at once.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["TensorParallelSpec", "drop_pending_grads", "settle_pending_grads", "tensor_parallel_specs"]


class TensorParallelSpec:
    """How one tensor-parallel parameter sits on its mesh: placements, global shape, and this
    rank's local tensor's offsets in the global one."""

    def __init__(self, param, comm):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self.mesh = param.device_mesh
        self.placements = tuple(param.placements)
        self.global_shape = tuple(param.shape)
        self.global_stride = tuple(param.stride())
        local_shape, offsets = compute_local_shape_and_global_offset(param.shape, self.mesh, self.placements)
        self.offsets = tuple(int(o) for o in offsets)
        self.local_shape = tuple(int(s) for s in local_shape)
        self.comm = comm  # fusedist communicator of the tensor-parallel group
        #: whether every tensor-parallel rank holds the same values (counted once in norms)
        self.replicated = not any(p.is_shard() for p in self.placements)
        #: a gradient not yet redistributed to ``placements`` (Note [tensor-parallel gradients
        #: across micro-batches]): this backward's, plus unsynchronized backwards' in reduce_dtype
        self.pending = None

    @staticmethod
    def local(param) -> torch.Tensor:
        """The parameter's local tensor (what the unit shards)."""
        return param._local_tensor

    def wrap(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """A DTensor parameter over ``local`` (same storage), as the modules see it gathered."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            dt = DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                    shape=torch.Size(self.global_shape), stride=self.global_stride)
        return nn.Parameter(dt, requires_grad=requires_grad)

    def local_grad(self, grad) -> Optional[torch.Tensor]:
        """A DTensor gradient as this rank's local gradient of the parameter's placements, or
        None where it needs redistributing: then kept in ``pending`` for the unit's
        post-backward (Note [tensor-parallel gradients across micro-batches])."""
        from torch.distributed.tensor import DTensor

        if not isinstance(grad, DTensor):
            return grad
        if tuple(grad.placements) == self.placements and self.pending is None:
            return grad.to_local()
        self.pending = grad if self.pending is None else self.pending + grad
        return None

    def full(self, local_whole: torch.Tensor) -> torch.Tensor:
        """The global parameter from every tensor-parallel rank's whole local tensor (a
        collective over the tensor-parallel group)."""
        from torch.distributed.tensor import DTensor

        dt = DTensor.from_local(local_whole, self.mesh, self.placements, run_check=False,
                                shape=torch.Size(self.global_shape), stride=self.global_stride)
        return dt.full_tensor()

    def local_of_global(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut from the global parameter (a view)."""
        out = whole
        for dim, (start, size) in enumerate(zip(self.offsets, self.local_shape)):
            if size != whole.shape[dim]:
                out = out.narrow(dim, start, size)
        return out


def tensor_parallel_specs(name: str, params: list, fqns: list, dims: list, groups, post_forward,
                          device) -> Optional[list]:
    """Each parameter's spec (None for a plain one), or None when the unit has no DTensor
    parameter; what this composition does not cover is refused naming the parameter."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ..comm import get_communicator

    found = [(i, p) for i, p in enumerate(params) if isinstance(p, DTensor)]
    if not found:
        return None
    i, first = found[0]
    where = f"fusedist.fully_shard({name}): parameter '{fqns[i]}' is tensor-parallel (a DTensor)"
    if post_forward is not None:
        raise NotImplementedError(f"{where}: reshard_after_forward as an int is not supported with tensor "
                                  "parallelism (FSDP2 refuses it too); pass True or False")
    tp_ranks = dist.get_process_group_ranks(first.device_mesh.get_group())
    dp_ranks = sorted(groups.ranks)  # (under HSDP the whole mesh: a peer in neither group overlaps too)
    if set(tp_ranks) & set(dp_ranks) != {dist.get_rank()}:
        raise ValueError(f"{where} on a mesh whose ranks {tp_ranks} overlap the data-parallel group's {dp_ranks}: "
                         "pass the other dims of the mesh to fully_shard (mesh['dp'], or mesh['dp_replicate', "
                         "'dp_shard'] for HSDP, for parameters on mesh['tp'])")
    for j, p in found:
        if dims[j] != 0:
            raise NotImplementedError(f"fusedist.fully_shard({name}): parameter '{fqns[j]}' is tensor-parallel and "
                                      f"shard_placement_fn gave Shard({dims[j]}); tensor-parallel parameters are "
                                      "sharded on dim 0 of their local tensors")
        if dist.get_process_group_ranks(p.device_mesh.get_group()) != tp_ranks:
            raise NotImplementedError(f"fusedist.fully_shard({name}): parameters '{fqns[i]}' and '{fqns[j]}' are "
                                      "on different tensor-parallel meshes; one unit takes one mesh")
    comm = get_communicator(first.device_mesh.get_group(), device)
    return [TensorParallelSpec(p, comm) if isinstance(p, DTensor) else None for p in params]


def settle_pending_grads(unit, grads: list, synced: bool, reduce_dtype: Optional[torch.dtype]) -> None:
    """At ``unit``'s post-backward (Note [tensor-parallel gradients across micro-batches]): in a
    synchronized backward each pending gradient, redistributed (a collective over the
    tensor-parallel group, in the same order on every rank: the unit's parameters'), is added
    to its parameter's entry of ``grads`` (the local gradients the unit reduces; in
    ``reduce_dtype`` after accumulation, which the unsharded parameter's ``.grad`` could not
    hold); otherwise it stays pending, cast to ``reduce_dtype`` as FSDP2 casts its
    accumulated gradient."""
    for i, spec in enumerate(unit.tp):
        if spec is None or spec.pending is None:
            continue
        pending = spec.pending
        if not synced:
            if reduce_dtype is not None and pending.is_floating_point() and pending.dtype != reduce_dtype:
                spec.pending = pending.to(reduce_dtype)
            continue
        spec.pending = None
        local = pending.redistribute(spec.mesh, spec.placements).to_local()
        grads[i] = local if grads[i] is None else grads[i] + local


def drop_pending_grads(unit) -> None:
    """Forget ``unit``'s pending gradients (an aborted iteration drops its accumulators too)."""
    for spec in unit.tp:
        if spec is not None:
            spec.pending = None
