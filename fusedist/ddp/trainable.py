"""Parameters whose ``requires_grad`` changes after the model was wrapped (progressive unfreezing).

Note [trainable set changes]
    torch DDP fixes the reduced parameters at construction: one unfrozen later is trained on
    each rank's local gradient (the ranks drift apart), one frozen later stalls
    ``find_unused_parameters=False``. fusedist follows the module instead:

    * Every training forward compares the parameters' ``requires_grad`` flags with those the
      bucket layout was built from (a list comparison; the CRC below only when they differ).
      A newly trainable parameter gets its gradient hook then, so its backward reaches the
      reducer.
    * The flags' CRC is a field of the per-step check (Note [step check]): ranks that changed
      different sets raise :class:`RankMismatchError` on every rank, naming the parameters and
      the ranks (:func:`describe_mismatch`).
    * The backward of that forward still runs on the old layout, so every rank issues the same
      bucket collectives whatever it changed: a newly frozen parameter's slot is sent as zeros
      and its gradient left alone; a newly trainable one gets its local gradient from autograd.
    * At the end of that backward a rank whose flags changed reads the step check's verdict at
      once (a mismatch raises there; the other ranks raise at their next forward). Then every
      rank averages the newly trainable parameters' gradients with one extra all-reduce per
      dtype, divided as the buckets are, and re-buckets (trainable_rebucket.py): plain DDP rebuilds the layout without
      the frozen parameters (and re-observes the readiness order at the next synchronized
      backward); with a ZeroRedundancyOptimizer, whose shards follow the buckets, the layout
      only grows (``Reducer.append_only``): new parameters get new buckets at the end, frozen
      ones keep a slot sent as zeros, so no other parameter's shard moves. A communication
      hook gets the same: its buckets keep their indices and sizes, as under torch's DDP, whose
      buckets never change (PowerSGD keys its error feedback by bucket index; a rebuilt layout
      failed its next backward with a size mismatch), and a parameter trainable again whose
      slot was kept goes through the hook from its first backward, as torch's does
      (``_thaw_into_hook_buckets``).

    So the optimizer step after that backward sees averaged gradients, as torch DDP built with
    the parameter already trainable would give. With ``FUSEDIST_CHECKS=0`` there is no step
    check and so no cross-rank comparison: every rank must change the same parameters.

Note [parameters replaced after wrapping]
    The hooks, buckets and step check follow the Parameter objects the module held when it
    was wrapped. A Parameter assigned into the module afterwards -- ``load_state_dict(...,
    assign=True)``, ``module.weight = nn.Parameter(...)``, adapters added to a wrapped model --
    has no gradient hook: it would train on this rank's gradient alone and the ranks would
    drift apart without an error (torch DDP does so; without ``find_unused_parameters`` the
    orphaned old Parameter at least fails the backward, for a reason that names the wrong
    cause). torch calls a global hook on every Parameter registration: fusedist installs one
    (``fusedist/_process_hooks.py``) that notes assignments into the modules of a live wrapper,
    and the wrapper's next training forward raises, naming them, before anything trains on
    them. A submodule added (``model.module.extra = nn.Linear(...)``) registers its Parameters
    with no Parameter registration: torch's global submodule registration hook notes those
    not followed already (a submodule shared under a second name is reduced once, as before),
    and the submodules it brings are followed from then on (an empty container filled later).
    A submodule registered also has the wrapper find the module's buffers again, so those of a
    submodule without parameters (a normalization without affine weights) are broadcast, as
    torch's DDP, which walks the module at every broadcast, does.
    Wrapping the module again takes such changes. Conversions such as ``model.half()``
    keep the Parameter objects and change their data (and their gradients'), which the
    buckets no longer hold: every training forward compares the first parameter of each
    bucket with the bucket's dtype (a whole-module conversion, without a per-parameter cost),
    and a gradient hook that cannot hand a converted parameter its bucket view reports the
    parameter (``Reducer.converted_after_wrapping``).

Note [submodules removed]
    A submodule replaced (``model.module.fc = nn.Identity()``, or a new ``nn.Linear`` under
    other parameter names) or set to None after wrapping takes Parameters out of the module
    that the buckets, the step check and the optimizer still hold. torch's DDP keeps reducing
    them: without ``find_unused_parameters`` its next forward fails ("Expected to have finished
    reduction"), with it the module trains on with the wrapper's view of it out of date, and a
    replacement's new Parameters train on each rank's gradient alone. The registration hook
    above sees the old submodule while it is still registered: it only notes its name (no
    per-step cost), and the next training forward walks the module once to find which followed
    Parameters left it, raising with the other assignments, naming them. A submodule deleted
    (``del model.module.fc``, a container's ``pop``) fires no hook: without
    ``find_unused_parameters`` (or with ``static_graph``) its parameters then get no gradient,
    and that error says they are no longer in the module (``unused.removed_from_module``, a walk
    on the error path only); with it they are unused parameters, reduced as zeros, which
    changes no result.

Note [submodules inserted into a container]
    ``nn.ModuleList.insert`` and ``nn.Sequential.insert`` write the container's ``_modules``
    directly (to shift the later entries' names), so torch's registration hook never sees the
    inserted submodule: its Parameters would train on each rank's gradient alone, silently (torch's
    DDP does so); so would those of a submodule written into any module's ``_modules`` by other
    code. Every forward compares the module tree with the one last seen (Note [submodules written
    without the registration hook] in module_tree.py), and on a change reads it once for the
    submodules this wrapper does not follow yet. Each is then handled as an added submodule -- its
    buffers found, its tree followed -- and one with parameters is refused at that training
    forward, naming it by its current path. The followed parameters are renamed to their current
    paths then (Note [names follow the module]): the entries after an insertion or a deletion are
    named as they are now, not as they were wrapped.
"""

from __future__ import annotations

import weakref
import zlib

import torch

from .._process_hooks import install_module_registration_hook, install_parameter_registration_hook
from . import compiled_assignments
from .memory_format import check_memory_format
from .module_tree import ModuleTree, rename_followed
from .layout import converted_param


def flags_crc(flags: list) -> int:
    """A rank-independent 31-bit digest of the requires_grad flags."""
    return zlib.crc32(bytes(flags)) & 0x7FFFFFFF


class TrainableTracker:
    """The module's parameters and the flags the reducer's layout was built from."""

    def __init__(self, module, owner):
        # The weights with sparse gradients are the wrapper's, never the buckets' (Note [sparse
        # gradients] in sparse.py): their flags change no layout; only their assignment is followed.
        sparse = dict(zip(owner._sparse.names, owner._sparse.params))
        named = [(n, p) for n, p in owner.synced_parameters() if n not in sparse]
        self.sparse = sparse
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.position = {n: i for i, n in enumerate(self.names)}
        self.assigned: list[str] = []  # Note [parameters replaced after wrapping]
        # Note [submodules removed]: submodules replaced or set to None since the last training
        # forward, and the followed parameters found gone with them (with those submodules' names).
        self.replaced_modules: list[str] = []
        self.removed: list[str] = []
        self.removed_modules: list[str] = []
        self._held_ids: "frozenset[int] | None" = None  # the followed Parameters' ids, built when needed
        # Note [submodules inserted into a container]: the parameters (and submodules) found registered
        # without the registration hook since the last training forward.
        self.inserted: list[str] = []
        self.inserted_modules: list[str] = []
        self.compiled = False  # Note [assignments inside a compiled function] in compiled_assignments.py
        follow_assignments(module, self)
        self.tree = ModuleTree(module)  # Note [submodules written without the registration hook]
        self.layout_flags = [p.requires_grad for p in self.params]
        self.layout_crc = flags_crc(self.layout_flags)
        self.target = None  # flags seen at a training forward that the layout does not follow yet
        self.target_crc = self.layout_crc
        self.owner = weakref.ref(owner)

    @property
    def crc(self) -> int:
        """The flags of the last training forward (the step check's ``trainable`` field)."""
        return self.target_crc

    def observe(self, reducer, tree_checked: bool = False) -> None:
        """Called by every training forward; cheap unless the flags changed. ``tree_checked``: the
        forward compared the module tree already (before its buffer broadcast)."""
        if not tree_checked:
            self.find_inserted()
        if self.replaced_modules:
            self._find_removed()
        if self.assigned or self.removed or self.inserted:
            raise self._assigned_error(reducer)
        converted = converted_param(reducer.layout.buckets)
        if converted is not None:
            bucket, _ = converted
            raise reducer.converted_after_wrapping(bucket.names[0], bucket.params[0], bucket.dtype, reducer.device)
        check_memory_format(reducer)  # Note [memory format changed after wrapping] in memory_format.py
        flags = [p.requires_grad for p in self.params]
        if flags == (self.target if self.target is not None else self.layout_flags):
            return
        if flags == self.layout_flags:
            self.target, self.target_crc = None, self.layout_crc
            reducer.frozen_now = set()
            return
        self.target, self.target_crc = flags, flags_crc(flags)
        reducer.frozen_now = {p for p, f in zip(self.params, flags) if not f and reducer.is_active(p)}
        for p, f, name in zip(self.params, flags, self.names):
            if f and not reducer.is_active(p):
                _check_trainable_dtype(reducer, p, name)
                reducer.ensure_hook(p)
        _thaw_into_hook_buckets(reducer, {p for p, f in zip(self.params, flags) if f})

    def find_inserted(self) -> None:
        """Handle the submodules registered without torch's registration hook, and rename the
        parameters after any change of the tree (Note [submodules written without the registration
        hook], Note [names follow the module] in module_tree.py); one flat comparison when none was."""
        if compiled_assignments.any_noted():
            compiled_assignments.replay()
        if self.tree.unchanged():
            return
        owner = self.owner()
        if owner is None:
            return
        for path, parent in owner.module.named_modules():
            for name, sub in list(parent._modules.items()):
                if sub is not None and not _follows(sub, self):
                    self._note_inserted(parent, f"{path}." if path else "", name, sub)
        owner.submodules_changed()  # (a submodule deleted: its buffers are no longer broadcast)
        before = self.tree.modules()
        self.tree.snapshot(owner.module)
        _unfollow(self.tree.left(before), self)
        _follow_tree(owner.module, weakref.ref(self), "")  # assignments noted under the current paths
        rename_followed(owner, self)
        owner.watch.names_changed()  # (the parameter check names them as they are now)

    def tree_replaced(self) -> None:
        """The wrapper's module was replaced by one around the same Parameters (Note [the wrapped
        module replaced] in module_swap.py): its tree is read as a changed one, now."""
        self.tree.forget()
        self.find_inserted()

    def _note_inserted(self, parent, prefix: str, name: str, submodule) -> None:
        before = len(self.assigned)
        _registered_into(self, parent, prefix, name, submodule)
        # (its parameters may share names the container's shifted entries were wrapped under:
        # reported as inserted, not as replacements)
        added, self.assigned[before:] = self.assigned[before:], []
        if added:
            self.inserted += [n for n in added if n not in self.inserted]
            self.inserted_modules.append(f"{prefix}{name} ({type(submodule).__name__})")

    def note_assignment(self, name: str, param, module=None, key: str = "") -> None:
        """A Parameter was registered under ``name``, as ``module``'s ``key`` (Note [parameters
        replaced after wrapping])."""
        owner = self.owner()
        if owner is not None and owner.ignores(module, key):
            return  # rank-local: not DDP's to follow (Note [ignored entries followed by identity])
        index = self.position.get(name)
        held = self.params[index] if index is not None else self.sparse.get(name)
        if held is param or name in self.assigned:
            return
        if held is None and id(param) in self.held_ids():
            return  # a followed Parameter under a second name (a shared submodule): reduced once, as before
        self.assigned.append(name)

    def held_ids(self) -> "frozenset[int]":
        """The ids of the Parameters followed (alive: this tracker holds them)."""
        if self._held_ids is None:
            self._held_ids = frozenset(map(id, self.params + list(self.sparse.values())))
        return self._held_ids

    def assigned_since_wrapping(self, param, name: str) -> "str | None":
        """``"replaced"`` or ``"added"`` for a Parameter held by the module under ``name`` that the
        wrapper was not built with (Note [parameters replaced after wrapping]), else None."""
        if id(param) in self.held_ids():
            return None
        return "replaced" if name in self.position or name in self.sparse else "added"

    def not_in_module(self, params) -> list[str]:
        """The names of those of ``params`` (followed ones) that the wrapped module no longer
        holds (one walk of the module: for error paths and after a submodule was replaced)."""
        owner = self.owner()
        if owner is None:
            return []
        present = {id(p) for p in owner.module.parameters()}
        names = {id(p): n for n, p in zip(self.names, self.params)}
        names.update((id(p), n) for n, p in self.sparse.items())
        return [names[id(p)] for p in params if id(p) in names and id(p) not in present]

    def _find_removed(self) -> None:
        """Note [submodules removed]: after a submodule was replaced or set to None, note the
        followed Parameters that left the module with it."""
        replaced, self.replaced_modules = self.replaced_modules, []
        gone = [n for n in self.not_in_module(self.params + list(self.sparse.values())) if n not in self.assigned]
        if gone:
            self.removed += [n for n in gone if n not in self.removed]
            self.removed_modules += [m for m in replaced if m not in self.removed_modules]

    def _assigned_error(self, reducer) -> RuntimeError:
        known = [n for n in self.assigned if n in self.position or n in self.sparse]
        groups = (("replaced by new Parameter objects", known),
                  ("added", [n for n in self.assigned if n not in known]),
                  (f"added with the submodule(s) {self.inserted_modules} registered without torch's registration "
                   "hook (inserted into a ModuleList or Sequential by insert(), or written into a module's _modules "
                   "directly: module._modules[name] = ...)", self.inserted),
                  (f"removed with the submodule(s) {self.removed_modules} replaced or set to None", self.removed))
        what = [f"{label}: {names[:10]}{' ...' if len(names) > 10 else ''}" for label, names in groups if names]
        who, module, when, redo = _words(self.owner(), reducer.comm.rank)
        when += compiled_assignments.WHERE if self.compiled else ""
        return RuntimeError(
            f"{who}: parameters of the {module} were assigned {when}, or removed ({'; '.join(what)}), e.g. by "
            "load_state_dict(..., assign=True), module.weight = nn.Parameter(...), a submodule added "
            "(module.extra = nn.Linear(...)) or replaced (module.fc = nn.Identity()). The engine synchronizes "
            "the gradients of the Parameters it was built with: new ones would train on this rank's gradients "
            f"alone, and removed ones are still reduced (and checked) as parts of the model. {redo}"
        )

    def describe_mismatch(self, comm) -> list[str]:
        """Lines naming the parameters whose flags differ across ranks. A collective: every rank
        calls it when the step check's ``trainable`` field differs (the same verdict everywhere)."""
        flags = self.target if self.target is not None else self.layout_flags
        mine = torch.tensor(flags, dtype=torch.uint8, device=comm.device)
        everyone = torch.empty(comm.world_size * len(flags), dtype=torch.uint8, device=comm.device)
        comm.all_gather(everyone, mine, tag="ddp trainable flags")
        table = everyone.view(comm.world_size, len(flags)).tolist()
        lines = []
        for i, name in enumerate(self.names):
            column = [row[i] for row in table]
            if len(set(column)) > 1:
                on = [r for r, v in enumerate(column) if v]
                off = [r for r, v in enumerate(column) if not v]
                lines.append(f"  parameter '{name}': requires_grad=True on ranks {on}, False on ranks {off}")
        return lines[:10] + (["  ..."] if len(lines) > 10 else [])


def _words(owner, rank: int) -> tuple:
    """(who, the module, since when, what to do) for the refusal of changed parameters: a
    ``fusedist.replicate`` module is no wrapper, and its engine is built at its first forward."""
    from .replicate import ReplicatedModule, _class_name

    if owner is not None and isinstance(owner.module, ReplicatedModule):
        name = _class_name(owner.module)
        return (f"fusedist.replicate({name}) (rank {rank})", f"replicated {name}",
                "after its first forward (when its data-parallel engine was built)",
                f"Make such changes before the first forward of the replicated {name}")
    return (f"fusedist.DistributedDataParallel (rank {rank})", "wrapped module", "after it was wrapped",
            "Make such changes before wrapping, or wrap the module again")


# Note [parameters replaced after wrapping]: module -> [(tracker, qualified-name prefix)].
_followed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# Note [registrations while dynamo traces]
# A compiled forward that slices a ModuleList (``self.layers[1:]`` builds a new one, registering its
# members) ran the registration hooks below inside the trace: dynamo guarded on the length of
# ``_followed``'s weak dict, which changes whenever a wrapped model is garbage-collected, and such a
# forward recompiled at random (up to the recompile limit). The hooks do nothing while dynamo traces:
# what a compiled region registers into is a container it built (no followed module); an assignment
# into a wrapped module made inside a compiled function is noted through a mark on the module (Note
# [assignments inside a compiled function] in compiled_assignments.py).


def follow_assignments(module, tracker: TrainableTracker) -> None:
    """Have Parameter assignments and submodules added into ``module`` or its submodules noted
    by ``tracker``."""
    install_parameter_registration_hook("ddp parameters assigned after wrapping",
                                        _parameter_registered)
    install_module_registration_hook("ddp submodules added after wrapping",
                                     _module_registered)
    _follow_tree(module, weakref.ref(tracker), "")


def _follow_tree(module, ref, prefix: str) -> None:
    """Follow ``module``'s tree for ``ref``'s tracker under the paths it has now (one entry per
    tracker: a module followed again, after the tree changed, takes its current path)."""
    tracker = ref()
    for name, sub in module.named_modules():
        # (dropping the entries of wrappers that are gone: a module wrapped again and again)
        live = [entry for entry in _followed.get(sub, ()) if entry[0]() not in (None, tracker)]
        _followed[sub] = live + [(ref, prefix + name + "." if name else prefix)]
        compiled_assignments.mark(sub)


def _unfollow(modules, tracker) -> None:
    """Drop ``tracker``'s entries of ``modules``, which left its module: an assignment into one
    is not the model's (Note [modules that left the tree] in module_tree.py)."""
    for module in modules:
        live = [entry for entry in _followed.get(module, ()) if entry[0]() not in (None, tracker)]
        if live:
            _followed[module] = live
        else:
            _followed.pop(module, None)


def _follows(module, tracker) -> bool:
    return any(ref() is tracker for ref, _ in _followed.get(module, ()))


def _current_entries(module) -> list:
    """The (tracker, path prefix) entries of ``module``, with the paths brought up to date first
    where the tree changed since the last forward (Note [names follow the module] in
    module_tree.py: an entry inserted before it renumbered it); one tree comparison per tracker."""
    for ref, _ in list(_followed.get(module, ())):
        tracker = ref()
        if tracker is not None:
            tracker.find_inserted()
    return [(ref(), prefix) for ref, prefix in _followed.get(module, ()) if ref() is not None]


def _parameter_registered(module, name: str, param):
    if torch.compiler.is_compiling():  # (Note [registrations while dynamo traces])
        return compiled_assignments.note_traced(module, name, param, parameter=True)
    for tracker, prefix in _current_entries(module):
        tracker.note_assignment(prefix + name, param, module, name)
    return None  # the Parameter is registered unchanged


def _module_registered(module, name: str, submodule):
    """A submodule registered into a followed module: its Parameters are noted as assigned
    (those followed already under another name excepted) and its tree is followed."""
    if torch.compiler.is_compiling():  # (Note [registrations while dynamo traces])
        return compiled_assignments.note_traced(module, name, submodule, parameter=False)
    for tracker, prefix in _current_entries(module):
        _registered_into(tracker, module, prefix, name, submodule)
    return None  # the submodule is registered unchanged


def _registered_into(tracker: TrainableTracker, module, prefix: str, name: str, submodule) -> None:
    """``submodule`` registered under ``name`` into ``module`` (at ``prefix``), which ``tracker``
    follows; ``module._modules`` may still hold the submodule it replaces."""
    owner = tracker.owner()
    if owner is not None:
        owner.submodules_changed()  # its buffers are found again (a submodule set to None: dropped)
    old = module._modules.get(name)  # still registered: the hook runs before the assignment
    if old is not None and old is not submodule and next(old.parameters(), None) is not None:
        tracker.replaced_modules.append(f"{prefix}{name}")  # Note [submodules removed]
    if submodule is None:
        return
    seen: set = set()  # (each Parameter once, under its first name: named_parameters())
    for path, sub in submodule.named_modules(prefix=f"{prefix}{name}"):
        for key, param in sub._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                tracker.note_assignment(f"{path}.{key}", param, sub, key)
    _follow_tree(submodule, weakref.ref(tracker), f"{prefix}{name}.")


def _thaw_into_hook_buckets(reducer, trainable: set) -> None:
    """Under a communication hook, a parameter trainable again whose slot the buckets kept goes
    through the hook from this backward on, as under torch's DDP (whose buckets keep every
    parameter), not averaged after the buckets: a hook that compresses (PowerSGD) or averages
    over a subgroup (post-local SGD) would give other numbers."""
    thawed = {p for p in reducer.inactive if p in trainable}
    if thawed and reducer.strategy.keeps_buckets:
        reducer.inactive = reducer.inactive - thawed


def _check_trainable_dtype(reducer, p, name: str) -> None:
    if not (p.dtype.is_floating_point or p.dtype.is_complex):
        raise TypeError(
            f"fusedist.DistributedDataParallel (rank {reducer.comm.rank}): parameter '{name}' became "
            f"trainable with dtype {p.dtype}; only floating-point and complex parameters can be trained"
        )
