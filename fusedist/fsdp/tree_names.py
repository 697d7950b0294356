"""The paths of a root's units, and the names of its parameters, kept current when the module's
tree changes.

Note [unit paths follow the module]
    A unit's path under its root names it in collective tags (hence in timeouts and stall
    reports), in the step check's list of the units a forward ran, and, with its parameters'
    names, in messages: the replica check's, the held-alike check's, ``to_local()``'s refusal.
    It is taken at the root's first forward. An entry inserted before others in a ModuleList or
    Sequential, or one deleted from it, renumbers the later ones (``layers.1`` becomes
    ``layers.2``), and the paths taken then name other blocks. torch's FSDP2 takes its names
    once too (``_init_fqns`` at its lazy init: its profiler labels keep the old ones), and
    fusedist's DDP follows the tree (Note [names follow the module] in
    fusedist/ddp/module_tree.py). So the root keeps its modules' tree as last seen
    (``ModuleTree``: flat comparisons by identity) and compares it when a forward of the root
    begins -- first by a fingerprint (Note [the tree's fingerprint]) -- and, in full, at
    ``check_consistency()``; when it changed, each unit takes its current path and the step
    watch its parameters' current names -- a parameter's first path in ``named_parameters()``,
    by identity, so a renumbering inside a unit is followed too. A unit or parameter no longer
    in the tree keeps the name it had. Each unit's parameters' names in the unit (``names``:
    what its messages say after its path -- a piece of another size, a mixed conversion, a
    refused tie, the held-alike check, ``to_local()``) are taken again then too, from its
    modules' tree as ``fully_shard`` took them at wrapping (``fqns``, kept as they were), so a
    module inserted into or deleted from a Sequential inside a unit does not leave a message
    naming its neighbour.

Note [the tree's fingerprint]
    The full comparison reads every module's ``_modules`` and every submodule: 0.3-1.8 ms per
    forward for 1,200-4,800 modules on a loaded 2-core CPU. A root forward compares a fingerprint
    instead (about a tenth of that): the count of submodule registrations in the process (torch's
    global module-registration hook, installed once through ``fusedist/_process_hooks.py``: every
    ``setattr`` / ``add_module`` of a submodule, ``append``, ``ModuleList.__setitem__``) and the
    length of each ``_modules`` dict of the tree as last seen. That hook does not see
    ``ModuleList.insert`` / ``Sequential.insert`` nor a deletion (``del layers[1]``, ``pop``),
    which write the dict directly -- but each changes that dict's length. The full comparison runs
    only when the fingerprint changed (a registration anywhere in the process is enough). What
    the fingerprint does not see: a direct write of a module under a key already present
    (``parent._modules["1"] = other``, no hook, same length) or a ``_modules`` dict replaced
    without its old one changing. Such a write is seen at the next forward on the way from the
    root to a module given to ``fully_shard`` (by the spine) and where it replaces a module holding
    a unit's parameters (its parent's ``_modules`` is a watched dict whose writes the fingerprint
    counts, and which is compared by identity, so that one replaced whole is seen too: Note [a
    sharded submodule replaced] in replaced_modules.py); elsewhere it is followed at the next full
    comparison -- the next fingerprint change or ``check_consistency()``.

Note [a sharded unit removed]
    ``del model.blocks[1]`` after the first forward removes a unit from the root's tree. It stays
    one of the root's units, as in torch's FSDP2: the optimizer still holds its pieces, which get
    no gradient and are not stepped (an optimizer skips a parameter without ``.grad``), the step
    watch keeps them, the state dict no longer lists them; training equals the unsharded model
    with the block removed. What it held gathered is freed when the root sees the tree changed,
    and no forward prefetches it (the previous forward's order named it next after its neighbour):
    nothing under the root runs it now, so nothing would reshard one kept gathered
    (``reshard_after_forward=False``, forwards without gradients: an evaluation loop) until a
    backward or an optimizer step (FSDP2 keeps it gathered). Put back, it is a unit as before. A
    removed module *replaced* by another is refused (Note [a sharded submodule replaced] in
    replaced_modules.py).
"""

from __future__ import annotations

import weakref
from operator import attrgetter
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._process_hooks import install_module_registration_hook
from ..ddp.module_tree import ModuleTree
from .replaced_modules import WRITES, Places, Spine, WatchedDicts, check_replaced, watch_parents

__all__ = ["RootTree", "name_units", "param_path", "unit_listed", "unit_named", "unit_owner", "unit_where"]


_CHILDREN = attrgetter("_modules")
_REGISTRATIONS = [0]  # submodule registrations in the process (Note [the tree's fingerprint])


def _registered(module, name, submodule) -> None:
    # Not while dynamo traces: a compiled forward that slices a ModuleList (``self.layers[:-1]`` builds
    # a new one, registering its members) would guard on the count it bumps and recompile every step;
    # what a compiled region registers is a traced stand-in, and a real change still moves a length.
    if not torch.compiler.is_compiling():
        _REGISTRATIONS[0] += 1


class _Fingerprint:
    """The registrations count and each ``_modules`` dict's length, when last seen."""

    __slots__ = ("registrations", "dicts", "lengths")

    def __init__(self, trees: list):
        install_module_registration_hook("fully_shard module trees", _registered)
        self.registrations = _REGISTRATIONS[0] + WRITES[0]
        self.dicts = [d for tree in trees for d in map(_CHILDREN, tree.modules())]
        self.lengths = list(map(len, self.dicts))

    def same(self) -> bool:
        return self.registrations == _REGISTRATIONS[0] + WRITES[0] and list(map(len, self.dicts)) == self.lengths


class RootTree:
    """The root's modules' trees as last seen (Note [unit paths follow the module])."""

    __slots__ = ("_module_refs", "trees", "fingerprint", "full_compares", "places", "spine", "watched")

    def __init__(self, modules: list):
        # weakly: the root's modules hold their context, hence this (Note [a dropped model freed at
        # once] in state.py); what is below them does not lead back to them
        self._module_refs = [weakref.ref(m) for m in modules]
        self.trees = [ModuleTree(m, hold_root=False) for m in modules]
        self.fingerprint = _Fingerprint(self.trees)
        self.full_compares = 0  # (how often the fingerprint sent it to the full comparison)
        # where each module was, and the modules on the way to the sharded ones (Note [a sharded
        # submodule replaced] in replaced_modules.py): taken at the first refresh, which knows the states
        self.places: Optional[Places] = None
        self.spine: Optional[Spine] = None
        self.watched: Optional[WatchedDicts] = None

    @property
    def modules(self) -> list:
        """The root's modules (None for one freed)."""
        return [ref() for ref in self._module_refs]

    def refresh(self, states: list, watch=None, full: bool = False) -> bool:
        """Rename the units of ``states`` and ``watch``'s parameters if the tree changed since
        last seen; whether it did. Compared in full only where ``full``, the fingerprint changed
        (Note [the tree's fingerprint]) or a module on the way to a sharded one was replaced;
        refused where a module the units hold was replaced (Note [a sharded submodule replaced])."""
        if self.places is None:
            self._take_places(states)
        if not full and self.fingerprint.same() and self.spine.holds() and self.watched.hold():
            return False
        self.full_compares += 1
        if all(tree.unchanged() for tree in self.trees):
            if not self.watched.hold():  # (a watched dict replaced by one holding the same modules: watched again)
                self._take_places(states)
            self.fingerprint = _Fingerprint(self.trees)
            return False
        check_replaced(self.places, self.modules, states)
        for tree, module in zip(self.trees, self.modules):
            tree.snapshot(module)
        self.fingerprint = _Fingerprint(self.trees)
        self._take_places(states)
        names = {id(m): n for member in self.modules for n, m in member.named_modules()}
        name_units(states, names)
        _reshard_removed(states, names)
        if watch is not None:
            params = WeakIdKeyDictionary()  # (weak: a parameter that leaves the tree is not kept alive)
            for member in self.modules:
                for n, p in member.named_parameters():
                    if p not in params:
                        params[p] = n
            watch.names_changed(params)
        return True

    def _take_places(self, states: list) -> None:
        self.places = Places(self.modules)
        self.spine = Spine(self.places, states)
        made = watch_parents(self.places, states)
        self.watched = WatchedDicts(self.places, states, self.modules)
        if made:  # (new dicts: the fingerprint reads their lengths)
            self.fingerprint = _Fingerprint(self.trees)


def name_units(states: list, names: dict) -> None:
    """Give the units of ``states`` their paths in ``names`` (module id -> path under the root)
    and their parameters' current names in the unit; a unit not found keeps its path."""
    for st in states:
        if st.unit is not None:
            path = st.path_in(names)
            if path is not None:
                st.unit.path = path
            if len(st.modules) > 1:  # Note [a list of modules as one unit] in members.py
                old = st.unit.member_paths or [None] * len(st.modules)
                st.unit.member_paths = [names.get(id(m), o) for m, o in zip(st.modules, old)]
            st.unit.names = _names_in_unit(st.unit, st.modules)


def _reshard_removed(states: list, names: dict) -> None:
    """Mark the units no module of which is in the tree any more, and free what they hold gathered
    (Note [a sharded unit removed]). Local (no collective): every rank frees its own copy. One whose
    call is running or whose backward is still to come is left to that (``check_consistency()``
    between a forward and its backward)."""
    for st in states:
        st.removed = st.unit is not None and not any(id(m) in names for m in st.modules)
        if st.removed and not st.forward_running and not st.backward_pending:
            st.unit.reshard()


def param_path(unit, index: int) -> str:
    """Parameter ``index`` of ``unit`` named from the root, as FSDP2 and ``named_parameters()`` name
    it, once the root named the unit; its name in the unit before. A group unit's names in the unit
    start with the member's index (``[1].0.weight``): the member's path replaces it."""
    name = unit.names[index]
    if len(unit.member_paths or ()) > 1:
        k, sep, rest = name.partition("].")
        paths = unit.member_paths
        if sep and k.startswith("[") and k[1:].isdigit() and int(k[1:]) < len(paths) and paths[int(k[1:])]:
            return f"{paths[int(k[1:])]}.{rest}"
        return name
    if unit.path is None:
        return name
    return f"{unit.path}.{name}" if unit.path else name


def unit_where(unit) -> str:
    """``unit`` in a message: its module's path and class once the root named it ("the root
    module (Net)" for the root's own unit, whose path is empty), its class before."""
    if unit.path is None:
        return unit.name or "the root module"
    return f"'{unit.path}' ({unit.name})" if unit.path else f"the root module ({unit.name})"


def unit_named(unit) -> str:
    """``unit`` where a message says "unit ...": "unit blocks.0 (Block)", and the root's own
    unit as "the root module (Net)" (its label)."""
    return unit.label if unit.path == "" else f"unit {unit.label}"


def unit_listed(unit) -> str:
    """``unit`` in a list of units: its label, "blocks.0 (Block)", the root's own unit "the root
    module (Net)"."""
    return unit.label


def unit_owner(unit) -> str:
    """``unit`` after a parameter's path from the root ("'0.weight' of ..."): the call that holds
    it, ``fully_shard(Block)`` -- the path already says where -- and the root's own unit as "the
    root module (Net)" once the root named it, so a message does not make it look like a block."""
    return f"the root module ({unit.name})" if unit.path == "" else f"fully_shard({unit.name})"


def _names_in_unit(unit, modules: list) -> list:
    """Each parameter's name under ``modules`` (the unit's) as ``fully_shard`` names it: the first
    module holding it, in the order it walks them; its old name where no module holding it is left."""
    from .members import managed_modules_of

    where: dict = {}
    for k, (name, sub) in enumerate(managed_modules_of(modules)):
        where.setdefault(id(sub), (k, name))
    current = []
    for old, regs in zip(unit.names, unit.registrations):
        held = [(where[id(m)], attr) for m, attr in regs if id(m) in where]
        if not held:
            current.append(old)
            continue
        (_, name), attr = min(held, key=lambda h: h[0][0])
        current.append(f"{name}.{attr}" if name else attr)
    return current
