"""The background part of a ``Checkpointer`` save, run on its writer thread (``_writer.py``):
take or keep the root's lease, make the step directory (beside a complete one of the same
step), write every rank's file, then the common file and the manifest, and prune by retention.
Every step is agreed over the writer's own process group, so a failure on one rank fails the
save on every rank (Note [asynchronous save] in ``periodic.py``).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Optional

from . import _checks, _failed_save, _files, _heartbeat, _owner, _replace, api, layout
from ._files import CheckpointError


class PersistMixin:
    """``_persist`` and ``_write_files`` of ``Checkpointer``, over its coordinator, lease and
    heartbeat."""

    def _persist(self, step: int, snapshot: dict, record: dict) -> None:
        """Write ``snapshot`` as ``step-<N>`` on every rank, the manifest last; then retention.
        A step the root holds complete already is rewritten beside it (Note [saving a step
        again] in ``_replace.py``). The ranks wait for each other's I/O without the collective
        deadline (Note [waiting for a peer's I/O] in ``_writer.py``)."""
        with self._coord.io_round():
            self._persist_round(step, snapshot, record)

    def _persist_round(self, step: int, snapshot: dict, record: dict) -> None:
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
        self._coord.io_wait("creating the directory")
        everyone = self._coord.all_gather((error, save_id))
        failed = [e for e, _ in everyone if e is not None]
        if failed:
            raise CheckpointError(f"fusedist.checkpoint.Checkpointer: saving step {step} to {path} failed "
                                  f"(creating the directory): {failed[0]}; nothing was written")
        save_id = self._flight_id = everyone[0][1]  # what a failure left is told by it (periodic.py)
        kept = ("the complete checkpoint of that step written before is kept" if save_id
                else "the incomplete checkpoint is removed; earlier ones are unaffected")
        completed, failure = None, None
        try:
            self._write_files(step, path, save_id, snapshot, lambda error, what: agree(error, what, kept))
            completed = started
        except Exception as exc:
            failure = exc
            raise
        finally:
            # Not once another job holds the root: the files unknown here may be its own.
            if rank == 0 and _replace.still_held(self.directory, self._lease):
                _replace.finish(path, save_id, completed)
                if failure is not None and _failed_save.peers_done(failure):  # Note [a failed save leaves nothing]
                    _failed_save.remove_step_directory(path, save_id)
        record["persist_s"] = time.perf_counter() - start
        if rank == 0:
            other = _owner.lost(self.directory, self._lease)
            if other is not None:  # the next save fails on every rank; prune nothing meanwhile
                warnings.warn(f"fusedist.checkpoint.Checkpointer: retention under {self.directory} skipped: {other}")
                return
            try:
                record["removed"] = layout.retain(self.directory, self.keep, step, started)
                _owner.remove_stale_temporaries(self.directory, started)
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
            for name, content in snapshot.get("stage_files", {}).items():  # Note [pipelined checkpoints]
                mine[name] = api._write(path, name, save_id, content, rank=rank)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = (f"rank {rank} could not write {os.path.join(path, _files.file_name(name, save_id))}: "
                     f"{type(exc).__name__}: {exc}")
        self._coord.io_wait("writing the rank files")
        files = self._coord.all_gather((mine, error, os.path.abspath(path), _sampler_epoch(snapshot)))
        agree(next((e for _, e, *_ in files if e is not None), None), "writing the rank files")

        error = None
        if rank == 0:
            try:
                manifest = dict(snapshot["manifest"], files={}, created_unix=time.time())
                if save_id:
                    # files with names of their own
                    manifest["version"] = max(manifest["version"], _files.SAVE_ID_VERSION)
                for entry, *_ in files:
                    manifest["files"].update(entry)
                # Note [a per-rank position at another world size] in _restore.py: the job's epoch
                epoch = next((e for *_, e in files if e is not None), None)
                manifest["checkpointer"] = dict(manifest.get("checkpointer") or {}, epoch=epoch)
                # Before the manifest lists them (a Checkpointer built with another directory
                # on some rank, or one not every rank sees, would write no loadable checkpoint).
                error = _checks.unseen_rank_files(path, manifest["files"], [d for _, _, d, _ in files])
                if error is None:
                    error = _owner.lost(self.directory, self._lease)
                if error is None:
                    manifest["files"][_files.COMMON] = api._write(path, _files.COMMON, save_id, snapshot["common"],
                                                                  rank=0)
                    _files.write_manifest(path, manifest)
            except Exception as exc:  # noqa: BLE001
                error = f"rank 0 could not complete {path}: {type(exc).__name__}: {exc}"
        self._coord.io_wait("writing the manifest")
        agree(error, "writing the manifest")


def _sampler_epoch(snapshot: dict) -> Optional[int]:
    """The epoch of this rank's per-rank sampler state in ``snapshot`` (a
    ResumableDistributedSampler's), else None."""
    per_rank = (snapshot.get("sections") or {}).get("per_rank") or {}
    epoch = (per_rank.get("sampler") or {}).get("epoch")
    return None if epoch is None else int(epoch)
