"""Checkpoints of ``fully_shard`` (ZeRO stage 3) models, in ZeRO's layout-independent format.

Note [stage-3 checkpoints]
    At rest a ``fully_shard`` model's parameters are this rank's pieces (Note [sharded
    parameters] in ``fsdp/unit.py``): a block of whole rows, i.e. one contiguous range of
    the flattened parameter. That is exactly a fragment of Note [fragments]
    (``zero/state.py``), so a stage-3 checkpoint is written in that format and nothing else:

    * each rank's file gets ``model_shard``: ``{"format": MODEL_FORMAT, "rank", "world_size",
      "keys": [state-dict key of every sharded parameter], "param_meta", "fragments": {k:
      [{"range": (lo, hi), "master": the piece's values, "state": {}}]}}`` -- the parameter's
      value travels as the fragment's ``master`` (at rest the piece *is* the authoritative copy;
      with ``mp_policy`` the unit computes in ``param_dtype`` from it);
    * each rank's file gets ``optimizer_shard``: a ZeroRedundancyOptimizer shard (``zstate.FORMAT``,
      ``stage`` 3) made from the optimizer's own torch-format state dict over the pieces: every
      elementwise tensor is the piece's range of the parameter's state, scalars (``step``) as
      they are, a fused optimizer's ``master_param`` as the fragment's master. A parameter the
      units do not shard (``ignored_params``) is replicated: rank 0 writes it whole;
    * ``common.pt``'s ``model`` holds what is not sharded (buffers, ignored parameters), and
      the manifest says ``model_sharded``.

    Because the shards are ZeRO shards over whole-parameter shapes, a DDP run (an unsharded
    optimizer) and a ZeRO-1/2 run load a stage-3 checkpoint through the paths they already
    have, at any world size. Loading into a ``fully_shard`` model goes the other way: every
    parameter's value and optimizer state is assembled whole from the fragments (or taken from
    ``common.pt`` and the full optimizer state of a DDP checkpoint), validated, and cut to this
    rank's piece, whatever the world size, unit layout or placement that saved it. A piece of
    a parameter sharded on a dim other than 0 (``shard_placement_fn``) is no range: it is
    written as a box fragment (Note [box fragments] in ``zero/box_fragments.py``) and cut
    with ``narrow`` on its dim at load (``_piece_boxes.py``). Pieces are row-major
    (contiguous); a channels_last parameter of a DDP save is reordered by ``zstate.relayout``.
    CPU memory for a load is about the whole model and optimizer state (every rank reads every
    rank's file), as for ZeRO.

Note [HSDP checkpoints]
    On a 2-D mesh (HSDP, ``fsdp/mesh.py``) the units' group is one shard group of R; taken as
    the save's world, the R shard groups would each write ``rank-00000.pt`` and a manifest into
    the one directory. The save's world is therefore every rank of the mesh (the default
    group, which the mesh must span: checked, named otherwise), each writing its own file --
    RNG states, a sampler's position -- while only the first replica's ranks put pieces into
    theirs: the replicas hold the same pieces after every step's all-reduce, so each element
    is written once, and the fragments tile every parameter as on a 1-D mesh. A load reads
    every file whatever the mesh: any world size, 1-D or HSDP, loads it, and an HSDP model
    loads any stage-3 (or DDP, ZeRO) checkpoint, each replica cutting the same pieces.

Note [tensor-parallel checkpoints]
    A unit over tensor-parallel parameters (Note [tensor-parallel parameters] in
    ``fsdp/tensor_parallel.py``) shards each rank's *local* tensor, a block of the global
    parameter at the spec's offsets. Its piece, rows (or a dim's chunk) of that block, is a
    block of the global parameter too, bounded on several dims at once for a
    ``RowwiseParallel`` weight: it is written as one region fragment of the *global*
    parameter (Note [region fragments] in ``zero/box_fragments.py``), so the checkpoint holds
    global parameters, as without tensor parallelism, and loads at any data-parallel or
    tensor-parallel degree, or into a DDP or ZeRO model, through the same assembly. At load
    the global parameter is assembled, this rank's local tensor cut from it, and the piece
    from that. Who writes: every rank of the mesh (the data-parallel ranks times the
    tensor-parallel ones: the job's, or a pipeline stage's ``process_group``, checked in
    ``comm_of``), and of a parameter the
    tensor-parallel ranks hold alike (``Replicate()`` placements, or a plain parameter beside
    tensor-parallel ones) the first tensor-parallel rank only -- the others' pieces of it are
    copies, cut where their own local tensors put the unit's boundaries.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..zero import state as zstate
from ..zero.sharded_state import class_algorithm
from . import _names, _piece_boxes

MODEL_FORMAT = "fusedist.fsdp.model/1"


# ---------------------------------------------------------------------------- the model's units
def units(model: torch.nn.Module) -> list:
    """The ``fully_shard`` units under ``model`` ([] for any other model)."""
    from ..fsdp.state_dict import units_of

    return units_of(model)


def piece_index(model: torch.nn.Module) -> dict:
    """id of a piece (or an unsharded parameter) -> (unit, parameter index)."""
    from ..fsdp.state_dict import piece_index as index

    return index(units(model))


def tensor_parallel_mesh(found: list):
    """The tensor-parallel mesh of the units' parameters (Note [tensor-parallel checkpoints]),
    None without tensor parallelism; one mesh for the whole model, refused otherwise."""
    meshes = [(unit, i, s.mesh) for unit in found for i, s in enumerate(unit.tp) if s is not None]
    if not meshes:
        return None
    first_unit, first_i, mesh = meshes[0]
    for unit, i, other in meshes[1:]:
        if other is not mesh and not torch.equal(other.mesh, mesh.mesh):
            raise NotImplementedError(
                f"fusedist.checkpoint: the tensor-parallel parameters '{first_unit.fqns[first_i]}' and "
                f"'{unit.fqns[i]}' lie on different meshes (ranks {mesh.mesh.tolist()} and {other.mesh.tolist()}); "
                "a fusedist checkpoint covers one tensor-parallel mesh. Save model.state_dict() with "
                "torch.distributed.checkpoint instead")
    return mesh


def has_tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether a save of ``model`` writes region fragments (Note [region fragments])."""
    return any(s is not None for unit in units(model) for s in unit.tp)


def comm_of(model: torch.nn.Module, world=None):
    """The communicator a save or load of a ``fully_shard`` model runs over, or None: the units'
    group, or on HSDP or with tensor parallelism every rank of the mesh: ``world`` (the
    communicator of a pipeline stage's ranks, say) when given, else the job's (Note [HSDP
    checkpoints], Note [tensor-parallel checkpoints])."""
    found = units(model)
    if not found:
        return None
    unit = found[0]
    tp_mesh = tensor_parallel_mesh(found)
    if unit.replicate_comm is None and tp_mesh is None:
        return unit.comm
    import torch.distributed as dist

    from ..comm import get_communicator

    replicas = unit.replicate_comm.world_size if unit.replicate_comm is not None else 1
    shards, tp = unit.comm.world_size, tp_mesh.size() if tp_mesh is not None else 1
    if world is not None and world.world_size == replicas * shards * tp:
        return world
    if dist.get_world_size() != replicas * shards * tp:
        what = (f"{replicas} replicas x {shards} shards" + (f" x {tp} tensor-parallel ranks" if tp_mesh is not None
                                                           else ""))
        given = "" if world is None else f" and {world.world_size} of the process_group"
        raise NotImplementedError(
            f"fusedist.checkpoint: the mesh of this fully_shard model ({what}) spans {replicas * shards * tp} of the "
            f"job's {dist.get_world_size()} ranks{given}; "
            "a checkpoint of it is written by every rank of its mesh: pass process_group= a group of exactly those "
            "ranks (a pipeline stage's), or save it with torch.distributed.checkpoint (dcp.save of "
            "model.state_dict())")
    return get_communicator(None, unit.device)


def _writes_piece(unit, index: int, tp_mesh) -> bool:
    """Whether this rank's file holds the unit's piece of parameter ``index``: on HSDP the
    first replica's ranks only (Note [HSDP checkpoints]); of a parameter the tensor-parallel
    ranks hold alike, the first of them only (Note [tensor-parallel checkpoints])."""
    if unit.replicate_comm is not None and unit.replicate_comm.rank != 0:
        return False
    if tp_mesh is None:
        return True
    spec = unit.tp[index]
    mesh, placements = (spec.mesh, spec.placements) if spec is not None else (tp_mesh, ())
    coordinate = mesh.get_coordinate()
    return all(coordinate[d] == 0 for d in range(mesh.ndim) if d >= len(placements) or not placements[d].is_shard())


def full_shape(p: torch.Tensor, where: dict) -> Optional[tuple]:
    """The whole parameter's shape for a piece, the tensor's own for any other tensor, None
    for a value that is not one (a module's ``get_extra_state()``, which torch saves as is)."""
    hit = where.get(id(p))
    if hit is not None:
        return hit[0].whole_shape(hit[1])
    return tuple(p.shape) if isinstance(p, torch.Tensor) else None


def _whole(p: torch.Tensor, where: dict) -> torch.Tensor:
    """What the fragment functions see as the parameter: a contiguous meta tensor of the
    whole parameter for a piece (pieces are row-major ranges of it), ``p`` itself otherwise."""
    hit = where.get(id(p))
    if hit is None:
        return p
    unit, i = hit
    return torch.empty(unit.whole_shape(i), dtype=unit.piece_data(i).dtype, device="meta")


def _meta(p: torch.Tensor, where: dict) -> dict:
    return zstate.param_meta([_whole(p, where)])[0]


def has_dim_sharded(model: torch.nn.Module) -> bool:
    """Whether a save of ``model`` writes box fragments (Note [box fragments]): a parameter of
    a unit is sharded on a dim other than 0 (the same on every rank: fully_shard checks it)."""
    return any(_piece_boxes.has_box(unit, i) for unit in units(model) for i in range(len(unit.sharded)))


def _place(unit, i: int) -> Optional[dict]:
    """Where this rank's piece of parameter ``i`` lies in the whole parameter, as a fragment
    names it: ``{"range": (lo, hi)}`` of the flattened parameter, for a parameter sharded on
    another dim ``{"box": (dim, start, length)}``, for a tensor-parallel parameter ``{"region":
    ((start, length) per dim)}`` of the global parameter; None for an empty piece."""
    if not unit.sharded[i].numel():
        return None
    box = _piece_boxes.chunk_box(unit, i)
    spec = unit.tp[i]
    if spec is None:
        if box is not None:
            return {"box": box}
        lo, hi = unit.element_range(i)
        return {"range": (lo, hi)}
    local = spec.local_shape  # Note [tensor-parallel checkpoints]
    bounds = [(0, size) for size in local]
    if box is not None:
        bounds[box[0]] = box[1:]
    else:  # whole rows of the local tensor
        lo, hi = unit.element_range(i)
        row = math.prod(local[1:])
        bounds[0] = (lo // row, (hi - lo) // row)
    return {"region": tuple((int(offset + start), int(length))
                            for (start, length), offset in zip(bounds, spec.offsets))}


def _packed_fragments(unit, i: int) -> list:
    """Range fragments of quantized storage's canonical bytes (Note [quantized storage] in
    fsdp/packed.py): this rank's parts of the cut inner tensors, and on the shard group's first
    rank the bytes every rank holds alike -- so the fragments tile the bytes once, at any
    world size."""
    spec = unit.ext[i]
    return [{"range": span, "master": part.cpu().clone(), "state": {}}
            for span, part in spec.entry_parts(spec.inner(unit.sharded[i]), shared=unit.rank == 0)]


def packed_layouts(shards: list[dict]) -> dict:
    """``{state-dict key: recorded layout}`` of the quantized-storage weights of a stage-3
    save's model shards (``fsdp.packed.layout_record``; none in a checkpoint written before it was recorded)."""
    if not shards:
        return {}
    return {k: m["packed"] for k, m in zip(shards[0]["keys"], shards[0]["param_meta"]) if "packed" in m}


# ---------------------------------------------------------------------------- save
@torch.no_grad()
def model_shard(model: torch.nn.Module, rank: int, world_size: int) -> tuple[dict, set]:
    """This rank's ``model_shard`` section and the state-dict keys it covers."""
    from ..fsdp import packed

    where = piece_index(model)
    tp_mesh = tensor_parallel_mesh(units(model))
    keys, meta, fragments = [], [], {}
    for key, value in model.state_dict(keep_vars=True).items():
        hit = where.get(id(value))
        if hit is None:
            continue
        unit, i = hit
        k = len(keys)
        keys.append(_names.canonical_key(model, key))
        meta.append(_meta(unit.sharded[i], where))
        spec = unit.ext[i]
        if spec is not None and spec.packed:  # its canonical bytes' ranges (Note [quantized storage])
            meta[-1]["packed"] = packed.layout_record(spec.canonical)  # (what the bytes hold: checked at a load)
            if _writes_piece(unit, i, tp_mesh):
                fragments[k] = _packed_fragments(unit, i)
            continue
        place = _place(unit, i)
        # the piece, not the unsharded buffer (stale after a step) nor its storage
        if place is not None and _writes_piece(unit, i, tp_mesh):
            fragments[k] = [{**place, "master": unit.piece_data(i).detach().reshape(-1).cpu().clone(), "state": {}}]
    section = {"format": MODEL_FORMAT, "rank": rank, "world_size": world_size, "keys": keys,
               "param_meta": meta, "fragments": fragments}
    return section, set(keys)


def common_model(model: torch.nn.Module, sharded_keys: set) -> dict:
    """The state dict entries every rank holds whole (buffers, ignored parameters), by
    canonical name (Note [canonical names])."""
    state = _names.canonical_state(model, model.state_dict())
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v  # (get_extra_state()'s: as is)
            for k, v in state.items() if k not in sharded_keys}


@torch.no_grad()
def optimizer_shard(model: torch.nn.Module, optimizer, params: list, rank: int, world_size: int) -> dict:
    """A ZeroRedundancyOptimizer shard (Note [fragments]) of ``optimizer``'s state over the
    pieces: this rank's range of every parameter (Note [stage-3 checkpoints])."""
    where = piece_index(model)
    tp_mesh = tensor_parallel_mesh(units(model))
    full = optimizer.state_dict()
    per_element = zstate.per_element_keys(full["state"], params)
    fragments: dict[int, list] = {}
    for index, st in full["state"].items():
        index = int(index)
        p = params[index]
        hit = where.get(id(p))
        if hit is None:
            if rank != 0:
                continue  # replicated: rank 0's copy is the one saved
            place = {"range": (0, p.numel())}
        else:
            place = _place(*hit)
            if place is None or not _writes_piece(*hit, tp_mesh):
                continue  # an empty piece holds no part of the parameter; a second replica's, a copy
        frag = zstate.fragments_from_full({"state": {0: st}}, [p], name=_named_at(model, p, index))[0][0]
        n = p.numel()
        if "range" in place:
            frag["range"] = place["range"]
        else:  # Note [box fragments], Note [region fragments]
            del frag["range"]
            frag = {**place, **frag}
        # Copies: a fused optimizer's state may be views of its flat buffers (saved whole otherwise).
        frag["state"] = zstate.slice_state(frag["state"], n, 0, n, copy=True, optimizer_name=type(optimizer).__name__,
                                           why="it cannot be cut into the pieces of fully_shard")
        if p.dim() == 0:  # its moments as one-element fragments (per_element_keys)
            frag["state"] = {k: v.reshape(1) if k in per_element and torch.is_tensor(v) else v
                             for k, v in frag["state"].items()}
        frag["master"] = frag["master"].clone() if frag["master"] is not None else None
        fragments[index] = [frag]
    return {
        "format": zstate.FORMAT,
        "stage": 3,
        "world_size": world_size,
        "rank": rank,
        "optimizer_class": type(optimizer).__name__,
        "algorithm": class_algorithm(type(optimizer)),
        "param_groups": [dict(g) for g in full["param_groups"]],
        "param_meta": [_meta(p, where) for p in params],
        "fragments": fragments,
    }


def _named_at(model: torch.nn.Module, p: torch.Tensor, index: int):
    """``name(0)`` for a state dict of ``p``'s state alone: ``p`` as parameter ``index`` of the optimizer, by
    its name in ``model`` (looked up only for an error)."""
    from ..zero import param_labels
    from ._params import known_name, param_names  # (it imports this module)

    return lambda _: param_labels.label(p, index, known_name(param_names(model, [p])[0]))


# ---------------------------------------------------------------------------- load
def check_shard_set(shards: list[dict], what: str, source: str) -> None:
    """Shards load as a complete set: every rank of the world that saved them, once."""
    ranks = sorted(sd.get("rank") for sd in shards)
    sizes = {sd.get("world_size") for sd in shards}
    if len(sizes) != 1 or ranks != list(range(next(iter(sizes)))):
        world = (f"a world of {next(iter(sizes))}" if len(sizes) == 1
                 else f"worlds of sizes {sorted(sizes, key=str)}")
        raise zstate.StateDictError(f"{source}: {what} shards of ranks {ranks} of {world}; "
                                    "a rank's file is missing or comes from another save")


def assemble_model(shards: list[dict], source: str) -> dict:
    """The whole value of every sharded parameter of a stage-3 save, by state-dict key."""
    check_shard_set(shards, "model", source)
    keys = shards[0]["keys"]
    if any(sd["keys"] != keys for sd in shards):
        raise zstate.StateDictError(f"{source}: the ranks' model shards name different parameters")
    meta = shards[0]["param_meta"]
    # Keyed by the quoted state-dict key, which assemble's errors then name (not a position in ``keys``).
    names = [f"'{key}'" for key in keys]
    wholes = {name: torch.empty(m["shape"], device="meta") for name, m in zip(names, meta)}
    merged = zstate.merge_fragments(shards)
    assembled = zstate.assemble({name: merged.get(k) for k, name in enumerate(names)}, wholes, names, source=source)
    out = {}
    for k, key in enumerate(keys):
        shape = tuple(meta[k]["shape"])
        item = assembled.get(names[k])
        if item is None:
            if wholes[names[k]].numel():
                raise zstate.StateDictError(f"{source}: no rank's model shard holds '{key}' (shape {shape})")
            out[key] = torch.empty(shape, dtype=getattr(torch, meta[k]["dtype"]))
        elif item["master"] is None:
            raise zstate.StateDictError(f"{source}: the model shards hold no values of '{key}' (shape {shape})")
        else:
            out[key] = item["master"].view(shape)
    return out


def full_shapes(model: torch.nn.Module) -> dict:
    """The model's state-dict keys (canonical, Note [canonical names]) with the whole parameters' shapes."""
    where = piece_index(model)
    return {k: full_shape(v, where) for k, v in _names.canonical_state(model, model.state_dict(keep_vars=True)).items()}


def optimizer_for_pieces(model: torch.nn.Module, optimizer, params: list, frags: dict, groups: list,
                         saved_meta: Optional[list], source: str, names: Optional[list] = None) -> dict:
    """A torch-format state dict for ``optimizer`` over the pieces: every parameter's state
    assembled whole from ``frags`` (validated), reordered to row-major if it was saved in
    another memory order, and cut to this rank's range. ``names``: the parameters' checkpoint
    names, which errors name them by."""
    from ._params import labeller  # (it imports this module)

    where = piece_index(model)
    wholes = [_whole(p, where) for p in params]
    assembled = zstate.assemble(frags, wholes, range(len(params)), source=source, keep_empty=True,
                                name=None if names is None else labeller(names, wholes))
    if saved_meta is not None:
        zstate.relayout(assembled, wholes, saved_meta)
    per_element = zstate.per_element_keys({i: item["state"] for i, item in assembled.items()}, wholes)
    mine = {}
    for index, item in assembled.items():
        hit = where.get(id(params[index]))
        if hit is None:
            mine[index] = item
            continue
        n = wholes[index].numel()
        zstate.slice_state(item["state"], n, 0, n, copy=False, optimizer_name=type(optimizer).__name__,
                           why="it cannot be cut into the pieces of fully_shard")  # refuses non-elementwise state
        scalar_param = wholes[index].dim() == 0
        mine[index] = {
            "master": _piece_boxes.cut(item["master"], *hit) if item["master"] is not None else None,
            "state": {key: _piece_boxes.cut(v, *hit)
                      if zstate.is_elementwise(v, n) or (scalar_param and key in per_element and torch.is_tensor(v))
                      else (v.clone() if isinstance(v, torch.Tensor) else v) for key, v in item["state"].items()},
        }
    out = zstate.to_torch_format(mine, params, groups)
    zstate.check_groups(out["param_groups"], optimizer.param_groups, source)
    return out
