"""Reading a checkpoint written by torch's distributed checkpoint (DCP) in
:func:`fusedist.checkpoint.load`.

Note [torch's distributed checkpoints in load]
    A job trained with torch's DDP and optimizer saves with ``dcp.save({"model": msd, "optim":
    osd})``, the two from ``get_state_dict`` (parameters by name, the optimizer's state and
    groups by parameter name, nested or flattened as torchtitan saves it). Continuing it on a
    ZeroRedundancyOptimizer has no route through torch's helpers: ``get_state_dict`` asks the
    optimizer for torch's format, and a ZeRO optimizer's state dict is its rank's shard. So
    ``load`` reads such a directory itself: every rank reads the whole checkpoint onto the CPU
    (as it reads every shard file of a fusedist checkpoint: about the full model and optimizer
    state in memory), finds the model's state (the dict whose keys are the model's names) and
    the optimizer's (the dict with ``state`` and ``param_groups``), turns the optimizer's into
    torch's index-keyed format in the order of the optimizer's parameters (or takes it as it
    is: ``optimizer.state_dict()`` saved directly, by index), and goes on as for a
    checkpoint of an unsharded optimizer: everything is checked before anything changes, the
    model is loaded, the master weights are taken from the loaded parameters (torch's
    optimizers keep none), and the state is resharded over the ranks. ``extra`` is None; a
    GradScaler's state is not in such a checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Optional

import torch

from . import _group_record, _names, _part_groups
from ._files import CheckpointError, refusal_reason
from ._part_groups import NOT_SETTINGS, same_value

METADATA = ".metadata"


def is_dcp(directory: str) -> bool:
    """A directory DCP's file-system writer completed (it writes ``.metadata`` last)."""
    return os.path.isfile(os.path.join(directory, METADATA))


# Note [objects of a torch distributed checkpoint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's planner unpickles a checkpoint's non-tensor entries (step counts, a module's extra
# state, a user's objects) with torch.load(weights_only=False), which runs whatever a pickle
# says: a checkpoint from elsewhere ran its code at fusedist.checkpoint.load, where the docs
# promise torch's restricted unpickler unless trusted=True (as for fusedist's own files). The
# reader here unpickles them as fusedist's files are read: restricted, and an entry the
# restricted unpickler refuses names its key and trusted=True.
def _restricted_planner(trusted: bool):
    """torch's planner of a whole checkpoint, unpickling its objects restricted unless ``trusted``."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner

    class _Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            if trusted:
                return super().load_bytes(read_item, value)
            key = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise CheckpointError(
                    f"fusedist.checkpoint: entry {key!r} of torch's distributed checkpoint holds an object the "
                    f"safe loader refuses ({refusal_reason(exc)}). Pass trusted=True to load it with full "
                    "unpickling -- only for a checkpoint from a source you trust: unpickling can run "
                    "arbitrary code.") from exc
            self._put(key, loaded)

        def _put(self, key: str, value) -> None:
            if self.flatten_state_dict:  # (where torch's load_bytes puts it)
                set_element(self.original_state_dict, self.mappings[key], value)
            self.state_dict[key] = value

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            _tag_layouts(self.state_dict, metadata)
            self.metadata = metadata

        def resolve_tensor(self, read_item):  # Note [quantized storage in a torch distributed checkpoint]
            target = super().resolve_tensor(read_item).as_subclass(_Receiver)
            target._fusedist_item = (self, read_item)
            return target

        def commit_tensor(self, read_item, tensor) -> None:
            received = getattr(tensor, "_fusedist_received", None)
            if received is not None:
                self._put(read_item.dest_index.fqn, received)

    return _Planner()


def _tag_layouts(flat: dict, metadata) -> None:
    """Each tensor read whose chunks record the layout of quantized storage (Note [the layout of
    quantized storage in DCP] in fsdp/dcp.py) keeps it as ``LAYOUT_TAG``, through the tree's
    reshaping to the model's names, for the load's check (``_load_plan._cross_packed``)."""
    from ..fsdp.dcp import recorded_layout

    for fqn, md in metadata.state_dict_metadata.items():
        layout = recorded_layout(md)
        if layout is not None and isinstance(flat.get(fqn), torch.Tensor):
            setattr(flat[fqn], LAYOUT_TAG, layout)


LAYOUT_TAG = "_fusedist_packed_layout"


# Note [quantized storage in a torch distributed checkpoint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DCP saves a DDP or plain model's NF4 weight (torchao's NF4Tensor, a wrapper subclass) as the
# pickled subclass under a plain tensor's metadata (its shape, its dequantized dtype). Reading
# the checkpoint whole, torch's planner makes a plain tensor of that metadata and copies the
# subclass read back into it -- which NF4's copy_ refuses with an AttributeError (and would
# otherwise dequantize). So the planner's targets receive such a value as it is: a copy_ from a
# wrapper subclass keeps the subclass, which replaces the plain target in the tree read; the
# load then takes it as a fusedist checkpoint's subclass (Note [quantized storage across run
# kinds] in _load_plan.py). A subclass saved in chunks (sharded) cannot be joined here: refused
# by key.
class _Receiver(torch.Tensor):
    """A planner's target that keeps a wrapper subclass copied into it instead of converting
    it (Note [quantized storage in a torch distributed checkpoint])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if func is torch.Tensor.detach:  # (the reader detaches the target: keep its record)
            return args[0]
        if func is torch.Tensor.copy_ and is_traceable_wrapper_subclass(args[1]):
            target, value = args[0], args[1]
            planner, item = target._fusedist_item
            if tuple(value.shape) != tuple(planner.lookup_tensor(item.dest_index).shape):
                raise CheckpointError(
                    f"fusedist.checkpoint: entry {item.dest_index.fqn!r} of torch's distributed checkpoint is a "
                    f"{type(value).__name__} saved in chunks (a sharded model's); fusedist reads such a tensor only "
                    "saved whole (by a DDP or plain model)")
            target._fusedist_received = value
            return target
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _refusal_inside(exc: BaseException) -> Optional[CheckpointError]:
    """The planner's refusal, wrapped by torch's CheckpointException (one failure per rank)."""
    for failure in (getattr(exc, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CheckpointError):
            return inner
    return None


def read(directory: str, trusted: bool = False) -> tuple[str, dict]:
    """The SHA-256 of the checkpoint's metadata (what ranks compare) and the whole checkpoint,
    nested as it was saved, on the CPU; its objects unpickled by torch's restricted unpickler
    unless ``trusted`` (Note [objects of a torch distributed checkpoint])."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    with open(os.path.join(directory, METADATA), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    reader = FileSystemReader(directory)
    _check_files(directory, reader)
    tree: dict = {}
    planner = _restricted_planner(trusted)
    try:  # every rank reads all of it, on its own (what torch's dcp_to_torch_save does)
        _load_state_dict(tree, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        refusal = _refusal_inside(exc)
        if refusal is not None:
            raise CheckpointError(str(refusal)) from exc
        raise CheckpointError(f"fusedist.checkpoint: reading torch's distributed checkpoint {directory} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    return digest, _in_saved_order(tree, getattr(planner, "metadata", None))


def _check_files(directory: str, reader) -> None:
    """The checkpoint's metadata readable, and every data file it lists present and as long as
    the data it records there: a file cut short (a copy or upload interrupted, a disk that
    filled) failed inside torch's reader with a traceback per rank and an unzip or unpickling
    error that named no file."""
    try:
        storage = reader.read_metadata().storage_data or {}
    except Exception as exc:  # noqa: BLE001 - torch's reader logged tracebacks, and raised one naming no file
        raise CheckpointError(
            f"fusedist.checkpoint: the metadata file {METADATA} of torch's distributed checkpoint {directory} cannot "
            f"be read ({type(exc).__name__}: {exc}): it was cut short (a copy or upload interrupted) or damaged. "
            "Copy it again from the source, or load another checkpoint; nothing was loaded") from exc
    ends: dict = {}
    for info in storage.values():
        path, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if isinstance(path, str) and isinstance(offset, int) and isinstance(length, int):
            ends[path] = max(ends.get(path, 0), offset + length)
    for path, end in sorted(ends.items()):
        full = os.path.join(directory, path)
        size = os.path.getsize(full) if os.path.isfile(full) else None
        if size is None or size < end:
            found = "is missing" if size is None else f"has {size} bytes"
            raise CheckpointError(
                f"fusedist.checkpoint: file {path} of torch's distributed checkpoint {directory} {found}, and its "
                f"metadata records data up to byte {end}: the file was cut short (a copy, upload or write "
                "interrupted) or removed. Copy it again from the source, or load another checkpoint; nothing was "
                "loaded")


def _in_saved_order(tree: dict, metadata) -> dict:
    """``tree`` with each dict's entries in the order they were saved, as far as the checkpoint
    tells (Note [the order of unexpected keys] in ``_names.py``). The entries come back in the
    order of its metadata, where each rank's come together (the lowest rank's first), though of
    one module's entries saved alike by several ranks each may come from another rank (``bias``
    before ``weight``); a flattened save also records each rank's state dict in its order (its
    planner data, the highest rank's first). So subtrees (modules) keep the metadata's order,
    and the entries of one module take the planner data's."""
    mappings = getattr(metadata, "planner_data", None)
    if not isinstance(mappings, dict) or not mappings:
        return tree
    listed = {fqn: i for i, fqn in enumerate(metadata.state_dict_metadata)}
    module_at: dict = {}  # each module prefix's first entry in the metadata
    for fqn, i in listed.items():
        parts = fqn.split(".")
        for j in range(1, len(parts)):
            module_at.setdefault(tuple(parts[:j]), i)
    rank = {fqn: tuple((True, module_at[tuple(fqn.split(".")[:j])]) for j in range(1, fqn.count(".") + 1))
            + ((False, i),) for i, fqn in enumerate(mappings) if fqn in listed}
    first: dict = {}
    for fqn, path in mappings.items():
        for j in range(1, len(path) + 1 if fqn in rank else 0):
            below = first.get(tuple(path[:j]))
            if below is None or rank[fqn] < below:
                first[tuple(path[:j])] = rank[fqn]
    inner = {tuple(path[:j]) for path in mappings.values() for j in range(len(path))}  # (not a saved value)
    last = ((True, len(listed) + len(mappings)),)

    def ordered(obj, path: tuple):
        if type(obj) is not dict or path not in inner:
            return obj
        items = sorted(obj.items(), key=lambda kv: first.get(path + (kv[0],), last))
        return {k: ordered(v, path + (k,)) for k, v in items}

    return ordered(tree, ())


def _dicts(tree: dict) -> list:
    """The checkpoint itself and its top-level dicts: where a model or optimizer state may be."""
    return [("", tree)] + [(k, v) for k, v in tree.items() if isinstance(v, dict)]


def _is_optimizer(d: dict) -> bool:
    keys = [k for k in d if k != _group_record.MEMBERS]
    return ("state" in d and "param_groups" in d) or (
        bool(keys) and all(isinstance(k, str) and k.split(".", 1)[0] in ("state", "param_groups") for k in keys))


def _model_entries(d: dict) -> dict:
    """A saved model state: its tensors and its modules' ``get_extra_state()`` values, which DCP
    saves as objects (read back as they were). Taking the tensors only, a model with extra state
    was refused: its checkpoint seemed to lack the ``_extra_state`` keys it holds."""
    return {k: v for k, v in d.items()
            if isinstance(v, torch.Tensor) or (isinstance(k, str) and _names.is_extra_state(k))}


def split(tree: dict, expected: dict, normalize, directory: str) -> tuple[dict, Optional[dict]]:
    """(the model's state, the optimizer's or None) in ``tree``. ``normalize`` maps a dict of
    saved keys to the model's names (``_names.strip_prefix``)."""
    found = _model_dict(tree, expected, normalize, directory)
    best = normalize(_model_entries(found))
    optimizers = [d for _, d in _dicts(tree) if d is not found and _is_optimizer(d)]
    if len(optimizers) > 1:
        raise CheckpointError(f"fusedist.checkpoint: torch's distributed checkpoint {directory} holds "
                              f"{len(optimizers)} optimizer states; fusedist.checkpoint.load reads one")
    return best, (optimizers[0] if optimizers else None)


def _model_dict(tree: dict, expected: dict, normalize, directory: str) -> dict:
    """The entry of ``tree`` holding the most of the model's names (by names, not form: a model
    may have a child called "state"). Several that hold as many -- an EMA copy of the model saved
    beside it -- are told apart by the name ``model`` (torch's recipes, torchtitan), and refused
    otherwise: taking the first one, a checkpoint that saved ``{"ema": ..., "model": ...}``
    loaded the EMA weights into the model, silently, with the model's optimizer state."""
    scored = []
    for key, d in _dicts(tree):
        tensors = {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}
        if tensors:
            scored.append((len(set(normalize(tensors)) & set(expected)), key, d))
    most = max((overlap for overlap, _, _ in scored), default=0)
    if not most:
        raise CheckpointError(
            f"fusedist.checkpoint: torch's distributed checkpoint {directory} holds no state of this model (none of "
            f"its top-level entries {sorted(tree)[:10]} has the model's parameter names)")
    tied = [(key, d) for overlap, key, d in scored if overlap == most]
    named = [d for key, d in tied if key == "model"]
    if len(tied) > 1 and not named:
        shown = ", ".join(repr(key) if key else "its top level" for key, _ in tied)
        raise CheckpointError(
            f"fusedist.checkpoint: torch's distributed checkpoint {directory} holds the model's names in several "
            f"entries ({shown}) and none is called 'model'; fusedist.checkpoint.load cannot tell which is the "
            "model's state (load it with dcp.load and set_state_dict instead)")
    return named[0] if len(tied) > 1 else tied[0][1]


def _nested(optim: dict, names: list, source: str, others: bool = False) -> tuple[dict, list, bool]:
    """A flattened optimizer state (``state.<name>.<key>``, ``param_groups.<name>.<setting>``:
    ``flatten_optimizer_state_dict=True``) as ``state`` by name and its groups: the recorded
    ones where the state records them (Note [param groups of a flattened optimizer state] in
    ``_group_record.py``), else one per parameter; and whether the groups are the saved ones.
    ``others``: entries of parameters not in ``names`` are skipped (other pipeline stages')
    instead of refused."""
    if "state" in optim and "param_groups" in optim:
        return optim["state"], optim["param_groups"], True
    state: dict = {}
    settings: dict = {}
    known = set(names)
    members = _group_record.recorded(optim, source)
    for key, value in optim.items():
        if key == _group_record.MEMBERS:
            continue
        kind, rest = key.split(".", 1)
        name, _, field = rest.rpartition(".")
        if name not in known:
            if others:
                continue
            raise CheckpointError(f"fusedist.checkpoint: {source}: entry {key!r} names no parameter of the optimizer")
        (state if kind == "state" else settings).setdefault(name, {})[field] = value
    if members is None:
        return state, [dict(values, params=[name]) for name, values in settings.items()], False
    return state, _recorded_groups(members, settings, known, source, others), True


def _recorded_groups(members: list, settings: dict, known: set, source: str, others: bool) -> list:
    """The saved param groups rebuilt from the recorded ``members``, each with the settings of its
    parameters, which must agree (torch's ``set_optimizer_state_dict`` refuses them otherwise)."""
    groups, listed = [], set()
    for index, group in enumerate(members):
        kept = [n for n in group if n in known] if others else list(group)
        for name in kept:
            if name not in settings:
                raise CheckpointError(
                    f"fusedist.checkpoint: {source}: its record of param groups lists parameter {name!r} in group "
                    f"{index}, which has no settings saved ('param_groups.{name}.<setting>'): the record belongs to "
                    "another state; nothing was loaded")
            if not same_value(settings[name], settings[kept[0]]):
                raise CheckpointError(
                    f"fusedist.checkpoint: {source}: parameters {kept[0]!r} and {name!r} were saved in param group "
                    f"{index} but with different settings; nothing was loaded")
        listed.update(kept)
        groups.append(dict(settings[kept[0]] if kept else {}, params=kept))
    unlisted = [n for n in settings if n not in listed]
    if unlisted:
        raise CheckpointError(
            f"fusedist.checkpoint: {source}: parameter {unlisted[0]!r} has saved settings but is in no param group "
            f"of its record of groups ({len(unlisted)} such): the record belongs to another state; nothing was loaded")
    return groups


def to_torch_format(optim: dict, names: list, optimizer_groups: list, source: str, others: bool = False,
                    one_saved: bool = True, own_groups: bool = False, origins: Optional[list] = None,
                    part: str = "the optimizer") -> dict:
    """The optimizer state ``optim`` (by parameter name) as torch's ``state_dict()`` of an
    optimizer whose parameters are named ``names``, in its param groups ``optimizer_groups``
    (each takes the saved settings of its parameters; an empty one keeps its own), ``others``:
    as in :func:`_nested`. ``one_saved``: ``optim``'s groups are one saved optimizer's, in its
    order (not several pipeline stages' put together), so a parameter in another group than
    the one it was saved in, or groups merged or split, is refused (Note [parameters moved
    between param groups]); with ``others`` too where ``own_groups``: the saved groups holding
    ``names`` are one optimizer's of a saved list (Note [one position, one set of parameters] in
    ``_optimizer_list.py``), not pipeline stages' that a re-split may merge. Groups merged or
    split by name must agree in their settings (Note [param groups across a pipeline re-split]
    in ``_part_groups.py``); ``origins`` name where each saved group was saved, ``part`` the
    optimizer, in its refusals."""
    group_sizes = [len(g["params"]) for g in optimizer_groups]
    state, groups, grouped = _nested(_without_ddp_prefix(optim, names), names, source, others)
    if not names and groups and all(isinstance(i, int) for g in groups for i in g.get("params", [])):
        return _over_no_parameters(state, groups, optimizer_groups, source)
    if groups and all(isinstance(i, int) for g in groups for i in g.get("params", [])):
        return _by_index(state, groups, group_sizes, source)
    group_of = {}
    for gi, g in enumerate(groups):
        for name in g.get("params", []):
            group_of[name] = gi
    missing = [n for n in names if n not in group_of]
    if missing:
        raise CheckpointError(f"fusedist.checkpoint: {source} has no parameter {missing[0]!r} of the optimizer "
                              f"({len(missing)} of {len(names)} missing)")
    if grouped and one_saved:
        _refuse_regrouped(groups, group_of, names, group_sizes, source, count_must_match=own_groups or not others,
                          own_numbers=own_groups)
    if origins is None:
        origins = [f"param group {gi} of the checkpoint" if grouped else "the checkpoint" for gi in range(len(groups))]
    _part_groups.check(groups, origins, names, optimizer_groups, part, source)
    labels = _saved_labels(groups)
    out_groups, out_state, start = [], {}, 0
    for size, own in zip(group_sizes, optimizer_groups):
        members = names[start:start + size]
        first = groups[group_of[members[0]]] if members else own
        settings = {k: v for k, v in first.items() if k not in NOT_SETTINGS}
        out_groups.append(dict(settings, params=list(range(start, start + size))))
        if all(n in labels for n in members) and (members or "param_names" in own):
            out_groups[-1]["param_names"] = [labels[n] for n in members]
        for i, name in enumerate(members, start):
            if name in state and state[name]:
                out_state[i] = dict(state[name])
        start += size
    return {"state": out_state, "param_groups": out_groups}


def _saved_labels(groups: list) -> dict:
    """Each saved parameter's entry in its group's ``param_names`` (torch's named optimizers), by
    its name here: a group merged or split by name takes its members' (its saved list named the
    saved group's members, and torch's ``load_state_dict`` installs it as it finds it)."""
    labels = {}
    for g in groups:
        given = g.get("param_names")
        if isinstance(given, (list, tuple)) and len(given) == len(g.get("params", [])):
            labels.update(zip(g["params"], given))
    return labels


def _without_ddp_prefix(optim: dict, names: list) -> dict:
    """``optim`` with DDP's ``module.`` taken off its parameter names when every name has it and
    they are not the optimizer's names as they are (as ``_names.strip_prefix`` does for the
    model's keys): torch's ``get_state_dict`` leaves the segment in the names of a model
    wrapped by fusedist's DDP, which is not torch's class, so the optimizer state of such a
    checkpoint named no parameter while its model state loaded."""
    if "state" in optim and "param_groups" in optim:
        saved = [k for k in optim["state"] if isinstance(k, str)]
        saved += [n for g in optim["param_groups"] for n in g.get("params", []) if isinstance(n, str)]
    else:
        saved = [key.split(".", 1)[1].rpartition(".")[0] for key in optim if "." in key]
    if not _names.has_ddp_prefix(saved, set(names)):
        return optim

    def strip(name):
        prefixed = isinstance(name, str) and name.startswith(_names.DDP_PREFIX)
        return name[len(_names.DDP_PREFIX):] if prefixed else name

    if "state" in optim and "param_groups" in optim:
        return dict(optim, state={strip(k): v for k, v in optim["state"].items()},
                    param_groups=[dict(g, params=[strip(n) for n in g.get("params", [])])
                                  for g in optim["param_groups"]])
    members = optim.get(_group_record.MEMBERS)
    out = {kind + "." + strip(rest): v for (kind, rest), v in ((k.split(".", 1), v) for k, v in optim.items()
                                                               if k != _group_record.MEMBERS)}
    if isinstance(members, (list, tuple)):
        out[_group_record.MEMBERS] = [[strip(n) for n in g] if isinstance(g, (list, tuple)) else g for g in members]
    return out


def by_index(optim: Optional[dict]) -> bool:
    """Whether ``optim`` is an optimizer's own ``state_dict()`` (parameters by index), whose
    state's keys DCP saved as the strings of the indices."""
    groups = (optim or {}).get("param_groups") if "state" in (optim or {}) else None
    return bool(groups) and all(isinstance(i, int) for g in groups for i in g.get("params", []))


def state_names(optim: dict) -> list:
    """The names of the parameters with state in ``optim`` (nested or flattened by name)."""
    if "state" in optim and "param_groups" in optim:
        return [k for k, v in optim["state"].items() if isinstance(k, str) and v]
    return sorted({key.split(".", 1)[1].rpartition(".")[0] for key in optim if key.startswith("state.")})


# Note [parameters moved between param groups]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An optimizer state saved by parameter name records which parameters each param group held.
# A parameter the loading optimizer puts in another group of as many (a decay/no-decay rule
# changed, groups built in another order) was regrouped by name and loaded whenever the groups'
# settings were equal. torch's set_optimizer_state_dict maps each saved group to the
# optimizer's group of its parameters, so a saved group whose parameters went to two groups
# leaves one of them without settings (its next step fails on a KeyError 'lr'), and elsewhere
# it takes one saved group's settings for parameters saved in several, unchecked. torch's
# Optimizer.load_state_dict pairs groups by position and parameters by index, and refuses
# another number of groups. What a group's index carries besides its settings -- an LR
# scheduler's state (its base_lrs, its lambdas), a per-group rule the training code applies by
# index -- would then act on other parameters than in the saved run, silently. So
# fusedist.checkpoint.load, whose contract for its own files is load_state_dict's, holds a
# state saved by name to it too: the groups holding parameters must be as many as the saved
# ones holding them (two saved groups of equal settings were merged into one; a merge is
# refused naming both counts), and hold the parameters they were saved with, in the saved
# order of groups (the refusal names the parameter and both groups). Groups without parameters
# are left out on both sides (a flattened state has none; a pipeline part's filtered ones). A
# state saved flattened records its groups only with its record (Note [param groups of a
# flattened optimizer state] in _group_record.py); without it, and for a part taking some of
# a checkpoint's groups (others), another number of groups keeps the check of their settings.
def _refuse_regrouped(groups: list, group_of: dict, names: list, group_sizes: list, source: str,
                      count_must_match: bool, own_numbers: bool = False) -> None:
    """``own_numbers``: ``groups`` are a saved list's, every optimizer's in turn (torch's
    ``get_state_dict(model, [...])`` puts them in one list): a saved group is named by its index
    among the groups holding this optimizer's parameters ("its group 1"), not in the whole list."""
    known = set(names)
    saved_used = [gi for gi, g in enumerate(groups) if any(n in known for n in g.get("params", []))]
    own_used = [i for i, size in enumerate(group_sizes) if size]

    def number(gi: int, noun: str = "group") -> str:
        return f"its {noun} {saved_used.index(gi)}" if own_numbers else f"{noun} {gi}"

    if len(saved_used) != len(own_used):
        if not count_must_match:
            return
        shown = "; ".join(f"{number(gi)}: {', '.join(map(repr, groups[gi]['params'][:2]))}"
                          f"{' ...' if len(groups[gi]['params']) > 2 else ''}" for gi in saved_used[:4])
        raise CheckpointError(
            f"fusedist.checkpoint: {source}: the optimizer holds its parameters in {len(own_used)} param group(s), "
            f"the checkpoint in {len(saved_used)} ({shown}). torch's Optimizer.load_state_dict refuses another "
            "number of groups; merged or split by name, what a group's index carries (an LR scheduler's state "
            f"among it) would act on other parameters. Build the optimizer with the {len(saved_used)} saved groups, "
            "or pass optimizer=None to start a new one; nothing was loaded")
    paired = dict(zip(own_used, saved_used))
    start = 0
    for index, size in enumerate(group_sizes):
        for name in names[start:start + size]:
            saved = group_of[name]
            if saved != paired[index]:
                with_it = [n for n in groups[saved].get("params", []) if n != name][:2]
                beside = f" with {', '.join(map(repr, with_it))}" if with_it else ""
                raise CheckpointError(
                    f"fusedist.checkpoint: {source}: parameter {name!r} is in param group {index} of the optimizer "
                    f"but was saved in {number(saved, 'param group')}{beside}: the groups must hold the saved "
                    "optimizer's parameters in its order of groups (what a group's index carries, an LR scheduler's "
                    "state among it, would act on other parameters). Build the groups as the saved job did, or pass "
                    "optimizer=None to start a new one; nothing was loaded")
        start += size


def _over_no_parameters(state: dict, groups: list, optimizer_groups: list, source: str) -> dict:
    """The saved groups' settings for an optimizer over no parameters (a pipeline part without
    state steps one with the others): as torch's ``Optimizer.load_state_dict`` restores an
    empty group's settings, and refuses another number of groups."""
    if len(groups) != len(optimizer_groups):
        raise CheckpointError(
            f"fusedist.checkpoint: {source}: the optimizer over no parameters (a model part without state's) has "
            f"{len(optimizer_groups)} param group(s); the saved optimizer whose settings it takes has {len(groups)}, "
            "and torch's Optimizer.load_state_dict refuses another number of groups: pass one with "
            f"{len(groups)} param group(s), or optimizer None for this part; nothing was loaded")
    return {"state": {}, "param_groups": [dict(g, params=[]) for g in groups]}


def _by_index(state: dict, groups: list, group_sizes: list, source: str) -> dict:
    """An optimizer's own ``state_dict()`` saved as it is (parameters by index; DCP turned the
    state's keys into strings): its groups must hold as many parameters as the optimizer's."""
    sizes = [len(g["params"]) for g in groups]
    if sizes != list(group_sizes):
        raise CheckpointError(f"fusedist.checkpoint: {source} (an optimizer's state_dict(), parameters by index) has "
                              f"param groups of {sizes} parameters, the optimizer {list(group_sizes)}")
    return {"state": {int(k): dict(v) for k, v in state.items() if v}, "param_groups": [dict(g) for g in groups]}

