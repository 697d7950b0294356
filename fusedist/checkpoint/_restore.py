"""The resume path of a ``Checkpointer``: find the newest complete checkpoint under the root
(rank 0 lists, every rank tries the same candidates in turn), load it, and apply the per-rank
and job-wide state -- LR scheduler, sampler position, RNG states -- on every rank or fail on
every rank. Kept apart from the save path (``_snapshot.py``, ``_persist.py``), which it shares
only the registered objects and the coordinator with.
"""

from __future__ import annotations

import copy
import warnings
from typing import Optional

import torch

from . import _checks, _files, _load_plan, _names, _owner, api, layout, resume
from . import _optimizer_list, _preload, _visibility
from . import pipeline as pipelined
from ._files import CheckpointError
from ._writer import stage_group
from ._restore_optimizer import check_optimizer
from ._schedule import step_count
from ._persist import _sampler_epoch
from ._snapshot import epochs_differ, is_zero
from .sampler import ElasticDistributedSampler


class RestoreMixin:
    """``restore`` and its helpers, over ``Checkpointer``'s coordinator and registered objects."""

    def restore(self, model: torch.nn.Module, optimizer=None, scaler=None, *, lr_scheduler=None, sampler=None,
                step: Optional[int] = None, trusted: bool = False, strict: bool = True) -> int:
        """Load the latest complete checkpoint into the given objects and return its step (the
        number of completed training steps), or 0 when there is none. A collective.

        Also registers the objects that later saves write. Incomplete directories (a save
        killed mid-write) are skipped with a warning; a complete one that fails to load (a
        corrupt file) is reported and the next older one is tried; one whose files a rank does not
        see yet (a lagging network filesystem) is waited for, then refused, never passed over
        (Note [a checkpoint another rank does not see yet] in ``_visibility.py``). ``step`` picks a specific
        checkpoint instead. At the world size that saved it, everything -- RNG states and the
        data position included -- continues bit for bit; at another world size the optimizer
        is resharded and an ElasticDistributedSampler re-splits the rest of the epoch (a
        ResumableDistributedSampler starts the saved epoch from its beginning), while
        the per-rank RNG states (which belong to the old ranks) are left as the script set
        them. CUDA generator states are restored into the devices the saving machine and this
        one both have (with a warning when their numbers differ). Create DataLoader iterators
        after this call. ``strict=False`` resumes a model that gained or lost parameters or
        buffers since (Note [a load that is not strict] in ``_load.py``: the keys both have are
        loaded, the others left as they are and named in ``incompatible_keys``). A restore
        refused for objects that do not match the checkpoint changes none of them (Note [a
        refused restore changes nothing]).
        """
        if step is not None:
            step = step_count(step, "restore")
        _refuse_stateless_sampler(sampler, self.rank)
        if not self.pipeline and _optimizer_list.is_list(optimizer) and len(optimizer) > 1:
            model = self._optimizer_parts(model, optimizer)
        if self.pipeline:  # Note [pipelined checkpoints] in pipeline.py
            for j, (module, opt) in enumerate(pipelined.parts(model, optimizer)):
                self._stage_world(module, opt, j)
        else:
            self._check_saving_world(model, optimizer)
        self._wait_previous()  # (a save in flight counts once it completed)
        self._restores_trusted = bool(trusted)  # Note [checkpoints the restore cannot read]
        self._state = dict(model=model, optimizer=optimizer, scaler=scaler, lr_scheduler=lr_scheduler,
                           sampler=sampler)
        candidates = self._coord.broadcast(self._candidates_or_error(step) if self.rank == 0 else None)
        if isinstance(candidates, str):
            raise CheckpointError(candidates)
        failures, tried = [], False
        for saved_step, path, incomplete in candidates:
            if incomplete is not None:  # (Note [a checkpoint another rank does not see yet] in _visibility.py)
                incomplete = _visibility.await_listed(self._coord, path, saved_step, incomplete)
            if incomplete is not None:  # (Note [incomplete checkpoints below the newest complete one])
                failures.append(f"step {saved_step} ({path}): incomplete: {incomplete}")
                if self.rank == 0:
                    warnings.warn(f"fusedist.checkpoint.Checkpointer: skipping incomplete checkpoint {path} "
                                  f"(step {saved_step}): {incomplete}", stacklevel=2)
                continue
            tried = True
            # (raises where a rank's view lags: not corrupt, and an older checkpoint would undo the steps since)
            error = _visibility.await_visible(self._coord, path, saved_step)  # (a damaged file: corrupt)
            # The rank files are read first, on every rank, and the objects loaded only when
            # every rank could read its own: a file that fails after the model and optimizer
            # were loaded left them changed behind the CheckpointError that says nothing was.
            manifest = per_rank = epoch = None
            try:
                if error is None:
                    manifest = _files.read_manifest(path)  # (once: every check below reads this one)
                    per_rank = api.per_rank_of(path, manifest, self.rank, self.world_size, trusted)
                    epoch = self._saved_epoch(path, manifest, trusted)
            except CheckpointError as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - e.g. an unreadable file: every rank must learn of it
                error = f"rank {self.rank} could not read its per-rank state: {type(exc).__name__}: {exc}"
            everyone = self._coord.all_gather((error, self._epoch_restored(per_rank)))
            errors = [e for e, _ in everyone if e is not None]
            error = errors[0] if errors else _mixed_epochs([e for _, e in everyone])
            if error is None:
                self._refuse_mismatch_agreed(saved_step, path, manifest, per_rank, trusted, strict)
                try:  # (checked on every rank alike before anything is loaded: raises on all or none)
                    extra = api.load(path, model, optimizer, scaler, trusted=trusted, strict=strict,
                                     process_group=self._coord.group, pipeline=self.pipeline)
                except CheckpointError as exc:
                    error = str(exc)
            if error is None:
                if not strict:  # the model keys it left out (Note [a load that is not strict] in _load.py)
                    if self._optimizer_list is not None:  # (by the optimizers' views: in the whole model's order)
                        extra = _optimizer_list.in_torch_order(extra, self._whole_model)
                    self.incompatible_keys, extra = extra, extra.extra
                self._apply_agreed(saved_step, path, extra, per_rank, epoch, manifest)
                return saved_step
            failures.append(f"step {saved_step} ({path}): {error}")
            if self.rank == 0 and saved_step != candidates[-1][0]:
                warnings.warn(f"fusedist.checkpoint.Checkpointer: the checkpoint of step {saved_step} in {path} "
                              f"could not be loaded ({error}); trying the previous one", stacklevel=2)
        if tried or step is not None:  # (else nothing to load: a fresh start)
            raise CheckpointError("fusedist.checkpoint.Checkpointer: no checkpoint under "
                                  f"{self.directory} could be loaded: " + "; ".join(failures))
        return 0

    def _optimizer_parts(self, model, optimizers) -> list:
        """The model's views, one per optimizer, saved and restored from now on as the parts of a
        pipelined checkpoint of the whole job (Note [several optimizers over one model])."""
        parts = _optimizer_list.views(model, optimizers, "Checkpointer.restore")
        self._stage_ranks, self._stage_group = stage_group(None)
        if len(self._stage_ranks) != self.world_size:  # (the Checkpointer's process_group: not the whole job)
            raise ValueError("fusedist.checkpoint.Checkpointer.restore: a list of optimizers is checkpointed by the "
                             "whole job: create the Checkpointer without a process_group of fewer ranks")
        self.pipeline, self._optimizer_list = True, _optimizer_list.classes(optimizers)
        self._whole_model = model  # (its DDP step check: the views are bare modules)
        return parts

    def _check_saving_world(self, model, optimizer) -> None:
        """The model must be saved by the Checkpointer's ranks (Note [a Checkpointer per pipeline
        stage] in ``_writer.py``)."""
        _optimizer_list.refuse_parts(model)
        saving = api._World(optimizer, model, self._coord.group).size
        if saving != self.world_size:
            who = ("the ZeroRedundancyOptimizer shards over" if is_zero(optimizer)
                   else "the model is saved by the")
            raise ValueError(
                f"Checkpointer (rank {self.rank}): {who} {saving} ranks of its data-parallel "
                f"group, the Checkpointer's group has {self.world_size} (ranks {self._coord.ranks}): the ranks of "
                "other groups would write other models into one checkpoint. Under pipeline parallelism give "
                "each stage a Checkpointer of its own: Checkpointer(f'{root}/stage{i}', process_group=<the "
                "stage's data-parallel group, or its mesh, mesh['dp', 'tp'], for a tensor-parallel or HSDP stage>), "
                "or one Checkpointer for the job with pipeline=True and that process_group"
            )

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
        """Rank 0: ``(step, path, why it is incomplete or None)`` of the checkpoints to try, newest
        first, or an error message."""
        refused = _owner.refusal(self.directory, self._run, self._run_source, self._lease_timeout)
        if refused is not None:  # another job's root: read nothing (Note [one job per checkpoint root])
            return refused
        entries = layout.scan(self.directory)
        if step is not None:
            chosen = [e for e in entries if e.step == step]
            if chosen and chosen[0].unseen:  # waited for by restore (Note [a checkpoint another rank does not see yet])
                return [(step, chosen[0].path, chosen[0].reason)]
            if not chosen or not chosen[0].complete:
                why = chosen[0].reason if chosen else "there is no such directory"
                return (f"fusedist.checkpoint.Checkpointer: cannot restore step {step} from {self.directory}: {why} "
                        f"(complete checkpoints: steps {[e.step for e in entries if e.complete]})")
            return [(step, chosen[0].path, None)]
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
            if e.complete and e.leftovers:  # Note [saving a step again] in _replace.py
                warnings.warn(f"fusedist.checkpoint.Checkpointer: {e.path} holds files of an interrupted save of "
                              f"step {e.step} ({', '.join(e.leftovers)}), which its manifest does not list: they "
                              "are ignored, the complete checkpoint there is used, and the next complete save "
                              "removes them", stacklevel=3)
        # Note [incomplete checkpoints below the newest complete one]
        #     The incomplete ones stay in the list, newest first, for restore to skip by name when
        #     it reaches them: those below the newest complete one were skipped without a word
        #     when it failed to load, and the final error named only the checkpoints tried.
        return [(e.step, e.path, None if e.complete else e.reason) for e in entries]

    def _apply_agreed(self, step: int, path: str, extra: dict, per_rank: Optional[dict],
                      epoch: Optional[int], manifest: dict) -> None:
        """:meth:`_apply` on every rank, or an error on every rank naming the ranks where it
        failed: a sampler refusing the saved position on one rank (another seed or dataset
        there) raised on that rank alone, and the others trained on into their next
        collective, waiting for it until the timeout."""
        failed = self._failures_on_any_rank(lambda: self._apply(step, path, extra, per_rank, epoch, manifest),
                                            f"step {step}: restored")
        if failed:
            raise CheckpointError(
                f"fusedist.checkpoint.Checkpointer: restoring step {step} from {path} failed on {'; '.join(failed)}. "
                "The model and optimizer state were loaded; pass objects that match the checkpoint (the same "
                "sampler settings and dataset, an LR scheduler if one was saved) and restore again")

    def _apply(self, step: int, path: str, extra: dict, per_rank: Optional[dict],
               epoch: Optional[int], manifest: dict) -> None:
        state = self._state
        meta = extra or {}
        self._load_lr_schedulers(path, meta, manifest)  # Note [an LR scheduler per pipeline part] in _snapshot.py
        saved_world = meta.get("world_size", self.world_size)
        sampler = state["sampler"]
        position = self._saved_position(path, meta, per_rank)
        if position is not None:
            sampler.load_state_dict(position)
        elif sampler is not None:
            self._restore_epoch(path, saved_world, epoch)
        if per_rank is not None:
            resume.restore_rng_state(self._restorable_rng(path, per_rank["rng"]))
        self.restored_step = self.last_saved_step = step
        self._set_aside_above = step
        self.restored_world_size = saved_world
        self.extra = meta.get("user")

    # Note [CUDA generator states without CUDA]
    #     A checkpoint saved on GPUs holds every device's CUDA generator state, and a restore on
    #     a machine without CUDA (debugging a GPU job's checkpoint on a laptop, a CPU fallback)
    #     raised in restore_rng_state -- after the model and optimizer had been loaded, behind
    #     an error telling the user to pass other objects, which could not help. The tensors
    #     are read onto the CPU and copied into the model wherever it lives; the CUDA states,
    #     which nothing here could use, are left out with a warning saying the continuation is
    #     not the saved run's bit for bit (the other generators are restored).
    #
    # Note [CUDA generator states of another number of devices]
    #     A save holds the state of every CUDA device its rank saw (``get_rng_state_all``), and
    #     a restore on a machine with fewer devices (another node type, CUDA_VISIBLE_DEVICES
    #     narrowed) failed in ``set_rng_state_all`` on the first missing device -- after the
    #     model and optimizer had been loaded. Device ``i``'s state is restored into device
    #     ``i`` wherever both exist; the states of devices missing here are left out, devices the
    #     save did not have keep their own, and a warning says so.
    def _restorable_rng(self, path: str, rng: dict) -> dict:
        """``rng`` less the CUDA generator states where CUDA is not available, or those of the
        devices this machine does not have (Notes [CUDA generator states without CUDA], [CUDA
        generator states of another number of devices])."""
        if "cuda" not in rng:
            return rng
        if not torch.cuda.is_available():
            if self.rank == 0:
                warnings.warn(f"fusedist.checkpoint.Checkpointer: {path} holds CUDA generator states (it was saved on "
                              "GPUs) but CUDA is not available here: they are not restored (the CPU, Python and "
                              "NumPy generators are), so random draws on the GPU side do not continue the saved "
                              "run's", stacklevel=7)  # (the caller of restore)
            return {k: v for k, v in rng.items() if k != "cuda"}
        saved, here = len(rng["cuda"]), torch.cuda.device_count()
        if saved == here:
            return rng
        if self.rank == 0:
            kept = (f"devices {saved}..{here - 1} keep their own" if saved < here
                    else f"those of devices {here}..{saved - 1} are left out")
            warnings.warn(f"fusedist.checkpoint.Checkpointer: {path} holds the CUDA generator states of {saved} "
                          f"device(s), this machine has {here}: those of devices 0..{min(saved, here) - 1} are "
                          f"restored, {kept}, so random draws on another device than the saved run's may not "
                          "continue it", stacklevel=7)  # (the caller of restore)
        return dict(rng, cuda=list(rng["cuda"])[:here])

    def _saved_position(self, path: str, meta: dict, per_rank: Optional[dict]) -> Optional[dict]:
        """The state the registered sampler loads; None for none (no sampler, or a per-rank
        position saved at another world size); CheckpointError when the checkpoint holds none
        for it."""
        sampler = self._state["sampler"]
        if isinstance(sampler, ElasticDistributedSampler):
            if meta.get("sampler") is None:
                raise CheckpointError(f"fusedist.checkpoint.Checkpointer: {path} holds no sampler position")
            return meta["sampler"]
        if sampler is None:
            return None
        if per_rank is not None and per_rank.get("sampler") is not None:
            return per_rank["sampler"]
        if meta.get("world_size", self.world_size) == self.world_size:  # (saved without one: it would start over)
            raise CheckpointError(f"fusedist.checkpoint.Checkpointer: {path} holds no sampler position "
                                  f"for this {type(sampler).__name__}")
        return None

    # Note [a per-rank position at another world size]
    #     A ResumableDistributedSampler's position is an offset into one rank's share, which
    #     another world size splits otherwise: it is not restored there (documented, with a
    #     warning). Its epoch is the job's, though, and was dropped with it: the sampler went
    #     back to epoch 0's order, so a resumed job re-trained the first epoch's order instead of
    #     continuing the saved one. The saved epoch is set, from its beginning, as torch's
    #     ``set_epoch`` would. It is the job's, so the save writes it into the manifest
    #     (``checkpointer.epoch``, by ``_persist.py``); checkpoints written before it was there
    #     are read from the saving world's rank-0 file (every rank saved the same epoch), which
    #     every new rank read whole -- a ZeRO shard with it -- for one number.
    def _saved_epoch(self, path: str, manifest: dict, trusted: bool) -> Optional[int]:
        """The saved epoch of the registered sampler when its position stays behind (Note [a
        per-rank position at another world size]), else None."""
        sampler = self._state["sampler"]
        if sampler is None or isinstance(sampler, ElasticDistributedSampler):
            return None
        saved_world = manifest.get("world_size", self.world_size)
        if saved_world == self.world_size:
            return None
        job = manifest.get("checkpointer") or {}
        if "epoch" in job:
            return job["epoch"]
        first = api.per_rank_of(path, manifest, 0, saved_world, trusted)  # (an older checkpoint)
        return ((first or {}).get("sampler") or {}).get("epoch")

    def _epoch_restored(self, per_rank: Optional[dict]) -> Optional[int]:
        """The epoch this rank's saved sampler state gives the registered sampler, or None (Note
        [one epoch for the job] in ``_snapshot.py``)."""
        sampler = self._state["sampler"]
        if sampler is None or isinstance(sampler, ElasticDistributedSampler):
            return None
        return _sampler_epoch({"sections": {"per_rank": per_rank}})

    def _restore_epoch(self, path: str, saved_world: int, epoch: Optional[int]) -> None:
        """Set the saved epoch on a sampler whose position stays behind (Note [a per-rank
        position at another world size]), and say so."""
        sampler = self._state["sampler"]
        if epoch is not None:
            sampler.set_epoch(int(epoch))
        if self.rank == 0:
            kept = (f"its epoch {epoch} is restored, from the beginning of that epoch" if epoch is not None
                    else "nor is its epoch (none was saved)")
            warnings.warn(f"fusedist.checkpoint.Checkpointer: the data position in {path} was saved at world size "
                          f"{saved_world} by a {type(sampler).__name__}, whose position belongs to one rank; it "
                          f"is not restored here ({kept}). Use ElasticDistributedSampler to resume mid-epoch at "
                          "another world size", stacklevel=7)  # (the caller of restore)

    # Note [a refused restore changes nothing]
    #     The registered LR scheduler and sampler were checked against the checkpoint only after
    #     the model and optimizer had been loaded into: a sampler of another seed or dataset (a
    #     scheduler missing from the checkpoint) was refused with the model already changed,
    #     although a failed call changes nothing elsewhere. Their saved states are now read
    #     (from the job's common file, whose tensors are mapped, not read) and matched to the
    #     registered schedulers, and the sampler's tried on a shallow copy of it, on every rank
    #     before api.load; the load repeats the checks, the last word on a file it then verifies.
    #
    # Note [a model that does not match]
    #     A model of another architecture than the saved one (a layer widened, renamed or
    #     removed since) failed api.load like a corrupt file: every older checkpoint was tried
    #     in turn, each failing alike, and the error ended on the whole list. The mismatch is
    #     the user's, the same for every checkpoint of the job: the model's keys and shapes are
    #     now compared with those of the common file (mapped, as above) before the load, and a
    #     mismatch refuses the restore at once, naming the key and both shapes -- unless the
    #     common file fails its checksum, which makes it the file's fault, and an older
    #     checkpoint is tried. So are the optimizer (none saved, another algorithm, other
    #     parameters by name and shape: from the manifest) and a GradScaler none was saved for.
    #     The parameters a sharded (``fully_shard``) checkpoint keeps in its rank files are
    #     compared by the whole shapes every rank file lists; the parts of a pipelined
    #     Checkpointer, or a pipelined checkpoint's stages, by the shapes of the keys both have
    #     (which part takes which key is the load's to check). The optimizer's state itself is
    #     checked by the load.
    def _refuse_mismatch_agreed(self, step: int, path: str, manifest: dict, per_rank: Optional[dict],
                                trusted: bool, strict: bool = True) -> None:
        """Raise on every rank, naming the ranks, when the registered objects do not take what
        the checkpoint holds for them (Notes [a refused restore changes nothing], [a model that
        does not match])."""
        # (UnreadableFile: the load names what is wrong with the file, and tries an older one)
        failed = self._failures_on_any_rank(lambda: self._check_takes(path, manifest, per_rank, trusted, strict),
                                            f"step {step}: checked", tolerated=_preload.UnreadableFile)
        if failed:
            raise CheckpointError(
                f"fusedist.checkpoint.Checkpointer: restoring step {step} from {path} is refused on "
                f"{'; '.join(failed)}. Nothing was loaded, and no older checkpoint is tried (they hold the same "
                "job's state); pass objects that match the checkpoint (the model it was saved from, the same "
                "sampler settings and dataset, an LR scheduler if one was saved) and restore again")

    def _failures_on_any_rank(self, fn, label: str, tolerated=()) -> list:
        """``fn()`` on every rank, and what failed on each, as ``"rank r: Error: message"``
        (a collective: a rank that raised alone left the others waiting in their next one)."""
        error = None
        try:
            fn()
        except tolerated:
            pass
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not wait
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        return [e for e in self._coord.all_gather(error, label) if e is not None]

    def _check_takes(self, path: str, manifest: dict, per_rank: Optional[dict], trusted: bool,
                     strict: bool = True) -> None:
        common = _saved_common(path, manifest, trusted)
        meta = common.get("extra") or {}
        try:
            # (the optimizers of a pipelined Checkpointer or checkpoint, per part, are checked by
            # the load; the parts' shapes, and their LR scheduler states, from the stages' files here)
            if self._optimizer_list is not None:  # Note [several optimizers over one model]
                _optimizer_list.check_load(manifest, self._state["optimizer"], path)
            if not self.pipeline and "pipeline" not in manifest:
                self._check_objects(path, manifest, common, trusted, strict)
            else:
                self._check_part_shapes(path, manifest, common, trusted)
            self._lr_scheduler_states(path, meta, manifest)  # (raises what the load would)
            position = self._saved_position(path, meta, per_rank)
            if position is not None:
                copy.copy(self._state["sampler"]).load_state_dict(position)
        except Exception:
            _verified(path, manifest)  # a mismatch read from a corrupt file is the file's fault
            raise

    def _check_objects(self, path: str, manifest: dict, common: dict, trusted: bool, strict: bool) -> None:
        """The registered model, optimizer and scaler against the checkpoint (Note [a model
        that does not match]): the load's first checks, on the manifest and the mapped common
        file, raised as the load raises them."""
        model, optimizer, scaler = self._state["model"], self._state["optimizer"], self._state["scaler"]
        expected, sharded = _load_plan._expected_model(_names.unwrap(model))
        saved = _names.strip_prefix(_saved_model(path, manifest, common, trusted), expected)
        saved = _load_plan._cross_packed(saved, _names.unwrap(model), sharded, path)  # (NF4 weights' other form)
        _load_plan._check_model(saved, expected, path, strict)
        if optimizer is not None:
            check_optimizer(path, manifest, common, model, optimizer, trusted)
        if scaler is not None:
            if common.get("scaler") is None:
                raise CheckpointError(f"fusedist.checkpoint: {path} holds no GradScaler state")
            _checks.check_scaler(common["scaler"], scaler, path)

    def _check_part_shapes(self, path: str, manifest: dict, common: dict, trusted: bool) -> None:
        """The shapes of the keys each registered model part and the checkpoint both have (Note
        [a model that does not match]) -- a pipelined Checkpointer's parts or a pipelined
        checkpoint's stages, whose keys are shared out by the load (which checks them all)."""
        saved = _saved_model(path, manifest, common, trusted)
        for module, _ in self._parts():
            expected, sharded = _load_plan._expected_model(_names.unwrap(module))
            mine = _load_plan._cross_packed(_names.strip_prefix(saved, expected), _names.unwrap(module), sharded, path)
            _load_plan._check_model(mine, expected, path, strict=False)


def _refuse_stateless_sampler(sampler, rank: int) -> None:
    """Raise when ``sampler`` cannot save its position (no ``state_dict`` / ``load_state_dict``:
    torch's ``DistributedSampler``, a ``RandomSampler``, a DataLoader passed by mistake). It was
    registered without a word, and every later save failed in its snapshot with an
    AttributeError; a restore from a checkpoint said only that it held no position for it."""
    if sampler is None or all(callable(getattr(sampler, m, None)) for m in ("state_dict", "load_state_dict")):
        return
    raise TypeError(
        f"Checkpointer.restore (rank {rank}): the sampler, a {type(sampler).__name__}, has no state_dict() and "
        "load_state_dict(), so its data position cannot be saved or restored. Use "
        "fusedist.checkpoint.ElasticDistributedSampler (torch's DistributedSampler, resumable mid-epoch at any world "
        "size; report what was trained with sampler.advance(len(batch))), or pass sampler=None")


def _mixed_epochs(epochs: list) -> Optional[str]:
    """Why a checkpoint whose ranks saved different sampler epochs is not restored (written
    before saves refused them: Note [one epoch for the job] in ``_snapshot.py``), or None."""
    differs = epochs_differ(epochs)
    if differs is None:
        return None
    return (f"its ranks saved different data positions ({differs}): each rank would resume in another epoch's "
            "order. It was written by ranks that called set_epoch differently")


def _saved_model(path: str, manifest: dict, common: dict, trusted: bool) -> dict:
    """Every model entry of the checkpoint by its saved key: the common files' tensors (mapped),
    and the parameters sharded (``fully_shard``) checkpoints keep in their rank files as empty
    tensors of their whole shapes, for the checks before the load."""
    files = manifest["files"]
    saved = {} if "pipeline" in manifest else dict(common.get("model") or {})
    for stage in manifest.get("pipeline", []):  # Note [pipelined checkpoints] in pipeline.py
        saved.update(_preload.peek(path, files, stage["common"], trusted).get("model") or {})
    for name, section in _sharded_sections(manifest):  # every rank's names all sharded parameters
        shard = _preload.peek(path, files, name, trusted, section)
        saved.update((k, torch.empty(meta["shape"], device="meta"))
                     for k, meta in zip(shard["keys"], shard["param_meta"]))
    return saved


def _sharded_sections(manifest: dict) -> list:
    """``(rank file, section)`` of one ``model_shard`` section of each sharded model (stage)."""
    files = manifest["files"]

    def held(name: str, section: str) -> bool:
        return section in files.get(name, {}).get("sections", [])

    if "pipeline" in manifest:
        found = [(api.rank_file(s["ranks"][0]), pipelined._section("model_shard", s["part"]))
                 for s in manifest["pipeline"] if s.get("model_sharded")]
        return [(n, section) for n, section in found if held(n, section)]
    if not manifest.get("model_sharded"):
        return []
    return [(n, "model_shard") for n in sorted(files) if held(n, "model_shard")][:1]


def _model_files(manifest: dict) -> list:
    """The files :func:`_saved_model` reads, beside the common file."""
    commons = [s["common"] for s in manifest.get("pipeline", [])]
    return commons + [n for n, _ in _sharded_sections(manifest)]


def _saved_common(path: str, manifest: dict, trusted: bool) -> dict:
    """The checkpoint's common file (the Checkpointer's state in its ``extra``), read with the
    tensors memory-mapped (they are the load's), unverified (the load verifies the file)."""
    common = _preload.peek(path, manifest["files"], _files.COMMON, trusted)
    return common if isinstance(common, dict) else {}


def _verified(path: str, manifest: dict) -> None:
    """Raise UnreadableFile when a file the checks read does not match its manifest entry: the
    common files, and a rank file whose ``model_shard`` section gave the sharded shapes."""
    files = manifest["files"]
    try:
        for name in dict.fromkeys([_files.COMMON] + _model_files(manifest)):
            _files.verify_file(path, name, files[name])
    except Exception as exc:  # noqa: BLE001
        raise _preload.UnreadableFile(str(exc)) from exc
