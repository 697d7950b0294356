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
``ResumableDistributedSampler``'s per rank, same world size only), the step, and a user ``extra`` dict. It is an ordinary
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
    are complete; a process killed before that leaves a directory without a manifest, which
    ``restore`` skips with a warning.

Note [steps only go forward]
    ``restore`` picks the complete checkpoint with the highest step, and retention never
    removes the steps above the one just saved. A save of a step below the run's last saved
    or restored one (a step counter reset at each epoch, a loop that passes the epoch instead
    of the step) wrote a checkpoint that no restart would pick while the newer ones existed:
    the run's progress since looked saved and was not. Such a save is refused; a run that
    means to go back restores that step first (Note [a restore that rolls back] in
    ``layout.py``). A step saved again (``save(N)`` after ``maybe_save(N)``) replaces it, the
    complete one kept until the new one is complete (Note [saving a step again] in
    ``_replace.py``).

One job per root: a job's saves hold the root with a lease, and a second job given the same
root is refused instead of overwriting and pruning the first's checkpoints, while a restart of
the same run continues (Note [one job per checkpoint root] in ``_owner.py``).
"""

from __future__ import annotations

import operator
import os
import time
import warnings
from typing import Optional

import torch

from . import _checks, _files, _heartbeat, _owner, _replace, _root_checks, _sampler_state, api, layout, resume
from ._files import CheckpointError
from ._writer import BackgroundWriter, Coordinator
from .sampler import ElasticDistributedSampler
from .staging import StagingBuffers


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _step_count(step, what: str) -> int:
    """``step`` as an int (a NumPy or 0-d tensor integer too), or a ValueError: a bool, a
    float, a string or a negative number is no count of training steps (``restore(step=True)``
    restored step 1)."""
    try:
        count = operator.index(step) if not isinstance(step, bool) else None
    except TypeError:
        count = None
    if count is None or count < 0:
        raise ValueError(f"fusedist.checkpoint.Checkpointer.{what}: step must be a non-negative int (the "
                         f"number of completed training steps), got {step!r}")
    return count


def _is_zero(optimizer) -> bool:
    from ..zero import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


class Checkpointer:
    """Step-numbered checkpoints under ``directory``, every ``every_steps`` steps, keeping the
    ``keep`` newest complete ones (None: all), written asynchronously unless
    ``async_save=False``.

    Construction is a collective (it creates the saves' own process group): every rank
    builds the Checkpointer at the same point, after the process group is initialized.
    ``directory`` must be on a filesystem every rank sees.

    ``run_id``: what identifies this job across restarts (default: torchrun's rendezvous id,
    else this launch); a job of another run holding ``directory`` is refused (Note [one job
    per checkpoint root]), unless its holder stopped renewing the lease for
    ``lease_timeout_s`` seconds (it ended: Note [lease heartbeat]).
    """

    def __init__(self, directory: str, every_steps: Optional[int] = None, keep: Optional[int] = 3,
                 async_save: bool = True, *, run_id: Optional[str] = None,
                 lease_timeout_s: float = _heartbeat.DEFAULT_TIMEOUT_S):
        if every_steps is not None and (not _is_int(every_steps) or every_steps < 1):
            raise ValueError(f"Checkpointer: every_steps must be a positive int or None, got {every_steps!r}")
        if keep is not None and (not _is_int(keep) or keep < 1):
            raise ValueError(f"Checkpointer: keep must be a positive int or None (keep all), got {keep!r}")
        self.directory, self.every_steps, self.keep, self.async_save = directory, every_steps, keep, async_save
        self._coord = Coordinator()
        self.rank, self.world_size = self._coord.rank, self._coord.size
        self._staging = StagingBuffers()
        self._writer = BackgroundWriter(f"fusedist.checkpoint.Checkpointer({directory!r}) on rank {self.rank}")
        self._state: Optional[dict] = None
        self.last_saved_step: Optional[int] = None
        self.restored_step: Optional[int] = None
        self.restored_world_size: Optional[int] = None
        self.extra: Optional[dict] = None  # the user `extra` of the restored checkpoint
        self.stats: list[dict] = []  # per save: step, wait_s, stall_s, bytes (and persist_s once known)
        # Note [one job per checkpoint root]: rank 0's run and, once a save took it, the root's lease.
        self._run, self._run_source = _owner.run_identity(run_id)
        self._lease: Optional[dict] = None
        if not isinstance(lease_timeout_s, (int, float)) or not lease_timeout_s > 0:
            raise ValueError(f"Checkpointer: lease_timeout_s must be a positive number of seconds, got {lease_timeout_s!r}")
        self._lease_timeout = float(lease_timeout_s)  # Note [lease heartbeat] in _heartbeat.py
        self._heartbeat: Optional[_heartbeat.Heartbeat] = None
        # Note [a restore that rolls back]: the restored step, until the first save sets aside
        # the complete checkpoints above it.
        self._set_aside_above: Optional[int] = None

    # ------------------------------------------------------------------ restore
    def restore(self, model: torch.nn.Module, optimizer=None, scaler=None, *, lr_scheduler=None, sampler=None,
                step: Optional[int] = None, trusted: bool = False) -> int:
        """Load the latest complete checkpoint into the given objects and return its step (the
        number of completed training steps), or 0 when there is none. A collective.

        Also registers the objects that later saves write. Incomplete directories (a save
        killed mid-write) are skipped with a warning; a complete one that fails to load (a
        corrupt file) is reported and the next older one is tried. ``step`` picks a specific
        checkpoint instead. At the world size that saved it, everything -- RNG states and the
        data position included -- continues bit for bit; at another world size the optimizer
        is resharded and an ElasticDistributedSampler re-splits the rest of the epoch, while
        the per-rank RNG states (which belong to the old ranks) are left as the script set
        them. Create DataLoader iterators after this call.
        """
        if step is not None:
            step = _step_count(step, "restore")
        if _is_zero(optimizer) and optimizer.world_size != self.world_size:
            raise ValueError(
                f"Checkpointer (rank {self.rank}): the ZeroRedundancyOptimizer shards over {optimizer.world_size} "
                f"ranks, the job has {self.world_size}; the Checkpointer saves the whole job's state"
            )
        self._writer.wait()
        self._state = dict(model=model, optimizer=optimizer, scaler=scaler, lr_scheduler=lr_scheduler,
                           sampler=sampler)
        candidates = self._coord.broadcast(self._candidates_or_error(step) if self.rank == 0 else None)
        if isinstance(candidates, str):
            raise CheckpointError(candidates)
        failures = []
        for saved_step, path in candidates:
            error = None
            try:
                extra = api.load(path, model, optimizer, scaler, trusted=trusted)
            except CheckpointError as exc:
                error = str(exc)
            else:
                try:
                    per_rank = api.load_per_rank(path, self.rank, self.world_size, trusted=trusted)
                except CheckpointError as exc:
                    error = str(exc)
                except Exception as exc:  # noqa: BLE001 - e.g. an unreadable file: every rank must learn of it
                    error = f"rank {self.rank} could not read its per-rank state: {type(exc).__name__}: {exc}"
                errors = [e for e in self._coord.all_gather(error) if e is not None]
                error = errors[0] if errors else None
            if error is None:
                self._apply_agreed(saved_step, path, extra, per_rank)
                return saved_step
            failures.append(f"step {saved_step} ({path}): {error}")
            if self.rank == 0 and saved_step != candidates[-1][0]:
                warnings.warn(f"fusedist.checkpoint.Checkpointer: the checkpoint of step {saved_step} in {path} "
                              f"could not be loaded ({error}); trying the previous one", stacklevel=2)
        if failures:
            raise CheckpointError("fusedist.checkpoint.Checkpointer: no checkpoint under "
                                  f"{self.directory} could be loaded: " + "; ".join(failures))
        return 0

    def _candidates_or_error(self, step: Optional[int]):
        """:meth:`_candidates`, or why they could not be listed: raised on rank 0 alone (an
        unreadable directory or manifest), that error left the other ranks waiting for the
        broadcast until the collective timeout."""
        try:
            return self._candidates(step)
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            return (f"fusedist.checkpoint.Checkpointer: rank 0 could not list the checkpoints under "
                    f"{self.directory}: {type(exc).__name__}: {exc}")

    def _candidates(self, step: Optional[int]):
        """Rank 0: the complete checkpoints to try, newest first, or an error message."""
        refused = _owner.refusal(self.directory, self._run, self._run_source, self._lease_timeout)
        if refused is not None:  # another job's root: read nothing (Note [one job per checkpoint root])
            return refused
        entries = layout.scan(self.directory)
        if step is not None:
            chosen = [e for e in entries if e.step == step]
            if not chosen or not chosen[0].complete:
                why = chosen[0].reason if chosen else "there is no such directory"
                return (f"fusedist.checkpoint.Checkpointer: cannot restore step {step} from {self.directory}: {why} "
                        f"(complete checkpoints: steps {[e.step for e in entries if e.complete]})")
            return [(step, chosen[0].path)]
        complete = [(e.step, e.path) for e in entries if e.complete]
        newest = complete[0][0] if complete else -1
        newer = [e for e in entries if e.newer_format and e.step > newest]
        if newer:  # Note [checkpoints of a newer fusedist] in layout.py
            older = f"restore(..., step={newest}) to continue from the newest one it reads" if complete else \
                "move them away to start afresh"
            return (f"fusedist.checkpoint.Checkpointer: {self.directory} holds checkpoints written by a newer "
                    f"fusedist (steps {[e.step for e in newer]}: {newer[0].reason}); restoring an older one would "
                    f"silently go back past them. Upgrade fusedist, or {older}; they are never removed")
        for e in entries:
            if not e.complete and e.step > newest:
                warnings.warn(f"fusedist.checkpoint.Checkpointer: skipping incomplete checkpoint {e.path} "
                              f"(step {e.step}): {e.reason}", stacklevel=3)
            elif e.complete and e.leftovers:  # Note [saving a step again] in _replace.py
                warnings.warn(f"fusedist.checkpoint.Checkpointer: {e.path} holds files of an interrupted save of "
                              f"step {e.step} ({', '.join(e.leftovers)}), which its manifest does not list: they "
                              "are ignored, the complete checkpoint there is used, and the next complete save "
                              "removes them", stacklevel=3)
        return complete

    def _apply_agreed(self, step: int, path: str, extra: dict, per_rank: Optional[dict]) -> None:
        """:meth:`_apply` on every rank, or an error on every rank naming the ranks where it
        failed: a sampler refusing the saved position on one rank (another seed or dataset
        there) raised on that rank alone, and the others trained on into their next
        collective, waiting for it until the timeout."""
        error = None
        try:
            self._apply(step, path, extra, per_rank)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not wait
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        failed = [e for e in self._coord.all_gather(error, f"step {step}: restored") if e is not None]
        if failed:
            raise CheckpointError(
                f"fusedist.checkpoint.Checkpointer: restoring step {step} from {path} failed on {'; '.join(failed)}. "
                "The model and optimizer state were loaded; pass objects that match the checkpoint (the same "
                "sampler settings and dataset, an LR scheduler if one was saved) and restore again")

    def _apply(self, step: int, path: str, extra: dict, per_rank: Optional[dict]) -> None:
        state = self._state
        meta = extra or {}
        if state["lr_scheduler"] is not None:
            if meta.get("lr_scheduler") is None:
                raise CheckpointError(f"fusedist.checkpoint.Checkpointer: {path} holds no LR scheduler state")
            state["lr_scheduler"].load_state_dict(meta["lr_scheduler"])
        saved_world = meta.get("world_size", self.world_size)
        sampler = state["sampler"]
        if isinstance(sampler, ElasticDistributedSampler):
            if meta.get("sampler") is None:
                raise CheckpointError(f"fusedist.checkpoint.Checkpointer: {path} holds no sampler position")
            sampler.load_state_dict(meta["sampler"])
        elif sampler is not None:
            if per_rank is not None and per_rank.get("sampler") is not None:
                sampler.load_state_dict(per_rank["sampler"])
            elif self.rank == 0:
                warnings.warn(f"fusedist.checkpoint.Checkpointer: the data position in {path} was saved at world size "
                              f"{saved_world} by a {type(sampler).__name__}, whose position belongs to one rank; it "
                              "is not restored here. Use ElasticDistributedSampler to resume at another world size",
                              stacklevel=3)
        if per_rank is not None:
            resume.restore_rng_state(per_rank["rng"])
        self.restored_step = self.last_saved_step = step
        self._set_aside_above = step
        self.restored_world_size = saved_world
        self.extra = meta.get("user")

    # ------------------------------------------------------------------ save
    def maybe_save(self, step: int, extra: Optional[dict] = None) -> bool:
        """Save if ``step`` (completed training steps) is a multiple of ``every_steps``; returns
        whether a save started. Call it on every rank after each step."""
        step = self._check_step(step, "maybe_save")
        if self.every_steps is None or step % self.every_steps or step == self.last_saved_step:
            return False
        self.save(step, extra)
        return True

    def save(self, step: int, extra: Optional[dict] = None) -> None:
        """Write the checkpoint of ``step`` now (asynchronously unless ``async_save=False``).
        A collective. ``extra``: a dict of plain values returned as ``self.extra`` at restore."""
        if self._state is None:
            raise RuntimeError("fusedist.checkpoint.Checkpointer: call restore(model, optimizer, ...) before saving; "
                               "it registers what a checkpoint holds (and returns 0 on a fresh start)")
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"fusedist.checkpoint.Checkpointer.save: extra must be a dict, got {type(extra).__name__}")
        step = self._check_step(step, "save")
        t0 = time.perf_counter()
        self._wait_previous()
        t1 = time.perf_counter()
        state = self._state
        api._check_ranks_agree(state["model"], state["optimizer"])
        snapshot = self._agreed_snapshot(step, extra)
        t2 = time.perf_counter()
        record = {"step": step, "wait_s": t1 - t0, "stall_s": t2 - t0, "bytes": self._staging.bytes,
                  "async": self.async_save}
        self.stats.append(record)
        self.last_saved_step = step
        if self.async_save:
            self._writer.submit(lambda: self._persist(step, snapshot, record))
        else:
            self._persist(step, snapshot, record)
            record["stall_s"] = time.perf_counter() - t0

    def _check_step(self, step, what: str) -> int:
        """``step`` as an int (a NumPy or 0-d tensor integer too); refuse a step that is no
        step count, or one below the last saved or restored (Note [steps only go forward])."""
        step = _step_count(step, what)
        if self.last_saved_step is not None and step < self.last_saved_step:
            raise ValueError(
                f"fusedist.checkpoint.Checkpointer.{what}({step}): this run is at step {self.last_saved_step} (its "
                f"last {'restored' if self.last_saved_step == self.restored_step else 'saved'} checkpoint), and a "
                f"checkpoint of an earlier step would never be restored while the newer ones exist. Pass the "
                f"number of completed training steps; to roll back, restore(..., step={step}) first"
            )
        return step

    def _wait_previous(self) -> None:
        try:
            self._writer.wait()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a peer died during the exchange
            step = self.last_saved_step
            where = layout.entry(self.directory, step)
            if where is not None and where.complete:
                # A peer stopped after the manifest was written (in the exchanges that follow it):
                # the checkpoint is whole, and saying it was skipped would send users to an older one.
                outcome = ("its checkpoint was written completely and loads; the failure came after its manifest, "
                           "so checkpoints older than it may not have been pruned")
            else:
                outcome = "the checkpoint is incomplete and will be skipped; earlier ones are unaffected"
            raise CheckpointError(
                f"fusedist.checkpoint.Checkpointer: rank {self.rank}: the asynchronous save of step {step} to "
                f"{layout.step_dir(self.directory, step)} failed: {type(exc).__name__}: {exc} ({outcome})"
            ) from exc

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

    def _agreed_snapshot(self, step: int, extra: Optional[dict]) -> dict:
        """:meth:`_snapshot` on every rank, or an error on every rank naming the ranks whose
        snapshot failed and why. A snapshot failing on one rank alone (a state that cannot be
        copied, a host allocation refused) left the other ranks' save waiting for that rank's
        files until the collective timeout. One small exchange per save, in the training
        thread: the coordinator's group is free here (the previous save was waited for). It
        also carries what is refused before any copy (the root: ``_root_checks.py``) and the
        ranks' data positions, which must agree (Note [one data position for the job])."""
        refused = _root_checks.claim(self.directory, self)  # Note [one saving Checkpointer per root in a process]
        if refused is None and self.rank == 0:
            refused = _root_checks.unwritable(self.directory)  # Note [a root that cannot be written]
        snapshot, error, cause, position = None, None, None, None
        try:
            if refused is None:
                position = _sampler_state.position(self._state["sampler"])
                snapshot = self._snapshot(step, extra, position[1])
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not wait
            error, cause = f"rank {self.rank}: {type(exc).__name__}: {exc}", exc
        everyone = self._coord.all_gather((error, position, refused), f"step {step}: snapshot taken")
        refusals = [f"rank {r}: {why}" for r, (_, _, why) in enumerate(everyone) if why is not None]
        if refusals:
            raise CheckpointError(f"fusedist.checkpoint.Checkpointer: cannot save step {step} to {self.directory}: "
                                  f"{'; '.join(refusals)}. Nothing was written")
        failed = [e for e, _, _ in everyone if e is not None]
        if not failed:
            differs = _sampler_state.disagreement([p for _, p, _ in everyone])
            if differs is None:
                return snapshot
            raise CheckpointError(  # Note [one data position for the job] in _sampler_state.py
                f"fusedist.checkpoint.Checkpointer: the ranks' data positions differ at step {step}: {differs}. "
                "An ElasticDistributedSampler's position is the whole job's (what all ranks consumed together), "
                "so every rank must call advance(len(batch)) after each step and set_epoch alike; saving rank "
                f"0's would repeat or skip the other ranks' samples at a resume. Nothing was written for step "
                f"{step}; earlier checkpoints are unaffected")
        message = (f"fusedist.checkpoint.Checkpointer: the snapshot of step {step} failed on "
                   f"{'; '.join(failed)}. Nothing was written for step {step}; earlier checkpoints are unaffected")
        raise CheckpointError(message) from cause

    def _snapshot(self, step: int, extra: Optional[dict], elastic_position: Optional[dict]) -> dict:
        """Copies of everything the checkpoint holds (the only part the training loop waits for)."""
        s = self._state
        model, optimizer = s["model"], s["optimizer"]
        zero = _is_zero(optimizer)
        if zero:
            optimizer.wait_for_params()
        sampler = s["sampler"]
        per_rank = {"rng": resume.capture_rng_state()}
        if sampler is not None and not isinstance(sampler, ElasticDistributedSampler):
            per_rank["sampler"] = sampler.state_dict()
        sections = {"per_rank": per_rank}
        held, sharded_keys = api.rank_sections(model, optimizer, self.rank, self.world_size)
        sections.update(held)  # ZeRO's or fully_shard's shards (Note [stage-3 checkpoints])
        common = manifest = None
        if self.rank == 0:
            meta = {"step": step, "world_size": self.world_size, "user": extra,
                    "lr_scheduler": s["lr_scheduler"].state_dict() if s["lr_scheduler"] is not None else None,
                    "sampler": elastic_position}  # the same on every rank (checked by the caller)
            common = {"model": api.common_model(model, sharded_keys),
                      "optimizer": api.full_optimizer_state(model, optimizer),
                      "scaler": s["scaler"].state_dict() if s["scaler"] is not None else None,
                      "extra": meta}
            manifest = self._manifest_base(step, model, optimizer)
        staged = self._staging.stage({"sections": sections, "common": common})
        return dict(staged, manifest=manifest)

    def _manifest_base(self, step: int, model, optimizer) -> dict:
        """The manifest :func:`fusedist.checkpoint.load` expects, less the file list."""
        base = api.manifest_base(model, optimizer, self._state["scaler"], self.world_size)
        return dict(base, checkpointer={"step": step})

    # ------------------------------------------------------------------ persist (background)
    def _persist(self, step: int, snapshot: dict, record: dict) -> None:
        """Write ``snapshot`` as ``step-<N>`` on every rank, the manifest last; then retention.
        A step the root holds complete already is rewritten beside it (Note [saving a step
        again] in ``_replace.py``)."""
        start, started = time.perf_counter(), time.time()
        path = layout.step_dir(self.directory, step)
        rank = self.rank

        def agree(error: Optional[str], what: str, kept: str = "the checkpoint is incomplete and will be skipped"):
            everyone = self._coord.all_gather(error)
            failed = [e for e in everyone if e is not None]
            if failed:
                raise CheckpointError(f"fusedist.checkpoint.Checkpointer: saving step {step} to {path} failed "
                                      f"({what}): {failed[0]}; {kept}")
            return everyone

        error, save_id = None, ""
        if rank == 0:
            try:
                # Before anything is written or removed (Note [one job per checkpoint root]).
                try:
                    lease, error = _owner.acquire(self.directory, self._run, self._run_source, self._lease,
                                                  self._lease_timeout)
                except OSError as exc:
                    lease, error = None, f"rank 0 could not write the lease {_owner.LEASE} in {self.directory}: {exc}"
                if error is None:
                    if lease is not self._lease:  # newly taken: renew it (Note [lease heartbeat])
                        self._stop_heartbeat()
                        self._heartbeat = _heartbeat.Heartbeat(self.directory, lease, self._lease_timeout)
                    self._lease = lease
                    if self._set_aside_above is not None:  # Note [a restore that rolls back]
                        moved = layout.set_aside_above(self.directory, self._set_aside_above)
                        if moved:
                            warnings.warn(f"fusedist.checkpoint.Checkpointer: this run continues from step "
                                          f"{self._set_aside_above}; the checkpoints above it, of the branch it "
                                          f"rolled back from, are set aside as {moved} under {self.directory}")
                        self._set_aside_above = None
                    save_id, error = _replace.prepare(self.directory, step)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not wait
                error = f"rank 0 could not create {path}: {type(exc).__name__}: {exc}"
        everyone = self._coord.all_gather((error, save_id))
        failed = [e for e, _ in everyone if e is not None]
        if failed:
            raise CheckpointError(f"fusedist.checkpoint.Checkpointer: saving step {step} to {path} failed "
                                  f"(creating the directory): {failed[0]}; nothing was written")
        save_id = everyone[0][1]
        kept = ("the complete checkpoint of that step written before is kept" if save_id
                else "the checkpoint is incomplete and will be skipped")
        completed = None
        try:
            self._write_files(step, path, save_id, snapshot, lambda error, what: agree(error, what, kept))
            completed = started
        finally:
            # Not once another job holds the root: the files unknown here may be its own.
            if rank == 0 and _replace.still_held(self.directory, self._lease):
                _replace.finish(path, save_id, completed)
        record["persist_s"] = time.perf_counter() - start
        if rank == 0:
            other = _owner.lost(self.directory, self._lease)
            if other is not None:  # the next save fails on every rank; prune nothing meanwhile
                warnings.warn(f"fusedist.checkpoint.Checkpointer: retention under {self.directory} skipped: {other}")
                return
            try:
                record["removed"] = layout.retain(self.directory, self.keep, step, started)
            except Exception as exc:  # noqa: BLE001 - the new checkpoint is complete; old ones stay a while longer
                warnings.warn(f"fusedist.checkpoint.Checkpointer: retention under {self.directory} failed: "
                              f"{type(exc).__name__}: {exc}")

    def _write_files(self, step: int, path: str, save_id: str, snapshot: dict, agree) -> None:
        """Every rank's file, then rank 0's common file and the manifest: the moment the
        checkpoint (or a rewrite of it) becomes the one ``path`` holds."""
        rank = self.rank
        name = api.rank_file(rank)
        mine, error = {}, None
        try:
            mine[name] = api._write(path, name, save_id, snapshot["sections"], rank=rank)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = (f"rank {rank} could not write {os.path.join(path, _files.file_name(name, save_id))}: "
                     f"{type(exc).__name__}: {exc}")
        files = self._coord.all_gather((mine, error, os.path.abspath(path)))
        agree(next((e for _, e, _ in files if e is not None), None), "writing the rank files")

        error = None
        if rank == 0:
            try:
                manifest = dict(snapshot["manifest"], files={}, created_unix=time.time())
                if save_id:
                    manifest["version"] = _files.VERSION  # files with names of their own
                for entry, _, _ in files:
                    manifest["files"].update(entry)
                # Before the manifest lists them (a Checkpointer built with another directory
                # on some rank, or one not every rank sees, would write no loadable checkpoint).
                error = _checks.unseen_rank_files(path, manifest["files"], [d for _, _, d in files])
                if error is None:
                    error = _owner.lost(self.directory, self._lease)
                if error is None:
                    manifest["files"][_files.COMMON] = api._write(path, _files.COMMON, save_id, snapshot["common"],
                                                                  rank=0)
                    _files.write_manifest(path, manifest)
            except Exception as exc:  # noqa: BLE001
                error = f"rank 0 could not complete {path}: {type(exc).__name__}: {exc}"
        agree(error, "writing the manifest")
