"""Pipeline parts loading torch's distributed checkpoint of a pipeline-parallel job
(torchtitan's: every stage's state by name in one checkpoint, the optimizer's flattened by
name): Note [pipelined checkpoints] in ``pipeline.py``."""

from __future__ import annotations

import torch

from . import _dcp_algorithm, _from_dcp, _load_plan, _names, _optimizer_list
from ._files import CheckpointError
from ._params import optimizer_params, param_names


def prepare(directory: str, held: list, scaler, strict: bool, trusted: bool) -> dict:
    """``pipeline.prepare`` for a checkpoint of torch's distributed checkpoint holding the whole
    model (Note [torch's distributed checkpoints in load] in ``_from_dcp.py``): torchtitan's
    save of a pipeline-parallel job, every part's state by its names, the optimizer's
    flattened by name (``flatten_optimizer_state_dict=True``). Each part takes its entries."""
    if scaler is not None:
        raise CheckpointError(f"fusedist.checkpoint: {directory} is a checkpoint of torch's distributed checkpoint, "
                              "which holds no GradScaler state fusedist reads; pass scaler=None")
    from . import pipeline

    digest, tree = _from_dcp.read(directory, trusted)
    read = pipeline.loaded_objects(directory, digest, strict, held, scaler)
    plans, every_key, every_param = [], {}, {}
    for position, (module, optimizer) in enumerate(held):
        target = _names.unwrap(module)
        expected, sharded_target = _load_plan._expected_model(target)
        why = None
        if expected or strict:
            names = expected or _dcp_model_keys(tree, directory)
            saved, optim, saved_key = _dcp_split(tree, names, expected, directory)
        else:  # a part without state takes nothing, and a load that is not strict checks nothing more
            keys, optim, why = _stateless_view(tree, directory)
            saved, saved_key = {}, {}
            every_key.update((key, 0) for key in keys)
        every_key.update((saved_key[k], 0) for k in saved)
        mine = type(saved)((k, v) for k, v in saved.items() if k in expected)
        mine = _load_plan._cross_packed(mine, target, sharded_target, directory)  # (an NF4 weight's other form)
        plan = {"model": _load_plan._check_model(mine, expected, directory, strict), "model_sharded": sharded_target,
                "strict": strict, "extra": None, "params": []}
        plan["keys"], plan["missing"] = [saved_key[k] for k in plan["model"]], [k for k in expected if k not in mine]
        if optimizer is not None:
            params = optimizer_params(optimizer)
            if optim is None and params:  # (one over no parameters takes nothing: as from fusedist's own)
                raise CheckpointError(why or f"fusedist.checkpoint: {directory} holds no optimizer state")
            listed = _optimizer_list.is_view(module)  # (its groups: one optimizer's own, as many as saved)
            source = (f"the state of optimizer {position} ({type(optimizer).__name__}) of the list in {directory}"
                      if listed else f"optimizer state in {directory}")
            plan["params"] = param_names(module, params)
            part = f"optimizer {position} of the list" if listed else f"part {position} of rank {_job_rank()}"
            full = _from_dcp.to_torch_format(optim or {}, plan["params"], optimizer.param_groups, source, others=True,
                                             own_groups=listed, part=part)
            if params and _from_dcp.by_index(optim):  # (what check_taken compares: the saved indices)
                plan["params"] = [str(i) for i in range(len(params))]
            _dcp_algorithm.check(full["param_groups"], optimizer, directory)
            plan["optimizer"] = _load_plan._prepare_full(full, directory, target, _load_plan._sharding(target),
                                                         optimizer, params, source)
        if optim is not None:  # (what a strict load takes when a rank passes an optimizer: check_taken)
            every_param.update((n, 0) for n in _from_dcp.state_names(optim))
        plans.append(plan)
    read["keys"] = sorted({k for p in plans for k in p.pop("keys")})
    read["params"] = sorted({n for p in plans for n in p.pop("params")})
    if not strict:
        read["tree"] = pipeline.part_trees(held, every_key, read["keys"])
        read.update(pipeline.missing_of(held, plans))
    return {"parts": plans, "extra": None, "read": read, "strict": strict, "stages": [{"ranks": None}],
            "all_keys": every_key, "all_params": every_param}


def _job_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _dcp_split(tree: dict, names, expected: dict, directory: str) -> tuple:
    """``_from_dcp.split`` of ``tree`` for a part expecting ``expected``, and the saved key of
    each model entry by its name here. The names are normalized against the part, so they
    differ by part (a part of a model whose only child is ``module`` keeps that segment, a part
    without state strips it); the saved keys are what ``pipeline.check_taken`` compares, alike on
    every rank (as ``pipeline._Reader.model``'s)."""
    # (each value carries its saved key through the renaming)
    pairs, optim = _from_dcp.split(tree, names, lambda d: _names.strip_prefix(
        type(d)((key, (key, value)) for key, value in d.items()), expected), directory)
    saved = type(pairs)((name, value) for name, (_, value) in pairs.items())
    return saved, optim, {name: key for name, (key, _) in pairs.items()}


def _stateless_view(tree: dict, directory: str) -> tuple:
    """The saved keys of the model's state in torch's distributed checkpoint ``tree``, its
    optimizer state (None if it holds none) and why there is none, for a load that is not
    strict of a part without state. The keys are what the part does not load, listed by the
    load's ``unexpected_keys`` unless another part takes it (Note [a load that is not strict] in
    ``_load.py``; a rank holding only such parts listed none, where the whole model's
    ``load_state_dict`` lists them). None are listed where the checkpoint holds several entries
    that could be the model's: only a part with state tells them apart. The optimizer state is
    what the part's optimizer (one over no parameters of the part) takes nothing from, though
    the checkpoint holds the other parts'; where several could be it, the reason names them (it
    said the checkpoint held none)."""
    try:
        names, model = _dcp_model_keys(tree, directory), None
    except CheckpointError as exc:
        names, model = None, str(exc).split(": ", 1)[1]
    optims = [(key, d) for key, d in _from_dcp._dicts(tree) if _from_dcp._is_optimizer(d)]
    if names is not None and len(optims) <= 1:
        _, optim, saved_key = _dcp_split(tree, names, {}, directory)
        return list(saved_key.values()), optim, None
    if len(optims) == 1:
        return [], optims[0][1], None
    return [], None, None if not optims else (
        f"fusedist.checkpoint: torch's distributed checkpoint {directory} holds {len(optims)} optimizer states "
        f"({_shown(optims)}); fusedist.checkpoint.load reads one, and a model part without state cannot tell "
        f"which is its job's{'' if model is None else ' (nor which is the model: ' + model + ')'}")


def _shown(entries: list) -> str:
    return ", ".join(repr(key) if key else "its top level" for key, _ in entries)


def _dcp_model_keys(tree: dict, directory: str) -> dict:
    """The model keys of torch's distributed checkpoint ``tree``, for a part without state (a
    pipeline stage without parameters, Note [an optimizer per pipeline stage] in ``_checks.py``),
    which has no names to find the model's state by: it takes nothing, but must know every key
    and parameter the checkpoint holds, as the other ranks do, for a strict load's check that
    the parts took all of it (``pipeline.check_taken``, alike on every rank). The model's state is
    then the one entry holding tensors that is not an optimizer's, or of several the one called
    ``model``, as a part with state tells them apart (``_from_dcp._model_dict``)."""
    found = [(key, d) for key, d in _from_dcp._dicts(tree) if not _from_dcp._is_optimizer(d)
             and any(isinstance(v, torch.Tensor) for v in d.values())]
    named = [(key, d) for key, d in found if key == "model"]
    if len(found) != 1 and not named:
        raise CheckpointError(f"fusedist.checkpoint: torch's distributed checkpoint {directory} holds {len(found)} "
                              f"entries of tensors besides an optimizer's ({_shown(found) or 'none'}) and none is "
                              "called 'model': a model part without state cannot tell which is the model's state "
                              "(save it as 'model', as torch's recipes and torchtitan do, or load with strict=False)")
    model = (named or found)[0][1]
    return _names.strip_prefix({k: v for k, v in model.items() if isinstance(v, torch.Tensor)}, {})
