"""Optimizer state over ``fully_shard`` pieces in state dicts: ``optimizer.state_dict()``, torch's
``get_optimizer_state_dict``/``set_optimizer_state_dict`` and its Distributed Checkpoint (DCP).

Note [optimizer state of pieces]
    An optimizer over a ``fully_shard`` model steps the pieces (Note [sharded parameters] in
    unit.py), so its elementwise state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, a
    fused optimizer's ``master_param``, ...) is piece-shaped plain tensors. torch's helpers
    map the optimizer's parameter ids to the model's FQNs and pass the tensors on: DCP then
    saved one rank's piece of every state tensor as if replicated, and
    ``full_state_dict=True`` returned pieces. torch's FSDP2 has DTensor state instead.

    So the state dict of an optimizer holding pieces presents each elementwise state tensor as
    the model side presents the parameter (Note [pieces in torch's distributed checkpoint] in
    dcp.py): a :class:`ShardedPiece` of the whole parameter's shape, holding this rank's range
    ``[lo, hi)`` of it -- the same chunks as the parameter, so DCP saves every rank's part and
    loads at any world size, into fusedist or torch FSDP2 optimizers (the keys are the same
    FQNs). Scalar state (``step``, by name: a 0-dim parameter's piece is 0-dim too) and any
    other value stay as they are. ``state_dict()`` returns new per-parameter dicts: the
    optimizer's own are left alone, while the entries alias its state tensors (DCP loads into
    them; ``set_optimizer_state_dict`` then loads them anyway). A ShardedPiece pickles as the
    plain piece, so ``torch.save(optimizer.state_dict())`` is what it was.

    Under torch's ``get_optimizer_state_dict(..., full_state_dict=True)`` (the stack lookup of
    Note [full state dict through torch's helpers] in torch_helpers.py, for
    ``_get_optim_state_dict``) the entries are the whole state tensors instead: one all-gather
    per unit and state name, on every rank, in the optimizer's parameter order. The ranks first
    check that they hold the same state
    names (one all-reduce), so a mismatch raises instead of hanging.

    Loading: a load pre-hook turns each entry of a piece back into a plain piece-shaped
    tensor: a ShardedPiece of this rank's range gives its piece (a ShardedPiece of another
    range or shape is refused), a tensor of the whole parameter's shape (a full state dict,
    ``set_optimizer_state_dict(full_state_dict=True)``) is cut to this rank's range (copied);
    a post-hook replaces any ShardedPiece left in the optimizer's state by its plain piece.

    Where the hooks come from: ``fully_shard`` never sees the optimizer, so a global optimizer
    step pre-hook (fusedist/_process_hooks.py) registers them on every optimizer the first time
    it steps while fully_shard units exist. torch's helpers step an optimizer that has no state
    once (``_init_optim_state``, lr 0) before reading it, so a fresh optimizer is covered. An
    optimizer that has state but never stepped in this process (filled by
    ``load_state_dict``) has no hooks yet: :func:`track_optimizer` registers them at once.

    Not supported: ``set_optimizer_state_dict(full_state_dict=True)`` into fusedist's fused
    optimizers (their ``load_state_dict`` checks state shapes before the load pre-hooks could
    cut the whole tensors): refused with an error naming the sharded alternatives.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Optional

import torch

from .gathered_optimizer import refuse_gathered_params
from .dcp import ShardedPiece, describe_region, piece_region
from .state_dict_hooks import as_entry, whole_of_dtensor, whole_to_piece
from .torch_helpers import full_load_without_broadcast, torch_helper_options

__all__ = ["track_optimizer", "note_unit"]

#: every live fully_shard unit (the pieces an optimizer may hold)
_UNITS: "weakref.WeakSet" = weakref.WeakSet()
#: optimizers with the hooks
_TRACKED: "weakref.WeakSet" = weakref.WeakSet()


def note_unit(unit) -> None:
    """A new unit: its pieces may be stepped by any optimizer from now on."""
    _UNITS.add(unit)
    from .._process_hooks import install_optimizer_step_hooks

    install_optimizer_step_hooks("fully_shard: optimizer state dicts", _before_step, lambda *_: None)


@torch.compiler.disable  # a global step hook: traced in a compiled step, it broke the graph inside torch's hook table
def _before_step(optimizer, args, kwargs) -> None:
    refuse_gathered_params(optimizer, _UNITS)  # Note [an optimizer over gathered parameters]
    if optimizer not in _TRACKED:
        _check_elementwise(optimizer)
        track_optimizer(optimizer)


def _check_elementwise(optimizer) -> None:
    """An optimizer over pieces must be elementwise (Note [elementwise optimizers only] in
    fusedist/optim/elementwise.py): checked at its first step."""
    pieces = _piece_map()
    if any(id(p) in pieces for group in optimizer.param_groups for p in group["params"]):
        from ..optim.elementwise import check_elementwise

        check_elementwise(type(optimizer), "fully_shard", "this rank's pieces of the parameters")


def track_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Register the state-dict hooks of Note [optimizer state of pieces] on ``optimizer`` (once;
    done on its first step by itself), after turning the state it already holds into pieces
    (Note [state loaded before the hooks]). Returns ``optimizer``."""
    if optimizer not in _TRACKED:
        _pieces_of_loaded_state(optimizer)
        _TRACKED.add(optimizer)
        optimizer.register_state_dict_post_hook(_post_state_dict)
        optimizer.register_load_state_dict_pre_hook(_pre_load_state_dict)
        optimizer.register_load_state_dict_post_hook(_post_load_state_dict)
    return optimizer


# Note [state loaded before the hooks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The load hooks are registered at an optimizer's first step, so ``optimizer.load_state_dict``
# on a fresh optimizer (the usual resume) runs without them: an FSDP2 optimizer's state dict
# left DTensors in the state (the first step then failed with "got mixed torch.Tensor and
# DTensor"), and a full state dict left whole-shaped tensors (a shape error at the step).
# So before the hooks are registered the state already held is turned into pieces as the load
# pre-hook would have done: a DTensor made whole (a collective: every rank steps together),
# a whole tensor cut to this rank's range, a ShardedPiece of this rank's range to its plain
# piece (one of another range is refused). State that is already piece-shaped is left as is.
@torch.no_grad()
def _pieces_of_loaded_state(optimizer) -> None:
    """The state ``optimizer`` holds for pieces, as pieces (Note [state loaded before the hooks])."""
    if not optimizer.state:
        return
    where = _piece_map()
    for index, p in enumerate(_ordered_params(optimizer.param_groups)):
        hit = where.get(id(p))
        values = optimizer.state.get(p)
        if hit is None or not isinstance(values, dict):
            continue
        for name, value in list(values.items()):
            piece = _to_piece(name, value, *hit, f"parameter {index}")
            if piece is not value:
                values[name] = piece


def _piece_map() -> dict:
    """id of a piece -> (unit, index), over every live unit."""
    out = {}
    for unit in list(_UNITS):
        for i, sp in enumerate(unit.sharded):
            out[id(sp)] = (unit, i)
    return out


def _ordered_params(param_groups) -> list:
    """The optimizer's parameters in ``state_dict()``'s index order (first occurrence)."""
    seen, out = set(), []
    for group in param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _elementwise(name, value, piece: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and name != "step" and tuple(value.shape) == tuple(piece.shape)


# ---------------------------------------------------------------------------- state_dict()
@torch.no_grad()
def _post_state_dict(optimizer, state_dict: dict) -> Optional[dict]:
    where = _piece_map()
    if not where:
        return None
    params = _ordered_params(optimizer.param_groups)
    state = state_dict["state"]
    entries = [(pid, p, *where[id(p)]) for pid, p in enumerate(params)
               if id(p) in where and isinstance(state.get(pid), dict)]
    if not entries:
        return None
    options = torch_helper_options("_get_optim_state_dict")
    new_state = dict(state)
    if options is not None and options[0]:
        wholes = _gather_states(entries, state, to_cpu=options[1])
        for pid, p, unit, i in entries:
            new_state[pid] = {k: wholes.get((pid, k), v) for k, v in state[pid].items()}
    else:
        for pid, p, unit, i in entries:
            new_state[pid] = {k: as_entry(v, unit, i) if _elementwise(k, v, p) else v
                              for k, v in state[pid].items()}
    return {**state_dict, "state": new_state}


def _gather_states(entries: list, state: dict, *, to_cpu: bool) -> dict:
    """``(pid, name) -> whole tensor`` of every elementwise state tensor of ``entries``: per
    unit and (name, dtype), the pieces' states laid out like the unit's shard, all-gathered
    (Note [optimizer state of pieces]). A collective over each unit's ranks."""
    jobs: dict = {}  # (unit position, name, dtype) -> [(pid, index)]
    units: list = []
    for pid, p, unit, i in entries:
        if not any(u is unit for u in units):
            units.append(unit)
        pos = next(k for k, u in enumerate(units) if u is unit)
        for name, value in state[pid].items():
            if _elementwise(name, value, p):
                jobs.setdefault((pos, name, value.dtype), []).append((pid, i))
    order = sorted(jobs, key=lambda j: (j[0], j[1], str(j[2])))
    _check_same_jobs(units, [(pos, name, str(dtype), [i for _, i in jobs[pos, name, dtype]])
                             for pos, name, dtype in order])
    out = {}
    for pos, name, dtype in order:
        unit = units[pos]
        shard = torch.zeros(unit.layout.shard_numel, dtype=dtype, device=unit.device)
        for pid, i in jobs[pos, name, dtype]:
            piece = unit.layout.piece(i, unit.rank)
            if piece.numel:
                shard[piece.shard_offset:piece.shard_offset + piece.numel].copy_(state[pid][name].reshape(-1))
        flat = torch.empty(unit.layout.total_numel, dtype=dtype, device=unit.device)
        for handle in unit.gather_into(flat, shard, f"fully_shard full optimizer state {unit.name} {name}"):
            handle.wait()
        for pid, i in jobs[pos, name, dtype]:
            sec = unit.layout.sections[unit.section_index(i)]
            whole = unit.layout.whole(i, flat[sec.full_base:sec.full_base + sec.layout.total_numel])
            if unit.tp[i] is not None:  # the global tensor (a collective over the tensor-parallel group)
                whole = unit.tp[i].full(whole)
            device = torch.device("cpu") if to_cpu else state[pid][name].device
            out[pid, name] = whole.to(device, copy=True)
    return out


def _check_same_jobs(units: list, jobs: list) -> None:
    """Every rank must gather the same state tensors in the same order: compare a digest of
    the list (one all-reduce per communicator) and raise on a mismatch instead of hanging."""
    digest = int.from_bytes(hashlib.sha256(repr((len(units), jobs)).encode()).digest()[:7], "little")
    seen = set()
    for unit in units:
        if id(unit.comm) in seen:
            continue
        seen.add(id(unit.comm))
        t = torch.tensor([digest, -digest], dtype=torch.int64, device=unit.comm.device)
        unit.comm.all_reduce(t, op="max", tag="fully_shard full optimizer state check")
        if t[0].item() != digest or -t[1].item() != digest:
            raise RuntimeError(
                "fusedist.fully_shard: get_optimizer_state_dict(full_state_dict=True): the ranks' optimizers hold "
                "different state for the sharded parameters (a parameter stepped on some ranks only?), so the "
                "state cannot be gathered whole. Step every rank's optimizer first, or save a sharded state dict "
                "with torch.distributed.checkpoint, or use fusedist.checkpoint.save.")


# ---------------------------------------------------------------------------- load_state_dict()
@torch.no_grad()
def _pre_load_state_dict(optimizer, state_dict: dict) -> Optional[dict]:
    where = _piece_map()
    _check_full_load(optimizer, where)
    saved_groups = state_dict.get("param_groups")
    if not where or not isinstance(saved_groups, list) or len(saved_groups) != len(optimizer.param_groups):
        return None  # torch's loader reports a mismatch
    id_map = {}
    for old, group in zip(saved_groups, optimizer.param_groups):
        if len(old["params"]) != len(group["params"]):
            return None
        id_map.update(zip(old["params"], group["params"]))
    new_state, changed = {}, False
    for key, values in state_dict["state"].items():
        p = id_map.get(key)
        hit = where.get(id(p)) if p is not None else None
        if hit is None or not isinstance(values, dict):
            new_state[key] = values
            continue
        new_state[key] = {name: _to_piece(name, v, *hit, key) for name, v in values.items()}
        changed = True
    return {**state_dict, "state": new_state} if changed else None


def _check_full_load(optimizer, where: dict) -> None:
    """Under ``set_optimizer_state_dict(full_state_dict=True)`` without ``broadcast_from_rank0``,
    check that every rank was given a state dict (Note [full state dict loaded on some ranks
    only] in torch_helpers.py): a rank given ``{}`` loads its own state back while the others
    load the dict. A collective over the ranks of the optimizer's first sharded parameter."""
    found = full_load_without_broadcast("_load_optim_state_dict")
    unit = next((where[id(p)][0] for group in optimizer.param_groups for p in group["params"] if id(p) in where),
                None)
    if found is None or unit is None:
        return
    from .._consistency import check_same_across_ranks

    given = "a state dict" if found[1].get("state_dict") else "an empty state dict"
    check_same_across_ranks(
        [given], "the optimizer state dict given to set_optimizer_state_dict(full_state_dict=True)",
        comm=unit.comm, op="fully_shard: set_optimizer_state_dict(full_state_dict=True) on every rank",
        hint="Without broadcast_from_rank0 each rank loads the dict it is given: pass the whole state dict "
             "on every rank, or pass it on rank 0 with StateDictOptions(broadcast_from_rank0=True).")


def _to_piece(name, value, unit, i: int, key):
    if not isinstance(value, torch.Tensor) or name == "step":
        return value
    value = whole_of_dtensor(value)  # Note [DTensor entries loaded] in state_dict_hooks.py
    full_shape = unit.whole_shape(i)
    region = piece_region(unit, i)
    if isinstance(value, ShardedPiece):
        if tuple(value.full_shape) != full_shape or value.element_range != region or \
                value.placement != unit.placement(i):
            raise ValueError(
                f"fusedist.fully_shard: optimizer state {name!r} of {key!r} is {describe_region(value.element_range)} "
                f"of shape {tuple(value.full_shape)}, but this rank's piece is {describe_region(region)} of shape "
                f"{full_shape}: the state dict comes from another rank or layout (load it "
                "through torch.distributed.checkpoint, which reshards)")
        return value.local()
    detached = value.detach()
    cut = whole_to_piece(detached, unit, i)
    return value if cut is detached else cut.clone()  # (a piece, or the optimizer's own shape error: as is)


def _post_load_state_dict(optimizer) -> None:
    for st in optimizer.state.values():
        if isinstance(st, dict):
            for name, v in list(st.items()):
                if isinstance(v, ShardedPiece):
                    st[name] = v.local()
