"""Layout-independent optimizer state: per-parameter *fragments*.

Note [fragments]
    A sharded state dict stores, for every parameter a rank owns part of, a fragment
    ``{"range": (lo, hi), "master": Tensor[hi-lo] | None, "state": {key: Tensor[hi-lo] | scalar}}``
    over the flattened parameter, in its memory order (a channels_last weight's elements as
    they lie in memory: ``flat_like`` / ``shaped_like`` in ``fusedist/ddp/layout.py``). The
    shards record each parameter's strides (``param_meta``), and a full state dict is converted
    with the parameter's layout, so both load into any memory format (:func:`relayout`).
    Fragments do not depend on the bucket layout or the world
    size, so state saved at N ranks is loaded at M ranks by assembling each needed parameter
    from whichever fragments cover it and slicing the new range out (resharding at load time).
    A full (torch-format) state dict is the special case of one fragment ``(0, numel)`` per
    parameter. Optimizer state must be *elementwise* (a tensor per parameter element, or a
    scalar such as ``step``); that holds for Adam/AdamW/SGD/Lion-style optimizers. A
    ``fully_shard`` piece sharded on another dim than 0 is a box fragment instead (Note [box
    fragments] in ``box_fragments.py``), assembled into the same flat whole state.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ddp.layout import flat_like, shaped_like
from ..optim.sgd import without_unfilled_buffers

FORMAT = "fusedist.zero/1"


class StateDictError(ValueError):
    """An optimizer state dict does not fit the optimizer it is loaded into."""


def param_meta(params) -> list[dict]:
    """Shape, dtype and the strides that define each fragment's element order (Note
    [fragments]): :func:`relayout` uses them to load shards into another memory format."""
    return [{"shape": tuple(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
             "strides": tuple(slot_strides(p))} for p in params]


def slot_strides(p: torch.Tensor) -> tuple:
    """The strides that see a parameter's flat slot (its memory order) with its shape."""
    return shaped_like(torch.empty(p.numel(), device="meta"), p).stride()


def relayout(assembled: dict[int, dict], params, saved_meta: list[dict]) -> None:
    """Re-order, in place, the assembled full flat state of every parameter whose memory
    layout differs from the saving run's (a channels_last model saved, a contiguous one
    loading, or the reverse), so a sharded state dict loads into any memory format. Metadata
    without strides predates memory-ordered slots: those were row-major."""
    for index, item in assembled.items():
        p = params[index]
        saved = tuple(saved_meta[index].get("strides") or torch.empty(p.shape, device="meta").stride())
        if saved == tuple(slot_strides(p)):
            continue

        def convert(v):
            return flat_like(v.reshape(-1).as_strided(p.shape, saved), p).clone()

        item["state"] = {k: convert(v) if is_elementwise(v, p.numel()) else v for k, v in item["state"].items()}
        if item["master"] is not None:
            item["master"] = convert(item["master"])


def is_elementwise(value, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def slice_state(state: dict, numel: int, lo: int, hi: int, *, copy: bool, optimizer_name: str,
                why: str) -> dict:
    """Elements ``[lo, hi)`` of one optimizer state over ``numel`` elements: elementwise tensors
    sliced (views, or copies with ``copy``), scalars (e.g. ``step``) cloned. A non-elementwise
    tensor cannot be divided: ``StateDictError`` saying ``why`` it would have to be."""
    out = {}
    for key, v in state.items():
        if is_elementwise(v, numel):
            out[key] = v[lo:hi].clone() if copy else v[lo:hi]
        elif isinstance(v, torch.Tensor) and v.numel() > 1:
            raise StateDictError(
                f"ZeroRedundancyOptimizer: state '{key}' of {optimizer_name} is not elementwise; {why}"
            )
        else:
            out[key] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def merge_fragments(state_dicts: list[dict]) -> dict[int, list]:
    """Every shard's fragments, per parameter. Shards marked ``replicated`` (written by earlier
    versions, which saved the whole state on every rank when no step had built the shards
    yet) each hold the whole state: one of them is taken."""
    replicated = [sd for sd in state_dicts if sd.get("replicated")]
    if replicated:
        if len(replicated) != len(state_dicts):
            raise StateDictError("the shards mix replicated and partitioned ones: they come from different saves")
        state_dicts = replicated[:1]
    merged: dict[int, list] = {}
    for sd in state_dicts:
        for index, frags in sd["fragments"].items():
            merged.setdefault(int(index), []).extend(frags)
    return merged


def per_element_keys(states: dict, params) -> set:
    """The optimizer state keys that hold one value per element (moments), as the parameters
    with dims show them (``states``: index -> state). A 0-dim parameter's moments are 0-dim
    like its ``step``: taken for scalars, they were copied whole to every rank, and to a rank
    whose piece of the parameter is empty (or to every rank of ZeRO, whose slices are flat)
    the next step failed ("output with shape [] doesn't match the broadcast shape [0]"). Those
    keys are per element for the 0-dim parameter too: one-element fragments, cut as the others."""
    return {key for index, state in states.items() if params[int(index)].dim() > 0
            for key, v in state.items() if is_elementwise(v, params[int(index)].numel())}


def _which(index: int, params, name) -> str:
    """Parameter ``index`` in a message: ``name(index)`` where the caller can name it (a sharded
    optimizer, by its module path: Note [naming a parameter given without its name] in
    param_labels.py), else by index and shape."""
    return name(index) if name is not None else f"parameter {index} (shape {tuple(params[index].shape)})"


def fragments_from_full(full: dict, params, name=None) -> dict[int, list]:
    """Fragments of a torch-format state dict ``{"state": {index: {...}}, "param_groups"}``
    (a 0-dim parameter's moments made one-element: :func:`per_element_keys`); ``name(index)``
    names a parameter in errors (default: index and shape)."""
    out: dict[int, list] = {}
    states = full.get("state", {})
    for index in states:  # (all checked first: per_element_keys reads every index's parameter)
        if not 0 <= int(index) < len(params):
            raise StateDictError(f"state dict has state for parameter {int(index)}, the optimizer has {len(params)}")
    per_element = per_element_keys(states, params)
    for index, values in states.items():
        index = int(index)
        n = params[index].numel()
        state, master = {}, None
        for key, v in values.items():
            if key == "master_param":
                master = flat_like(v, params[index])
            elif isinstance(v, torch.Tensor) and (v.dim() > 0 or (params[index].dim() == 0 and key in per_element)):
                if v.numel() != n:
                    raise StateDictError(
                        f"state '{key}' of {_which(index, params, name)} has {v.numel()} elements, the parameter "
                        f"has {n} "
                        "(ZeroRedundancyOptimizer shards only elementwise optimizer state)"
                    )
                state[key] = flat_like(v, params[index])
            else:
                state[key] = v
        out[index] = [{"range": (0, n), "master": master, "state": state}]
    return out


def assemble(frags_by_param: dict[int, list], params, indices, *, source: str,
             keep_empty: bool = False, name=None) -> dict[int, dict]:
    """Full flat ``{"master", "state"}`` per parameter in ``indices`` from its fragments.

    Raises :class:`StateDictError` naming the parameter when fragments do not cover it exactly
    once, disagree on keys or scalars, or have the wrong sizes. A parameter with no fragment
    at all has no state (it was never stepped). A parameter with no elements owns no slice of
    any shard: its state -- torch's optimizers step it, and their state dicts hold empty
    moments and a step count for it -- is taken from its first fragment with ``keep_empty``
    (a ZeroRedundancyOptimizer keeps it: Note [parameters with no elements] in
    ``empty_params.py``), else dropped. ``name(index)`` names a parameter in errors (default: index
    and shape)."""
    from .box_fragments import assemble_boxes, is_box  # (it imports this module)

    out: dict[int, dict] = {}
    for index in indices:
        frags = frags_by_param.get(index)
        p = params[index]
        n = p.numel()
        if frags and n == 0 and keep_empty:
            out[index] = _assemble_empty(frags[0], source, _which(index, params, name))
        if not frags or n == 0:
            continue
        if any(is_box(f) for f in frags):  # Note [box fragments], Note [region fragments]
            out[index] = assemble_boxes(frags, tuple(p.shape), _which(index, params, name), source=source)
            continue
        frags = sorted(frags, key=lambda f: f["range"][0])
        cursor = 0
        for f in frags:
            lo, hi = f["range"]
            if lo != cursor or hi <= lo or hi > n:
                raise StateDictError(
                    f"{source}: the fragments of {_which(index, params, name)} cover "
                    f"{[tuple(g['range']) for g in frags]}, not exactly [0, {n}) once; shards are missing "
                    "or come from different checkpoints"
                )
            cursor = hi
        if cursor != n:
            raise StateDictError(
                f"{source}: the fragments of {_which(index, params, name)} end at element "
                f"{cursor} of {n}; a shard is missing"
            )
        keys = set(frags[0]["state"])
        has_master = frags[0]["master"] is not None
        state: dict = {}
        for key in keys:
            first = frags[0]["state"][key]
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                parts = []
                for f in frags:
                    v = f["state"].get(key)
                    lo, hi = f["range"]
                    if not (isinstance(v, torch.Tensor) and v.numel() == hi - lo):
                        raise StateDictError(f"{source}: state '{key}' of {_which(index, params, name)} is "
                                             "inconsistent across shards")
                    parts.append(v.reshape(-1))
                state[key] = torch.cat(parts) if len(parts) > 1 else parts[0]
            else:
                for f in frags[1:]:
                    other = f["state"].get(key)
                    if not (key in f["state"] and same_scalar_state(first, other)):
                        raise StateDictError(
                            f"{source}: scalar state '{key}' of {_which(index, params, name)} differs across shards "
                            f"({first!r} vs {other!r})"
                        )
                state[key] = first
        for f in frags:
            if set(f["state"]) != keys or (f["master"] is not None) != has_master:
                raise StateDictError(f"{source}: shards of {_which(index, params, name)} hold different state keys")
            lo, hi = f["range"]
            if has_master and f["master"].numel() != hi - lo:
                raise StateDictError(
                    f"{source}: the fragment of {_which(index, params, name)} for elements "
                    f"{(lo, hi)} holds {f['master'].numel()} values, not {hi - lo}; a rank's file is corrupt")
        master = torch.cat([f["master"].reshape(-1) for f in frags]) if has_master else None
        out[index] = {"master": master, "state": state}
    return out


def same_scalar_state(a, b) -> bool:
    """Whether two fragments of a parameter hold the same per-parameter scalar state: numbers and
    0-dim tensors by value; anything else an optimizer keeps per parameter (a string, a tuple,
    None) by ``==``, as torch's state dicts carry it. (Every value went through ``torch.as_tensor``,
    which fails on a string: consolidating a user optimizer's state with one raised a TypeError
    on the receiving rank only.)"""
    numbers = (torch.Tensor, int, float, bool)
    if isinstance(a, numbers) and isinstance(b, numbers):
        return torch.equal(torch.as_tensor(b), torch.as_tensor(a))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a plain truth value of ==: not provably the same
        return False


def keep_loaded_strings(loaded: dict, given: dict) -> None:
    """Put back the string values of ``given`` (tensor -> its state, as handed to an optimizer's
    ``load_state_dict``) into ``loaded`` (that optimizer's state after the load). torch's
    ``Optimizer.load_state_dict`` rebuilds every iterable state value from its items, and a
    string comes back as the text of a generator ("<generator object ...>"); torch's
    ZeroRedundancyOptimizer sets its local state directly and keeps them."""
    for t, st in given.items():
        for key, v in st.items():
            if isinstance(v, str) and t in loaded:
                loaded[t][key] = v


def _assemble_empty(frag: dict, source: str, which: str) -> dict:
    """The state of a parameter with no elements from one of its fragments (every rank's
    holds the same): its tensors must be empty too."""
    state = {}
    for key, v in frag["state"].items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if v.numel():
                raise StateDictError(f"{source}: state '{key}' of {which} has {v.numel()} elements, "
                                     "the parameter has none")
            v = v.reshape(-1)
        state[key] = v
    return {"master": None, "state": state}


def to_torch_format(assembled: dict[int, dict], params, param_groups: list[dict], *,
                    without_step: bool = False) -> dict:
    """A state dict loadable by an unsharded optimizer over ``params`` (torch's format; FP32
    master weights of half-precision parameters under ``master_param``, as fusedist's fused
    optimizers keep them). A FusedSGD momentum buffer no step has filled is left out, as that
    optimizer's own state dict does (``without_unfilled_buffers``); so are the step counts
    ``without_step`` (FusedSGD's, which its own state dict leaves out as torch's SGD keeps none)."""
    state = {}
    inner = without_unfilled_buffers({index: item["state"] for index, item in assembled.items()})
    for index, item in sorted(assembled.items()):
        p = params[index]
        entry = {}
        for key, v in inner.get(index, {}).items():
            if without_step and key == "step":
                continue
            entry[key] = shaped_like(v, p) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
        if item["master"] is not None and p.dtype in (torch.float16, torch.bfloat16):
            entry["master_param"] = shaped_like(item["master"], p)
        if entry or (index in inner and not without_step):
            state[index] = entry
    return {"state": state, "param_groups": [dict(g) for g in param_groups]}


def check_groups(saved_groups: list[dict], groups: list[dict], source: str) -> None:
    """The saved param groups must index the same parameters as the optimizer's."""
    saved = [list(g["params"]) for g in saved_groups]
    current = [list(g["params"]) for g in groups]
    if [len(g) for g in saved] != [len(g) for g in current]:
        raise StateDictError(
            f"{source}: param group sizes {[len(g) for g in saved]} do not match the optimizer's "
            f"{[len(g) for g in current]}"
        )


def hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def flat_or_none(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.reshape(-1)
