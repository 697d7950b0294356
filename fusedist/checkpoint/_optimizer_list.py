"""Several optimizers over disjoint parts of one model, in one checkpoint.

Note [several optimizers over one model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A GAN's generator and discriminator, a backbone and a head with their own algorithms: one
model, a list of optimizers over disjoint subsets of its parameters (two ZeroRedundancyOptimizers
over parts of one DDP model among them, Note [a subset of a DDP model's parameters] in
fusedist/zero/wiring.py). torch's ``get_state_dict(model, optimizers=[...])`` merges such a list
under parameter names. Here the model is cut into one *view* per optimizer -- a tree of bare
modules holding the very parameters that optimizer steps, under their names in the whole model
(the model's buffers and frozen parameters go with the first) -- and the views are saved and
loaded as the parts of a pipelined checkpoint (Note [pipelined checkpoints] in ``pipeline.py``),
which already keys every entry and every optimizer state by name, reshards ZeRO state at
another world size, and checks each part's algorithm. The manifest records the classes of the
saved list: a list loads only a checkpoint of a list of the same length whose optimizer at each
position ran the algorithm of the one here (torch's and fusedist's fused class of one algorithm
interchange) over the same parameters, by name, in as many param groups, strict or not (Note [one
position, one set of parameters]), or torch's distributed checkpoint of ``get_state_dict``'s list; one optimizer
is refused a checkpoint of several (its state would merge two algorithms). A list of one
optimizer is that optimizer, as a Checkpointer has always taken it. A Checkpointer given a list
at ``restore`` saves and restores it this way from then on, one LR scheduler per optimizer.

The views leave out whatever a module adds to its state beyond its parameters and buffers
(``get_extra_state``, state-dict hooks): such a model is refused rather than saved without it.
The model's data-parallel group must be the whole job, as a pipelined save is a collective of
the job.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from . import _checks, _files, _names, _save_entry
from ._files import CheckpointError
from ._params import optimizer_params, param_names

#: the manifest key recording the classes of a saved list of optimizers, in order
MANIFEST_KEY = "optimizer_list"

#: the model each optimizer of a list was last cut from (by :func:`views`): what names its parameters
#: when a load compares them with the ones that saved its position (Note [one position, one set of parameters])
_MODEL_OF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

#: the modules :func:`views` cut: parts of a load that are one list's positions, each optimizer's own
#: param groups (not a pipeline stage's, which a re-split may legitimately merge; Note [one position,
#: one set of parameters])
_VIEWS: "weakref.WeakSet" = weakref.WeakSet()


def is_list(optimizer) -> bool:
    return isinstance(optimizer, (list, tuple))


def is_view(module) -> bool:
    """Whether ``module`` is a position's view of a list of optimizers (:func:`views`)."""
    return module in _VIEWS


def classes(optimizers) -> list:
    return [_checks.optimizer_class(o).__name__ for o in optimizers]


def views(model: torch.nn.Module, optimizers, where: str) -> list:
    """One module per optimizer holding its parameters under their names in ``model``; raise
    TypeError/ValueError naming the problem before anything is written or changed."""
    optimizers = list(optimizers)
    if not optimizers or any(not hasattr(o, "param_groups") for o in optimizers):
        raise TypeError(f"fusedist.checkpoint.{where}: a list of optimizers must hold optimizers, got "
                        f"{[type(o).__name__ for o in optimizers]}")
    module = _names.unwrap(model)
    _refuse_state_beyond_tensors(module, where)
    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(_names.canonical_key(module, name))
    owner = {}
    for i, opt in enumerate(optimizers):
        for p in optimizer_params(opt):
            if p not in names:
                raise ValueError(f"fusedist.checkpoint.{where}: optimizer {i} ({type(opt).__name__}) steps a "
                                 f"parameter of shape {tuple(p.shape)} that is not in the model")
            if owner.setdefault(p, i) != i:
                raise ValueError(f"fusedist.checkpoint.{where}: parameter {names[p][0]!r} is in optimizers "
                                 f"{owner[p]} and {i}; the optimizers of one checkpoint must step disjoint "
                                 "parameters (each parameter's state belongs to one optimizer)")
    _check_whole_job(model, optimizers, where)
    for opt in optimizers:
        try:
            _MODEL_OF[opt] = weakref.ref(model)
        except TypeError:  # (an optimizer that takes no weak reference is not checked by name)
            pass
    shells = [torch.nn.Module() for _ in optimizers]
    _VIEWS.update(shells)
    for p, keys in names.items():
        for key in keys:
            _place(shells[owner.get(p, 0)], key, p, parameter=True)
    persistent = {_names.canonical_key(module, n) for n in module.state_dict(keep_vars=True)}
    for name, b in module.named_buffers(remove_duplicate=False):
        key = _names.canonical_key(module, name)
        if key in persistent:
            _place(shells[0], key, b, parameter=False)
    return shells


def check_load(manifest: Optional[dict], optimizers, directory: str) -> None:
    """Refuse a list of optimizers whose length or classes are not the saved list's."""
    if manifest is None:
        return  # torch's distributed checkpoint: optimizer state by name, checked per part
    saved = manifest.get(MANIFEST_KEY)
    here = classes(optimizers)
    if saved is None:
        raise CheckpointError(f"fusedist.checkpoint: {directory} was not saved with a list of optimizers; it cannot "
                              f"be loaded into the list {here}. Load it with the optimizer it was saved with")
    metas = {e.get("part"): e.get("optimizer") for e in manifest.get("pipeline", [])}
    differences = [] if len(saved) != len(here) else [
        (i, difference) for i, o in enumerate(optimizers) if metas.get(i) is not None
        for difference in [_position_problem(metas[i], o)] if difference is not None]
    if len(saved) != len(here) or differences:
        which = "".join(f"; optimizer {i}: {d}" for i, d in differences[:2])
        raise CheckpointError(f"fusedist.checkpoint: {directory} holds the state of {len(saved)} optimizers {saved}, "
                              f"not of {len(here)} {here}{which}. Pass the optimizers of the save, in its order (or "
                              "optimizer=None to load the model alone)")
    for i, o in enumerate(optimizers):
        if metas.get(i) is not None:
            _check_same_params(metas[i], i, o, directory)


def _check_same_params(meta: dict, position: int, optimizer, directory: str) -> None:
    """Note [one position, one set of parameters]
        Optimizer state belongs to a list of parameters: torch's ``Optimizer.load_state_dict``
        refuses groups of other sizes, and ``load`` promises an optimizer is loaded only into
        the very parameters that saved it, strict or not (``strict=False`` is about model keys).
        A position's view is cut from the model by the optimizer's parameters, so a load that is
        not strict took the state of the parameters both had and dropped the rest: an
        optimizer saved over two layers loaded over one without a word. So each position's
        parameters, by name, and its number of param groups must be the saved ones."""
    model = _MODEL_OF.get(optimizer)
    model = model() if model is not None else None
    saved_names = meta.get("param_names")
    if model is None or saved_names is None:
        return
    groups = [len(g["params"]) for g in optimizer.param_groups]
    here = param_names(model, optimizer_params(optimizer))
    wanted = set(here)
    saved = [n if n in wanted else _names.legacy_key(n) for n in saved_names]
    left, lacking = [n for n in saved if n not in wanted], [n for n in here if n not in set(saved)]
    saved_groups = meta.get("group_algorithms")
    if not left and not lacking and (saved_groups is None or len(saved_groups) == len(groups)):
        return
    what = type(optimizer).__name__
    detail = "".join(f"; {label} {names[:4]}{' ...' if len(names) > 4 else ''}" for label, names in (
        ("saved but not stepped here", left), ("stepped here but not saved", lacking)) if names)
    in_groups = f" in {len(saved_groups)} param group(s)" if saved_groups is not None else ""
    raise CheckpointError(f"fusedist.checkpoint: optimizer {position} ({what}) of {directory} was saved over "
                          f"{len(saved)} parameters{in_groups}; here it steps {len(here)} in {len(groups)} param "
                          f"group(s) of sizes {groups}{detail}. An optimizer's state loads only into the parameters "
                          "that saved it, as torch's Optimizer.load_state_dict requires: pass the optimizers over "
                          "the parameters of the save (or optimizer=None to load the model alone and start new ones)")


def _position_problem(meta: dict, optimizer) -> Optional[str]:
    """Why the state of one position cannot load into ``optimizer``, or None. A manifest written
    before the groups' weight decays were recorded (``group_weight_decay``) cannot tell Adam
    without weight decay, which loads into AdamW (Note [Adam without weight decay is AdamW without
    it] in ``_adam_family.py``), from Adam's L2 decay: where that alone decides, the part's load
    decides it from the saved param groups (``pipeline._prepare_optimizer``), before anything changes."""
    difference = _checks.algorithm_problem(meta, optimizer)
    if difference is None or meta.get("group_weight_decay") is not None:
        return difference
    return None if _checks.algorithm_problem(dict(meta, group_weight_decay=[0.0]), optimizer) is None else difference


def refuse_single(manifest: dict, optimizer, directory: str) -> None:
    """Refuse one optimizer for a checkpoint of several (its state would be merged across algorithms)."""
    if optimizer is not None and not is_list(optimizer) and manifest.get(MANIFEST_KEY) is not None:
        raise CheckpointError(f"fusedist.checkpoint: {directory} holds the state of a list of optimizers "
                              f"{manifest[MANIFEST_KEY]}: pass that list (or optimizer=None to load the model alone)")


def refuse_parts(model, pipeline: bool = False) -> None:
    """Outside pipeline mode, refuse a list of model parts (Note [pipelined checkpoints] in
    ``pipeline.py``); a list of optimizers is taken (Note [several optimizers over one model])."""
    if not pipeline and isinstance(model, (list, tuple)):
        raise TypeError("fusedist.checkpoint: a list of model parts is the parts of a pipeline stage's ranks: pass "
                        "pipeline=True (Note [pipelined checkpoints])")


def _place(shell: torch.nn.Module, key: str, tensor, parameter: bool) -> None:
    *path, leaf = key.split(".")
    for part in path:
        if part not in shell._modules:
            shell.add_module(part, torch.nn.Module())
        shell = shell._modules[part]
    if parameter:
        shell.register_parameter(leaf, tensor)
    else:
        shell.register_buffer(leaf, tensor)


def _refuse_state_beyond_tensors(module: torch.nn.Module, where: str) -> None:
    for name, sub in module.named_modules():
        extra = type(sub).get_extra_state is not torch.nn.Module.get_extra_state
        hooks = sub._state_dict_hooks or sub._state_dict_pre_hooks or sub._load_state_dict_pre_hooks
        if extra or hooks:
            raise TypeError(f"fusedist.checkpoint.{where}: module {name or '<root>'!r} ({type(sub).__name__}) adds "
                            "state beyond its parameters and buffers (get_extra_state or state-dict hooks), which a "
                            "checkpoint of several optimizers leaves out; pass one optimizer (param groups may "
                            "carry their own settings)")


def _check_whole_job(model, optimizers, where: str) -> None:
    from .api import _World

    if not (dist.is_available() and dist.is_initialized()):
        return
    sizes = {_World(o, model, None).size for o in optimizers}
    if sizes != {dist.get_world_size()}:
        raise ValueError(f"fusedist.checkpoint.{where}: a list of optimizers is saved by the whole job "
                         f"({dist.get_world_size()} ranks), but the model or its optimizers run over "
                         f"{sorted(sizes)} ranks; pass one optimizer per checkpoint call")


def save(directory: str, model, optimizers, scaler, extra, per_rank, process_group) -> None:
    """``save(directory, model, [opt, ...])``: the views as the parts of a pipelined checkpoint."""
    from . import api, pipeline

    if len(optimizers) == 1:  # a list of one optimizer is that optimizer, as a Checkpointer takes it
        return api.save(directory, model, optimizers[0], scaler, extra, per_rank=per_rank, process_group=process_group)
    _refuse_group(process_group, "save")
    parts = views(model, optimizers, "save")
    # Note [a save called on some ranks only] in _save_entry.py: the step check is the save's first collective
    with _save_entry.entered_by_every_rank("fusedist.checkpoint.save"):
        api._check_ranks_agree(model, None)  # a fusedist DDP model's step check (the views are bare modules)
    pipeline.save(directory, parts, list(optimizers), scaler, extra, per_rank=per_rank,
                  optimizer_list=classes(optimizers))


def load(directory: str, model, optimizers, scaler, trusted: bool, strict: bool, process_group):
    """``load(directory, model, [opt, ...])``: refused unless the checkpoint is of such a list
    (or torch's distributed checkpoint), then loaded part by part."""
    from . import api

    if len(optimizers) == 1:
        return api.load(directory, model, optimizers[0], scaler, trusted=trusted, strict=strict,
                        process_group=process_group)
    _refuse_group(process_group, "load")
    parts = views(model, optimizers, "load")
    try:
        manifest = _files.read_manifest(directory)
    except Exception:  # noqa: BLE001 - no manifest: torch's checkpoint, or the load below says why
        manifest = None
    check_load(manifest, optimizers, directory)
    result = api.load(directory, parts, list(optimizers), scaler, trusted=trusted, strict=strict, pipeline=True)
    return result if strict else in_torch_order(result, model)


def in_torch_order(result, model: torch.nn.Module):
    """A load's result by parts (the optimizers' views) with its keys in the order torch's
    ``load_state_dict(strict=False)`` of the whole ``model`` lists them: the missing ones in its
    state dict's order, the unexpected ones as Note [the order of unexpected keys] in
    ``_names.py`` says (they came part by part, in the checkpoint's order)."""
    from ._load import LoadResult

    model = _names.unwrap(model)
    order = {k: i for i, k in enumerate(_names.canonical_state(model, model.state_dict()))}
    missing = sorted(result.missing_keys, key=lambda k: order.get(k, len(order)))
    return LoadResult(missing, _names.unexpected_order(model, result.unexpected_keys), result.extra)


def _refuse_group(process_group, where: str) -> None:
    if process_group is not None:
        raise ValueError(f"fusedist.checkpoint.{where}: a list of optimizers is saved and loaded by the whole job, "
                         "without process_group: a group of ranks of their own saves one optimizer per call")
