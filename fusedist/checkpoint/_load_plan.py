"""What ``load`` does, in two halves: :func:`prepare` reads and checks everything (files
against the manifest, keys and shapes against the model, optimizer state against the
optimizer, the scaler's state) and returns a plan without modifying anything; :func:`apply`
carries the plan out and cannot fail on it. Between the two, ``load`` has every rank agree
that every rank's plan is ready, so a problem on any rank leaves every rank's objects untouched.
"""

from __future__ import annotations

import os

import torch

from ..zero import ZeroRedundancyOptimizer
from ..zero import state as zstate
from . import (_adam_family, _checks, _dcp_algorithm, _dtensor_targets, _files, _from_dcp, _names, _which_checkpoint,
               stage3)
from ._files import CheckpointError
from ._params import labeller, optimizer_params, param_names


def _expected_model(target) -> tuple[dict, bool]:
    """The model's canonical keys and whole shapes, and whether it is sharded (fully_shard)."""
    sharded_target = bool(stage3.units(target))
    if sharded_target:
        return stage3.full_shapes(target), True
    return {k: stage3.full_shape(v, {}) for k, v in _names.canonical_state(target, target.state_dict()).items()}, False


def _check_model(saved: dict, expected: dict, directory: str, strict: bool = True) -> dict:
    """The saved keys and shapes must be exactly the module's (whole parameters); with
    ``strict=False`` only the keys both have are loaded, and their shapes must match (Note
    [a load that is not strict]). Returns the entries to load."""
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if not strict:
        saved = type(saved)((k, v) for k, v in saved.items() if k in expected)
        expected = {k: v for k, v in expected.items() if k in saved}
    elif missing or unexpected:
        # With shapes: a renamed parameter shows up once on each side, and its shape is what
        # lets the reader pair the two names.
        def listed(keys, shapes):
            shown = ", ".join(f"{k} {_shown(shapes[k])}" for k in keys[:10])
            return f"[{shown}{', ...' if len(keys) > 10 else ''}]"

        raise CheckpointError(
            f"fusedist.checkpoint: the model in {directory} does not match: missing keys (in the model, "
            f"not in the checkpoint) {listed(missing, expected)}, unexpected keys (in the checkpoint, not "
            f"in the model) {listed(unexpected, {k: _shape(v) for k, v in saved.items()})}; load(..., strict=False) "
            "loads the keys both have, as torch's load_state_dict(strict=False) does"
        )
    reshaped = [k for k, shape in expected.items() if _shape(saved[k]) != (None if shape is None else tuple(shape))]
    if reshaped:
        raise CheckpointError(_reshaped_message(reshaped, saved, expected, directory))
    return saved


SHOWN_SHAPE_MISMATCHES = 20


def _reshaped_message(reshaped: list, saved: dict, expected: dict, directory: str) -> str:
    """Every key whose shape differs, in the model's order, as torch's ``load_state_dict`` lists
    every size mismatch: fixing one at a time would take a load per key."""
    shown = [f"'{k}' has shape {_shown(_shape(saved[k]))} in the checkpoint, the model's is {_shown(expected[k])}"
             for k in reshaped[:SHOWN_SHAPE_MISMATCHES]]
    counted = "1 key has" if len(reshaped) == 1 else f"{len(reshaped)} keys have"
    listed = capped(shown, len(reshaped))
    return f"fusedist.checkpoint: {counted} another shape in {directory} than in the model: {listed}"


def capped(shown: list, total: int) -> str:
    """The first mismatches found (at most ``SHOWN_SHAPE_MISMATCHES`` of ``shown``) and how many
    more of ``total``: every one named spares a load per mismatch, the cap keeps the text readable."""
    shown = shown[:SHOWN_SHAPE_MISMATCHES]
    more = total - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more else "")


def _unmatched(saved: dict, expected: dict, target) -> dict:
    """The model keys a load that is not strict leaves out, as torch's ``load_state_dict`` of
    ``target`` names them, in its order: ``missing`` (the model's, not in the checkpoint) and
    ``unexpected`` (the reverse: Note [the order of unexpected keys] in ``_names.py``)."""
    return {"missing": [k for k in expected if k not in saved],
            "unexpected": _names.unexpected_order(target, [k for k in saved if k not in expected])}


def _cross_packed(saved: dict, target, sharded_target: bool, directory, layouts=None) -> dict:
    """``saved`` with each quantized-storage weight (an NF4 one) in the form ``target`` holds it.

    Note [quantized storage across run kinds]
        A ``fully_shard`` unit holds a frozen NF4 weight as bytes, and its checkpoints hold the
        weight's canonical bytes, of shape ``(nbytes,)`` (Note [quantized storage] in
        ``fsdp/packed.py``); a DDP, ZeRO or plain model's checkpoint holds the subclass itself,
        of the weight's shape. Either loads into the other, as every other weight does: for a
        sharded model the subclass becomes its canonical bytes, for an unsharded one the bytes
        become the subclass (the model's own parameter gives its class, context and inner
        layout). A weight of another inner layout (other block sizes: another class layout, or
        another byte count) is refused by name. The byte count alone does not tell the layout
        (NF4 weights of other scaler block sizes can have the same one), so ``fully_shard``
        checkpoints record it (``layouts``, by key: ``fsdp.packed.layout_record``; in torch's
        distributed checkpoint the chunks' metadata does, read as ``_from_dcp.LAYOUT_TAG``: Note
        [the layout of quantized storage in DCP] in ``fsdp/dcp.py``) and canonical bytes of
        another recorded layout are refused too, into either kind of model.
    """
    from ..fsdp.packed import canonical_slots, from_canonical, is_packed_candidate, to_canonical

    out = None
    for key, (param, spec, mine, other) in _packed_forms(target, sharded_target).items():
        value = saved.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if tuple(value.shape) in (mine, other):  # (another byte count: refused below, by its count)
            recorded = (layouts or {}).get(key, getattr(value, _from_dcp.LAYOUT_TAG, None))
            _check_layout(key, value, recorded, spec.canonical if spec is not None else
                          canonical_slots(param)[0], param if spec is None else spec.cls, directory)
        if tuple(value.shape) == mine:
            continue
        if tuple(value.shape) != other:
            if spec is None and value.dim() == 1 and (value.dtype == torch.uint8 or value.is_meta):
                raise CheckpointError(
                    f"fusedist.checkpoint: '{key}' in {directory} holds {value.numel()} bytes of quantized storage (a "
                    f"fully_shard checkpoint's); the model's {type(param).__name__} {tuple(param.shape)} has "
                    f"{other[0]}: inner tensors {_inner(canonical_slots(param)[0])} (quantized with other block "
                    "sizes?)")
            continue  # (a shape the checks name)
        if value.is_meta:  # (the checks before a restore: shapes only)
            converted = torch.empty(mine, device="meta")
        elif spec is not None:
            layout = canonical_slots(value)[0] if is_packed_candidate(value) else None
            if layout != spec.canonical:
                raise CheckpointError(
                    f"fusedist.checkpoint: '{key}' in {directory} is a {type(value).__name__} of dtype {value.dtype} "
                    + (f"whose inner tensors are {_inner(layout)}" if layout is not None else "")
                    + f"; the model holds it as quantized storage ({spec.cls.__name__}) whose inner tensors are "
                    f"{_inner(spec.canonical)}: save it as that class (quantized with the same block sizes)")
            converted = to_canonical(value)
        elif not is_packed_candidate(value) and value.dtype == torch.uint8:
            converted = from_canonical(value, param)
        else:
            continue
        out = out if out is not None else type(saved)(saved)
        out[key] = converted
    return saved if out is None else out


def _check_layout(key: str, value: torch.Tensor, recorded, layout: list, held, directory) -> None:
    """Canonical bytes ``value`` whose recorded layout (a ``fully_shard`` checkpoint's) is not
    the model's ``layout`` are refused by name (Note [quantized storage across run kinds]): read
    with the model's layout they would be another weight, silently."""
    from ..fsdp.packed import layout_record

    if recorded is None or value.is_floating_point() or _is_wrapper(value):
        return
    if [list(r) for r in recorded] != layout_record(layout):
        what = held if isinstance(held, type) else type(held)
        raise CheckpointError(
            f"fusedist.checkpoint: '{key}' in {directory} holds quantized storage whose inner tensors are "
            f"{_inner(recorded)}; the model's {what.__name__} has {_inner(layout)} (quantized with other block "
            "sizes?): quantize the model's weight as the saved one was")


def _is_wrapper(value) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(value)


def _packed_forms(target, sharded_target: bool) -> dict:
    """``{canonical key: (parameter, its unit's spec or None, the shape the model holds it in,
    the other form's shape)}`` of every quantized-storage weight of ``target`` (Note
    [quantized storage across run kinds]): a unit's canonical bytes ``(nbytes,)`` against the
    weight's shape."""
    from ..fsdp.packed import canonical_slots, is_packed_candidate

    where = stage3.piece_index(target) if sharded_target else {}
    out = {}
    for key, param in _names.canonical_state(target, target.state_dict(keep_vars=True)).items():
        hit = where.get(id(param))
        spec = hit[0].ext[hit[1]] if hit is not None else None
        if spec is not None and spec.packed:
            out[key] = (param, spec, (spec.canonical_bytes,), spec.outer_shape)
        elif hit is None and is_packed_candidate(param):
            out[key] = (param, None, tuple(param.shape), (canonical_slots(param)[1],))
    return out


def _inner(layout: list) -> str:
    """Inner tensors of quantized storage as a message shows them."""
    return ", ".join(f"{n} {tuple(shape)} {str(dtype).replace('torch.', '')}" for n, _, shape, dtype in layout)


def _shape(value):
    """A saved entry's shape; None for a value that is not a tensor (``get_extra_state()``)."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _shown(shape) -> str:
    return "(not a tensor: a module's extra state)" if shape is None else str(tuple(shape))


def _prepare_dcp(directory, model, optimizer, scaler, strict: bool = True, trusted: bool = False) -> dict:
    """:func:`prepare` for a checkpoint of torch's distributed checkpoint (Note [torch's
    distributed checkpoints in load] in ``_from_dcp.py``)."""
    if scaler is not None:
        raise CheckpointError(f"fusedist.checkpoint: {directory} is a checkpoint of torch's distributed checkpoint, "
                              "which holds no GradScaler state fusedist reads; pass scaler=None")
    digest, tree = _from_dcp.read(directory, trusted)
    target = _names.unwrap(model)
    expected, sharded_target = _expected_model(target)
    saved, optim = _from_dcp.split(tree, expected, lambda d: _names.strip_prefix(d, expected), directory)
    saved = _cross_packed(saved, target, sharded_target, directory)  # Note [quantized storage across run kinds]
    plan: dict = {"extra": None, "model": _check_model(saved, expected, directory, strict),
                  "model_sharded": sharded_target, "strict": strict, **_unmatched(saved, expected, target),
                  "read": {"manifest": digest, "strict": strict,
                           **_checks.objects_passed(directory, optimizer, scaler)}}
    if optimizer is not None:
        if optim is None:
            raise CheckpointError(f"fusedist.checkpoint: {directory} holds no optimizer state")
        source = f"optimizer state in {directory}"
        params = optimizer_params(optimizer)
        full = _from_dcp.to_torch_format(optim, param_names(model, params), optimizer.param_groups, source)
        _dcp_algorithm.check(full["param_groups"], optimizer, directory)
        plan["optimizer"] = _prepare_full(full, directory, target, _sharding(target), optimizer, params, source)
    return plan


def prepare(directory, model, optimizer, scaler, trusted: bool = False, strict: bool = True) -> dict:
    """Read and check every file ``load`` needs and every tensor against ``model``, ``optimizer``
    and ``scaler``, without modifying them: the plan :func:`apply` carries out."""
    if _which_checkpoint.reads_dcp(directory):
        return _prepare_dcp(directory, model, optimizer, scaler, strict, trusted)
    manifest, digest = _files.read_manifest_and_digest(directory)
    files = manifest["files"]
    if _files.COMMON not in files:
        raise CheckpointError(
            f"fusedist.checkpoint: {os.path.join(directory, _files.MANIFEST)} lists no {_files.COMMON}")
    common = _files.load_file(_files.verify_file(directory, _files.COMMON, files[_files.COMMON]), trusted)
    # What the ranks compare before any of them applies its plan (_checks.check_same_load).
    read = {"manifest": digest, "strict": strict, **_checks.objects_passed(directory, optimizer, scaler)}
    plan: dict = {"extra": common.get("extra"), "read": read, "strict": strict}
    rank_files: dict = {}

    def sections(name: str) -> list:
        """Section ``name`` of every rank file holding it (each file read once)."""
        out = []
        for file, info in sorted(files.items()):
            if name in info.get("sections", []):
                if file not in rank_files:
                    rank_files[file] = _files.load_file(_files.verify_file(directory, file, info), trusted)
                out.append(rank_files[file][name])
        return out

    # Model: the saved keys and shapes must be exactly the module's (whole parameters).
    target = _names.unwrap(model)
    expected, sharded_target = _expected_model(target)
    saved = _names.strip_prefix(common["model"], expected)
    layouts = {}
    if manifest.get("model_sharded"):  # Note [stage-3 checkpoints]
        saved = dict(saved)
        saved.update(stage3.assemble_model(sections("model_shard"), source=f"model in {directory}"))
        layouts = stage3.packed_layouts(sections("model_shard"))
    saved = _cross_packed(saved, target, sharded_target, directory, layouts)
    plan["model"] = _check_model(saved, expected, directory, strict)
    plan["model_sharded"] = sharded_target
    plan.update(_unmatched(saved, expected, target))

    if optimizer is not None:
        plan["optimizer"] = _prepare_optimizer(directory, manifest, common, model, optimizer, sections)
    if scaler is not None:
        if common.get("scaler") is None:
            raise CheckpointError(f"fusedist.checkpoint: {directory} holds no GradScaler state")
        _checks.check_scaler(common["scaler"], scaler, directory)
        plan["scaler"] = common["scaler"]
    return plan


def _prepare_optimizer(directory, manifest, common, model, optimizer, sections):
    meta = manifest.get("optimizer")
    if meta is None:
        raise CheckpointError(f"fusedist.checkpoint: {directory} holds no optimizer state")
    params = optimizer_params(optimizer)
    names = param_names(model, params)
    target = _names.unwrap(model)
    sharded_target, where = sharding = _sharding(target)
    saved_names = [n if n in names else _names.legacy_key(n) for n in meta["param_names"]]
    order = _reordered(saved_names, names, optimizer)
    if order is not None:  # Note [parameters in another order]
        saved_names = names
        meta = dict(meta, param_shapes=[meta["param_shapes"][i] for i in order])
    crossed = _packed_positions(meta["param_shapes"], params, where)
    if crossed:  # Note [quantized storage across run kinds]
        meta = dict(meta, param_shapes=[list(stage3.full_shape(p, where)) if i in crossed else shape
                                         for i, (p, shape) in enumerate(zip(params, meta["param_shapes"]))])
    shapes = [list(stage3.full_shape(p, where)) for p in params]
    if saved_names != names or shapes != meta["param_shapes"]:
        raise optimizer_refusal(directory, _optimizer_mismatch(saved_names, names, meta["param_shapes"], shapes))
    shards = sections("optimizer_shard") if meta["kind"] == "zero" else None
    saved_groups = (shards[0] if shards else common.get("optimizer") or {}).get("param_groups")
    _checks.check_algorithm(meta, optimizer, directory, saved_groups)
    source = f"optimizer state in {directory}"
    if meta["kind"] == "zero":
        shards = [_adam_family.keep_own_setting(s, optimizer) for s in shards]  # (as _prepare_full's groups)
        if order is not None:
            shards = [_renumber_shard(s, order) for s in shards]
        if crossed:
            shards = [_packed_shard(s, crossed, params, where, names, directory) for s in shards]
        if len(shards) != manifest["world_size"]:
            raise CheckpointError(
                f"fusedist.checkpoint: {directory} lists {len(shards)} optimizer shard files for world size "
                f"{manifest['world_size']}"
            )
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer.prepare_load(shards, source=source)
        if sharded_target:
            if not any(s.get("replicated") for s in shards):
                stage3.check_shard_set(shards, "optimizer", source)
            return stage3.optimizer_for_pieces(target, optimizer, params, zstate.merge_fragments(shards),
                                               shards[0]["param_groups"], shards[0]["param_meta"], source,
                                               names=names)
        merged = zstate.merge_fragments(shards)
        assembled = zstate.assemble(merged, params, range(len(params)), source=source, keep_empty=True,
                                    name=labeller(names, params))
        zstate.relayout(assembled, params, shards[0]["param_meta"])
        full = _adam_family.keep_own_setting(zstate.to_torch_format(assembled, params, shards[0]["param_groups"]),
                                             optimizer)  # Note [Adam without weight decay is AdamW without it]
        zstate.check_groups(full["param_groups"], optimizer.param_groups, source)
        _checks.check_loadable(optimizer, full, directory)
        return full
    full = common["optimizer"] if order is None else _renumber_full(common["optimizer"], order)
    _check_no_state(full["state"], crossed, names, directory)
    return _prepare_full(full, directory, target, sharding, optimizer, params, source)


def _optimizer_mismatch(saved_names: list, names: list, saved_shapes: list, shapes: list) -> str:
    """What differs between the checkpoint's optimizer parameters and this optimizer's, saying
    only what was found: the counts, every position of another name (both names), else every
    other shape; a hint on the parameters one side has past the other's when the rest agree."""
    found = []
    if len(saved_names) != len(names):
        found.append(f"{len(saved_names)} parameters saved, {len(names)} here")
    renamed = [i for i, (a, b) in enumerate(zip(saved_names, names)) if a != b]
    if renamed:
        found.append(capped([f"parameter {i} is '{saved_names[i]}' in the checkpoint, '{names[i]}' here"
                              for i in renamed[:SHOWN_SHAPE_MISMATCHES]], len(renamed)))
        return "; ".join(found)
    reshaped = optimizer_shape_mismatch(names, saved_shapes, shapes)
    if reshaped:
        found.append(reshaped)
    detail = "; ".join(found)
    if len(saved_names) > len(names):
        detail += (f"; the checkpoint's optimizer also holds {_first_three(saved_names[len(names):])}: param groups "
                   "it gained during training (add_param_group) must be added again before loading")
    if len(saved_names) < len(names):
        detail += f"; the optimizer here also holds {_first_three(names[len(saved_names):])}: {_names.ADDED_AFTER_LOAD}"
    return detail


def _first_three(names: list) -> str:
    """``['a', 'b', 'c']``, and how many more where there are."""
    return f"{names[:3]}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def optimizer_shape_mismatch(names: list, saved_shapes: list, shapes: list) -> str:
    """Every optimizer parameter whose saved shape is not its shape here, by position and name
    (capped: :func:`capped`); empty when all agree. The ordinary and the pipelined load
    (which takes its state by name) name them alike."""
    reshaped = [i for i, (a, b) in enumerate(zip(saved_shapes, shapes)) if list(a) != list(b)]
    if not reshaped:
        return ""
    return capped([f"parameter {i} '{names[i]}' has shape {tuple(saved_shapes[i])} in the checkpoint, "
                    f"{tuple(shapes[i])} here" for i in reshaped[:SHOWN_SHAPE_MISMATCHES]], len(reshaped))


def optimizer_refusal(directory: str, detail: str) -> CheckpointError:
    """The refusal of an optimizer whose parameters are not the checkpoint's, ``detail`` saying how."""
    return CheckpointError(f"fusedist.checkpoint: the optimizer's parameters do not match {directory}: {detail}")


def _packed_positions(saved_shapes: list, params: list, where: dict) -> set:
    """The optimizer positions of quantized-storage weights saved in the other form than the
    loading model's (canonical bytes against the weight's shape, or the reverse: Note
    [quantized storage across run kinds]). Frozen, they hold no optimizer state, only records
    of their shape, which take the loading model's."""
    from ..fsdp.packed import canonical_slots, is_packed_candidate

    out = set()
    for i, (p, saved) in enumerate(zip(params, saved_shapes)):
        hit = where.get(id(p))
        spec = hit[0].ext[hit[1]] if hit is not None else None
        if spec is not None and spec.packed:
            forms = (list(spec.outer_shape), [spec.canonical_bytes])
        elif hit is None and is_packed_candidate(p):
            forms = (list(p.shape), [canonical_slots(p)[1]])
        else:
            continue
        if list(saved) != list(stage3.full_shape(p, where)) and list(saved) in forms:
            out.add(i)
    return out


def _check_no_state(state: dict, crossed: set, names: list, directory) -> None:
    """A crossed quantized weight (:func:`_packed_positions`) must hold no optimizer state: it
    could not follow the weight into its other form."""
    for i in sorted(crossed):
        if state.get(i) or state.get(str(i)):
            raise CheckpointError(
                f"fusedist.checkpoint: the optimizer state in {directory} holds state for '{names[i]}', a weight of "
                "quantized storage saved in another layout (fully_shard's bytes against the weight's shape); such "
                "weights are frozen and their state cannot be carried across. Load it into the run kind that saved it")


def _packed_shard(shard: dict, crossed: set, params: list, where: dict, names: list, directory) -> dict:
    """A ZeroRedundancyOptimizer shard whose records of the crossed quantized weights
    (:func:`_packed_positions`) are the loading model's; a fragment holding values for one is
    refused."""
    _check_no_state({i: any(f.get("master") is not None or f.get("state") for f in shard["fragments"].get(i, []))
                     for i in crossed}, crossed, names, directory)
    records = list(shard["param_meta"])
    for i in crossed:
        records[i] = stage3._meta(params[i], where)
    return dict(shard, param_meta=records)


def _reordered(saved_names: list, names: list, optimizer) -> list | None:
    """Where the optimizer's parameters are the saved ones in another order within each param
    group, ``order[i]``: the saved index of parameter ``i`` here; else None.

    Note [parameters in another order]
        An optimizer's state is saved by position, and its positions follow the model's
        registration order: a model whose class now registers its layers in another order
        (same names, same shapes) has the same parameters at other positions. The manifest
        names every position, so the state is renumbered by name, as torch's distributed
        checkpoint matches it by name; loading it by position would give one parameter
        another's moments, silently where their shapes agree. Only a reordering inside each
        param group is taken: a parameter moved to another group would take that group's
        hyperparameters, which the checkpoint did not train it with.
    """
    if saved_names == names or len(set(names)) != len(names) or sorted(saved_names) != sorted(names):
        return None
    start = 0
    for group in optimizer.param_groups:
        end = start + len(group["params"])
        if sorted(saved_names[start:end]) != sorted(names[start:end]):
            return None
        start = end
    where = {n: i for i, n in enumerate(saved_names)}
    return [where[n] for n in names]


def _renumber_full(full: dict, order: list) -> dict:
    """A torch-format optimizer state dict with its state keyed by the positions of ``order``
    (the param groups keep their ranges: ``_reordered`` moves no parameter between groups)."""
    new_of = {old: new for new, old in enumerate(order)}
    return dict(full, state={new_of.get(k, k): v for k, v in full["state"].items()})


def _renumber_shard(shard: dict, order: list) -> dict:
    """A ZeroRedundancyOptimizer shard with its fragments and parameter records in the
    positions of ``order``."""
    new_of = {old: new for new, old in enumerate(order)}
    return dict(shard, fragments={new_of[k]: v for k, v in shard["fragments"].items()},
                param_meta=[shard["param_meta"][old] for old in order])


def _sharding(target) -> tuple[bool, dict]:
    """Whether ``target`` is sharded with fully_shard, and its piece index ({} when not)."""
    sharded = bool(stage3.units(target))
    return sharded, stage3.piece_index(target) if sharded else {}


def _prepare_full(full: dict, directory, target, sharding: tuple, optimizer, params, source: str):
    """What :func:`apply` loads from ``full``, an unsharded optimizer's state in torch's format
    (``sharding``: :func:`_sharding` of the bare module ``target``)."""
    sharded_target, where = sharding
    full = _adam_family.keep_own_setting(full, optimizer)  # Note [Adam without weight decay is AdamW without it]
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.prepare_load(full, source=source)
    if sharded_target:
        wholes = [stage3._whole(p, where) for p in params]
        names = param_names(target, params)
        frags = zstate.fragments_from_full(full, wholes, name=labeller(names, wholes))
        return stage3.optimizer_for_pieces(target, optimizer, params, frags, full["param_groups"], None, source,
                                           names=names)
    zstate.check_groups(full["param_groups"], optimizer.param_groups, source)
    _checks.check_loadable(optimizer, full, directory)
    return full


def apply(plan: dict, model, optimizer, scaler):
    """Nothing here can fail on validated input: the model, then the optimizer (whose master
    weights default to the just-loaded parameters), then the scaler."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.wait_for_params()  # no parameter all-gather may land after the load
    target = _names.unwrap(model)
    own = _names.own_keys(target, target.state_dict(keep_vars=True))
    state = type(plan["model"])((own[k], v) for k, v in plan["model"].items())
    with torch.no_grad():
        if plan["model_sharded"]:  # each rank keeps its rows of the whole parameters
            from ..fsdp.state_dict import load_full_state_dict

            # (the keys were checked in prepare; a module's get_extra_state() value goes to its
            # set_extra_state there, as in torch's load_state_dict)
            load_full_state_dict(target, state, strict=False)
        else:  # (Note [a load into DTensor parameters] in _dtensor_targets.py)
            target.load_state_dict(_dtensor_targets.model_state(target, state), strict=plan["strict"])
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.sync_master_from_params()
        if "optimizer" in plan:
            optimizer._apply_assembled(*plan["optimizer"])
    elif optimizer is not None and "optimizer" in plan:
        optimizer.load_state_dict(plan["optimizer"])
        _dtensor_targets.place_optimizer_state(optimizer)
        if plan["model_sharded"]:  # its state dicts present the pieces' state (Note [optimizer state of pieces])
            from ..fsdp import track_optimizer

            track_optimizer(optimizer)
    if scaler is not None and "scaler" in plan:
        scaler.load_state_dict(plan["scaler"])
    return plan["extra"]
