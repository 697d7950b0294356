"""Full (unsharded) state dicts of a ``fully_shard`` model, for export and import.

``model.state_dict()`` of a sharded model holds this rank's pieces (Note [sharded
parameters] in unit.py), as ``ShardedPiece`` entries that torch's distributed checkpoint saves
and loads at any world size (Note [pieces in torch's distributed checkpoint] in dcp.py): it
round-trips through ``load_state_dict`` at the same world size, as torch's FSDP2 sharded state
dict does, and ``load_state_dict`` also takes whole parameters (each rank keeps its rows). For
a file any world size -- or an unsharded model --
can read, :func:`full_state_dict` gathers every parameter whole (one all-gather per unit),
and :func:`load_full_state_dict` loads such a dict, each rank keeping its rows.
"""

from __future__ import annotations

import torch
from torch import nn

from .state import state_of
from .state_dict_hooks import whole_of_dtensor

__all__ = ["full_state_dict", "load_full_state_dict", "units_of", "piece_index", "gather_params"]


def units_of(model: nn.Module) -> list:
    """The sharded units under ``model`` (each once, in module order)."""
    seen, units = set(), []
    for m in model.modules():
        st = state_of(m)
        if st is not None and st.unit is not None and id(st.unit) not in seen:
            seen.add(id(st.unit))
            units.append(st.unit)
    return units


def piece_index(units) -> dict:
    """id of a piece (or an unsharded parameter) -> (unit, parameter index)."""
    out = {}
    for unit in units:
        for i, (sp, u, v) in enumerate(zip(unit.sharded, unit.unsharded, unit.visible)):
            out[id(sp)] = out[id(u)] = out[id(v)] = (unit, i)
    return out


@torch.no_grad()
def gather_params(unit, *, to_cpu: bool, only=None) -> list:
    """Every parameter of ``unit`` whole (fresh tensors, in its piece's dtype), from the pieces:
    one all-gather per section -- a collective, every rank calls it for the same unit. With
    ``only`` (a set of parameter indices) the others are None: the gathered buffer is freed on
    return, so a caller keeps no more than it asked for. A submodule converted on its own since
    the last gather (``model.head.double()``) is taken up first, as that gather would, so the
    dict holds the converted dtype at once, as FSDP2's does; a conversion the unit cannot take
    up (its pieces left in several dtypes: the next forward refuses it) is not, and each
    parameter is then given in its piece's dtype."""
    mixed = unit.mixed_conversion() is not None
    if not mixed:
        unit.adopt_conversions()
    shards = [s.to(unit.device) for s in unit.shards]
    flats = [torch.empty(sec.layout.total_numel, dtype=s.dtype, device=unit.device)
             for sec, s in zip(unit.layout.sections, shards)]
    for handle in unit.gather_into(flats, shards, f"fully_shard full state dict {unit.name}"):
        handle.wait()
    out = []
    for i, slot in enumerate(unit.layout.slots):
        if only is not None and i not in only:
            out.append(None)
            continue
        full = unit.layout.whole(i, flats[unit.section_index(i)])
        if unit.ext[i] is not None and unit.ext[i].packed:  # the subclass whole (Note [quantized storage])
            out.append(unit.ext[i].whole_of_table(full.cpu() if to_cpu else full))
            continue
        if unit.tp[i] is not None:  # the global parameter (a collective over the tensor-parallel group)
            full = unit.tp[i].full(full)
        if mixed and full.dtype != unit.sharded[i].dtype:
            full = full.to(unit.sharded[i].dtype)
        out.append(full.cpu().clone() if to_cpu else full.clone())
    return out


# Note [canonical keys]
#     ``torch.compile(model)`` returns a wrapper whose ``state_dict()`` keys carry its attribute
#     ``_orig_mod.`` ("_orig_mod.0.weight"); so does a compiled submodule put in place of the
#     original. torch's FSDP2 full state dict (``get_model_state_dict(..., full_state_dict=True)``)
#     names each entry by the unwrapped model's path instead ("0.weight", torch's ``_get_fqns``:
#     the ``_orig_mod`` of a compiled wrapper is skipped), so a checkpoint written from a
#     compiled model loads into an uncompiled one and back. ``full_state_dict`` uses the same
#     keys, and ``load_full_state_dict`` takes either form (a dict an earlier version wrote
#     with the prefix still loads). The names are the checkpoints' canonical names (Note
#     [canonical names] in ``fusedist/checkpoint/_names.py``): wrappers' components are
#     dropped by walking the key's path through the modules, not a user's attribute of that name.


def _canonical_state(model: nn.Module, state: dict) -> dict:
    """``state`` (``model``'s state dict, or one to load into it) under canonical keys (Note
    [canonical keys])."""
    from ..checkpoint._names import canonical_state  # (not at import: the checkpoint package is large)

    return canonical_state(model, state)


@torch.no_grad()
def full_state_dict(model: nn.Module, *, to_cpu: bool = True) -> dict:
    """``model``'s state dict with every parameter whole, under the keys of the unwrapped
    model (buffers and ignored parameters as they are). A collective: every rank calls it,
    every rank gets the whole dict. Peak memory: the whole model, plus one gathered unit."""
    units = units_of(model)
    where = piece_index(units)
    gathered = {}
    for unit in units:
        for i, full in enumerate(gather_params(unit, to_cpu=to_cpu)):
            gathered[i, id(unit)] = full
    out = {}
    for key, value in _canonical_state(model, model.state_dict(keep_vars=True)).items():
        hit = where.get(id(value))
        if hit is not None:
            out[key] = gathered[hit[1], id(hit[0])]
        elif isinstance(value, torch.Tensor):
            value = value.detach()
            out[key] = value.cpu() if to_cpu else value
        else:  # a module's get_extra_state() value: any object, kept as torch's state_dict keeps it
            out[key] = value
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict, strict: bool = True) -> None:
    """Load a whole-parameter state dict (:func:`full_state_dict`'s, or an unwrapped model's)
    into the sharded ``model``: each rank copies its pieces' rows. No communication, except
    for DTensor entries (torch's FSDP2 state dicts, or a full one torch's
    ``set_model_state_dict`` loaded before): each is made whole first, a collective over its
    mesh, so every rank passes the same dict then."""
    from ..checkpoint._names import is_extra_state

    where = piece_index(units_of(model))
    held = model.state_dict(keep_vars=True)
    own = _canonical_state(model, held)
    state_dict = _canonical_state(model, state_dict)
    if strict:
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise KeyError(f"fusedist.fsdp.load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    originals = None  # canonical key -> the model's own key (its module's path), made if needed
    for key, target in own.items():
        if key not in state_dict:
            continue
        src = state_dict[key]
        if is_extra_state(key):  # any object, no rows: to its module, as torch loads it
            originals = originals or _canonical_state(model, {k: k for k in held})
            model.get_submodule(originals[key].rpartition(".")[0]).set_extra_state(src)
            continue
        src = whole_of_dtensor(src)  # Note [DTensor entries loaded] in state_dict_hooks.py
        hit = where.get(id(target))
        if hit is None:
            _check_whole_shape(key, src, tuple(target.shape), "tensor")
            target.copy_(src)
            continue
        unit, i = hit
        spec = unit.ext[i]
        if spec is not None and spec.packed:  # Note [quantized storage] in packed.py
            unit.piece_data(i).copy_(spec.row_of_whole(src, key, unit.piece_data(i)))
            if unit.is_unsharded:  # (the gathered subclass; its copy_ quantizes a plain weight alike)
                unit.unsharded[i].copy_(spec.as_whole(src))
            continue
        _check_whole_shape(key, src, unit.whole_shape(i), "parameter")
        if unit.tp[i] is not None:  # this rank's local tensor of the global parameter
            src = unit.tp[i].local_of_global(src)
        unit.sharded[i].copy_(unit.piece_of_whole(i, src))
        if unit.is_unsharded:
            unit.unsharded[i].copy_(src)


def _check_whole_shape(key: str, src, shape: tuple, what: str) -> None:
    """``src`` must be a tensor of the model's ``shape`` for ``key``: ``copy_`` would broadcast
    a smaller one (a buffer of shape (1,) filling a (10,) buffer) silently, where torch's
    ``load_state_dict`` reports a size mismatch."""
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"fusedist.fsdp.load_full_state_dict: '{key}' is a {type(src).__name__}, "
                        f"the model's {what} is a tensor of shape {shape}")
    if tuple(src.shape) != tuple(shape):
        raise ValueError(f"fusedist.fsdp.load_full_state_dict: '{key}' has shape {tuple(src.shape)}, "
                         f"the model's {what} {tuple(shape)}")
