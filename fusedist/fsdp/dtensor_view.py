"""What FSDP2's DTensor state-dict entries answer besides ``full_tensor()``: ``to_local()``,
``placements`` and ``device_mesh``, for fusedist's entries (ShardedPieces).

Note [entries read as DTensors]
    Code written for FSDP2 reads its sharded entries as DTensors: ``v.to_local()`` for this
    rank's shard (local norms, per-rank exports, ``DTensor.from_local(v.to_local(),
    v.device_mesh, v.placements)`` rebuilding an entry), ``v.placements`` to tell a sharded
    entry from a replicated one. The answers are FSDP2's on the same model and mesh:

    * ``placements``: ``(Shard(d),)`` for a parameter sharded on dim ``d``; HSDP adds
      ``Replicate()`` before it; a tensor-parallel parameter appends its own placements, and its
      data-parallel placement is ``_StridedShard(d, split_factor=...)`` where tensor parallelism
      shards the same dim (FSDP2's ``_init_sharding_spec_tp``).
    * ``device_mesh``: the mesh given to ``fully_shard`` (for ``process_group``, a 1-D mesh of
      that group, which FSDP2 has no argument for); with tensor parallelism the data-parallel mesh
      concatenated with the tensor-parallel one, as FSDP2's.
    * ``to_local()``: FSDP2's shard -- ``torch.chunk`` of the (tensor-parallel local) parameter
      on ``d`` over the shard group, rank ``r``'s chunk, ``0`` long on ``d`` past the last one. A
      piece of a dim-sharded parameter is that chunk (Note [dim-sharded sections] in
      chunk_layout.py), and so is a piece of dim 0 where the unit's flat layout happens to cut
      every rank's piece there: then ``to_local()`` is the entry's own storage, as a
      DTensor's is. Elsewhere (Note [row-aligned flat layout] in layout.py: a unit's parameters
      are cut where the flat shards end, not each in ``world`` chunks) the chunk is made from
      every rank's entry (``full_tensor``'s gather, then the chunk copied out): a collective,
      which every rank of the shard group calls for the same entries in the same order, and a
      copy, whose writes do not reach the entry. Whether it is one is the same on every rank
      (all ranks' pieces are known from the layout), so no rank waits for another in vain.
      Quantized storage (Note [quantized storage] in packed.py) answers as FSDP2's NF4 entries do:
      torchao's class (Note [quantized-storage entries read as DTensors] in packed_entry.py).

    The description is taken when the entry is made and travels with it (``.clone()``,
    ``.to()``, ``copy.deepcopy``), with what a gather needs -- the shard group's communicator,
    the tensor-parallel spec -- and no reference to the unit or the model: as a DTensor entry,
    one taken before ``del model`` still answers all of these, ``full_tensor()`` included
    (``sd = model.state_dict(); del model; export(sd)``), and does not keep the model alive.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

__all__ = ["record_mesh", "describe_entry", "EntryLayout"]


class _UnitMeshes:
    """The mesh a unit was sharded over; where ``process_group`` was given, a mesh of that group
    built on first use (a unit whose entries nobody reads as DTensors needs none)."""

    def __init__(self, mesh, group, device_type: str, replicated: bool):
        self._dp, self._group, self._device_type = mesh, group, device_type
        self.replicated = replicated  # HSDP: a replicate dim before the shard dim
        self._with_tp: dict = {}

    def dp_mesh(self):
        if self._dp is None:
            import torch.distributed as dist
            from torch.distributed.device_mesh import DeviceMesh

            self._dp = DeviceMesh.from_group(self._group or dist.group.WORLD, self._device_type)
        return self._dp

    def mesh_for(self, tp_mesh):
        """The entry's mesh: the data-parallel one, or it concatenated with ``tp_mesh``."""
        if tp_mesh is None:
            return self.dp_mesh()
        found = self._with_tp.get(id(tp_mesh))
        if found is None or found[0] is not tp_mesh:
            from torch.distributed.device_mesh import DeviceMesh

            found = self._with_tp[id(tp_mesh)] = (tp_mesh, DeviceMesh._concatenate([self.dp_mesh(), tp_mesh]))
        return found[1]


_MESHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # unit -> _UnitMeshes
_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # unit -> [EntryLayout or None]


def record_mesh(unit, mesh, groups) -> None:
    """Remember what ``unit`` was sharded over (``fully_shard``'s ``mesh``, else its groups)."""
    _MESHES[unit] = _UnitMeshes(mesh, groups.shard, groups.device.type, groups.replicate is not None)


class EntryLayout:
    """One parameter's entries read as FSDP2's DTensors (Note [entries read as DTensors])."""

    def __init__(self, unit, index: int, meshes: _UnitMeshes, placements: tuple, dim: int, start: int, size: int,
                 local_shape: tuple, aligned: bool, packed: bool):
        # what a gather of the entries needs, held without the unit: the shard group's communicator,
        # the compute device, the tensor-parallel spec (its mesh and placements) and a name for tags
        self.comm, self.device, self.tp, self.fqn = unit.comm, unit.device, unit.tp[index], unit.fqns[index]
        self._meshes, self._tp_mesh = meshes, self.tp.mesh if self.tp is not None else None
        self.placements = placements
        self.dim, self.start, self.size = dim, start, size  # this rank's chunk on ``dim``
        self.local_shape = local_shape  # the (tensor-parallel local) parameter's shape
        self.aligned = aligned  # every rank's piece is its FSDP2 chunk
        self.packed = packed
        # quantized storage: the unit's layout of the weight, without its module (Note
        # [quantized-storage entries read as DTensors] in packed_entry.py)
        self.packed_spec = None
        if packed:
            from .packed_entry import detached_spec

            self.packed_spec = detached_spec(unit.ext[index])

    def __deepcopy__(self, memo):
        # shared, not copied, by an entry's copies (``copy.deepcopy``, dcp.async_save's stager,
        # which deep-copies a tensor's attributes): it describes the parameter, not the values, and
        # holds a communicator and meshes, which are neither copied nor pickled
        return self

    def __copy__(self):
        return self

    @property
    def device_mesh(self):
        try:
            return self._meshes.mesh_for(self._tp_mesh)
        except RuntimeError as e:  # (torch's _concatenate: meshes of different roots)
            raise RuntimeError(
                f"fusedist.fully_shard: device_mesh of parameter '{self.fqn}': its tensor-parallel mesh "
                f"{self._tp_mesh} and the data-parallel mesh {self._meshes.dp_mesh()} given to fully_shard are not "
                f"dims of one mesh ({e}), so no mesh holds both; FSDP2 refuses such a model at fully_shard. "
                "fusedist trains it, and placements, to_local() and full_tensor() answer; for device_mesh, take "
                "both from one mesh: mesh = init_device_mesh(..., mesh_dim_names=('dp', 'tp')), parallelize on "
                "mesh['tp'], fully_shard(..., mesh=mesh['dp']).") from None

    def chunk_shape(self) -> tuple:
        if not self.local_shape:  # (a 0-dim parameter: on the first rank, an empty tensor elsewhere)
            return () if self.size else (0,)
        shape = list(self.local_shape)
        shape[self.dim] = self.size
        return tuple(shape)

    def chunk_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the whole (local) parameter ``whole``."""
        if whole.dim() == 0:
            return whole.clone() if self.size else whole.new_empty((0,))
        return whole.narrow(self.dim, self.start, self.size).contiguous().clone()


def describe_entry(unit, index: int) -> Optional[EntryLayout]:
    """Parameter ``index`` of ``unit`` as FSDP2 describes its DTensor; None for a unit whose mesh
    was not recorded. Built once per unit (the layout does not change)."""
    layouts = _LAYOUTS.get(unit)
    if layouts is None:
        meshes = _MESHES.get(unit)
        if meshes is None:
            return None
        layouts = _LAYOUTS[unit] = [_describe(unit, meshes, i) for i in range(len(unit.sharded))]
    return layouts[index]


def _describe(unit, meshes: _UnitMeshes, index: int) -> EntryLayout:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    spec, ext = unit.tp[index], unit.ext[index]
    packed = ext is not None and ext.packed
    dim = unit.layout.dims[index]
    shape = tuple(spec.local_shape) if spec is not None else tuple(unit.layout.slots[index].shape)
    world, rank = unit.comm.world_size, unit.comm.rank
    dp = Shard(dim)
    tail: tuple = ()
    if spec is not None:
        tail = spec.placements
        split = math.prod(spec.mesh.size(k) for k, p in enumerate(tail) if p.is_shard(dim))
        dp = _StridedShard(dim, split_factor=split) if split > 1 else dp
    placements = ((Replicate(),) if meshes.replicated else ()) + (dp,) + tuple(tail)
    start, size = _chunk(shape, dim, world, rank)
    aligned = not packed and all(_holds_chunk(unit, index, shape, dim, world, r) for r in range(world))
    return EntryLayout(unit, index, meshes, placements, dim, start, size, shape, aligned, packed)


def _chunk(shape: tuple, dim: int, world: int, rank: int) -> tuple:
    """``(start, size)`` on ``dim`` of rank ``rank``'s ``torch.chunk`` of a tensor of ``shape``
    (FSDP2's ``_chunk_with_empty``: nothing past the last chunk)."""
    n = shape[dim] if shape else 1
    step = -(-n // world) if n else 0
    start = min(rank * step, n)
    return start, max(0, min(step, n - start))


def _holds_chunk(unit, index: int, shape: tuple, dim: int, world: int, rank: int) -> bool:
    """Whether rank ``rank``'s piece of parameter ``index`` is its FSDP2 chunk."""
    sec, _ = unit.layout.section_of(index)
    if sec.chunked:
        return True  # (laid out as torch.chunk: Note [dim-sharded sections] in chunk_layout.py)
    start, size = _chunk(shape, dim, world, rank)
    lo, hi = unit.layout.element_range(index, rank)
    if not shape:
        return (lo, hi) == ((0, 1) if size else (0, 0))
    row = math.prod(shape[1:])
    return (hi - lo == size * row) and (not size or lo == start * row)
