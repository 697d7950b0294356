"""The process groups a ``fully_shard`` call shards and replicates over, read from its mesh.

A 1-D mesh (or a process group) shards over all its ranks. A 2-D mesh is HSDP, as torch's
FSDP2 reads it: dim 0 replicates, dim 1 shards (``init_device_mesh(dev, (R, S),
mesh_dim_names=("dp_replicate", "dp_shard"))``) -- gathers and reduce-scatters run within the
shard group, and each gradient shard is then all-reduced across the replicate group (Note
[replicate all-reduce] in replicate.py). Other meshes are refused here, by name, before
anything is built.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["DataParallelGroups", "groups_of"]

#: dim names that say a dim is not data parallel (tensor, pipeline, expert parallel): its ranks
#: hold different parameters, so a 2-D mesh naming one of them was most likely meant to be
#: sliced (``mesh["dp"]``) first. Not "cp": context-parallel ranks hold the same parameters and
#: their gradients are averaged like data-parallel ones (torchtitan shards over ``dp_shard_cp``),
#: so a ``("dp", "cp")`` mesh is a valid HSDP mesh, which FSDP2 runs too.
_NOT_DATA_PARALLEL = {"tp", "pp", "ep", "etp"}


@dataclasses.dataclass(frozen=True)
class DataParallelGroups:
    """``shard``: the group gathers and reduce-scatters run in; ``replicate``: the group each
    gradient shard is all-reduced over (None without HSDP); ``device``: the compute device;
    ``ranks``: every rank of this rank's data-parallel mesh -- under HSDP more than the shard and
    replicate groups through this rank, which are one row and one column of it."""

    shard: Optional[dist.ProcessGroup]
    replicate: Optional[dist.ProcessGroup]
    device: torch.device
    ranks: tuple


def groups_of(mesh, process_group) -> DataParallelGroups:
    """The groups and compute device of a ``fully_shard`` call (``mesh`` or ``process_group``,
    at most one of them given); raises ``ValueError`` naming what is wrong with ``mesh``."""
    replicate = None
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names is not None else None
        shape = tuple(mesh.mesh.shape)
        if mesh.get_coordinate() is None:  # (torch's get_group fails with a bare IndexError there)
            raise ValueError(
                f"fusedist.fully_shard: rank {dist.get_rank()} is not in the mesh (shape {shape}, dims {names}, "
                f"global ranks {mesh.mesh.flatten().tolist()}); shard a module over a mesh only on its ranks.")
        if mesh.ndim == 2:
            _check_hsdp_mesh(shape, names)
            shard, replicate = mesh.get_group(1), mesh.get_group(0)
        elif mesh.ndim == 1:
            shard = mesh.get_group()
        else:
            raise ValueError(
                f"fusedist.fully_shard: mesh must be 1-D (shard) or 2-D (replicate, shard: HSDP), got a "
                f"{mesh.ndim}-D mesh of shape {shape} (dims {names}). Pass the data-parallel part of it, e.g. "
                "mesh['dp'] or mesh['dp_replicate', 'dp_shard'].")
        device_type = mesh.device_type
        ranks = tuple(mesh.mesh.flatten().tolist())
    else:
        shard = process_group
        _check_member(shard)
        device_type = "cuda" if dist.get_backend(shard) == "nccl" else "cpu"
        ranks = tuple(dist.get_process_group_ranks(shard) if shard is not None else range(dist.get_world_size()))
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type)
    return DataParallelGroups(shard, replicate, device, ranks)


def _check_member(group) -> None:
    """Refuse a ``process_group`` this rank is not in: ``new_group`` hands the other ranks a
    placeholder, on which torch's lookups fail with "Invalid process group specified", naming
    neither the rank nor the call."""
    if group is None or dist.get_rank(group) >= 0:
        return
    raise ValueError(
        f"fusedist.fully_shard: rank {dist.get_rank()} is not a member of process_group (torch.distributed."
        "new_group returns GroupMember.NON_GROUP_MEMBER on the ranks it leaves out); shard a module over a "
        "group only on that group's ranks.")


def _check_hsdp_mesh(shape: tuple, names: Optional[tuple]) -> None:
    """A 2-D mesh is (replicate, shard), with names (torch's FSDP2 requires them too); names
    that put the shard dim first, or that name a non-data-parallel dim, are refused."""
    if names is None:
        raise ValueError(
            f"fusedist.fully_shard: a 2-D mesh (HSDP, shape {shape}) needs mesh_dim_names, as torch's FSDP2 "
            "requires: init_device_mesh(device, (replicate, shard), mesh_dim_names=('dp_replicate', 'dp_shard')). "
            "Dim 0 replicates, dim 1 shards.")
    bad = [n for n in names if n.lower() in _NOT_DATA_PARALLEL]
    if bad:
        raise ValueError(
            f"fusedist.fully_shard: the 2-D mesh {names} (shape {shape}) has a dim named {bad[0]!r}, which is not "
            "data parallel; fully_shard reads a 2-D mesh as (replicate, shard) and would replicate or shard over "
            f"it. Pass the data-parallel dims only, e.g. mesh['dp'] or mesh['dp_replicate', 'dp_shard'].")
    first, second = names[0].lower(), names[1].lower()
    if "shard" in first and "replicate" in second:
        raise ValueError(
            f"fusedist.fully_shard: the 2-D mesh's dims are {names}: dim 0 must be the replicate dim and dim 1 "
            "the shard dim (torch's FSDP2 reads them so). Build the mesh as (replicate, shard), e.g. "
            "init_device_mesh(device, (R, S), mesh_dim_names=('dp_replicate', 'dp_shard')).")


def shard_mesh_of(mesh, groups: DataParallelGroups):
    """The 1-D DeviceMesh of the shard group: what FSDP2 hands ``fsdp_pre_all_gather`` (Note
    [all-gather extension] in extension.py), made from the group when no mesh was given."""
    if mesh is not None:
        return mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[1]]
    from torch.distributed.device_mesh import DeviceMesh

    group = groups.shard if groups.shard is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, groups.device.type)
