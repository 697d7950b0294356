"""``fusedist.checkpoint.save`` / ``load``: per-rank atomic files, resharding at load.

Layout of a checkpoint directory::

    manifest.json        written last by rank 0: format version, world size, every file's
                         size and SHA-256, parameter names/shapes, optimizer kind
    common.pt            rank 0: {"model", "optimizer" (unsharded optimizers), "scaler", "extra"}
    rank-00000.pt ...    one per rank that holds per-rank state: {"optimizer_shard": the
                         ZeroRedundancyOptimizer shard (per-parameter fragments)}; for a
                         ``fully_shard`` model also {"model_shard": the rank's pieces as
                         fragments} (Note [stage-3 checkpoints] in ``stage3.py``)

Both files are dicts of named *sections*; adding per-rank state (RNG states, data-loader
position) means adding a section to ``_sections.rank_sections`` / ``_sections.common_sections`` and
consuming it in ``_load_plan.prepare`` -- older checkpoints simply lack the section. ``load`` reads and checks
everything before it modifies anything (``_load_plan.py``: the plan, then its application).

The directory must be visible to every rank (a shared filesystem): ranks write their own
files into it, and at load every rank reads every optimizer shard file (resharding needs the
slices of all of them; CPU memory for the load is about the full optimizer state).

Model keys and parameter names are saved without the segments wrappers insert: DDP's
``module.`` and ``torch.compile``'s ``_orig_mod.`` (Note [canonical names] in ``_names.py``),
so a model saved compiled loads uncompiled and the reverse; ``load`` accepts a bare, compiled
or (fusedist or torch) DDP-wrapped module, and checkpoints whose keys carry either prefix.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from .._rank import this_rank
from ..comm import get_communicator
from ..comm.objects import all_gather_object
from ..zero import ZeroRedundancyOptimizer
from . import _checks, _failed_save, _files, _given_up, _load, _names, _optimizer_list, _sections, _writer, stage3
from . import _save_entry
from ._files import CheckpointError



def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


# ---------------------------------------------------------------------------- helpers
class _World:
    """Rank, size and collectives for one save/load: the optimizer's data-parallel group for
    ZeRO, the units' group for a ``fully_shard`` model (on HSDP or with tensor parallelism
    ``process_group`` when given, else the default group: ``stage3.comm_of``), a fusedist DDP
    model's group, else ``process_group``, else the default group, else a single process.
    Its exchanges go through the communicator (bounded, monitored), so a rank missing from a
    save or load is named in a StallError, and ranks in different checkpoint calls are told
    which call each is in."""

    io = None  # a save's I/O barrier, beating from start_save to finish_save
    silence = None  # how long its peers' beats may stop (start_save: _writer.peer_silence)
    created = False  # whether rank 0 made the save's directory for it (start_save)

    def __init__(self, optimizer, model: Optional[torch.nn.Module] = None, process_group=None):
        self.comm = None
        process_group = _group_of(process_group)
        group_comm = get_communicator(process_group) if process_group is not None else None
        sharded_comm = stage3.comm_of(_names.unwrap(model), group_comm) if model is not None else None
        ddp = _ddp_of(model, optimizer) if model is not None else None
        if sharded_comm is not None:
            self.rank, self.size = sharded_comm.rank, sharded_comm.world_size
            if self.size > 1:
                self.comm = sharded_comm
        elif isinstance(optimizer, ZeroRedundancyOptimizer):
            self.rank, self.size = optimizer.rank, optimizer.world_size
            if optimizer.comm is not None and optimizer.world_size > 1:
                self.comm = optimizer.comm
        elif ddp is not None:
            self.rank, self.size = ddp.comm.rank, ddp.comm.world_size
            if self.size > 1:
                self.comm = ddp.comm
        elif group_comm is not None:  # a model every rank of the group holds whole
            self.rank, self.size = group_comm.rank, group_comm.world_size
            if self.size > 1:
                self.comm = group_comm
        elif dist.is_available() and dist.is_initialized():
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            if self.size > 1:
                self.comm = get_communicator(None)
        else:
            self.rank, self.size = 0, 1

    def ranks(self) -> list:
        """The job's ranks of this world, in its rank order (no exchange)."""
        if self.comm is None:
            return [this_rank()]
        group = getattr(self.comm, "group", None)
        return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)

    def all_gather(self, obj, what: str) -> list:
        """Every rank's ``obj``; ``what`` names the step in errors and stall reports."""
        if self.comm is None:
            return [obj]
        return all_gather_object(self.comm, obj, tag=f"fusedist.checkpoint.{what}")


def _group_of(process_group):
    """A process group for ``process_group``: itself, or a DeviceMesh's over all its ranks -- a
    stage's ``mesh["dp", "tp"]`` is flattened, as torchtitan flattens meshes (made once, by
    every rank of the job together, as the save or load of every stage is)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(process_group, DeviceMesh):
        return process_group
    return (process_group if process_group.ndim == 1 else process_group._flatten()).get_group()


# ---------------------------------------------------------------------------- save
def _check_ranks_agree(model: torch.nn.Module, optimizer) -> None:
    """Raise ``RankMismatchError`` on every rank, before anything is written or removed, if the
    ranks of a fusedist DDP model (passed, or found by a ZeroRedundancyOptimizer) have not run
    the same steps: a divergence in the last step before a save is otherwise reported at the
    next training forward -- after the checkpoint of a diverged run was written."""
    ddp = _ddp_of(model, optimizer)
    if ddp is not None:
        ddp.check_consistency()
    elif hasattr(model, "check_consistency") and stage3.units(model):
        model.check_consistency()  # a fully_shard root (Note [stage-3 step check])


def _ddp_of(model: torch.nn.Module, optimizer):
    """The fusedist DDP wrapper of ``model`` (passed, found by a ZeroRedundancyOptimizer, or the
    engine ``fusedist.replicate`` attached), or None."""
    from ..ddp import DistributedDataParallel
    from ..ddp.replicate import wrapper_of

    ddp = next((m for m in _names.layers(model) if isinstance(m, DistributedDataParallel)),
               getattr(optimizer, "ddp", None) or wrapper_of(_names.unwrap(model)))
    return ddp if isinstance(ddp, DistributedDataParallel) else None


def _warn_trusted_only(rank: int, optimizer, extra, per_rank) -> None:
    """Warn when what ``save`` writes holds a value that ``load`` reads only with
    ``trusted=True`` (Note [checkpoints the restore cannot read] in ``_safe_values.py``: a NumPy
    scalar in ``extra``, in a param group's ``lr``). A ``Checkpointer`` refuses such values,
    knowing its job's restore; here the loading side is unknown, so the save goes on, and the
    warning says it now rather than at the resume. ``extra`` and the param groups are written
    by rank 0, ``per_rank`` by each rank."""
    from ._safe_values import first_unreadable

    groups = None
    if optimizer is not None and rank == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    for value, where in ((extra if rank == 0 else None, "extra"), (groups, "the optimizer's param_groups"),
                         (per_rank, f"per_rank (rank {rank})")):
        found = first_unreadable(value, where)
        if found is not None:
            warnings.warn(
                f"fusedist.checkpoint.save: {found} cannot be read back by load() without trusted=True (its "
                "safe loader takes tensors, numbers, strings and containers of them); convert it (float(x), "
                "int(x), torch.from_numpy(a)) so the checkpoint loads by default", stacklevel=3)


def save(directory: str, model: torch.nn.Module, optimizer=None, scaler=None, extra: Optional[dict] = None,
         *, per_rank: Optional[dict] = None, process_group=None, pipeline: bool = False) -> None:
    """Write a checkpoint of ``model`` (and optimizer, GradScaler, ``extra``) to ``directory``.

    A collective: every rank of the data-parallel group calls it. A fusedist DDP model is
    first checked for ranks that diverged (``check_consistency()``): the error leaves any
    earlier checkpoint in ``directory`` untouched. Each rank holding
    per-rank state (a ZeroRedundancyOptimizer shard) writes its own file, rank 0 writes the
    replicated state, and rank 0 writes the manifest last (Note [checkpoint atomicity]);
    the call returns on every rank once the checkpoint is complete. ``extra`` is a dict
    (step counters, configuration) returned by :func:`load`; keep it to tensors, numbers,
    strings and containers of them, or loading it will need ``trusted=True``. ``optimizer`` may be a
    list of optimizers over disjoint parameters of the model (Note [several optimizers over one
    model] in ``_optimizer_list.py``), which :func:`load` restores into such a list.

    ``per_rank`` (exact resume, see :mod:`.resume`): a picklable dict of *this rank's* state
    (RNG states, data position), written into this rank's own file and read back with
    :func:`load_per_rank`. Pass it on every rank or on none.

    ``process_group``: the ranks whose model this is, when that is not the whole job -- a
    pipeline stage's ranks (Note [a Checkpointer per pipeline stage] in ``_writer.py``), as a
    process group or a DeviceMesh (``mesh["dp", "tp"]`` is flattened into one group the first
    time, by every rank of the job together): the save of a model sharded with HSDP or tensor
    parallelism runs over it, as does the save of a model its ranks hold whole. A
    data-parallel model (DDP, ZeRO, a 1-D ``fully_shard``) is saved over its own group anyway.

    ``pipeline=True``: every rank of a pipeline-parallel job saves its stage into this one
    directory (Note [pipelined checkpoints] in ``pipeline.py``): ``model`` is the rank's model
    part, or a list of its parts where it holds several stages, and ``optimizer`` one optimizer
    per part; ``process_group`` is the stage's group, as above. Such a checkpoint loads into
    another pipeline split, or into a job without pipeline parallelism.

    Ranks that pass different kinds of arguments (a scaler or ``per_rank`` on some ranks
    only, ``extra`` not a dict on one) are refused on every rank before anything is written;
    rank 0 lists in the manifest only files it sees itself, so ranks given different
    directories, or one that not every rank sees, fail the save instead of leaving a
    checkpoint that cannot be loaded.
    """
    if not pipeline and _optimizer_list.is_list(optimizer):  # Note [several optimizers over one model]
        return _optimizer_list.save(directory, model, optimizer, scaler, extra, per_rank, process_group)
    if pipeline:
        from . import pipeline as pipelined

        return pipelined.save(directory, model, optimizer, scaler, extra, per_rank=per_rank,
                              process_group=process_group)
    _optimizer_list.refuse_parts(model)
    _given_up.settle()  # Note [a plain save given up on] in _given_up.py
    started = time.time()  # temporaries older than this save are abandoned once it completes
    with _save_entry.entered_by_every_rank("fusedist.checkpoint.save"):  # Note [a save called on some ranks only]
        _check_ranks_agree(model, optimizer)
        world = _World(optimizer, model, process_group)
        _warn_trusted_only(world.rank, optimizer, extra, per_rank)
        # Note [checkpoint atomicity]: over a complete checkpoint, the new files get names of
        # their own, so that the old checkpoint stays whole until the new manifest replaces its.
        info, failure = None, None
        try:  # (a user's state_dict hook may raise: Note [a failed save leaves nothing] in _failed_save.py)
            shapes = {"model": _sections.model_shapes(model)}  # Note [one model per save] in _checks.py
            info = {"model": _checks.keys_digest(shapes["model"])}
        except Exception as exc:  # noqa: BLE001 - raised on every rank by start_save
            failure = exc
        save_id, calls, claim, _ = start_save(
            world, directory, _checks.save_call(directory, optimizer, scaler, extra, per_rank), info,
            lambda infos: _checks.check_same_keys(infos, lambda: world.all_gather(shapes, "save: model keys"),
                                                  "fusedist.checkpoint.save"), failure)

    mine, error = {}, None
    try:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.wait_for_params()
        mine_sections, sharded_keys = _sections.rank_sections(model, optimizer, world.rank, world.size)
        if per_rank is not None:  # [resume] this rank's RNG / data position (fusedist.checkpoint.resume)
            mine_sections["per_rank"] = per_rank
        if mine_sections:
            os.makedirs(directory, exist_ok=True)  # (rank 0 made it; seen here too on shared storage)
            mine[rank_file(world.rank)] = _write(directory, rank_file(world.rank), save_id, mine_sections,
                                                 rank=world.rank)
    except Exception as exc:  # noqa: BLE001 - reported on every rank below instead of a hang
        error = f"rank {world.rank} could not write its checkpoint file in {directory}: {type(exc).__name__}: {exc}"
    except BaseException:
        stop_io(world)
        raise
    finish_save(world, directory, started, save_id, calls, claim, (mine, error, None),
                lambda infos: _sections.manifest_base(model, optimizer, scaler, world.size),
                lambda: _sections.common_sections(model, optimizer, scaler, extra, sharded_keys))


def start_save(world: "_World", directory: str, call: dict, info=None, check=None,
               failure: Optional[BaseException] = None) -> tuple:
    """The first exchange of a save: rank 0 creates ``directory`` (and picks the new files' names,
    Note [checkpoint atomicity]), every rank's ``call`` must match the others' (else every rank
    raises, before anything is written), and rank 0 claims the directory (Note [one save at a
    time]). ``info``: what else each rank tells the others, which ``check(infos)`` may refuse
    (raising ``CheckpointError``) as the calls are. ``failure``: what this rank raised while
    preparing its part, raised on every rank (Note [a failed save leaves nothing]). Returns
    ``(save_id, calls, claim, infos)``."""
    # Read (and checked) before anything is exchanged or made: a bad setting writes nothing.
    world.silence = _writer.peer_silence()  # Note [waiting for a peer's I/O] in _writer.py
    start, created = None, False
    if world.rank == 0:
        try:
            created = world.created = not os.path.isdir(directory)
            os.makedirs(directory, exist_ok=True)
            start = ("", uuid.uuid4().hex[:12] if os.path.exists(os.path.join(directory, _files.MANIFEST)) else "")
        except OSError as exc:
            start = (f"rank 0 cannot create {directory}: {type(exc).__name__}: {exc}", "")
    # Rank 0's random name for this save's I/O barriers (Note [waiting for a peer's I/O] in _writer.py).
    words = None if failure is None else _failed_save.preparation_failure(world.rank, failure)
    everyone = world.all_gather((start, call, info, uuid.uuid4().hex[:12], words), "save: start")
    (problem, save_id), calls = everyone[0][0], [c for _, c, *_ in everyone]
    try:
        failed = next((w for *_, w in everyone if w is not None), None)
        if failed is not None:
            raise CheckpointError(f"fusedist.checkpoint.save: {failed} (nothing was written)") from failure
        _checks.check_same_save(calls)
        if check is not None:
            check([i for _, _, i, *_ in everyone])
    except (TypeError, CheckpointError):
        if created:  # rank 0 made it for this save: leave no trace of a refused one
            _remove_empty(directory)
        _failed_save.leave_together(lambda: world.all_gather(None, "save: refused save removed"))
        raise
    if problem:
        raise CheckpointError(f"fusedist.checkpoint.save: {problem} (nothing was written)")
    claim = _claim(directory) if world.rank == 0 else None  # Note [one save at a time]
    _start_io(world, everyone[0][3])
    return save_id, calls, claim, [i for _, _, i, *_ in everyone]


def _start_io(world: "_World", name: str) -> None:
    """Let the ranks of this save wait for each other's writes without the collective deadline:
    a write slower than FUSEDIST_TIMEOUT_S ended the exchange after it, and with it the group
    (gloo closes a failed collective's connections), training included (Note [waiting for a
    peer's I/O] in ``_writer.py``). This rank beats until :func:`finish_save`."""
    world.io = _writer.io_barrier(f"save-{name}", world.rank, world.ranks(), "fusedist.checkpoint.save",
                                  world.silence)
    if world.io is not None:
        world.io.start_beat()


def stop_io(world: "_World") -> None:
    """Stop this rank's beat, on a save leaving between :func:`start_save` and :func:`finish_save`
    (an interrupt): left beating, the process showed its peers, waiting at the save's barrier for
    a rank that had left it, a save still running -- for as long as it lived, up to 30 minutes."""
    if world.io is not None:
        world.io.stop_beat()


def _io_exchange(world: "_World", obj, waited: str, what: str) -> list:
    """Every rank's ``obj``, exchanged once every rank is done with its I/O (``waited``).
    Once the exchange completed every rank has left the barrier, so rank 0 then removes the
    barrier's key: each save's barriers have names of their own, and their keys, left in the
    job's store, grew it by two keys a save for as long as the job ran."""
    if world.io is not None:
        world.io.wait(waited)
    everyone = world.all_gather(obj, what)
    if world.io is not None and world.rank == 0:
        world.io.forget_phase(world.io.phase)
    return everyone


def finish_save(world: "_World", directory: str, started: float, save_id: str, calls: list, claim, written: tuple,
                base, common=None) -> None:
    """The rest of a save once each rank wrote its files: ``written`` is this rank's ``(files
    written, error or None, info)``. Every rank learns of any rank's failure; rank 0 then writes
    ``common.pt`` (``common()``, unless None) and the manifest (``base(every rank's info)``) and
    removes the files the manifest does not list; every rank raises any failure."""
    try:
        _finish_written(world, directory, started, save_id, calls, claim, written, base, common)
    except Exception as exc:
        if not _failed_save.peers_done(exc) and world.io is not None:  # Note [a plain save given up on]
            _given_up.remember(world.io, lambda: _finish_failed(world, directory, save_id, calls, claim))
        elif _failed_save.peers_done(exc):  # Note [a failed save leaves nothing] in _failed_save.py
            _finish_failed(world, directory, save_id, calls, claim)
            if getattr(exc, "agreed", False):
                _failed_save.leave_together(lambda: world.all_gather(None, "save: failed save removed"))
        raise
    finally:
        stop_io(world)


def _finish_failed(world: "_World", directory: str, save_id: str, calls: list, claim: Optional[dict]) -> None:
    """The cleanup of a failed save once no rank writes for it any more (at once, or for a save
    given up on once every rank has left it: :func:`_given_up.settle`): its claim and files go
    (:func:`_finish_save`), and so do its writers' temporaries and the directory rank 0 made
    for it -- a user's directory, or one holding other files (a complete checkpoint's
    manifest), stays. Not once another save claimed the directory (Note [one save at a time]:
    the temporaries may be that save's)."""
    ours = world.rank == 0 and (claim is None or _files.claim_lost(directory, claim) is None)
    _finish_save(world, directory, calls, claim)
    if ours and world.created:
        _failed_save.remove_made_directory(directory)
    elif ours and save_id:
        _failed_save.remove_temporaries(directory, save_id)


def _finish_written(world: "_World", directory: str, started: float, save_id: str, calls: list, claim,
                    written: tuple, base, common) -> None:
    everyone = _io_exchange(world, written, "writing the rank files", "save: rank files written")
    failed = [e for _, e, _ in everyone if e is not None]
    if failed:  # (cleaned up by finish_save: Note [a failed save leaves nothing])
        raise _failed_save.agreed(CheckpointError(f"fusedist.checkpoint.save: {failed[0]} ({_kept(save_id)})"))
    error = None
    if world.rank == 0:
        # Rank 0's failure is exchanged like the rank files' above: raised here alone, it
        # left the other ranks waiting in the final exchange until the collective timeout
        # (and the group broken by that timeout).
        infos = [i for _, _, i in everyone]
        error = _complete(directory, save_id, [m for m, _, _ in everyone], calls, common, lambda: base(infos), claim)
        # Before the last exchange (every rank file is written by now): the other ranks return
        # to a directory that holds the new checkpoint alone, without the claim.
        if error is None:
            _finish_save(world, directory, calls, claim, started)
    failed = [e for e in _io_exchange(world, error, "writing the manifest", "save: manifest written") if e is not None]
    if world.rank != 0:
        _finish_save(world, directory, calls, claim)
    if failed:
        raise _failed_save.agreed(CheckpointError(f"fusedist.checkpoint.save: {failed[0]} ({_kept(save_id)})"))


def _claim(directory: str) -> Optional[dict]:
    """Rank 0's claim on ``directory`` for this save (Note [one save at a time] in
    ``_files.py``); None where the claim file cannot be written (the rank files then fail
    to be written too, with the reason)."""
    try:
        return _files.claim_directory(directory)
    except OSError:
        return None


def _complete(directory: str, save_id: str, rank_entries: list, calls: list, common, base,
              claim: Optional[dict]) -> Optional[str]:
    """Rank 0, once every rank file is written: check it sees them all and that no other save
    claimed the directory since this one started, write ``common.pt``, then the manifest (the
    switch to the new checkpoint). The error's text, or None."""
    files = {}
    for entry in rank_entries:
        files.update(entry)
    other = _files.claim_lost(directory, claim) if claim is not None else None
    if other is not None:
        return (f"another save into {directory} started while this one ran ({other}); a directory takes one "
                "save at a time, so this one stopped before its manifest and removed nothing (the stages of a "
                "pipeline-parallel job save into one directory together with pipeline=True)")
    try:
        unseen = _checks.unseen_rank_files(directory, files, [c["directory"] for c in calls])
        if unseen is not None:
            return unseen
        if common is not None:
            files[_files.COMMON] = _write(directory, _files.COMMON, save_id, common(), rank=0)
        manifest = dict(base(), created_unix=time.time(), files=files)
        if save_id:
            manifest["version"] = max(manifest["version"], _files.SAVE_ID_VERSION)  # files with names of their own
        _files.write_manifest(directory, manifest)  # the switch: one atomic rename
    except Exception as exc:  # noqa: BLE001 - reported on every rank instead of a hang
        return f"rank 0 could not write {_files.COMMON} or the manifest in {directory}: {type(exc).__name__}: {exc}"
    return None


def _remove_empty(directory: str) -> None:
    try:
        os.rmdir(directory)
    except OSError:
        pass  # not empty (another writer) or gone: leave it


def _write(directory: str, name: str, save_id: str, sections: dict, rank: int) -> dict:
    """Write one file of a save; its manifest entry (Note [checkpoint atomicity])."""
    file = _files.file_name(name, save_id)
    entry = dict(_files.atomic_torch_save(os.path.join(directory, file), sections), rank=rank,
                 sections=sorted(sections))
    if file != name:
        entry["file"] = file
    return entry


def _finish_save(world: "_World", directory: str, calls: list, claim: Optional[dict],
                 completed_since: Optional[float] = None) -> None:
    """Once no rank writes any more: rank 0 removes the files the manifest now in the
    directory does not list (the replaced checkpoint's, or a failed save's own), and so does
    a rank that was given another directory than rank 0 (a save refused for that). After a
    complete save that started at ``completed_since``, rank 0 also removes the temporaries
    of earlier saves killed mid-write (Note [abandoned temporaries]). Rank 0 removes nothing
    once another save has claimed the directory (Note [one save at a time]): the files it
    does not know are that save's."""
    if world.rank == 0 and claim is not None:
        other = _files.release_claim(directory, claim)
        if other is not None:
            if completed_since is not None:
                warnings.warn(f"fusedist.checkpoint.save: another save into {directory} started after this one "
                              f"({other}); this checkpoint is complete, but the files it replaced are left for "
                              "the next save to remove", stacklevel=3)
            return
    if world.rank == 0 or (calls[world.rank]["directory"] != calls[0]["directory"] and os.path.isdir(directory)):
        # Never raised: an error here would end a complete save with an error on this rank
        # alone while the others went on. The leftover files only take space.
        try:
            _files.remove_unlisted(directory)
            if completed_since is not None and world.rank == 0:
                _files.remove_stale_temporaries(directory, completed_since)
        except OSError as exc:
            warnings.warn(f"fusedist.checkpoint.save (rank {world.rank}): could not remove the files of the replaced "
                          f"or failed save from {directory}: {type(exc).__name__}: {exc}", stacklevel=3)


def _kept(save_id: str) -> str:
    return ("the checkpoint the directory held before is kept" if save_id
            else "no manifest was written")


def load_per_rank(directory: str, rank: Optional[int] = None, world_size: Optional[int] = None, *,
                  trusted: bool = False) -> Optional[dict]:
    """[resume] This rank's ``per_rank`` state saved by :func:`save`, verified against the
    manifest; None when the checkpoint was written at a different world size (the per-rank
    state of another partition cannot continue here) or without ``per_rank``. Not a
    collective. ``rank``/``world_size`` default to the default process group's. ``trusted``:
    as in :func:`load`."""
    if rank is None or world_size is None:
        initialized = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if rank is None and initialized else (rank or 0)
        world_size = dist.get_world_size() if world_size is None and initialized else (world_size or 1)
    return per_rank_of(directory, _files.read_manifest(directory), rank, world_size, trusted)


def per_rank_of(directory: str, manifest: dict, rank: int, world_size: int, trusted: bool) -> Optional[dict]:
    """:func:`load_per_rank` with the manifest already read (a restore reads it once)."""
    if manifest["world_size"] != world_size:
        return None
    info = manifest["files"].get(rank_file(rank))
    if info is None or "per_rank" not in info.get("sections", []):
        return None
    return _files.load_file(_files.verify_file(directory, rank_file(rank), info), trusted)["per_rank"]


load = _load.load  # (its own module, _load.py: Note [a load that is not strict] is there)
LoadResult = _load.LoadResult
