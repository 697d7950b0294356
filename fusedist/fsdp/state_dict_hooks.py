"""The state-dict hooks of ``fully_shard`` modules: ``state_dict()`` holds each sharded
parameter as a :class:`~fusedist.fsdp.dcp.ShardedPiece` (Note [pieces in torch's distributed
checkpoint] in dcp.py) or, for a full state dict, whole; ``load_state_dict`` takes either and
cuts a whole parameter to this rank's piece (Note [state-dict hooks on every module of a
unit])."""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from .._wrapper import values_of
from ..comm.base import CollectiveError
from .dcp import ShardedPiece, _is_box, describe_region, piece_region
from .dtensor_view import describe_entry
from .torch_helpers import full_load_without_broadcast, full_state_dict_requested
from .owners import register_pieces

__all__ = ["install_state_dict_hooks", "as_entry", "whole_of_dtensor", "whole_to_piece"]


# Note [state-dict hooks on every module of a unit]
#     A unit's parameters live on the modules under the module ``fully_shard`` was called on
#     (``blocks.0.mlp.0.weight`` is ``_parameters["weight"]`` of a Linear deep in the block),
#     and torch's state-dict calls are made on any of them: ``block.mlp.state_dict()``,
#     ``block.mlp.load_state_dict(pretrained)``, ``get_model_state_dict(block.mlp, ...)``,
#     ``set_model_state_dict(block.mlp, full, ...)`` (partial loads, LoRA adapters, one layer
#     exported; Lightning loads a full checkpoint submodule by submodule). With FSDP2 each
#     parameter is a DTensor, so these work from any module. Hooks on the unit's module alone
#     see none of these calls: the submodule returned its plain pieces (saved by DCP as
#     replicated tensors, one rank's rows as the whole) and refused whole parameters with a
#     shape mismatch against the piece.
#
#     So every module of the unit that holds parameters directly (and each module ``fully_shard``
#     was called on, which reshards at rest) gets the hooks, and each module's hooks handle its
#     *own* parameters only -- ``prefix + attr`` -- wherever the call starts: state_dict() puts
#     a ShardedPiece (or, under ``get_model_state_dict(full_state_dict=True)``, the whole
#     parameter) in the dict, load_state_dict cuts a whole parameter to this rank's piece and
#     reports a wrong shape against the whole parameter's shape, as FSDP2 does. Each module's
#     hooks run at its own level of the recursion, before any ancestor's state-dict post-hook
#     and after every ancestor's load pre-hook, so the keys are the module paths even under
#     torch's ``checkpoint_wrapper``, whose hooks drop and restore ``_checkpoint_wrapped_module.``
#     at the wrapper's level. A full state dict gathers each unit once per dict, not once per
#     module, and keeps whole only the parameters that dict will hold: those of the modules
#     under the module the state dict is taken of (torch's helper names it: Note [full state
#     dict through torch's helpers] in torch_helpers.py). ``get_model_state_dict(block.attn,
#     full_state_dict=True)`` all-gathers the block once, copies out ``attn``'s parameters and
#     frees the gathered buffer at once; the rest of the block is never held whole, and what
#     the per-dict cache keeps are the dict's own entries, released with it (FSDP2 gathers
#     each DTensor entry on its own, so it holds no more either). The modules' own parameters
#     are found from the unit's registrations (``_slots_of``), built once per unit, not by a
#     walk over the unit.

_KEEP_VARS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()
# a hooked module -> the module fully_shard was called on, whose state holds the unit (a weak
# reference: that module holds the hooked one, so a strong value would keep both alive for good)
_OWNER: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def install_state_dict_hooks(module: nn.Module) -> None:
    """The state-dict hooks of a module that ``fully_shard`` gave a unit and of the modules
    under it that hold its parameters (Note [state-dict hooks on every module of a unit])."""
    from .members import managed_modules

    for _, sub in managed_modules(module):
        if sub in _OWNER or (sub is not module and not any(p is not None for p in sub._parameters.values())):
            continue
        _OWNER[sub] = weakref.ref(module)
        sub.register_state_dict_pre_hook(_pre_state_dict)
        sub.register_state_dict_post_hook(_post_state_dict)
        sub.register_load_state_dict_pre_hook(_pre_load_state_dict)
        sub.register_load_state_dict_post_hook(_post_load_state_dict)


def _unit_state(module: nn.Module):
    """The fully_shard state holding the unit of ``module``'s parameters, or None."""
    from .state import state_of

    ref = _OWNER.get(module)
    owner = ref() if ref is not None else None
    return state_of(owner) if owner is not None else None


def _entries(module: nn.Module, prefix: str):
    """``(key, unit, index)`` of every sharded parameter ``module`` holds itself (its
    submodules' are their own hooks' (Note [state-dict hooks on every module of a unit])): the
    unit's own parameters and those it borrows, while the module still holds them."""
    st = _unit_state(module)
    if st is None or st.unit is None:
        return
    unit = st.unit
    for attr, k, i in _slots_of(unit).get(id(module), ()):
        holder = unit if k < 0 else unit.borrowed[k][0]
        p = module._parameters.get(attr)
        if p is not None and (p is holder.sharded[i] or p is holder.visible[i]):
            yield f"{prefix}{attr}", holder, i


_SLOTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _slots_of(unit) -> dict:
    """id of each module holding a parameter of ``unit`` -> ``(attr, k, index)`` of each such
    parameter: ``k`` -1 for the unit's own parameter ``index``, else the position in
    ``unit.borrowed`` of the unit lending it (ints only: no reference back to the modules).
    Built once per unit: each module's hook finds its own parameters without a walk over the
    whole unit."""
    slots = _SLOTS.get(unit)
    if slots is None:
        slots = {}
        for i, regs in enumerate(unit.registrations):
            for m, attr in regs:
                slots.setdefault(id(m), []).append((attr, -1, i))
        for k, (_, i, regs) in enumerate(unit.borrowed):
            for m, attr in regs:
                slots.setdefault(id(m), []).append((attr, k, i))
        _SLOTS[unit] = slots
    return slots


def _reshard_at_rest(module: nn.Module) -> None:
    """Reshard the module's unit before its state dict is taken or loaded, as FSDP2's
    state-dict pre-hooks do: a load (or ``dcp.load`` into the entries) writes the pieces, and a
    copy gathered before it would be stale (Note [forward without gradients] in ``state.py``).
    Not while the unit's forward or backward is running. Between a forward and its backward
    too, as FSDP2 does: the backward gathers the unit again before it reads the parameters
    (a unit left gathered there is the root, or one that does not reshard after forward;
    its module held the whole parameters, so a load refused each piece-shaped entry and left
    the gathered copy stale -- also after a forward with gradients whose backward never
    came). A unit set ``set_unshard_in_backward(False)`` is not gathered again: its backward
    reads no parameter values."""
    from . import recovery

    st = _unit_state(module)
    if st is None or st.unit is None:
        return
    if st.ctx is not None and recovery.is_running(st.ctx):
        return
    st.unit.reshard()


def _pre_state_dict(module, prefix, keep_vars) -> None:
    _reshard_at_rest(module)
    _KEEP_VARS[module] = bool(keep_vars)


def as_entry(value: torch.Tensor, unit, index: int) -> ShardedPiece:
    """``value`` -- parameter ``index`` of ``unit``'s piece, or a state tensor shaped like it --
    as a state-dict entry: a ShardedPiece that knows the whole parameter's shape and range."""
    region = piece_region(unit, index)
    spec = unit.ext[index]
    if spec is not None and spec.packed:  # its ranges of the canonical bytes (Note [quantized storage])
        from .packed import layout_record

        entry = ShardedPiece.wrap_ranges(spec.entry(spec.inner(value.detach())), (spec.canonical_bytes,), region,
                                         layout_record(spec.canonical))
        entry._fs_view = describe_entry(unit, index)
        return entry
    # (an extension piece: the high-precision values its subclass wraps, Note [all-gather extension])
    value = values_of(value.detach())
    if isinstance(value, ShardedPiece):
        value = value.local()
    if not value.is_contiguous():
        value = value.contiguous()
    if _is_box(region):
        entry = ShardedPiece.wrap_box(value, unit.layout.slots[index].shape, *region)
    else:
        entry = ShardedPiece.wrap(value, unit.layout.slots[index].shape, *region)
    entry._fs_view = describe_entry(unit, index)  # Note [entries read as DTensors] in dtensor_view.py
    spec = unit.tp[index]
    if spec is not None:  # Note [tensor-parallel parameters] in tensor_parallel.py
        entry._fs_size = torch.Size(spec.global_shape)
        entry.placed(spec.local_shape, spec.offsets)
    if unit.tp_comm is not None and (spec is None or spec.replicated):
        # held alike by the tensor-parallel ranks, but cut by layouts that may differ between them
        # (local tensors of unequal sizes in the unit): written by the first one only
        entry._fs_writes = unit.tp_comm.rank == 0
    return entry


# Note [DTensor entries loaded]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A state dict may hold DTensors: FSDP2's ``model.state_dict()``, or a full state dict that
# torch's ``set_model_state_dict(full_state_dict=True)`` loaded into an FSDP2 model before
# (it replaces the dict's tensors with DTensors in place). Their shards are not fusedist's
# pieces (another layout), and a DTensor reports the whole shape, so one was taken for a
# whole tensor: returned as it was where the piece has the whole shape and cut (a collective
# inside the DTensor's reshape) elsewhere -- ranks at different collectives, an abort or a
# hang. Each is made whole on every rank first (``full_tensor()``, one collective over its
# mesh, in the state dict's order, which every rank shares) and cut as a full entry.
def whole_of_dtensor(value):
    """``value`` whole when it is a DTensor (Note [DTensor entries loaded]), else as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def whole_to_piece(value: torch.Tensor, unit, index: int) -> torch.Tensor:
    """``value`` cut to this rank's piece of parameter ``index`` of ``unit`` (a view) when it has
    the whole parameter's shape, as a full state dict's entries do; anything else as it is (a
    piece as saved at this layout, or a shape the loader itself reports)."""
    piece_shape, full_shape = tuple(unit.sharded[index].shape), unit.whole_shape(index)
    if tuple(value.shape) == piece_shape or tuple(value.shape) != full_shape:
        return value
    if isinstance(value, ShardedPiece):
        value = value.local()
    if unit.tp[index] is not None:  # the global parameter: this rank's local tensor of it first
        value = unit.tp[index].local_of_global(value)
    return unit.piece_of_whole(index, value)


_GATHERED: dict = {}  # id of a state dict being filled -> _FullDict


class _FullDict:
    """What one full state dict being filled has gathered: per unit, the whole parameters it
    takes (the others None), and which those are."""

    def __init__(self, top: Optional[nn.Module]):
        # id(unit) -> indices of its parameters held by the modules under ``top`` (None: unknown)
        self.wanted = _wanted_under(top) if top is not None else None
        self.wholes: dict = {}  # id(unit) -> gather_params' list


def _wanted_under(top: nn.Module) -> dict:
    """id of each unit -> the indices of its parameters that the modules under ``top`` hold
    (its own and those lent to other units): what ``top``'s state dict takes."""
    wanted: dict = {}
    for m in top.modules():
        for _, holder, i in _entries(m, ""):
            wanted.setdefault(id(holder), set()).add(i)
    return wanted


def _whole(state_dict, unit, i: int, to_cpu: bool, top: Optional[nn.Module]) -> torch.Tensor:
    """Parameter ``i`` of ``unit`` whole, for the full state dict ``state_dict`` of ``top``:
    the unit is gathered once per dict, keeping only what the dict takes (Note [state-dict
    hooks on every module of a unit]) -- a collective the first time."""
    from .state_dict import gather_params

    entry = _GATHERED.get(id(state_dict))
    if entry is None:
        try:
            weakref.finalize(state_dict, _GATHERED.pop, id(state_dict), None)
        except TypeError:  # a destination that takes no weak reference: gather for each entry
            return gather_params(unit, to_cpu=to_cpu, only={i})[i]
        entry = _GATHERED[id(state_dict)] = _FullDict(top)
    wholes = entry.wholes.get(id(unit))
    if wholes is None:
        only = entry.wanted.get(id(unit), set()) | {i} if entry.wanted is not None else None
        wholes = entry.wholes[id(unit)] = gather_params(unit, to_cpu=to_cpu, only=only)
    return wholes[i]


@torch.no_grad()
def _post_state_dict(module, state_dict, prefix, local_metadata) -> None:
    if _KEEP_VARS.pop(module, False):
        return  # the parameters themselves, as asked
    entries = [(key, unit, i) for key, unit, i in _entries(module, prefix) if key in state_dict]
    full = full_state_dict_requested() if entries else None
    for key, unit, i in entries:
        if full is None:
            state_dict[key] = as_entry(unit.sharded[i], unit, i)
        else:
            state_dict[key] = _whole(state_dict, unit, i, *full)


@torch.no_grad()
def _pre_load_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs) -> None:
    """An entry of the whole parameter's shape (a full state dict) is cut to this rank's piece;
    one of another shape is reported against the whole parameter's shape, as FSDP2 reports it."""
    _check_full_load(module)
    _reshard_at_rest(module)
    assign = local_metadata.get("assign_to_params_buffers", False)
    for key, unit, i in _entries(module, prefix):
        value = whole_of_dtensor(state_dict.get(key))
        if not isinstance(value, torch.Tensor):
            continue
        if unit.ext[i] is not None and unit.ext[i].packed:
            problem = _load_packed(value, unit, i, key)
            if problem is not None:
                error_msgs.append(f"size mismatch for {key}: {problem}")
            loaded = unit.sharded[i].detach()  # loaded above; copied onto itself
        else:
            problem = _wrong_entry(value, unit, i)
            if problem is not None:
                error_msgs.append(f"size mismatch for {key}: {problem}")
            # (a wrong entry: the piece copied onto itself; the load raises with the message)
            loaded = whole_to_piece(value, unit, i) if problem is None else unit.sharded[i].detach()
        state_dict[key] = _assigned(unit, i, loaded) if assign else loaded


def _check_full_load(module: nn.Module) -> None:
    """Under ``set_model_state_dict(full_state_dict=True)`` without ``broadcast_from_rank0``,
    check once per call that every rank loads the same keys (Note [full state dict loaded on
    some ranks only] in torch_helpers.py): a collective over the unit's ranks."""
    found = full_load_without_broadcast("_load_model_state_dict")
    st = _unit_state(module)
    if found is None or st is None or st.unit is None or getattr(found[0], "_fs_full_load_checked", False):
        return
    info, helper = found
    info._fs_full_load_checked = True  # (torch's options object of this one call)
    from .._consistency import check_same_across_ranks

    model, loaded = helper.get("model"), helper.get("state_dict")
    own = {id(t) for t in (*model.parameters(), *model.buffers())} if isinstance(model, nn.Module) else set()
    lacking = sorted(k for k, v in (loaded or {}).items() if id(v) in own)  # (torch put the model's own there)
    hint = ("Without broadcast_from_rank0 each rank loads the dict it is given: pass the whole state dict "
            "on every rank, or pass it on rank 0 with StateDictOptions(broadcast_from_rank0=True).")
    try:
        check_same_across_ranks(
            lacking, "the keys missing from the full state dict given to set_model_state_dict",
            label=lambda k: f"missing {k!r}", comm=st.unit.comm, hint=hint,
            op="fully_shard: set_model_state_dict(full_state_dict=True, broadcast_from_rank0=False) on every rank")
    except CollectiveError as e:  # a rank never joined: given {}, torch skipped its load
        raise RuntimeError(
            f"fusedist.fully_shard: rank {st.unit.comm.rank} loads a full state dict through torch's "
            "set_model_state_dict/set_state_dict(full_state_dict=True, broadcast_from_rank0=False), but not every "
            "rank joined the load (a rank given an empty dict skips it, keeping its old values). " + hint +
            f"\n{e}") from e


# Note [load_state_dict(assign=True)]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With ``assign=True`` torch puts each entry in the module as a new Parameter instead of copying
# it into the parameter. A unit reads its pieces, not the modules' slots: the new Parameter
# was dropped at the next gather and the loaded values with it. So on a materialized unit the
# entry is copied into the piece and the piece itself is handed to torch to assign, which keeps
# it (and an optimizer built over it). On a unit built on the meta device (torchtune's load of
# a sharded checkpoint) the piece has no memory: torch assigns a plain copy of the entry, and
# once every parameter of the unit holds one, the unit adopts them as its pieces, as after
# ``to_empty`` (``_post_load_state_dict``). FSDP2 loads both ways too (``reset_sharded_param``).
def _assigned(unit, index: int, loaded: torch.Tensor) -> torch.Tensor:
    """What ``load_state_dict(assign=True)`` assigns for piece ``index`` (Note
    [load_state_dict(assign=True)])."""
    piece = unit.sharded[index]
    if not unit.is_meta:
        piece.copy_(loaded)
        return piece
    loaded = values_of(loaded.detach())
    return (loaded.local() if isinstance(loaded, ShardedPiece) else loaded).clone(memory_format=torch.contiguous_format)


def _post_load_state_dict(module, incompatible_keys) -> None:
    """A unit built on meta whose parameters an ``assign=True`` load all replaced adopts them
    (Note [load_state_dict(assign=True)])."""
    st = _unit_state(module)
    if st is None or st.unit is None or not st.unit.is_meta:
        return
    held = [m._parameters.get(attr) for m, attr in (regs[0] for regs in st.unit.registrations)]
    if all(p is not None and not p.is_meta for p in held):
        register_pieces(st, st.unit.repack())
        st.unit.relink_borrowed()


def _load_packed(value: torch.Tensor, unit, index: int, key: str) -> Optional[str]:
    """Load ``value`` into quantized-storage parameter ``index`` (Note [quantized storage] in
    packed.py): its entry as saved at this layout (or at any, through DCP), its canonical
    bytes, the whole subclass, or a plain weight to quantize. Returns why it cannot, or None."""
    spec, row = unit.ext[index], unit.piece_data(index)
    region = piece_region(unit, index)
    if isinstance(value, ShardedPiece):
        if value.size() != torch.Size((spec.canonical_bytes,)) or value.element_range != region:
            return (f"the entry holds {describe_region(value.element_range)} of {tuple(value.size())} canonical "
                    f"bytes of quantized storage, this rank's {describe_region(region)} of ({spec.canonical_bytes},) "
                    "(a state dict of another world size or layout: load it with torch.distributed.checkpoint, or "
                    "load whole parameters).")
        value = value.local()
    entry_bytes = sum(hi - lo for lo, hi in region)
    try:
        if value.dtype == torch.uint8 and tuple(value.shape) == (entry_bytes,) != (spec.canonical_bytes,):
            row.copy_(spec.row_of_entry(value))  # (this rank's entry as saved at this layout)
        else:
            row.copy_(spec.row_of_whole(value, key, row))
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _wrong_entry(value: torch.Tensor, unit, index: int) -> Optional[str]:
    """Why ``value`` cannot load into parameter ``index`` of ``unit``, or None: it must be the
    whole parameter, this rank's piece of it as this layout cuts it, or that piece's entry."""
    full_shape = unit.whole_shape(index)
    if isinstance(value, ShardedPiece):
        if value.size() != torch.Size(full_shape):
            return (f"copying a param with shape {value.size()} from checkpoint, the shape in current model "
                    f"is {torch.Size(full_shape)}.")
        region = piece_region(unit, index)
        if value.element_range != region or value.placement != unit.placement(index):
            return (f"the entry is a piece holding {describe_region(value.element_range)} of the parameter, "
                    f"this rank's piece holds {describe_region(region)} (a state dict of another world size or "
                    "layout: load it with torch.distributed.checkpoint, or load whole parameters).")
        return None
    if tuple(value.shape) in (tuple(full_shape), tuple(unit.sharded[index].shape)):
        return None
    return (f"copying a param with shape {value.shape} from checkpoint, the shape in current model is "
            f"{torch.Size(full_shape)}.")
