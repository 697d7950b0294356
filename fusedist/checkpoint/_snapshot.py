"""The training thread's part of a ``Checkpointer`` save: the snapshot (host copies of
everything a checkpoint holds, in reused staging buffers) and the one exchange that makes every
rank agree it succeeded, before any background work starts (Note [asynchronous save] in
``periodic.py``). What is written from the snapshot, and when, is ``_persist.py``'s.
"""

from __future__ import annotations

from typing import Optional

from . import _checks, _load_plan, _names, _root_checks, _safe_values, _sampler_state, _sections, api, resume
from . import _preload
from . import pipeline as pipelined
from ._files import CheckpointError
from ._optimizer_list import MANIFEST_KEY
from ._persist import _sampler_epoch
from .sampler import ElasticDistributedSampler


def is_zero(optimizer) -> bool:
    """Whether ``optimizer`` is a ZeroRedundancyOptimizer: the snapshot waits for its parameters,
    and ``restore`` checks that it shards over the whole job."""
    from ..zero import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def lr_schedulers(lr_scheduler) -> list:
    """The registered LR schedulers: none, one, or a list of them."""
    if lr_scheduler is None:
        return []
    return list(lr_scheduler) if isinstance(lr_scheduler, (list, tuple)) else [lr_scheduler]


# Note [an LR scheduler per pipeline part]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under pipeline parallelism each model part has an optimizer of its own and an LR scheduler
# over it: the parts' schedules may differ (each part's learning rates, its own schedule), and
# a stage without parameters has neither (Note [an optimizer per pipeline stage] in _checks.py).
# A pipelined Checkpointer takes one scheduler per part, in the parts' order (None for a part
# without one); the ranks of one stage register alike (a scheduler or None), stages may differ.
# Each part's state is saved with its stage (its common file, beside the optimizer's), and at
# restore each part's scheduler gets the state of the stage that saved its layers (the first
# of them with one, for a part of another split: pipeline.prepare). The first part's state,
# saved by rank 0 alone and loaded into every part, gave each part the first part's base
# learning rates and schedule, and a job with a stage without a scheduler was refused. Rank 0
# still writes its first part's state job-wide, for readers of checkpoints without per-stage
# states (a pipelined Checkpointer given an ordinary checkpoint loads it into every part).
def part_schedulers(lr_scheduler, count: int, rank: int) -> list:
    """A pipelined Checkpointer's LR scheduler of each of its ``count`` model parts, None where a
    part has none (Note [an LR scheduler per pipeline part])."""
    if lr_scheduler is None:
        return [None] * count
    listed = lr_schedulers(lr_scheduler)
    if len(listed) != count:
        raise ValueError(f"fusedist.checkpoint.Checkpointer (rank {rank}): {count} model part(s) and {len(listed)} "
                         "LR schedulers: pass a list of one per part, in the parts' order (None for a part without "
                         "one); each part's schedule is saved with its stage")
    return listed


# Note [one epoch for the job]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A ResumableDistributedSampler's offset is its rank's, but its epoch is the job's (set_epoch
# alike on every rank): each rank restores its own saved state at the same world size, and the
# manifest keeps one epoch for another world size. Ranks that saved different epochs (a
# set_epoch skipped on one rank) were saved without a word and restored so, each rank reading
# another epoch's order -- or, at another world size, every rank the first rank's epoch. A save
# whose ranks' epochs differ is now refused on every rank before anything is written, and a
# restore refuses a checkpoint written so before (an older one is tried, as for a corrupt one).
def epochs_differ(epochs: list) -> Optional[str]:
    """What differs between the ranks' saved sampler epochs (None where a rank saves none: a
    pipeline stage without a sampler), naming the ranks, or None (Note [one epoch for the job])."""
    ranks: dict = {}
    for rank, epoch in enumerate(epochs):
        if epoch is not None:
            ranks.setdefault(int(epoch), []).append(rank)
    if len(ranks) < 2:
        return None
    return "the sampler's epoch is " + ", ".join(f"{epoch} on ranks {rs}" for epoch, rs in ranks.items())


def _pipelined(path: str, manifest: Optional[dict]) -> bool:
    """Whether ``path`` holds a pipelined checkpoint, by its ``manifest`` when it was read."""
    return "pipeline" in manifest if manifest is not None else pipelined.is_pipelined(path)


class SnapshotMixin:
    """The snapshot of ``Checkpointer.save``, over its coordinator, staging buffers and
    registered objects."""

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
        snapshot, error, cause, position, shapes = None, None, None, None, {}
        try:
            if refused is None:
                shapes = self._model_shapes()  # Note [one model per save] in _checks.py
                position = _sampler_state.position(self._state["sampler"])
                snapshot = self._snapshot(step, extra, position[1])
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not wait
            error, cause = f"rank {self.rank}: {type(exc).__name__}: {exc}", exc
        stages = (snapshot["stages"], snapshot["entries"]) if self.pipeline and snapshot is not None else None
        digests = {part: _checks.keys_digest(keys) for part, keys in shapes.items()}
        epoch = _sampler_epoch(snapshot) if snapshot is not None else None  # Note [one epoch for the job]
        everyone = self._coord.all_gather((error, position, refused, stages, epoch, self._registered(), digests),
                                          f"step {step}: snapshot taken")
        refusals = [f"rank {r}: {why}" for r, (_, _, why, *_) in enumerate(everyone) if why is not None]
        if refusals:
            raise CheckpointError(f"fusedist.checkpoint.Checkpointer: cannot save step {step} to {self.directory}: "
                                  f"{'; '.join(refusals)}. Nothing was written")
        registered = [job for *_, (job, _), _ in everyone]
        unlike = "; ".join(f"{field} is {d}" for field in registered[0] if (d := _checks._differs(registered, field)))
        if unlike:  # Note [the same objects on every rank]
            raise CheckpointError(
                f"fusedist.checkpoint.Checkpointer: the ranks registered different objects at restore(): {unlike}. "
                "A checkpoint is one job's state, which every rank restores: pass the same kinds of objects on "
                f"every rank. Nothing was written for step {step}; earlier checkpoints are unaffected")
        _checks.check_stage_optimizers([held for *_, (_, held), _ in everyone],  # Note [an LR scheduler per
                                       "fusedist.checkpoint.Checkpointer (registered at restore())",  # pipeline part]
                                       f"written for step {step}; earlier checkpoints are unaffected", "LR scheduler")
        _checks.check_same_keys([d for *_, d in everyone], lambda: self._coord.all_gather(
            shapes, f"step {step}: model keys"), f"fusedist.checkpoint.Checkpointer (step {step})")
        failed = [e for e, *_ in everyone if e is not None]
        if not failed:
            positions, infos = [p for _, p, *_ in everyone], [info for _, _, _, info, *_ in everyone]
            differs = self._positions_differ(positions, infos)
            epochs = epochs_differ([e for *_, e, _, _ in everyone])
            if epochs is not None:
                raise CheckpointError(  # Note [one epoch for the job]
                    f"fusedist.checkpoint.Checkpointer: the ranks' data positions differ at step {step}: {epochs}. "
                    "A sampler's epoch is the job's: call set_epoch(epoch) alike on every rank; each rank would "
                    f"resume in another epoch's order. Nothing was written for step {step}; earlier checkpoints "
                    "are unaffected")
            if differs is None:
                if self.pipeline:
                    self._place_stages(step, snapshot, infos)
                    if self.rank == 0:  # Note [a sampler per pipeline stage]
                        snapshot["common"]["extra"]["sampler"] = next((p for _, p in positions if p is not None), None)
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

    # Note [a sampler per pipeline stage]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Under pipeline parallelism only the stages that read data hold a sampler (the first stage
    # its inputs, the last its labels; the stages between none), and every rank's sampler was
    # compared with every other's: such a job was refused at its first save ("the sampler passed
    # to restore() is ElasticDistributedSampler on ranks [0, 1], None on ranks [2, 3]"). A
    # pipelined Checkpointer compares the samplers' kinds within each stage, and the positions
    # of the ElasticDistributedSamplers across the job (the stages read the same batches: one
    # data position, Note [one data position for the job] in _sampler_state.py); rank 0 writes
    # that position whether or not it holds a sampler itself.
    def _positions_differ(self, positions: list, infos: list) -> Optional[str]:
        """What differs between the ranks' ``_sampler_state.position`` (Note [a sampler per
        pipeline stage]), or None. ``infos``: every rank's ``(its parts' stages, entries)``."""
        if not self.pipeline:
            return _sampler_state.disagreement(positions)
        kinds: dict = {}
        for r, ((kind, _), (stages, _)) in enumerate(zip(positions, infos)):
            kinds.setdefault(stages[0], {}).setdefault(kind, []).append(r)
        for ranks, of_kind in kinds.items():
            if len(of_kind) > 1:
                return (f"the sampler passed to restore() by the ranks of one pipeline stage ({list(ranks)}) is "
                        + ", ".join(f"{kind} on ranks {rs}" for kind, rs in of_kind.items()))
        elastic = [p for p in positions if p[1] is not None]
        if not elastic:
            return None
        # the ranks without an ElasticDistributedSampler agree with any position
        return _sampler_state.disagreement([p if p[1] is not None else elastic[0] for p in positions])

    def _model_shapes(self) -> dict:
        """Each model part's keys and whole shapes, by a name the ranks saving it share."""
        held = self._parts()
        if not self.pipeline:
            return {"model": _sections.model_shapes(held[0][0])}
        return {f"part {j} of ranks {list(self._stage_ranks)}": _sections.model_shapes(m)
                for j, (m, _) in enumerate(held)}

    def _registered(self) -> tuple:
        """Note [the same objects on every rank]: rank 0 writes the job's GradScaler and LR
        scheduler state. Registered on some ranks only, the saves went through without it (or
        with rank 0's alone), and a restart passing the same objects could load none of them
        (``holds no LR scheduler state`` / ``holds no GradScaler state``, on every checkpoint).
        Returns what the job's ranks compare, and ``[(stage, label, scheduler)]`` of each part
        that the ranks of its stage compare (Note [an LR scheduler per pipeline part])."""
        job = {"scaler": "a GradScaler" if self._state["scaler"] is not None else "None"}
        if not self.pipeline:
            job["lr_scheduler"] = "an LR scheduler" if lr_schedulers(self._state["lr_scheduler"]) else "None"
            return job, []
        try:
            schedulers = part_schedulers(self._state["lr_scheduler"], len(self._parts()), self.rank)
        except ValueError:  # raised by the snapshot, on every rank
            schedulers = []
        ranks = tuple(self._stage_ranks)
        return job, [((ranks, j), f"part {j} of ranks {list(ranks)}", "None" if s is None else "an LR scheduler")
                     for j, s in enumerate(schedulers)]

    def _load_lr_schedulers(self, path: str, meta: dict, manifest: dict) -> None:
        """The restore's half of Note [an LR scheduler per pipeline part], beside the save of the
        same states: each registered scheduler's state, checked for every part before any is
        loaded."""
        for scheduler, state in self._lr_scheduler_states(path, meta, manifest):
            if scheduler is not None:
                scheduler.load_state_dict(state)

    def _lr_scheduler_states(self, path: str, meta: dict, manifest: Optional[dict] = None) -> list:
        """``[(registered scheduler or None, its saved state)]``, or CheckpointError when the
        checkpoint holds none for a registered one. ``meta``: the load's ``extra``, or before the
        load the job's common file's (the per-part states are then read from the stages' files).
        Without per-part states (an ordinary checkpoint, or one saved before them) the job's one
        state goes into each part whose param groups it fits; a Checkpointer of the whole model
        takes the state of the first stage with one. ``manifest``: the checkpoint's, as the
        restore read it (read here when not given)."""
        per_part = meta.get(pipelined.PART_LR_SCHEDULERS)
        if per_part is None and self._state["lr_scheduler"] is not None and _pipelined(path, manifest):
            # before the load (Note [LR scheduler states before the load] in _preload.py)
            per_part = _preload.part_lr_scheduler_states(
                path, self._state["model"], self._state["optimizer"], self._trusted())
        if self.pipeline:
            schedulers = part_schedulers(self._state["lr_scheduler"], len(self._parts()), self.rank)
            states = per_part if per_part is not None else self._whole_model_lr_scheduler_states(path, meta,
                                                                                                  schedulers)
            self._check_scheduled_groups(path, schedulers, states)
        else:
            schedulers = lr_schedulers(self._state["lr_scheduler"])
            if len(schedulers) > 1 or (schedulers and meta.get("lr_schedulers") is not None):
                states = self._several_lr_scheduler_states(path, meta, len(schedulers))
            else:
                states = [meta.get("lr_scheduler") if per_part is None else per_part[0]] * len(schedulers)
                if per_part is not None:  # a stage's schedule, loaded by name (as a pipelined Checkpointer's)
                    self._check_scheduled_groups(path, schedulers, states)
        lacking = [j for j, (scheduler, state) in enumerate(zip(schedulers, states))
                   if scheduler is not None and state is None]
        if lacking:
            which = f" for model part(s) {lacking} (their stages were saved without one)" if self.pipeline else ""
            raise CheckpointError(f"fusedist.checkpoint.Checkpointer: {path} holds no LR scheduler state{which}")
        return list(zip(schedulers, states))

    def _trusted(self) -> bool:
        """Whether the restore reads its checkpoints fully unpickled (``trusted=True``)."""
        return getattr(self, "_restores_trusted", False)

    def _whole_model_lr_scheduler_states(self, path: str, meta: dict, schedulers: list) -> list:
        """The states of a pipelined Checkpointer's part schedulers from a checkpoint of the whole
        model: its one state for each (a part whose groups it does not fit is refused:
        :meth:`_check_scheduled_groups`)."""
        if any(s is not None for s in schedulers) and meta.get("lr_schedulers") is not None:
            raise CheckpointError(f"fusedist.checkpoint.Checkpointer: {path} holds the states of "  # Note [several
                                  f"{len(meta['lr_schedulers'])} LR schedulers of the whole model, which cannot be "
                                  "told apart into one per model part: restore without lr_scheduler= and set the "
                                  "parts' schedulers yourself")  # LR schedulers of one model]
        return [meta.get("lr_scheduler")] * len(schedulers)

    def _check_scheduled_groups(self, path: str, schedulers: list, states: list) -> None:
        """Refuse a part's saved LR scheduler state that belongs to other param groups than its
        optimizer's (Note [LR scheduler states before the load] in _preload.py)."""
        held = pipelined.parts(self._state["model"], self._state["optimizer"])  # (a list of one optimizer too)
        for j, ((module, optimizer), scheduler, state) in enumerate(zip(held, schedulers, states)):
            why = None if scheduler is None or state is None else _preload.lr_scheduler_group_mismatch(
                path, module, optimizer, self._trusted())
            if why is not None:
                raise CheckpointError(f"fusedist.checkpoint.Checkpointer: cannot load the LR scheduler state of "
                                      f"model part {j} (rank {self.rank}): {why}")

    # Note [several LR schedulers of one model]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A Checkpointer of the whole model may be given a list of LR schedulers (a warmup and a
    # decay stepped side by side on one optimizer, say). Each has its own state (its step count,
    # base learning rates); the first one's was saved and loaded into each, so the second
    # resumed with the first's schedule position. Their states are saved in order, and a restore
    # registering another number of schedulers is refused: which saved state belongs to which
    # registered scheduler cannot be told.
    @staticmethod
    def _several_lr_scheduler_states(path: str, meta: dict, count: int) -> list:
        """The saved states of ``count`` LR schedulers of one model, in their order (Note
        [several LR schedulers of one model])."""
        states = meta.get("lr_schedulers")
        if states is not None and len(states) == count:
            return states
        if states is None and meta.get("lr_scheduler") is None:
            return [None] * count  # (refused by the caller: no LR scheduler state)
        held = "one LR scheduler's state" if states is None else f"the states of {len(states)} LR schedulers"
        raise CheckpointError(f"fusedist.checkpoint.Checkpointer: {path} holds {held}, and restore() registered "
                              f"{count}: pass the schedulers it was saved with, in their order")

    def _snapshot(self, step: int, extra: Optional[dict], elastic_position: Optional[dict]) -> dict:
        """Copies of everything the checkpoint holds (the only part the training loop waits for)."""
        s = self._state
        held = self._parts()
        for _, optimizer in held:
            if is_zero(optimizer):
                optimizer.wait_for_params()
        sampler = s["sampler"]
        per_rank = {"rng": resume.capture_rng_state()}
        if sampler is not None and not isinstance(sampler, ElasticDistributedSampler):
            per_rank["sampler"] = sampler.state_dict()
        sections = {"per_rank": per_rank}
        scaler = s["scaler"].state_dict() if s["scaler"] is not None else None
        schedulers = part_schedulers(s["lr_scheduler"], len(held), self.rank) if self.pipeline else \
            lr_schedulers(s["lr_scheduler"])
        scheduled = [None if x is None else x.state_dict() for x in schedulers]
        common = manifest = None
        stage_commons, entries = {}, {}
        if self.pipeline:  # Note [pipelined checkpoints] in pipeline.py
            for j, (model, optimizer) in enumerate(held):
                world = self._stage_world(model, optimizer, j)
                part, sharded_keys = _sections.rank_sections(model, optimizer, world.rank, world.size)
                sections.update({f"{name}.{j}": value for name, value in part.items()})
                if world.rank == 0:  # (the part's LR scheduler: Note [an LR scheduler per pipeline part])
                    stage_commons[j] = {"model": _sections.common_model(model, sharded_keys),
                                        "optimizer": _sections.full_optimizer_state(model, optimizer), "scaler": scaler,
                                        "lr_scheduler": scheduled[j]}
                    keys = sorted(_load_plan._expected_model(_names.unwrap(model))[0])
                    entries[j] = dict(_sections.manifest_base(model, optimizer, s["scaler"], world.size),
                                      ranks=list(self._stage_ranks), part=j, keys=keys)
        else:
            model, optimizer = held[0]
            part, sharded_keys = _sections.rank_sections(model, optimizer, self.rank, self.world_size)
            sections.update(part)  # ZeRO's or fully_shard's shards (Note [stage-3 checkpoints])
        if self.rank == 0:
            meta = {"step": step, "world_size": self.world_size, "user": extra,
                    "lr_scheduler": next((x for x in scheduled if x is not None), None),
                    # Note [several LR schedulers of one model]
                    "lr_schedulers": scheduled if not self.pipeline and len(scheduled) > 1 else None,
                    "sampler": elastic_position}  # the same on every rank (checked by the caller)
            common = {"model": {}, "optimizer": None, "scaler": None, "extra": meta}
            if not self.pipeline:
                common.update(model=_sections.common_model(model, sharded_keys),
                              optimizer=_sections.full_optimizer_state(model, optimizer), scaler=scaler)
                manifest = self._manifest_base(step, model, optimizer)
        if not self._trusted():
            self._refuse_unreadable(sections, common, stage_commons)
        staged = self._staging.stage({"sections": sections, "common": common, "stage_commons": stage_commons})
        return dict(staged, manifest=manifest, entries=entries,
                    stages=[tuple(self._stage_ranks or ()) for _ in held])

    def _stage_world(self, model, optimizer, j: int):
        """The ranks that save part ``j`` (its sharding's, over the stage's group), which must be
        the stage's: another split saves other shards under one stage's name."""
        world = api._World(optimizer, model, self._stage_group)
        if world.size != len(self._stage_ranks):
            raise ValueError(f"Checkpointer (rank {self.rank}): part {j} is sharded over {world.size} ranks, its "
                             f"stage's process_group has {len(self._stage_ranks)} ({self._stage_ranks}); pass the "
                             "stage's group (its mesh, for a tensor-parallel or HSDP stage)")
        return world

    def _place_stages(self, step: int, snapshot: dict, infos: list) -> None:
        """Once every rank's snapshot is taken: the file each stage's common state goes to, and
        on rank 0 the manifest listing the stages (Note [pipelined checkpoints])."""
        members = [stages for stages, _ in infos]
        pipelined.check_stages(members)
        pipelined.check_names({(stages[j], j): entry["keys"] for stages, entries in infos
                               for j, entry in entries.items()})
        order = pipelined.stage_order(members)
        mine = snapshot["stages"]
        snapshot["stage_files"] = {pipelined.stage_common_file(order.index((mine[j], j))): content
                                   for j, content in snapshot["stage_commons"].items()}
        if self.rank == 0:
            entries = {order.index((stages[j], j)): entry for stages, of_rank in infos for j, entry in of_rank.items()}
            listed = {} if self._optimizer_list is None else {MANIFEST_KEY: self._optimizer_list}
            snapshot["manifest"] = dict(pipelined.manifest(entries, self.world_size), checkpointer={"step": step},
                                        **listed)  # Note [several optimizers over one model] in _optimizer_list.py

    @staticmethod
    def _refuse_unreadable(sections: dict, common: Optional[dict], stage_commons: Optional[dict] = None) -> None:
        """Raise TypeError naming the first value this job's restore (not trusted) could not
        read back (Note [checkpoints the restore cannot read] in ``_safe_values.py``)."""
        meta = (common or {}).get("extra") or {}
        held = [common or {}] + list((stage_commons or {}).values())
        parts = [("extra", meta.get("user")), ("the LR scheduler's state_dict()", meta.get("lr_scheduler")),
                 ("the LR schedulers' state_dict()", meta.get("lr_schedulers"))]
        for c in held:
            parts += [("the GradScaler's state_dict()", c.get("scaler")),
                      ("the LR scheduler's state_dict()", c.get("lr_scheduler")),
                      ("the optimizer's state_dict()", c.get("optimizer")),
                      ("the model's state_dict()", c.get("model"))]
        parts += [("the optimizer's state" if name.startswith("optimizer_shard") else "the model's state", value)
                  for name, value in sections.items() if name.startswith(("optimizer_shard", "model_shard"))]
        for label, value in parts:
            found = _safe_values.first_unreadable(value, label)
            if found is not None:
                raise TypeError(
                    f"{found} could not be read back by restore(), which this job called without trusted=True "
                    "(its safe loader takes tensors, numbers, strings and containers of them): convert it "
                    "(float(x), int(x), torch.from_numpy(a)), or restore with trusted=True if you trust this "
                    "checkpoint directory")

    def _manifest_base(self, step: int, model, optimizer) -> dict:
        """The manifest :func:`fusedist.checkpoint.load` expects, less the file list."""
        base = _sections.manifest_base(model, optimizer, self._state["scaler"], self.world_size)
        return dict(base, checkpointer={"step": step})
