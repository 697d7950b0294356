"""What ``save`` and ``load`` verify before anything is written or changed: that the ranks
agree (the same directory, the same kinds of objects, rank files rank 0 can see, one
checkpoint read by all), and that a checkpoint fits the objects it is loaded into (the
optimizer's algorithm, a scaler's state, what a fused optimizer would refuse; a
ZeroRedundancyOptimizer checks what it would refuse in its own ``prepare_load``).
Each check raises on every rank alike, or returns the text rank 0 exchanges, so that no
rank is left waiting in a collective while another raises alone."""

from __future__ import annotations

import hashlib
import os
from typing import Optional

from ..zero import ZeroRedundancyOptimizer
from ..zero.sharded_state import algorithm_difference, class_algorithm, group_algorithms, inner_class
from . import _adam_family, _files, _visibility
from ._files import CheckpointError


def objects_passed(directory, optimizer, scaler) -> dict:
    """What this rank passed to a save or load that the other ranks' calls must match: the
    directory, the optimizer's algorithm, whether there is a scaler."""
    return {
        "directory": os.path.abspath(directory),
        "optimizer": optimizer_passed(optimizer),
        "scaler": "a GradScaler" if scaler is not None else "None",
    }


def save_call(directory, optimizer, scaler, extra, per_rank) -> dict:
    """What this rank passed to ``save``, for the other ranks to compare with theirs (a
    save is one checkpoint: a scaler or per-rank state given on some ranks only would be
    written or lost silently depending on which rank writes what)."""
    return {
        **objects_passed(directory, optimizer, scaler),
        "per_rank": "given" if per_rank is not None else "None",
        "extra": None if extra is None or isinstance(extra, dict) else type(extra).__name__,
    }


def check_same_save(calls: list) -> None:
    """Raise on every rank, before anything is written, when a rank's arguments are wrong or
    differ from the others' (naming the ranks and what each passed)."""
    bad = [(r, c["extra"]) for r, c in enumerate(calls) if c["extra"] is not None]
    if bad:
        raise TypeError("fusedist.checkpoint.save: extra must be a dict, got "
                        + ", ".join(f"{kind} on rank {r}" for r, kind in bad) + " (nothing was written)")
    for field in ("optimizer", "scaler", "per_rank"):  # (a pipelined save compares its optimizers per stage)
        detail = _differs(calls, field)
        if detail:
            raise CheckpointError(
                f"fusedist.checkpoint.save: the ranks passed different arguments: {field} is {detail}. A save "
                "writes one checkpoint: every rank passes the same model, optimizer, scaler and per_rank (or "
                "none); nothing was written")


def _differs(calls: list, field: str) -> Optional[str]:
    """'X on ranks [..]; Y on ranks [..]' when the ranks' ``field`` differ, else None (also when
    no rank's call has the field: a pipelined save or load compares its optimizers per stage)."""
    if not any(field in c for c in calls):
        return None
    ranks: dict = {}
    for r, c in enumerate(calls):
        ranks.setdefault(c.get(field), []).append(r)
    if len(ranks) < 2:
        return None
    return "; ".join(f"{value} on ranks {rs}" for value, rs in ranks.items())


# Note [an optimizer per pipeline stage]: the ranks of a pipeline-parallel job hold other parts,
# and a stage may have no parameters at all (a last stage holding only the loss), for which torch
# refuses to build an optimizer: that stage passes None where the others pass theirs. The ranks
# of one stage (replicas of one part) must still pass the same optimizer -- one rank's None
# would save or load no optimizer state for that part while the others do -- so a pipelined
# save or load compares the optimizers within each stage rather than across the job.
def check_stage_optimizers(held: list, what: str, undone: str, objects: str = "optimizer") -> None:
    """Raise on every rank (Note [an optimizer per pipeline stage]) when the ranks holding one
    part pass different optimizers. ``held``: every rank's ``[(stage, label, optimizer)]`` for
    its parts, where ``stage`` identifies the part's stage alike on every rank holding it,
    ``label`` names it in the message and ``optimizer`` is :func:`objects_passed`'s; ``undone``:
    what was not done ("written", "loaded"). ``objects``: what is compared (a Checkpointer's
    LR schedulers are, as their optimizers)."""
    stages: dict = {}
    for r, parts in enumerate(held):
        for stage, label, optimizer in parts:
            stages.setdefault((stage, label), {}).setdefault(optimizer, []).append(r)
    for (_, label), ranks in stages.items():
        if len(ranks) > 1:
            detail = "; ".join(f"{value} on ranks {rs}" for value, rs in ranks.items())
            raise CheckpointError(
                f"{what}: the ranks of one pipeline stage ({label}) passed different {objects}s: {detail}. Every "
                f"rank of a stage passes the stage's {objects} (or None on each of them: stages may differ); "
                f"nothing was {undone}")


# Note [one model per save]: a checkpoint holds one model, whose unsharded entries rank 0
# writes. Ranks whose state-dict keys or shapes differ (a buffer registered on one rank
# only, a layer built on some ranks) saved rank 0's entries silently and lost the others'.
# Each rank sends a digest of its keys and whole shapes in an exchange the save makes
# anyway; only when the digests differ do the ranks exchange the keys, to name them.
def keys_digest(shapes: dict) -> str:
    """A short digest of a model's canonical state-dict keys and whole shapes (tuples, or None
    for a value that is not a tensor: :func:`_sections.model_shapes`)."""
    return hashlib.sha256(repr(sorted(shapes.items())).encode()).hexdigest()[:16]


def check_same_keys(digests: list, gather_shapes, what: str) -> None:
    """Raise on every rank (Note [one model per save]) when ranks saving one model part hold
    different keys or shapes. ``digests``: each rank's ``{part: digest}`` (an empty dict for a
    rank that failed before it had one); ``gather_shapes()``: every rank's ``{part: {key:
    shape}}``, a second exchange that every rank makes only when the digests differ."""
    parts: dict = {}
    for r, mine in enumerate(digests):
        for part, digest in mine.items():
            parts.setdefault(part, {}).setdefault(digest, []).append(r)
    differing = {part: by for part, by in parts.items() if len(by) > 1}
    if not differing:
        return
    shapes = gather_shapes()
    found = []
    for part, by in differing.items():
        ranks = sorted(r for rs in by.values() for r in rs)
        first = shapes[ranks[0]][part]
        where = "" if part == "model" else f"{part}: "
        for r in ranks[1:]:
            found += [where + d for d in _key_differences(first, ranks[0], shapes[r][part], r)]
    raise CheckpointError(
        f"{what}: the ranks' models have different state-dict keys: {'; '.join(found[:8])}"
        f"{'; ...' if len(found) > 8 else ''}. A checkpoint holds one model, whose unsharded entries rank 0 writes, "
        "so the other ranks' would be lost: every rank must hold the same parameters and buffers (register "
        "them on every rank). Nothing was written")


def _key_differences(first: dict, r0: int, other: dict, r: int) -> list:
    def shown(keys):
        return f"{keys[:6]}{' ...' if len(keys) > 6 else ''}"

    extra = sorted(k for k in other if k not in first)
    lacking = sorted(k for k in first if k not in other)
    shapes = sorted(k for k in first if k in other and first[k] != other[k])
    return ([f"rank {r} has {shown(extra)}, which rank {r0} has not"] if extra else []) + \
        ([f"rank {r} lacks {shown(lacking)}, which rank {r0} has"] if lacking else []) + \
        [f"'{k}' is {first[k]} on rank {r0}, {other[k]} on rank {r}" for k in shapes[:3]]


def unseen_rank_files(directory: str, files: dict, directories: list) -> Optional[str]:
    """Rank 0's check before it lists the rank files in a manifest: every one must be in its
    ``directory`` with the size its rank reported, else a manifest would describe a checkpoint
    that cannot be loaded (ranks given different directories, e.g. with a timestamp in the
    name, or a directory not on a filesystem every rank shares)."""
    missing = _files.not_seen(directory, files)
    if missing and len(set(directories)) == 1:  # (one directory: this host's view may lag the writers')
        missing = _visibility.wait_seen(directory, files)
    if not missing:
        return None
    shown = "; ".join(f"rank {files[n]['rank']} wrote {files[n].get('file', n)} into {directories[files[n]['rank']]}"
                      for n in missing[:4])
    more = "; ..." if len(missing) > 4 else ""
    waited = "" if len(set(directories)) > 1 else \
        f" after waiting {_visibility.wait_limit():g} s ({_visibility.WAIT_ENV})"
    return (f"rank 0 does not find in {directories[0]} what other ranks wrote ({shown}{more}){waited}: "
            "every rank must pass the same directory, on a filesystem every rank sees")


def check_same_load(reads: list) -> None:
    """Every rank must have read the same checkpoint (a manifest with the same bytes) for the
    same kinds of objects: ranks given different directories (a rank-dependent path) or a
    directory not shared by every rank would otherwise each load their own state, and the
    ranks go on from different models without any error. Nothing is loaded on any rank."""
    digests: dict = {}
    for r, read in enumerate(reads):
        digests.setdefault(read["manifest"], []).append(r)
    if len(digests) > 1:
        shown = "; ".join(f"ranks {rs} read {reads[rs[0]]['directory']} (manifest SHA-256 {d[:12]}...)"
                          for d, rs in digests.items())
        raise CheckpointError(
            f"fusedist.checkpoint: the ranks read different checkpoints: {shown}. A load is a collective of one "
            "checkpoint: every rank passes the same directory, on a filesystem every rank sees; nothing was loaded")
    if any("optimizers" in r for r in reads):  # a pipelined load: Note [an optimizer per pipeline stage]
        check_stage_optimizers([r.get("optimizers", []) for r in reads], "fusedist.checkpoint.load", "loaded")
    for field in ("optimizer", "scaler", "strict"):
        detail = _differs(reads, field)
        if detail:
            raise CheckpointError(
                f"fusedist.checkpoint: the ranks passed different arguments to load: {field} is {detail}; nothing "
                "was loaded")


_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def check_scaler(state: dict, scaler, directory: str) -> None:
    """What an enabled GradScaler's ``load_state_dict`` would raise on, raised before anything
    is loaded: a disabled scaler's (empty) state made it fail after the model and optimizer
    had been loaded. A disabled scaler ignores what it is given, as torch's does."""
    if not scaler.is_enabled():
        return
    if not state:
        raise CheckpointError(
            f"fusedist.checkpoint: {directory} holds the state of a disabled GradScaler (enabled=False when "
            "saved), this one is enabled: pass scaler=None and let it start from its own settings")
    missing = [k for k in _SCALER_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"fusedist.checkpoint: the GradScaler state in {directory} lacks {missing}")


def check_loadable(optimizer, full: dict, directory: str) -> None:
    """A fused optimizer's own checks of a state dict (hyperparameters it cannot step, such as
    torch's tensor learning rates; state shapes), run before anything is loaded: inside its
    ``load_state_dict`` they ran after the model had been."""
    check = getattr(optimizer, "_check_loadable", None)
    if check is None:
        return
    try:
        check(full["param_groups"], full["state"])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"fusedist.checkpoint: the optimizer state in {directory} cannot be loaded into "
                              f"{type(optimizer).__name__}: {exc}") from exc


def optimizer_passed(optimizer) -> Optional[str]:
    """The optimizer as the ranks compare it: its algorithm, or None."""
    return None if optimizer is None else optimizer_algorithm(optimizer)


def optimizer_algorithm(optimizer) -> str:
    """The algorithm an optimizer runs, whichever implementation runs it (``class_algorithm``
    in ``zero/sharded_state.py``); a ZeroRedundancyOptimizer has its inner optimizer's."""
    return class_algorithm(optimizer_class(optimizer))


def optimizer_group_algorithms(optimizer) -> list:
    """Per param group, the algorithm it runs (``group_algorithms``: Adam's groups run Adam or
    AdamW by their ``decoupled_weight_decay``), which a save records so that a load can tell
    ``Adam(decoupled_weight_decay=True)``'s state for AdamW's (Note [Adam and AdamW are one class
    in torch] in ``zero/sharded_state.py``)."""
    return list(group_algorithms(optimizer_algorithm(optimizer), optimizer.param_groups))


def optimizer_class(optimizer) -> type:
    """The class that runs the algorithm: a ZeroRedundancyOptimizer's inner one (``inner_class``:
    also where its ``optimizer_class`` is a factory such as a lambda)."""
    return inner_class(optimizer) if isinstance(optimizer, ZeroRedundancyOptimizer) else type(optimizer)


def _class_name(optimizer) -> str:
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return f"ZeroRedundancyOptimizer({inner_class(optimizer).__name__})"
    return type(optimizer).__name__


def check_algorithm(meta: dict, optimizer, directory: str, saved_param_groups: Optional[list] = None) -> None:
    """Refuse the state of another algorithm (SGD's momentum into AdamW, Adam's into AdamW):
    torch's loaders take it, hyperparameters included, and the optimizer then steps with the
    saved algorithm's settings (AdamW turned into Adam by the saved group's
    ``decoupled_weight_decay``) or fails at its next step. Adam and AdamW are compared per param
    group (Note [Adam and AdamW are one class in torch]): torch's AdamW state loads into
    ``Adam(decoupled_weight_decay=True)`` and back, Adam's L2 decay into AdamW stays refused.
    Checkpoints written before the algorithm was recorded are checked only when their class is
    one of torch's or fusedist's; before the per-group algorithms were, a class of the optimizer's
    own algorithm loads as it did. A group saved without weight decay runs either (Note [Adam
    without weight decay is AdamW without it] in ``_adam_family.py``): its weight decay is the
    manifest's record, else that of ``saved_param_groups`` (the saved groups, where read)."""
    difference = algorithm_problem(meta, optimizer, saved_param_groups)
    if difference is None:
        return
    raise CheckpointError(
        f"fusedist.checkpoint: {directory} cannot be loaded into {_class_name(optimizer)}: {difference}. "
        "Load the model alone (optimizer=None) to start a new optimizer from it"
    )


def algorithm_problem(meta: dict, optimizer, saved_param_groups: Optional[list] = None) -> Optional[str]:
    """Why the optimizer state ``meta`` describes cannot load into ``optimizer``
    (:func:`check_algorithm`), or None."""
    cls, groups = optimizer_class(optimizer), optimizer.param_groups
    decays = meta.get("group_weight_decay")
    if decays is None and saved_param_groups is not None:
        decays = _adam_family.recorded(saved_param_groups)
    saved_groups = _adam_family.read_as_loading(_saved_groups(meta, len(groups)), decays,
                                                list(group_algorithms(class_algorithm(cls), groups)))
    if saved_groups is None and algorithm_difference(meta["class"], meta.get("algorithm"), cls) is None:
        return None  # (an older manifest: which groups decayed how was not recorded)
    return algorithm_difference(meta["class"], meta.get("algorithm"), cls, saved_groups=saved_groups, groups=groups)


def _saved_groups(meta: dict, count: int) -> Optional[list]:
    """The saved param groups' settings that tell their algorithms (``group_algorithms`` reads
    them back), from the per-group algorithms the manifest records; None where it records none.
    One algorithm in every saved group stands for any number of groups (a pipelined load may
    take a part's groups from stages that grouped them otherwise)."""
    recorded = meta.get("group_algorithms")
    if not recorded:
        return None
    if len(set(recorded)) == 1 and len(recorded) != count:
        recorded = [recorded[0]] * count
    return [{"decoupled_weight_decay": algorithm == "AdamW"} for algorithm in recorded]
