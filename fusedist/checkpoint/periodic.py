"""``Checkpointer``: periodic, asynchronous checkpoints with retention and automatic resume.

A job that survives failures restarts its processes (``torchrun --max-restarts``) and
continues from the latest complete checkpoint, losing only the steps since it::

    ckpt = fusedist.checkpoint.Checkpointer("ckpt", every_steps=100, keep=3)
    start = ckpt.restore(model, opt, scaler, lr_scheduler=sched, sampler=sampler)  # 0 on a fresh start
    for step in range(start, total_steps):
        ...                                   # one training step
        ckpt.maybe_save(step + 1)             # after step + 1 completed steps
    ckpt.close()                              # waits for the save in flight
    torch.distributed.destroy_process_group()

What a checkpoint holds: model, optimizer (ZeRO shards, offloaded state included), GradScaler,
LR scheduler, every rank's RNG states, the data position of an
:class:`~fusedist.checkpoint.ElasticDistributedSampler` (the job's, which every save checks is
the same on every rank: Note [one data position for the job] in ``_sampler_state.py``; or a
``ResumableDistributedSampler``'s per rank, same world size only), the step, and a user
``extra`` dict. It is an ordinary
:func:`fusedist.checkpoint.save`-format directory ``<directory>/step-<N>``, so
:func:`~fusedist.checkpoint.load` reads it too, at any world size.

Note [asynchronous save]
    The training thread pays for a snapshot only: a consistency check of the ranks, a copy
    of every tensor into reused host buffers (``staging.py``), and one small exchange saying
    whether every rank's copy succeeded (a failure is raised there on every rank, before any
    background work starts). Serialization, checksums, fsyncs, the manifest and retention run
    on a background thread (``_writer.py``) that talks to the other ranks over a process
    group of its own. One save is in flight at a time: the next save (and ``close()``, and
    interpreter exit) first waits for it, so the staging buffers are never overwritten while
    being written, and its error, if any, is raised in the training thread there, on every
    rank. The checkpoint becomes visible (its manifest written) only once every rank's files
    are complete. A save that fails, or loses a rank killed mid-write, leaves no directory:
    rank 0 removes it (Note [a failed save leaves nothing] in ``_failed_save.py``); rank 0
    killed leaves one without a manifest, which ``restore`` skips with a warning.

Steps only go forward (Note [steps only go forward] in ``_schedule.py``). The parts of the
class live next to this module, one job each: ``_schedule.py`` (which steps are saved),
``_restore.py`` (the resume path), ``_snapshot.py`` (the training thread's part of a save),
``_persist.py`` (the background part: lease, files, manifest, retention), over the writer
thread and coordinator of ``_writer.py``.

One job per root: a job's saves hold the root with a lease, and a second job given the same
root is refused instead of overwriting and pruning the first's checkpoints, while a restart of
the same run continues (Note [one job per checkpoint root] in ``_owner.py``).
"""

from __future__ import annotations

import time
import warnings
from typing import Optional

from . import _files, _heartbeat, _owner, _root_checks, _save_entry, api, layout
from . import pipeline as pipelined
from ._files import CheckpointError
from ._persist import PersistMixin
from ._restore import RestoreMixin
from ._schedule import ScheduleMixin, is_int, step_count
from ._snapshot import SnapshotMixin
from ._writer import BackgroundWriter, Coordinator, stage_group
from .staging import StagingBuffers


class Checkpointer(ScheduleMixin, RestoreMixin, SnapshotMixin, PersistMixin):
    """Step-numbered checkpoints under ``directory``, every ``every_steps`` steps, keeping the
    ``keep`` newest complete ones (None: all), written asynchronously unless
    ``async_save=False``.

    Construction is a collective (it creates the saves' own process group): every rank
    builds the Checkpointer at the same point, after the process group is initialized.
    ``directory`` must be on a filesystem every rank sees.

    ``process_group``: the ranks whose model this Checkpointer saves (a process group or a
    DeviceMesh), by default the whole job. Under pipeline parallelism each stage's ranks
    hold another model: give each stage a Checkpointer of its own, over the stage's ranks
    (its data-parallel group; with tensor parallelism or HSDP its mesh, ``mesh["dp", "tp"]``)
    and with a root of its own (Note [a Checkpointer per pipeline stage] in ``_writer.py``);
    every rank of the job still constructs its Checkpointer at the same point. A model
    saved by other ranks than the Checkpointer's is refused at ``restore``.

    ``pipeline=True``: one root for every stage of a pipeline-parallel job (Note [pipelined
    checkpoints] in ``pipeline.py``), whose checkpoints restore into another pipeline split.
    Every rank constructs it with its stage's ``process_group`` (as above), and registers at
    ``restore`` its model part -- a list of parts where it holds several stages -- with one
    optimizer per part, and a list of one LR scheduler per part (None for a part without one;
    the ranks of a stage alike), each saved with its part's stage and restored into the part
    holding its layers (Note [an LR scheduler per pipeline part] in ``_snapshot.py``).

    ``run_id``: what identifies this job across restarts (default: torchrun's rendezvous id,
    else this launch); a job of another run holding ``directory`` is refused (Note [one job
    per checkpoint root]), unless its holder stopped renewing the lease for
    ``lease_timeout_s`` seconds (it ended: Note [lease heartbeat]).

    ``peer_silence_s``: how long a rank's sign of life may stop during a save before the other
    ranks give it up as ended and fail the save naming it (Note [waiting for a peer's I/O] in
    ``_writer.py``); default ``FUSEDIST_CHECKPOINT_PEER_SILENCE_S``, else 10 s; at least 2 s,
    and never longer than ``FUSEDIST_TIMEOUT_S``. Shorter reports a killed rank sooner; longer
    tolerates a host too loaded to renew the sign each second.
    """

    def __init__(self, directory: str, every_steps: Optional[int] = None, keep: Optional[int] = 3,
                 async_save: bool = True, *, run_id: Optional[str] = None,
                 lease_timeout_s: float = _heartbeat.DEFAULT_TIMEOUT_S, process_group=None, pipeline: bool = False,
                 peer_silence_s: Optional[float] = None):
        if every_steps is not None and (not is_int(every_steps) or every_steps < 1):
            raise ValueError(f"Checkpointer: every_steps must be a positive int or None, got {every_steps!r}")
        if keep is not None and (not is_int(keep) or keep < 1):
            raise ValueError(f"Checkpointer: keep must be a positive int or None (keep all), got {keep!r}")
        self.directory, self.every_steps, self.keep, self.async_save = directory, every_steps, keep, async_save
        self.pipeline = bool(pipeline)  # Note [pipelined checkpoints] in pipeline.py
        self._coord = Coordinator(None if self.pipeline else process_group, peer_silence_s)
        self._stage_ranks, self._stage_group = stage_group(process_group) if self.pipeline else (None, None)
        self._optimizer_list: Optional[list] = None  # the classes of a list of optimizers restore() registered
        self._whole_model = None  # the model cut into that list's views (Note [several optimizers over one model])
        self.rank, self.world_size = self._coord.rank, self._coord.size
        self._staging = StagingBuffers()
        self._writer = BackgroundWriter(f"fusedist.checkpoint.Checkpointer({directory!r}) on rank {self.rank}")
        self._state: Optional[dict] = None
        # The step of the last save that completed (its manifest written), or of the restored
        # checkpoint: what the step check compares with (Note [steps only go forward]). A save
        # that failed never counts, so the step it was at may be saved again, or an earlier one.
        self.last_saved_step: Optional[int] = None
        self._in_flight: Optional[int] = None  # the step of the save submitted and not yet waited for
        self._flight_id: Optional[str] = None  # its save id, once its ranks agreed on it (_persist.py)
        self.restored_step: Optional[int] = None
        self.restored_world_size: Optional[int] = None
        self.extra: Optional[dict] = None  # the user `extra` of the restored checkpoint
        self.incompatible_keys = None  # restore(strict=False): the model keys it left out (a LoadResult)
        self.stats: list[dict] = []  # per save: step, wait_s, stall_s, bytes (and persist_s once known)
        # Note [one job per checkpoint root]: rank 0's run and, once a save took it, the root's lease.
        self._run, self._run_source = _owner.run_identity(run_id)
        self._lease: Optional[dict] = None
        if not isinstance(lease_timeout_s, (int, float)) or not lease_timeout_s > 0:
            raise ValueError(
                f"Checkpointer: lease_timeout_s must be a positive number of seconds, got {lease_timeout_s!r}")
        self._lease_timeout = float(lease_timeout_s)  # Note [lease heartbeat] in _heartbeat.py
        self._heartbeat: Optional[_heartbeat.Heartbeat] = None
        # Note [a restore that rolls back]: the restored step, until the first save sets aside
        # the complete checkpoints above it.
        self._set_aside_above: Optional[int] = None

    def save(self, step: int, extra: Optional[dict] = None) -> None:
        """Write the checkpoint of ``step`` now (asynchronously unless ``async_save=False``).
        A collective. ``extra``: a dict of plain values returned as ``self.extra`` at restore."""
        if self._state is None:
            raise RuntimeError("fusedist.checkpoint.Checkpointer: call restore(model, optimizer, ...) before saving; "
                               "it registers what a checkpoint holds (and returns 0 on a fresh start)")
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"fusedist.checkpoint.Checkpointer.save: extra must be a dict, got {type(extra).__name__}")
        step = step_count(step, "save")
        t0 = time.perf_counter()
        try:
            self._wait_previous()
            self._coord.settle()  # Note [a save given up on] in _writer.py
        except CheckpointError as exc:
            raise _not_saved(exc, step) from exc
        # Once the save before is known to have completed or failed: only a completed one counts.
        step = self._check_step(step, "save")
        t1 = time.perf_counter()
        # Note [a save called on some ranks only] in _save_entry.py
        with _save_entry.entered_by_every_rank("fusedist.checkpoint.Checkpointer.save"):
            if self._whole_model is not None:  # as a plain save of the list checks it: the views find no DDP
                api._check_ranks_agree(self._whole_model, None)
            for module, optimizer in self._parts():
                api._check_ranks_agree(module, optimizer)
            snapshot = self._agreed_snapshot(step, extra)
        t2 = time.perf_counter()
        record = {"step": step, "wait_s": t1 - t0, "stall_s": t2 - t0, "bytes": self._staging.bytes,
                  "async": self.async_save}
        self.stats.append(record)
        self._in_flight, self._flight_id = step, None
        if self.async_save:
            self._writer.submit(lambda: self._persist(step, snapshot, record))
            return
        try:
            self._persist(step, snapshot, record)
        except Exception as exc:  # noqa: BLE001 - raised with what it left, as an asynchronous save's
            self._ended(exc)
        except BaseException:
            self._in_flight = self._flight_id = None  # not known to have completed
            raise
        self._ended(None)
        record["stall_s"] = time.perf_counter() - t0

    def _parts(self) -> list:
        """``(module, optimizer)`` of each registered model part (one unless ``pipeline=True``)."""
        state = self._state
        if self.pipeline:
            return pipelined.parts(state["model"], state["optimizer"])
        return [(state["model"], state["optimizer"])]

    def _wait_previous(self) -> None:
        try:
            self._writer.wait()
        except Exception as exc:  # noqa: BLE001 - e.g. a peer died during the exchange
            self._ended(exc)
        except BaseException:
            self._in_flight = self._flight_id = None  # not known to have completed
            raise
        self._ended(None)

    def _ended(self, error: Optional[BaseException]) -> None:
        """Account for the save in flight, which ended with ``error`` (None: it completed), and
        raise the error in words that say what it left. Only a save whose own manifest is in
        place counts as saved (``last_saved_step``): one that failed leaves the step check where
        the last completed save put it."""
        step, save_id = self._in_flight, self._flight_id
        self._in_flight = self._flight_id = None
        if step is None:
            return
        if error is None:
            self.last_saved_step = step
            return
        try:
            written, outcome = _outcome(self.directory, step, save_id)
        except Exception as exc:  # noqa: BLE001 - the save's error must come out, not this one
            written, outcome = False, f"what it left could not be read: {type(exc).__name__}: {exc}"
        if written:
            self.last_saved_step = step
        if isinstance(error, CheckpointError) and getattr(error, "silent_ranks", None) is None:
            if written:  # given up on after its manifest (a peer's retention hung): it is whole all the same
                raise CheckpointError(f"{error} ({outcome})") from error
            raise error  # (the save's own error, agreed by every rank, which says what it left)
        raise CheckpointError(
            f"fusedist.checkpoint.Checkpointer: rank {self.rank}: the "
            f"{'asynchronous ' if self.async_save else ''}save of step {step} to "
            f"{layout.step_dir(self.directory, step)} failed: {type(error).__name__}: {error} ({outcome})"
        ) from error

    def wait(self) -> None:
        """Block until the save in flight is complete on every rank; raise its error."""
        self._wait_previous()

    def close(self) -> None:
        """Finish the save in flight and give the directory up to a later job. Call before
        ``destroy_process_group()``."""
        try:
            self._wait_previous()
        finally:
            _root_checks.release(self.directory, self)
            self._stop_heartbeat()
            self._coord.close()  # Note [the keys a Checkpointer leaves at close] in _io_rounds.py
            if self.rank == 0 and self._lease is not None:
                _owner.release(self.directory, self._lease)
                self._lease = None

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is on its way: finish the save if it can, never mask the exception
            self.close()
        except Exception as err:  # noqa: BLE001
            warnings.warn(str(err), stacklevel=2)


def _outcome(directory: str, step: int, save_id: Optional[str]) -> tuple[bool, str]:
    """Whether a save of ``step`` that failed on its way (a peer lost) wrote its manifest, and what
    it left, in words. ``save_id``: the names its files took (Note [saving a step again] in
    ``_replace.py``; '' for a directory it made itself), None where its ranks never agreed on
    them -- it wrote nothing. A complete ``step-N`` may be the one it was to replace: that one is
    kept and loads, but this save's state is not in it."""
    where = layout.entry(directory, step)
    if where is not None and where.complete and save_id is not None and _lists_files_of(where.path, save_id):
        # A peer stopped after the manifest was written (in the exchanges that follow it):
        # the checkpoint is whole, and saying it was skipped would send users to an older one.
        return True, ("its checkpoint was written completely and loads; the failure came after its manifest, "
                      "so checkpoints older than it may not have been pruned")
    if where is not None and where.complete:
        return False, (f"this save's state was not written: {where.path} still holds the complete checkpoint of "
                       f"step {step} saved before, which loads; earlier ones are unaffected")
    if where is None:  # removed by rank 0 (Note [a failed save leaves nothing] in _failed_save.py)
        return False, "the incomplete checkpoint is removed; earlier ones are unaffected"
    return False, "the checkpoint is incomplete and will be skipped; earlier ones are unaffected"


def _lists_files_of(path: str, save_id: str) -> bool:
    """Whether the manifest in ``path`` lists the files of the save ``save_id`` ('' for the save
    that made ``path``: its files keep their plain names, and no other save wrote a manifest
    there)."""
    if not save_id:
        return True
    try:
        files = _files.read_manifest(path)["files"]
    except CheckpointError:
        return False
    return any(str(info.get("file", "")).endswith(f".{save_id}.pt") for info in files.values())


def _not_saved(error: CheckpointError, step: int) -> CheckpointError:
    """The previous save's error, raised by ``save(step)``, saying that ``step`` itself was not
    saved. Why: the message names only the earlier step, so a loop that reports the error and
    trains on (a full disk freed meanwhile) believed the checkpoint of ``step`` written, and
    lost it silently; calling ``save(step)`` again writes it."""
    return CheckpointError(f"{error}. The checkpoint of step {step} was not saved (this save raised the error of "
                           f"the one before it): call save({step}) again to write it")
