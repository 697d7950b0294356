"""``fusedist.checkpoint.load``: read and check everything on every rank, then apply.

The plan is made by ``_load_plan`` (or ``pipeline`` for a checkpoint or job by stage), every
rank learns whether every rank's plan is ready, and only then is anything changed.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.modules.module import _IncompatibleKeys

from ..zero import state as zstate
from . import _checks, _files, _given_up, _load_plan, _names, _optimizer_list, _same_hyperparameters, _visibility
from ._files import CheckpointError


def load(directory: str, model: torch.nn.Module, optimizer=None, scaler=None, *,
         trusted: bool = False, strict: bool = True, process_group=None, pipeline: bool = False):
    """Load a checkpoint written by :func:`save` at any world size; returns its ``extra``
    (``strict=False``: a :class:`LoadResult`, as below).

    The world size may differ from the one that saved it: ZeroRedundancyOptimizer state is
    resharded here (each rank reads every shard file it needs and keeps its own slices), an
    unsharded optimizer receives the consolidated state, and a sharded one can load a
    checkpoint of an unsharded optimizer. Every file is checked against the manifest (present,
    size, SHA-256) and every tensor against the model and optimizer *before* anything is
    modified; on any problem, on any rank, every rank raises :class:`CheckpointError` naming it
    and the model, optimizer and scaler are untouched. A collective when the optimizer is
    sharded or torch.distributed is initialized: every rank must read the same checkpoint
    (same manifest bytes) and pass the same kinds of objects, else every rank refuses. The
    optimizer must run the algorithm that saved the state (torch's and fusedist's fused class
    of one algorithm, e.g. ``AdamW`` and ``FusedAdamW``, are interchangeable).

    Files are read with torch's restricted unpickler (tensors and plain containers): a
    checkpoint whose ``extra`` holds other objects is refused unless ``trusted=True``, which
    unpickles fully -- only for checkpoints from a source you trust.

    Note [a load that is not strict]: ``strict=False`` loads the model keys the checkpoint and
    the model both have and leaves the others as they are, as torch's
    ``load_state_dict(strict=False)`` does (a new head on a saved backbone, a buffer added
    since); a key both have with another shape is still refused, as torch refuses it. The
    optimizer state belongs to a list of parameters, so an optimizer is still loaded only into
    the very parameters that saved it: pass ``optimizer=None`` to start a new one. It returns
    what torch's returns, the keys it left out -- ``missing_keys`` (the model's, not in the
    checkpoint) and ``unexpected_keys`` (the checkpoint's, not in the model), by their names
    without wrapper prefixes, as the checkpoint keeps them, in torch's order (Note [the order
    of unexpected keys] in ``_names.py``) -- in a :class:`LoadResult`, a
    subclass of torch's named tuple whose ``.extra`` is the checkpoint's ``extra``. (It
    returned ``extra`` alone, which left the keys it skipped unknown.) Loading pipeline parts,
    the unexpected keys are the ones no part of the job loads.

    ``process_group``: as in :func:`save` (a pipeline stage's ranks). ``pipeline=True``: every
    rank of a pipeline-parallel job loads its part(s) (as in :func:`save`) from one checkpoint of
    the whole model: a pipelined one of any pipeline split, or an ordinary one; strict, the parts
    of all ranks together must take all of it (Note [pipelined checkpoints] in ``pipeline.py``).
    Any job loads a pipelined checkpoint.

    ``directory`` may also be a checkpoint of torch's distributed checkpoint (``dcp.save`` of
    ``get_state_dict``'s model and optimizer state): e.g. a torch DDP + AdamW job continued on
    a ZeroRedundancyOptimizer, whose master weights then start from the loaded parameters
    (Note [torch's distributed checkpoints in load] in ``_from_dcp.py``); its ``extra`` is None.
    """
    from . import api
    from . import pipeline as pipelined

    if not pipeline and _optimizer_list.is_list(optimizer):  # Note [several optimizers over one model]
        return _optimizer_list.load(directory, model, optimizer, scaler, trusted, strict, process_group)
    _optimizer_list.refuse_parts(model, pipeline)
    _given_up.settle()  # Note [a plain save given up on] in _given_up.py
    world = pipelined.job_world() if pipeline else api._World(optimizer, model, process_group)
    by_stage = pipeline
    _visibility.await_loadable(world, directory)  # Note [a plain load waits for lagging files]
    try:
        plan, by_stage = _prepared(directory, model, optimizer, scaler, trusted, strict, pipeline)
        error = None
    except (CheckpointError, zstate.StateDictError) as exc:
        plan, error = None, str(exc)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not hang
        plan, error = None, f"fusedist.checkpoint: reading {directory} failed: {type(exc).__name__}: {exc}"
    read = plan["read"] if plan is not None else None
    hyper = None if by_stage else _same_hyperparameters.entries(plan, optimizer, world)
    everyone = world.all_gather((error, read, hyper), "load: files checked")
    failed = [(r, e) for r, (e, _, _) in enumerate(everyone) if e is not None]
    if failed:
        rank, message = failed[0]
        prefix = "" if rank == world.rank else f"rank {rank} could not load the checkpoint: "
        raise CheckpointError(prefix + message)
    _checks.check_same_load([r for _, r, _ in everyone])
    # Note [the same hyperparameters after a load] in _same_hyperparameters.py
    _same_hyperparameters.check([h for _, _, h in everyone], world.ranks(), directory)
    if by_stage:
        pipelined.check_taken(plan, [r for _, r, _ in everyone], directory)
        extra = pipelined.apply(plan, model, optimizer, scaler)
    else:
        extra = _load_plan.apply(plan, model, optimizer, scaler)
    return extra if strict else _unmatched(plan, [r for _, r, _ in everyone], extra,
                                           None if pipeline else _names.unwrap(model))


class LoadResult(_IncompatibleKeys):
    """What ``load(..., strict=False)`` returns: torch's ``load_state_dict`` result (the named
    tuple ``missing_keys``, ``unexpected_keys``), and the checkpoint's ``extra`` as ``.extra``."""

    def __new__(cls, missing_keys: list, unexpected_keys: list, extra=None):
        result = super().__new__(cls, missing_keys, unexpected_keys)
        result.extra = extra
        return result

    def __reduce__(self):
        return LoadResult, (self.missing_keys, self.unexpected_keys, self.extra)


def _unmatched(plan: dict, reads: list, extra, whole=None) -> LoadResult:
    """The keys a load that is not strict left out (Note [a load that is not strict]): the
    model's keys the checkpoint lacks (of every part of the job, once, by the parts' names) and the
    checkpoint's keys no model loads (for parts, none of the job's, by the saved names), in the
    order torch's ``load_state_dict`` of the whole model lists them: of ``whole`` where one model
    takes a pipelined checkpoint, else of the tree every rank's parts make together (Note [the
    order of unexpected keys] in ``_names.py``)."""
    if "parts" not in plan:
        return LoadResult(list(plan["missing"]), list(plan["unexpected"]), extra)
    taken = set().union(*(r["keys"] for r in reads))
    unexpected = [k for k in plan["all_keys"] if k not in taken]
    missing = list(dict.fromkeys(k for r in reads for k in r.get("missing", ())))  # every part of the job's, once
    ordered = _names.missing_order(whole if whole is not None else _names.merged_trees(
        [t for r in reads for t in r.get("missing_tree", ())], missing), missing)
    if whole is None:  # the parts' trees, from every rank (Note [the order of unexpected keys])
        whole = _names.merged_trees([t for r in reads for t in r.get("tree", ())], list(plan["all_keys"]))
    return LoadResult(ordered, _names.unexpected_order(whole, unexpected), extra)


def _prepared(directory: str, model, optimizer, scaler, trusted: bool, strict: bool, pipeline: bool) -> tuple:
    """The load's plan, and whether it loads by stage (a pipelined checkpoint or job), both of
    one manifest. Why: which reader a checkpoint needs is told by its manifest, which the reader
    reads again; a checkpoint replaced in between (a save of the same directory by another
    job) was read as the other kind -- a pipelined one as an ordinary one loads no model key,
    which strict=False took silently. A manifest that changed between the two reads is read
    again, and refused if it keeps changing."""
    from . import pipeline as pipelined

    for _ in range(3):
        try:
            manifest, digest = _files.read_manifest_and_digest(directory)
        except Exception:  # noqa: BLE001 - reported by the reader that follows (or a DCP checkpoint)
            manifest, digest = {}, None
        by_stage = pipeline or "pipeline" in manifest
        _optimizer_list.refuse_single(manifest, None if pipeline else optimizer, directory)
        try:
            plan = (pipelined.prepare if by_stage else _load_plan.prepare)(directory, model, optimizer, scaler,
                                                                           trusted, strict)
        except Exception:
            if digest is None or _digest_now(directory) == digest:
                raise  # the manifest read is the one refused
            continue
        if digest is None or plan["read"].get("manifest") == digest:
            return plan, by_stage
    raise CheckpointError(f"fusedist.checkpoint: the manifest of {directory} changed during each of 3 loads (another "
                          "job saves into it): load it once that save is complete, or load another checkpoint")


def _digest_now(directory: str) -> Optional[str]:
    """The SHA-256 of the manifest ``directory`` holds now, None where it cannot be read."""
    try:
        return _files.read_manifest_and_digest(directory)[1]
    except Exception:  # noqa: BLE001
        return None
