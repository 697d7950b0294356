"""The check at a root's first forward that every rank wrapped the model alike: the same units
with the same parameters (names, shapes, trainable flags, dtypes), the same mesh, the same
``reshard_after_forward``. A rank that differs would otherwise wait in a collective its peers
never issue; here every rank raises the same :class:`fusedist.RankMismatchError` naming the
first unit that differs and each rank's version of it. The FUSEDIST_* settings that decide which
collectives a step runs are compared too: a program that made its group with torch's own
``init_process_group`` never ran ``init_distributed``'s check of them (Note [settings that must agree]
in fusedist/reliability/settings_agreement.py), and ranks that differ paired their collectives wrongly."""

from __future__ import annotations

from typing import Any

from .._consistency import check_same_across_ranks
from ..reliability.settings_agreement import must_agree_readings
from .tree_names import unit_where

__all__ = ["check_one_mesh", "check_wrapping"]


def check_wrapping(named_units: list) -> list:
    """Compare ``(path, unit)`` of every unit under a root, in order, across the shard group
    (and across replicas on an HSDP mesh); return the units' ``(path, parameters)``
    signature, which the step watch keeps."""
    units = [u for _, u in named_units]
    signature = [(path, _unit_params(u)) for path, u in named_units]
    # the data-parallel shape: a rank sharding over a 2-D mesh whose peer was given a 1-D one
    # (or another 2-D one) is reported here, before an all-reduce the peer never issues hangs;
    # and each unit's reshard after forward, which decides which collectives its next gather
    # runs, over which ranks (Note [resharding to a smaller group after forward] in post_forward.py)
    # and the settings that decide the collectives, before the units (whose count may differ: a unit extra on one
    # rank then meets no setting in the comparison by position)
    checked = [(_MESH, _mesh_entry(units[0]))] + [(_SETTING, name, value) for name, value in must_agree_readings()]
    checked += [(path, params, _reshard_entry(u)) for (path, params), u in zip(signature, units)]
    replicate = units[0].replicate_comm
    # (the shard group's exchange is named as on a 1-D mesh, so a peer given the other kind of
    # mesh meets it and the difference is reported by content)
    groups = [(units[0].comm, "")] + ([(replicate, " (across replicas)")] if replicate is not None else [])
    for comm, over in groups:
        if comm.world_size > 1:  # replica peers pair up their all-reduces too
            check_same_across_ranks(
                checked, f"the fully_shard wrapping of the model{over}", label=_describe_unit,
                comm=comm, op=f"fully_shard: wrapping check{over}",
                hint="Every rank must apply fully_shard to the same modules, in the same order, on the same "
                     "model, with the same mesh (a 2-D mesh on every rank for HSDP) and the same "
                     "reshard_after_forward, and the same FUSEDIST_* settings.")
    return signature


def _unit_params(unit) -> list:
    """(name, shape) of a unit's parameters for the wrapping check; a frozen one is named so,
    since the flags at wrapping decide the layout (Note [trainable section]), and in a unit of
    several dtypes each is named with its dtype, which decides it too (Note [dtype sections]),
    in a unit of one dtype the first (a rank that loaded the model in float64 gathered other
    bytes: it waited in its first all-gather until the timeout);
    so is an extension parameter's subclass (a rank that converted to float8 and one that
    did not gather different bytes)."""
    out = []
    for i, (fqn, slot) in enumerate(zip(unit.fqns, unit.layout.slots)):
        sec = unit.layout.section_of(i)[0]
        name = fqn if sec.trainable else f"{fqn} (frozen)"
        if sec.extension:  # gathered as its subclass says (Note [all-gather extension] in extension.py)
            name = f"{name} ({unit.ext[i].cls.__name__})"
        elif sec.chunked:  # the dim decides the layout too (Note [dim-sharded sections] in chunk_layout.py)
            name = f"{name} (Shard({unit.layout.dims[i]}))"
        if unit.layout.mixed or i == 0:  # (one dtype: named on the first, which names the unit's)
            name = f"{name} ({str(sec.dtype or unit.dtype).replace('torch.', '')})"
        out.append((name, tuple(slot.shape)))
    return out


#: the wrapping check's first entry: the mesh's data-parallel shape (replicas, shard size)
_MESH = "<mesh>"
#: its next entries: each FUSEDIST_* setting that must agree across ranks, with this rank's reading
_SETTING = "<setting>"


def _mesh_entry(unit) -> tuple:
    replicas = unit.replicate_comm.world_size if unit.replicate_comm is not None else 1
    return ("2-D (HSDP)" if unit.replicate_comm is not None else "1-D", replicas, unit.world_size)


def _reshard_entry(unit):
    """The unit's reshard after forward as resolved: True, False or the int ``k``."""
    return unit.post_forward.size if unit.post_forward is not None else bool(unit.reshard_after_forward)


def _describe_unit(entry: Any) -> str:
    if entry[0] == _MESH:
        kind, replicas, size = entry[1]
        return f"a {kind} mesh: {replicas} replica(s) x {size} shards"
    if entry[0] == _SETTING:
        return f"the setting {entry[1]}={entry[2]}"
    name, params, reshard = entry
    shown = ", ".join(f"{f} {tuple(s)}" for f, s in params[:4])
    more = f", ... ({len(params)} parameters)" if len(params) > 4 else ""
    unit = f"unit '{name}'" if name else "the root module"
    return f"{unit} [{shown}{more}] reshard_after_forward={reshard}"


def check_one_mesh(units: list) -> None:
    """Refuse units of one root sharded over different meshes or process groups (FSDP2 runs
    them: experts on a mesh of their own), naming the first two that differ; before, the
    message named neither the units nor their groups."""
    first = units[0]
    other = next((u for u in units if (u.comm, u.replicate_comm) != (first.comm, first.replicate_comm)), None)
    if other is None:
        return

    def described(u) -> str:
        replicas = f" x {u.replicate_comm.world_size} replicas" if u.replicate_comm is not None else ""
        return f"{unit_where(u)} over {u.comm.world_size} shards{replicas} (communicator #{u.comm.uid})"

    raise ValueError(f"fusedist.fully_shard: the units under one root must share one mesh / process group: "
                     f"{described(first)} and {described(other)} differ. Shard every module of the model over "
                     "the same mesh (units on meshes of their own, as for experts, are not supported)")
