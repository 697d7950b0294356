"""Pipelined checkpoints: every stage of a pipeline-parallel job in one directory, loadable
into another pipeline split (``save(..., pipeline=True)`` / ``load(..., pipeline=True)``).

Note [pipelined checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under pipeline parallelism the ranks of each stage hold other parameters, sharded over that
stage's data-parallel (or HSDP / tensor-parallel) group. A save with ``pipeline=True`` is a
collective of the whole job: every rank passes its model part -- a list of them where a rank
holds several stages, as interleaved and V schedules place them -- with one optimizer per part
(None for a stage without parameters: the ranks of each stage pass the same, Note [an optimizer
per pipeline stage] in ``_checks.py``).
Each part and the group of ranks holding it form one *stage* of the checkpoint. Its ranks write
what an ordinary save over that group writes into their own files (``rank-<job rank>.pt``,
sections suffixed with the part's slot on the rank, ``model_shard.0``); the stage's first rank
writes ``common-stage-<k>.pt`` (the state its ranks hold alike, an unsharded optimizer, the
GradScaler); rank 0 of the job writes ``common.pt`` (``extra``) and last the manifest, which
lists each stage's ranks, files, model keys and optimizer metadata. The atomicity and the
one-save-at-a-time rules are those of every save: the manifest is the switch.

State-dict keys are the parts' own. A stage module cut from the whole model with the other
layers removed (torchtitan's split) keeps the whole model's names, and that is what lets a
checkpoint load into another split: at load, each part takes from the stages holding any of
its keys the model entries it has, its optimizer parameters' state by parameter name, and each
param group's hyperparameters from the saved group its parameters were in (parameters of one
group here must come from groups with the same hyperparameters; a part without state, whose
optimizer holds no parameters, takes the groups of the stage saved without state, as torch's
``Optimizer.load_state_dict`` sets an empty group's). A strict load also checks
across the job that the parts together take every model key and every parameter's optimizer
state of the checkpoint: a part left without its ``pipeline=True`` (or a model a key short) is
refused on every rank before any rank loads anything, as every load is.

Any job can load a pipelined checkpoint (a data-parallel one of the whole model reads every
stage); and a job with ``pipeline=True`` can load an ordinary checkpoint of the whole model,
each part taking its entries -- pipeline parallelism added to a run, or its degree changed --
or torch's distributed checkpoint of a pipeline-parallel job (torchtitan's: every stage's
state by name in one checkpoint, the optimizer's flattened by name).
Each rank reads the files of the stages its parts need: at most the whole model and its
optimizer state in CPU memory, as an ordinary load resharding an optimizer reads.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

from ..zero import ZeroRedundancyOptimizer
from ..zero import state as zstate
from . import (_checks, _files, _from_dcp, _given_up, _load_plan, _names, _pipeline_dcp, _save_entry, _sections,
               _which_checkpoint, api, stage3)
from ._files import CheckpointError
from ._optimizer_list import MANIFEST_KEY
from ._params import labeller, optimizer_params, param_names


#: the key of each part's LR scheduler state in a Checkpointer's ``extra`` as :func:`load`
#: returns it (Note [an LR scheduler per pipeline part] in ``_snapshot.py``)
PART_LR_SCHEDULERS = "part_lr_schedulers"


def job_world() -> "api._World":
    """Every rank of the job (the default group): a pipelined save or load is its collective."""
    return api._World(None, None, None)


def stage_common_file(k: int) -> str:
    return f"common-stage-{k:03d}.pt"


def _section(name: str, part: Optional[int]) -> str:
    return name if part is None else f"{name}.{part}"


def parts(model, optimizer) -> list[tuple]:
    """``(module, optimizer)`` of each model part this rank holds."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if not models:
        raise ValueError("fusedist.checkpoint: the list of model parts is empty")
    if isinstance(optimizer, (list, tuple)):
        optimizers = list(optimizer)
        if len(optimizers) != len(models):
            raise ValueError(f"fusedist.checkpoint: {len(models)} model parts and {len(optimizers)} optimizers; "
                             "pass one optimizer per part")
    elif optimizer is None or len(models) == 1:
        optimizers = [optimizer] * len(models)
    else:
        raise ValueError(f"fusedist.checkpoint: {len(models)} model parts and one optimizer: pass a list of one "
                         "optimizer per part (as torchtitan's OptimizersContainer holds them), whose state "
                         "a pipelined checkpoint keeps with its part's stage")
    return list(zip(models, optimizers))


def is_pipelined(directory: str) -> bool:
    """Whether ``directory`` holds a pipelined checkpoint; False when its manifest cannot be read
    (the ordinary load then reports why, on every rank)."""
    try:
        return "pipeline" in _files.read_manifest(directory)
    except Exception:  # noqa: BLE001 - reported by the load that follows
        return False


# ---------------------------------------------------------------------------- save
def check_stages(members: list) -> None:
    """Every rank's part ``j`` must name the same ranks as every rank it names: the stages'
    groups split the job's ranks (per slot) into disjoint groups. ``members``: every rank's
    ranks of each of its parts' stage."""
    for rank, mine in enumerate(members):
        for j, ranks in enumerate(mine):
            if rank not in ranks:
                raise CheckpointError(f"fusedist.checkpoint.save: rank {rank}'s part {j} is saved over ranks "
                                      f"{list(ranks)}, which do not hold it")
            for other in ranks:
                theirs = members[other]
                if len(theirs) <= j or theirs[j] != ranks:
                    seen = list(theirs[j]) if len(theirs) > j else f"{len(theirs)} parts"
                    raise CheckpointError(
                        f"fusedist.checkpoint.save: the pipeline stages do not agree: rank {rank} saves its part "
                        f"{j} over ranks {list(ranks)}, rank {other} its part {j} over {seen}; every rank of a "
                        "stage passes its parts in one order, over the stage's group (process_group=)")


def check_names(stage_keys: dict) -> None:
    """Stages must hold disjoint state-dict keys: a pipelined checkpoint keys each entry by its
    name in the whole model. ``stage_keys``: ``{(ranks, part slot): keys}``. Two causes are
    named, as the keys alone do not tell them apart: stages cut as slices (renumbered names), and
    an entry every stage keeps from the whole model's root (a persistent buffer such as RoPE
    frequencies), whose fix is another."""
    owner: dict = {}
    for stage, keys in sorted(stage_keys.items()):
        for key in keys:
            other = owner.setdefault(key, stage)
            if other != stage:
                raise CheckpointError(
                    f"fusedist.checkpoint: '{key}' is the name of an entry of two pipeline stages (ranks "
                    f"{list(other[0])} part {other[1]} and ranks {list(stage[0])} part {stage[1]}); a pipelined "
                    "checkpoint keys each entry by its name in the whole model, so build each stage from the whole "
                    "model with the other layers removed (its names kept), not from a slice that renumbers them; "
                    "an entry several stages keep alike (a persistent buffer of the model's root, such as RoPE "
                    "frequencies) must be kept by one stage only: register it with persistent=False (left out of "
                    "checkpoints) or remove it from the other stages. Nothing was written")


def stage_order(members: list) -> list:
    """The checkpoint's stages, ``(ranks, part slot)``, in order of their first rank
    (``members``: as in :func:`check_stages`)."""
    return sorted({(tuple(ranks), j) for mine in members for j, ranks in enumerate(mine)})


def manifest(entries: dict, world_size: int) -> dict:
    """The manifest of a pipelined save, less its files: ``entries``, stage index -> the
    stage's ``manifest_base`` with its ranks, part slot and keys, listed in order with their
    common files."""
    listed = [dict(entries[k], common=stage_common_file(k)) for k in range(len(entries))]
    return {"format": _files.FORMAT, "version": max([_files.PIPELINE_VERSION] + [e["version"] for e in listed]),
            "world_size": world_size, "pipeline": listed}


def save(directory: str, model, optimizer=None, scaler=None, extra: Optional[dict] = None, *,
         per_rank: Optional[dict] = None, process_group=None, optimizer_list: Optional[list] = None) -> None:
    """``fusedist.checkpoint.save(..., pipeline=True)`` (Note [pipelined checkpoints]); ``optimizer_list``:
    the classes of a list of optimizers over one model, recorded in the manifest (Note [several
    optimizers over one model] in ``_optimizer_list.py``)."""
    _given_up.settle()  # Note [a plain save given up on] in _given_up.py
    started = time.time()
    # Note [a save called on some ranks only] in _save_entry.py: its entry, up to its start exchange
    with _save_entry.entered_by_every_rank("fusedist.checkpoint.save"):
        held = parts(model, optimizer)
        for module, opt in held:
            api._check_ranks_agree(module, opt)
        job = job_world()
        stages = [api._World(opt, module, process_group) for module, opt in held]
        # No exchange over the stages' groups: ranks naming groups that do not agree would wait
        # in one for a peer that is in another; check_stages reports them on every rank instead.
        members = [tuple(w.ranks()) for w in stages]
        api._warn_trusted_only(job.rank, None, extra, per_rank)
        for (_, opt), w in zip(held, stages):  # each stage's first rank writes its param groups
            api._warn_trusted_only(w.rank, opt, None, None)
        shapes, keys, digests, failure = {}, [], {}, None
        try:  # (a user's state_dict hook may raise: Note [a failed save leaves nothing] in _failed_save.py)
            shapes = {f"part {j} of ranks {list(members[j])}": _sections.model_shapes(module)
                      for j, (module, _) in enumerate(held)}
            keys = [sorted(part) for part in shapes.values()]
            digests = {part: _checks.keys_digest(s) for part, s in shapes.items()}
        except Exception as exc:  # noqa: BLE001 - raised on every rank by start_save
            failure = exc
        optimizers = [_checks.optimizer_passed(opt) for _, opt in held]
        call = _checks.save_call(directory, None, scaler, extra, per_rank)
        del call["optimizer"]  # compared within each stage (Note [an optimizer per pipeline stage] in _checks.py)

        def check(infos: list) -> None:
            check_stages([m for m, *_ in infos])
            _checks.check_stage_optimizers([[((ranks, j), f"part {j} of ranks {list(ranks)}", opt)
                                             for j, (ranks, opt) in enumerate(zip(m, o))] for m, _, _, o in infos],
                                           "fusedist.checkpoint.save", "written")
            _checks.check_same_keys([d for _, _, d, _ in infos], lambda: job.all_gather(shapes, "save: model keys"),
                                    "fusedist.checkpoint.save")  # Note [one model per save]: the ranks of a stage
            check_names({(tuple(ranks), j): part_keys for members_of, keys_of, *_ in infos
                         for j, (ranks, part_keys) in enumerate(zip(members_of, keys_of))})

        save_id, calls, claim, infos = api.start_save(job, directory, call, (members, keys, digests, optimizers), check,
                                                      failure)
    mine, entries, error = {}, {}, None
    try:  # (every failure up to finish_save is reported on every rank: Note [waiting for a peer's I/O])
        order = stage_order([m for m, *_ in infos])
        for _, opt in held:
            if isinstance(opt, ZeroRedundancyOptimizer):
                opt.wait_for_params()
        sections, sharded = {}, []
        for j, ((module, opt), w) in enumerate(zip(held, stages)):
            part_sections, sharded_keys = _sections.rank_sections(module, opt, w.rank, w.size)
            sections.update({_section(name, j): value for name, value in part_sections.items()})
            sharded.append(sharded_keys)
        if per_rank is not None:  # [resume] this rank's RNG / data position
            sections["per_rank"] = per_rank
        if sections:
            os.makedirs(directory, exist_ok=True)
            mine[api.rank_file(job.rank)] = api._write(directory, api.rank_file(job.rank), save_id, sections,
                                                       rank=job.rank)
        for j, ((module, opt), w) in enumerate(zip(held, stages)):
            if w.rank != 0:
                continue
            k = order.index((members[j], j))
            name = stage_common_file(k)
            mine[name] = api._write(directory, name, save_id, {
                "model": _sections.common_model(module, sharded[j]),
                "optimizer": _sections.full_optimizer_state(module, opt),
                "scaler": scaler.state_dict() if scaler is not None else None,
            }, rank=job.rank)
            entries[k] = dict(_sections.manifest_base(module, opt, scaler, w.size), ranks=list(members[j]), part=j,
                              keys=keys[j])
    except Exception as exc:  # noqa: BLE001 - reported on every rank instead of a hang
        error = f"rank {job.rank} could not write its checkpoint files in {directory}: {type(exc).__name__}: {exc}"
    except BaseException:
        api.stop_io(job)
        raise

    api.finish_save(job, directory, started, save_id, calls, claim, (mine, error, entries),
                    lambda infos: dict(manifest({k: e for info in infos for k, e in info.items()}, job.size),
                                       **({} if optimizer_list is None else {MANIFEST_KEY: optimizer_list})),
                    lambda: {"model": {}, "optimizer": None, "scaler": None, "extra": extra})


# ---------------------------------------------------------------------------- load
class _Reader:
    """The checkpoint's files, each read and verified once, and each stage's model and
    optimizer state assembled whole once (several parts of a rank may need one stage)."""

    def __init__(self, directory: str, manifest: dict, trusted: bool):
        self.directory, self.files, self.trusted = directory, manifest["files"], trusted
        self._loaded: dict = {}
        self._models: dict = {}
        self.layouts: dict = {}  # recorded layouts of quantized storage, by key (stage3.packed_layouts)

    def file(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"fusedist.checkpoint: {os.path.join(self.directory, _files.MANIFEST)} lists no "
                                  f"{name}")
        if name not in self._loaded:
            path = _files.verify_file(self.directory, name, self.files[name])
            self._loaded[name] = _files.load_file(path, self.trusted)
        return self._loaded[name]

    def sections(self, stage: dict, name: str) -> list:
        """Section ``name`` of the stage's ranks' files."""
        wanted = _section(name, stage["part"])
        out = []
        for rank in stage["ranks"]:
            info = self.files.get(api.rank_file(rank))
            if info is not None and wanted in info.get("sections", []):
                out.append(self.file(api.rank_file(rank))[wanted])
        return out

    def model(self, k: int, stage: dict, expected: dict) -> dict:
        """The stage's whole model entries, ``{canonical key: (saved key, value)}``. A pipelined
        stage's keys are its model's canonical ones as saved: normalized against a part holding
        some of them, they lost a ``module.`` segment every key starts with (a stage whose only
        child is ``module``), and a part of another split found none of its keys. Only an
        ordinary checkpoint's are normalized, against each part (``_names.strip_prefix``: older
        checkpoints' DDP prefix), and the saved keys kept: they are what :func:`check_taken`
        compares, alike on every rank whatever parts it holds (a rank of a part without state
        normalized them against none and refused a load the others went on with)."""
        if k not in self._models:
            saved = dict(self.file(stage["common"])["model"])
            common = list(saved)
            if stage.get("model_sharded"):  # Note [stage-3 checkpoints]
                saved.update(stage3.assemble_model(self.sections(stage, "model_shard"),
                                                   source=f"model in {self.directory}"))
                self.layouts.update(stage3.packed_layouts(self.sections(stage, "model_shard")))
            self._models[k] = (common, saved)
        common, saved = self._models[k]
        names = {}
        if stage["keys"] is None:  # an ordinary checkpoint's, normalized against the part
            names = dict(zip(common, _names.strip_prefix(dict.fromkeys(common), expected)))
        return {names.get(key, key): (key, value) for key, value in saved.items()}

    def optimizer(self, stage: dict) -> dict:
        """The stage's optimizer state in torch's format (whole tensors; indices of its saved
        parameters)."""
        meta, source = stage["optimizer"], f"optimizer state in {self.directory}"
        if meta["kind"] != "zero":
            return self.file(stage["common"])["optimizer"]
        shards = self.sections(stage, "optimizer_shard")
        if len(shards) != stage["world_size"]:
            raise CheckpointError(f"fusedist.checkpoint: {self.directory} lists {len(shards)} optimizer shard files "
                                  f"for a stage of {stage['world_size']} ranks ({stage['ranks']})")
        if not any(s.get("replicated") for s in shards):
            stage3.check_shard_set(shards, "optimizer", source)
        param_meta = shards[0]["param_meta"]
        wholes = [torch.empty(m["shape"], dtype=getattr(torch, m["dtype"]), device="meta") for m in param_meta]
        assembled = zstate.assemble(zstate.merge_fragments(shards), wholes, range(len(wholes)), source=source,
                                    name=labeller(meta.get("param_names") or [], wholes))
        zstate.relayout(assembled, wholes, param_meta)
        return zstate.to_torch_format(assembled, wholes, shards[0]["param_groups"])


def _stages(manifest: dict) -> list[dict]:
    """The checkpoint's stages; an ordinary checkpoint is one stage of every rank that saved it,
    whose keys are known once its files are read."""
    if "pipeline" in manifest:
        return manifest["pipeline"]
    return [dict(manifest, ranks=list(range(manifest["world_size"])), part=None, common=_files.COMMON, keys=None)]


def prepare(directory: str, model, optimizer, scaler, trusted: bool, strict: bool) -> dict:
    """The plan of a load into the parts of ``model`` (Note [pipelined checkpoints]): each
    part's :func:`_load_plan.prepare`-style plan, read and checked without modifying anything."""
    held = parts(model, optimizer)
    if _which_checkpoint.reads_dcp(directory):
        return _pipeline_dcp.prepare(directory, held, scaler, strict, trusted)
    manifest, digest = _files.read_manifest_and_digest(directory)
    stages, reader = _stages(manifest), _Reader(directory, manifest, trusted)
    read = loaded_objects(directory, digest, strict, held, scaler)
    plans = [_prepare_part(directory, stages, reader, module, opt, scaler if j == 0 else None, strict,
                           (job_world().rank, j)) for j, (module, opt) in enumerate(held)]
    read["keys"] = sorted({k for p in plans for k in p.pop("keys")})  # as saved (_Reader.model)
    read["params"] = sorted({n for p in plans for n in p.pop("params")})
    all_keys = {key: i for i, s in enumerate(stages) for key, _ in reader.model(i, s, {}).values()}
    all_params = {n: i for i, s in enumerate(stages) if s.get("optimizer") is not None
                  for n in s["optimizer"]["param_names"]}
    if not strict:
        read["tree"] = part_trees(held, all_keys, read["keys"])
        read.update(missing_of(held, plans))
    extra = reader.file(_files.COMMON).get("extra")
    if any("lr_scheduler" in p for p in plans):  # a Checkpointer's (Note [an LR scheduler per pipeline part])
        extra = dict(extra or {}, **{PART_LR_SCHEDULERS: [p.pop("lr_scheduler", None) for p in plans]})
    return {"parts": plans, "extra": extra, "read": read, "strict": strict,
            "stages": stages, "all_keys": all_keys, "all_params": all_params}


def part_trees(held: list, every_key: dict, taken: list) -> list:
    """The module tree of each part along the saved keys this rank's parts do not load, which
    every rank sends for the order of a load's unexpected keys (Note [the order of unexpected
    keys] in ``_names.py``: no rank holds the whole model)."""
    left = [k for k in every_key if k not in set(taken)]
    return [_names.module_tree(_names.unwrap(module), left) for module, _ in held]


def missing_of(held: list, plans: list) -> dict:
    """The model keys this rank's parts miss, and each part's module tree along them, which
    every rank sends: a load that is not strict lists every part's of the job once, in the
    whole model's order, as torch's ``load_state_dict`` of the whole model lists them (a rank
    listed its own parts', and a key every part holds, a root buffer, once per part)."""
    return {"missing": list(dict.fromkeys(k for p in plans for k in p["missing"])),
            "missing_tree": [_names.module_tree(_names.unwrap(module), p["missing"])
                             for (module, _), p in zip(held, plans)]}


def loaded_objects(directory: str, digest: str, strict: bool, held: list, scaler) -> dict:
    """What this rank's load reads and is given, for every rank to compare
    (``_checks.check_same_load``): the optimizers part by part, each part's stage known by its
    keys and shapes, which the ranks of a stage share (Note [an optimizer per pipeline stage]
    in ``_checks.py``: a stage without parameters has none)."""
    read = {"manifest": digest, "strict": strict, **_checks.objects_passed(directory, None, scaler)}
    del read["optimizer"]
    read["optimizers"] = []
    for module, opt in held:
        shapes = _sections.model_shapes(module)
        label = f"the part holding '{min(shapes)}'" if shapes else "the parts holding no state"
        read["optimizers"].append((_checks.keys_digest(shapes), label, _checks.optimizer_passed(opt)))
    return read


def _chosen(stages: list, expected: dict) -> list:
    """``(index, stage)`` of the stages a part expecting the model keys ``expected`` takes its
    state from: those saving any of its keys (every stage of an ordinary checkpoint: its one)."""
    return [(k, s) for k, s in enumerate(stages) if s["keys"] is None or not expected.keys().isdisjoint(s["keys"])]


def _part_lr_scheduler(commons: list):
    """A part's LR scheduler state from the common files of its stages (Note [an LR scheduler
    per pipeline part] in ``_snapshot.py``): the first with one; absent (no key) when they were
    saved without per-stage states."""
    scheduled = [c["lr_scheduler"] for c in commons if "lr_scheduler" in c]
    return {"lr_scheduler": next((state for state in scheduled if state is not None), None)} if scheduled else {}


def _prepare_part(directory: str, stages: list, reader: _Reader, model, optimizer, scaler, strict: bool,
                  where: tuple) -> dict:
    """The plan of one part; ``where``: ``(job rank, the part's slot on it)``."""
    target = _names.unwrap(model)
    expected, sharded_target = _load_plan._expected_model(target)
    chosen = _chosen(stages, expected)
    saved, holder, taken = {}, {}, []
    for k, stage in chosen:
        for key, (saved_key, value) in reader.model(k, stage, expected).items():
            if key in expected:
                if key in saved:
                    raise CheckpointError(f"fusedist.checkpoint: '{key}' is saved by two stages of {directory} "
                                          f"(ranks {stages[holder[key]]['ranks']} and {stage['ranks']})")
                saved[key], holder[key] = value, k
                taken.append(saved_key)
    # (an NF4 weight saved in its other form: Note [quantized storage across run kinds] in _load_plan.py)
    saved = _load_plan._cross_packed(saved, target, sharded_target, directory, reader.layouts)
    plan: dict = {"model": _load_plan._check_model(saved, expected, directory, strict),
                  "model_sharded": sharded_target, "strict": strict, "extra": None, "params": [], "keys": taken,
                  "missing": [k for k in expected if k not in saved]}
    if optimizer is not None:
        plan["optimizer"], plan["params"] = _prepare_optimizer(directory, chosen, reader, model, optimizer,
                                                               [] if chosen else _stateless_first(stages, *where),
                                                               f"part {where[1]} of rank {where[0]}")
    # the stages' LR schedulers, saved by a Checkpointer (Note [an LR scheduler per pipeline part])
    plan.update(_part_lr_scheduler([reader.file(s["common"]) for _, s in chosen]))
    if scaler is not None:
        found = next((s for _, s in chosen or _stateless_first(stages, *where) if s.get("scaler")), None)
        if found is None:
            raise CheckpointError(f"fusedist.checkpoint: {directory} holds no GradScaler state for this part's stages")
        state = reader.file(found["common"])["scaler"]
        _checks.check_scaler(state, scaler, directory)
        plan["scaler"] = state
    return plan


def _stateless_first(stages: list, rank: int, slot: int) -> list:
    """The stages whose GradScaler state a part holding no state takes (a pipeline stage without
    parameters, whose loss the scaler scales; it takes nothing else): the stage this rank saved
    in this slot when it held no state either (each stage's own GradScaler, as at the save:
    with several stages without parameters, each took the first one's scale and growth
    tracker), then a stage saved without state, else the first saved with a scaler. Those
    holding a part's layers are the ones a part with state takes it from."""
    def order(ks):
        stage = ks[1]
        own = rank in (stage["ranks"] or ()) and stage["part"] == slot and not stage["keys"]
        return not own, bool(stage["keys"])

    return sorted(enumerate(stages), key=order)


def _prepare_optimizer(directory: str, chosen: list, reader: _Reader, model, optimizer, stateless: list,
                       part: str) -> tuple:
    """The part's optimizer state in torch's format, from the stages holding its parameters:
    their state and param groups by parameter name, put in the optimizer's order as a torch
    distributed checkpoint's are (``_from_dcp.to_torch_format``), then checked and converted
    by :func:`_load_plan._prepare_full`; and the names taken, as saved (what :func:`check_taken`
    compares with the stages' ``param_names``: an older checkpoint's ``_orig_mod.`` names,
    taken by their names now, were reported as state no part loads). ``stateless``: the stages
    in :func:`_stateless_first`'s order for a part holding no state, whose optimizer over no
    parameters takes its groups' settings from :func:`_saved_without_state`; ``part`` names it
    (Note [param groups across a pipeline re-split] in ``_part_groups.py``)."""
    params = optimizer_params(optimizer)
    names = param_names(model, params)
    target = _names.unwrap(model)
    sharding = _load_plan._sharding(target)
    wanted = set(names)
    state, groups, shapes, taken = {}, [], {}, []  # by name; the saved groups with their parameters' names
    origins = []  # where each of groups was saved
    with_state = [s for _, s in chosen if s.get("optimizer") is not None]
    if not with_state and names:
        raise CheckpointError(f"fusedist.checkpoint: {directory} holds no optimizer state")
    if not chosen and not names:  # (one over no parameters, a part without state's: its groups' settings)
        with_state = _saved_without_state(directory, stateless, reader, optimizer)
    for stage in with_state:
        meta = stage["optimizer"]
        full = reader.optimizer(stage)
        _checks.check_algorithm(meta, optimizer, directory, full.get("param_groups"))
        saved = {i: n if n in wanted else _names.legacy_key(n) for i, n in enumerate(meta["param_names"])}
        saved = {i: n for i, n in saved.items() if n in wanted}
        shapes.update((n, meta["param_shapes"][i]) for i, n in saved.items())
        taken += [meta["param_names"][i] for i in saved]
        state.update((saved[int(i)], v) for i, v in full.get("state", {}).items() if int(i) in saved)
        groups += [_taken_group(g, saved) for g in full["param_groups"]]
        holder = "the saved optimizer" if stage["ranks"] is None else f"part {stage['part']} of ranks {stage['ranks']}"
        origins += [f"group {gi} of {holder}" for gi in range(len(full["param_groups"]))]
    missing = [n for n in names if n not in shapes]
    if missing:
        listed = _load_plan.capped([f"'{n}'" for n in missing], len(missing))
        raise CheckpointError(f"fusedist.checkpoint: no stage of {directory} holds optimizer state for the "
                              f"parameters {listed}: the optimizers saved did not hold them; load the model alone "
                              "(optimizer=None) to start a new optimizer from it")
    own = [list(stage3.full_shape(p, sharding[1])) for p in params]
    for p, name, shape in zip(params, names, own):
        if shapes[name] != shape and _load_plan._packed_positions([shapes[name]], [p], sharding[1]):
            # a frozen NF4 weight saved in its other form (Note [quantized storage across run kinds])
            _load_plan._check_no_state({0: state.get(name)}, {0}, [name], directory)
            shapes[name] = shape
    reshaped = _load_plan.optimizer_shape_mismatch(names, [shapes[n] for n in names], own)
    if reshaped:  # every one, as the ordinary load names them
        raise _load_plan.optimizer_refusal(directory, reshaped)
    source = f"optimizer state in {directory}"
    full = _from_dcp.to_torch_format({"state": state, "param_groups": groups}, names, optimizer.param_groups, source,
                                     one_saved=len(with_state) == 1, origins=origins, part=part)
    return _load_plan._prepare_full(full, directory, target, sharding, optimizer, params, source), taken


def _taken_group(group: dict, saved: dict) -> dict:
    """A saved param group with its parameters this part takes, by name (``saved``: index -> name),
    and their entries of torch's ``param_names`` where it has them (a named optimizer's)."""
    kept = [k for k, i in enumerate(group["params"]) if int(i) in saved]
    out = dict(group, params=[saved[int(group["params"][k])] for k in kept])
    given = group.get("param_names")
    if isinstance(given, (list, tuple)) and len(given) == len(group["params"]):
        out["param_names"] = [given[k] for k in kept]
    return out


def _saved_without_state(directory: str, stages: list, reader: _Reader, optimizer) -> list:
    """The stage whose param groups the optimizer over no parameters of a part without state
    takes (the first saved without state of ``stages``, in :func:`_stateless_first`'s order: the
    one this rank saved in this slot first), as torch's ``Optimizer.load_state_dict`` restores
    an empty group's settings (lr, weight decay) too: the part kept its own. None (``[]``) where
    that stage was saved without an optimizer: it keeps its own, as there is nothing to take.
    Its groups must be as many as the optimizer's, as torch requires."""
    saved = next((s for _, s in stages if s["keys"] == []), None)
    if saved is None or saved.get("optimizer") is None:
        return []
    count = len(reader.optimizer(saved)["param_groups"])
    if count != len(optimizer.param_groups):
        raise CheckpointError(
            f"fusedist.checkpoint: the optimizer of a model part without state has {len(optimizer.param_groups)} "
            f"param group(s) (of no parameters); the one its stage without state (ranks {saved['ranks']}, part "
            f"{saved['part']}) saved in {directory} has {count}, whose settings it takes, as torch's "
            "Optimizer.load_state_dict does (it refuses another number of groups): pass one with as many; nothing "
            "was loaded")
    return [saved]


def check_taken(plan: dict, reads: list, directory: str) -> None:
    """A strict load's parts, on every rank together, must take every model key and every
    parameter's optimizer state of the checkpoint (Note [pipelined checkpoints]); raised
    on every rank alike, before any loads."""
    if not plan["strict"]:
        return
    # The optimizer state must all be taken when any rank loads an optimizer (a stage without
    # parameters has none: Note [an optimizer per pipeline stage]), decided alike on every rank.
    optimizers = any(opt is not None for r in reads for _, _, opt in r["optimizers"])
    for what, every, taken, hint in (
            ("model keys", plan["all_keys"], "keys", ""),
            ("parameters' optimizer state", plan["all_params"] if optimizers else {}, "params",
             ", each part holding parameters with its optimizer")):
        took = set().union(*(r[taken] for r in reads))
        left = [k for k in every if k not in took]
        if left:
            ranks = plan["stages"][every[left[0]]]["ranks"]
            saved_by = "" if ranks is None else f"; saved by ranks {ranks}"
            raise CheckpointError(
                f"fusedist.checkpoint: {directory} holds {len(left)} {what} that no model part of this job loads "
                f"({left[:5]}{' ...' if len(left) > 5 else ''}{saved_by}): every rank of a pipeline-parallel job "
                f"passes its parts with pipeline=True{hint}, and the parts together must be the saved model "
                "(load(..., strict=False) loads what the parts have); nothing was loaded")


def apply(plan: dict, model, optimizer, scaler):
    """Each part's plan (:func:`_load_plan.apply`); returns the checkpoint's ``extra``."""
    for (module, opt), part_plan in zip(parts(model, optimizer), plan["parts"]):
        _load_plan.apply(part_plan, module, opt, scaler if "scaler" in part_plan else None)
    return plan["extra"]
