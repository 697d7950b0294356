"""A Checkpointer's checks of the registered optimizer against a checkpoint, before the load.

The load checks all of this again (the last word on the files it then verifies); here the
refusals that belong to the objects, not to one checkpoint's files, come first, so that a
restore does not try every older checkpoint for a mismatch they all share.
"""

from __future__ import annotations

from ..zero import state as zstate
from . import _checks, _files, _load_plan, _names, _preload, stage3
from ._files import CheckpointError
from ._params import optimizer_params, param_names


def check_optimizer(path: str, manifest: dict, common: dict, model, optimizer, trusted: bool) -> None:
    """Raise as the load would when ``optimizer`` cannot take the checkpoint's optimizer state:
    none saved, other parameters, another algorithm, other param groups."""
    if manifest.get("optimizer") is None:
        raise CheckpointError(f"fusedist.checkpoint: {path} holds no optimizer state")
    if _other_parameters(model, optimizer, manifest["optimizer"]):
        _refuse_other_parameters(path, model, optimizer, manifest["optimizer"])
        _load_plan._prepare_optimizer(path, manifest, common, model, optimizer, _not_read)  # (raises)
    # (a full optimizer's saved groups tell their weight decays where the manifest does not)
    _checks.check_algorithm(manifest["optimizer"], optimizer, path,
                            (common.get("optimizer") or {}).get("param_groups"))
    _check_param_groups(path, manifest, common, optimizer, trusted)


def _not_read(name: str):
    """The rank files are not read before the load (its own check of the parameters comes first)."""
    raise _preload.UnreadableFile(f"the {name} sections are the load's to read")


def _other_parameters(model, optimizer, meta: dict) -> bool:
    """Whether the optimizer's parameters, by name and whole shape, are not the saved ones in any
    order: the load refuses them whatever the checkpoint's files hold (its own check, which
    also takes a reordering, then says which)."""
    here, saved = _here_and_saved(model, optimizer, meta)
    return sorted(here) != sorted(saved)


def _here_and_saved(model, optimizer, meta: dict) -> tuple:
    """``(name, whole shape)`` of the optimizer's parameters here, and of the saved ones."""
    params = optimizer_params(optimizer)
    names = param_names(model, params)
    _, where = _load_plan._sharding(_names.unwrap(model))
    here = [(n, tuple(stage3.full_shape(p, where))) for n, p in zip(names, params)]
    saved_names = [n if n in names else _names.legacy_key(n) for n in meta["param_names"]]
    by_name = dict(zip(names, params))
    # (a quantized weight saved in its other form counts as its form here: the load takes it)
    shapes = [stage3.full_shape(by_name[n], where) if n in by_name and _load_plan._packed_positions(
        [shape], [by_name[n]], where) else shape for n, shape in zip(saved_names, meta["param_shapes"])]
    return here, [(n, tuple(shape)) for n, shape in zip(saved_names, shapes)]


def _refuse_other_parameters(path: str, model, optimizer, meta: dict) -> None:
    """Raise naming the parameters and shapes in which the optimizer's differ from the saved
    ones (the load's own message names only the first name out of place, or the counts)."""
    here, saved = map(dict, _here_and_saved(model, optimizer, meta))
    found = [f"'{n}' is {saved[n]} in the checkpoint, {here[n]} here" for n in here
             if n in saved and saved[n] != here[n]]
    lacking = [n for n in here if n not in saved]
    extra = [n for n in saved if n not in here]
    if lacking:
        found.append(f"the checkpoint's optimizer lacks {lacking[:4]}{' ...' if len(lacking) > 4 else ''}" + (
            "" if extra else f": {_names.ADDED_AFTER_LOAD}"))
    if extra:
        found.append(f"the checkpoint's optimizer also holds {extra[:4]}{' ...' if len(extra) > 4 else ''}" + (
            "" if lacking else ": param groups it gained during training (add_param_group) must be added again "
            "before loading"))
    if found:
        raise CheckpointError(f"fusedist.checkpoint: the optimizer's parameters do not match {path}: {len(saved)} "
                              f"parameters saved, {len(here)} here: {'; '.join(found[:4])}"
                              f"{'; ...' if len(found) > 4 else ''}")


# Note [param groups that do not match]
#     An optimizer whose parameters are the saved ones but grouped otherwise (the weight-decay
#     split added or dropped since) is refused by the load: its state's group sizes are not the
#     optimizer's. That refusal came from the load, as a corrupt file's does: the restore warned
#     that the newest checkpoint "could not be loaded" and tried every older one, each failing
#     alike, and ended on the whole list. The grouping is the user's, the same for every
#     checkpoint of the job, so it is compared before the load (the saved groups: in the common
#     file, or in the first ZeRO shard's rank file, mapped) and refused at once -- unless the
#     file it was read from fails its checksum, which makes it the file's fault.
def _check_param_groups(path: str, manifest: dict, common: dict, optimizer, trusted: bool) -> None:
    """Raise as the load would when the optimizer's param group sizes are not the saved ones
    (Note [param groups that do not match])."""
    files, name = manifest["files"], _files.COMMON
    if manifest["optimizer"]["kind"] == "full":
        saved = (common.get("optimizer") or {}).get("param_groups")
    else:
        name = next((n for n in sorted(files) if "optimizer_shard" in files[n].get("sections", [])), None)
        saved = None if name is None else _preload.peek(path, files, name, trusted, "optimizer_shard",
                                                        "param_groups")
    if saved is None:  # (nothing to compare: the load says what is missing)
        return
    try:
        zstate.check_groups(saved, optimizer.param_groups, f"optimizer state in {path}")
    except zstate.StateDictError:
        try:
            _files.verify_file(path, name, files[name])
        except Exception as exc:  # noqa: BLE001 - a damaged file: the load's to report
            raise _preload.UnreadableFile(str(exc)) from exc
        raise
