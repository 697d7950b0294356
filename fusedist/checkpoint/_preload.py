"""What a Checkpointer's restore reads of a checkpoint before its load: files memory-mapped,
unverified (the load verifies them), for the checks that refuse a restore before anything is
loaded (Note [a refused restore changes nothing] in ``_restore.py``) -- the LR scheduler state
each pipeline part takes and whether its param groups fit it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import _files, _load_plan, _names, api
from . import pipeline as pipelined
from ._files import CheckpointError
from ._params import optimizer_params, param_names


# Note [LR scheduler states before the load]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A Checkpointer's restore matches the registered LR schedulers to the saved states before
# anything is loaded (Note [a refused restore changes nothing] in _restore.py). A pipelined
# checkpoint's states are per stage, and they were known only from the load's plan: a part
# whose stages were saved without one was refused after the model and optimizer were loaded.
# These read what the match needs from the small files alone (the stages' common files, their
# tensors memory-mapped, not read; unverified: the load verifies them), choosing the stages as
# the load does (pipeline._chosen, pipeline._part_lr_scheduler).
#
# A scheduler's state holds values per param group of the optimizer that saved it (base and
# last learning rates): an ordinary checkpoint's one schedule of the whole model, a pipelined
# one's of each stage. It was loaded into each part's scheduler as it was, so a part whose
# groups are not the saved ones in their order (other groups, fewer, another order) took
# another group's rates (LambdaLR set a weight group's rate from the bias group's base), where
# the optimizer's groups took their own (by parameter name). It is loaded only into a part
# whose param groups are the saved ones in their order (lr_scheduler_group_mismatch).
class UnreadableFile(CheckpointError):
    """A file :func:`peek` could not read before the load: the load's to report (it verifies
    the file), and a restore then tries an older checkpoint."""


def peek(directory: str, files: dict, name: str, trusted: bool, *path):
    """File ``name`` of the checkpoint (its entry ``path``), its tensors memory-mapped (Note [LR
    scheduler states before the load])."""
    try:
        value = torch.load(os.path.join(directory, files[name].get("file", name)), map_location="cpu",
                           weights_only=not trusted, mmap=True)
        for key in path:
            value = value[key]
        return value
    except Exception as exc:  # noqa: BLE001 - unpickling fails in many ways
        raise UnreadableFile(f"fusedist.checkpoint: {name} of {directory}: {type(exc).__name__}: {exc}") from exc


def part_lr_scheduler_states(directory: str, model, optimizer, trusted: bool) -> Optional[list]:
    """The LR scheduler state the load gives each part of ``model`` (``PART_LR_SCHEDULERS`` of
    its ``extra``), None where a pipelined checkpoint holds none for a part; None for a
    checkpoint without per-stage states (an ordinary one, or one saved before them)."""
    manifest = _files.read_manifest(directory)
    if "pipeline" not in manifest:
        return None
    stages, commons = manifest["pipeline"], {}

    def common(stage: dict) -> dict:
        if stage["common"] not in commons:
            commons[stage["common"]] = peek(directory, manifest["files"], stage["common"], trusted)
        return commons[stage["common"]]

    found = []
    for module, _ in pipelined.parts(model, optimizer):
        chosen = pipelined._chosen(stages, _load_plan._expected_model(_names.unwrap(module))[0])
        found.append(pipelined._part_lr_scheduler([common(s) for _, s in chosen]))
    return [f.get("lr_scheduler") for f in found] if any(found) else None


def _saved_groups(directory: str, files: dict, stage: dict, trusted: bool) -> list:
    """The stage's optimizer param groups as saved (their parameters by index into its
    ``param_names``): in its common file, or in its first rank's ZeRO shard."""
    if stage["optimizer"]["kind"] == "full":
        return peek(directory, files, stage["common"], trusted, "optimizer", "param_groups")
    return peek(directory, files, api.rank_file(stage["ranks"][0]), trusted,
                 pipelined._section("optimizer_shard", stage["part"]), "param_groups")


def _stage_name(stage: dict) -> str:
    return "the whole model's optimizer" if stage["keys"] is None else f"part {stage['part']} of ranks {stage['ranks']}"


def lr_scheduler_group_mismatch(directory: str, model, optimizer, trusted: bool) -> Optional[str]:
    """Why the LR scheduler state the load gives the part ``model`` does not fit its optimizer
    (its param groups are not those of the optimizer that saved the state, in their order: Note
    [LR scheduler states before the load]), or None when it fits or nothing tells."""
    manifest = _files.read_manifest(directory)
    files, stages = manifest["files"], pipelined._stages(manifest)
    chosen = [s for _, s in pipelined._chosen(stages, _load_plan._expected_model(_names.unwrap(model))[0])
              if s.get("optimizer") is not None]
    if optimizer is None or not chosen:
        return None
    # the stage the state is from: the first of them saved with one (an ordinary checkpoint's one)
    source = next((s for s in chosen if s["keys"] is None or peek(directory, files, s["common"], trusted).get(
        "lr_scheduler") is not None), chosen[0])
    names = param_names(model, optimizer_params(optimizer))
    wanted, group_of, label_of, count = set(names), {}, {}, 0
    for stage in chosen:
        saved = _saved_groups(directory, files, stage, trusted)
        count = len(saved) if stage is source else count
        for g, group in enumerate(saved):
            for i in group["params"]:
                name = stage["optimizer"]["param_names"][int(i)]
                name = name if name in wanted else _names.legacy_key(name)
                group_of[name], label_of[name] = g, f"{g} of {_stage_name(stage)}"
    taken, labels, start = [], [], 0
    for group in optimizer.param_groups:
        members = names[start:start + len(group["params"])]
        start += len(members)
        taken.append(sorted({group_of.get(n) for n in members}, key=str))
        labels.append(sorted({label_of[n] for n in members if n in label_of}))
    if len(taken) == count and all(sources in ([], [g]) for g, sources in enumerate(taken)):
        return None
    saver = "the whole model's optimizer" if source["keys"] is None else \
        f"the optimizer of the stage of ranks {source['ranks']} (its part {source['part']})"
    shown = "; ".join(f"its group {i} from saved group{'s' if len(from_groups) > 1 else ''} "
                      f"{' and '.join(from_groups) or '(none)'}" for i, from_groups in enumerate(labels))
    return (f"the LR scheduler state {directory} holds for it was saved over {saver}, with {count} param group(s); "
            f"this part's optimizer has {len(taken)} ({shown}): the schedule's values per group (base and last "
            "learning rates) would go to other groups. Give the part's optimizer the saved param groups in their "
            "order (its group i from the saved group i), or restore without its LR scheduler and set its state "
            "yourself")
