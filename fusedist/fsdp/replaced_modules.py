"""A sharded submodule replaced in a root's tree after its first forward: seen at the next forward,
refused naming it.

Note [a sharded submodule replaced]
    ``model.layer = new_module`` (or ``model.layers[1] = ...``, or a write of the parent's ``_modules``
    under the same key) where the old module was given to ``fully_shard``, or held parameters of a
    unit, leaves the units as they were: the new module's parameters are no unit's -- each rank
    trains its own copy, their gradients never reduced -- while the old pieces, which the optimizer
    steps, are used no more. torch's FSDP2 runs on silently so. So when the root's tree changed
    (Note [unit paths follow the module] in tree_names.py), a module the units hold that left the
    tree is looked for where it was: if a module new to the tree holds that place (its own, or an
    ancestor's that left with it), the forward is refused on every rank (the check reads only the
    model), naming the place, the old and new classes and the unit, until the old module is put
    back. A module removed without a replacement (``del layers[1]``, which renumbers the rest) and
    modules moved within the tree are followed as before.

    Such a write is seen at the next forward: an assignment through ``setattr`` by torch's
    registration hook (the tree's fingerprint), a direct write of a ``_modules`` dict under a key
    already there -- invisible to the fingerprint -- by the *spine*: the modules on the way from the
    root down to each module given to ``fully_shard``, whose children are compared by identity with
    those last seen at each forward of the root (a list compare per such parent, not a walk of the
    tree; taken again when the tree changed). Inside a unit, a direct write replacing a module that
    holds a unit's parameter (``block._modules["fc"] = nn.Linear(...)``) is seen by its parent's
    ``_modules`` dict itself: the root makes the dict of each module holding such a module a
    ``WatchedChildren`` (a ``dict`` whose writes are counted into the fingerprint), so the next
    forward compares the tree in full and refuses. Unrefused, the new Linear's parameters trained
    unsharded on each rank, unreduced and outside the optimizer, and a new module given the unit's
    own pieces (``new.weight = block.fc.weight``) failed in its forward on a shard-sized tensor.
    Extending the spine down to those parents instead cost several times the fingerprint at every
    forward (a dict read per module holding parameters); a watched dict costs nothing until
    written (but its identity compare, below). A module holding none of a unit's parameters replaced this way
    (``block._modules["act"] = nn.GELU()``) is followed, as before: the next forward runs the new
    one, as the unsharded model would.

    A watched dict replaced whole (``block._modules = {...}``, ``block.__dict__["_modules"] = ...``)
    changes no length the fingerprint reads, and the new dict counts no writes: so the root keeps
    each watched dict (``WatchedDicts``) and compares it by identity with the module's at each
    forward (one attribute read per such module: for 300 blocks of 12 modules, 900 of them
    watched, 29 us against the fingerprint's 65 us on a loaded 2-core CPU). Changed, the tree is
    compared in full -- a module the units hold that left is refused as above -- and the new dict
    is watched in turn, so a later write into it is seen too. Unseen, the new Linear trained
    unsharded on each rank until the next full comparison (``check_consistency()`` or another
    change of the tree).
"""

from __future__ import annotations

import weakref
from operator import attrgetter, is_

__all__ = ["Spine", "Places", "WatchedChildren", "WatchedDicts", "WRITES", "check_replaced", "watch_parents",
           "user_class_name"]

_CHILDREN = attrgetter("_modules")

WRITES = [0]  # writes into a WatchedChildren dict in the process (the tree's fingerprint reads it)


class Spine:
    """The modules on the way from the root's modules down to those given to ``fully_shard``, each
    with its children as last seen."""

    __slots__ = ("parents",)

    def __init__(self, places: "Places", states: list):
        parents: dict = {}
        for st in states:
            for m in st.modules:
                where = places.of.get(id(m))
                while where is not None and where[0]() is not None and id(where[0]()) not in parents:
                    parent = where[0]()
                    # (weakly: the root is among them, and its module holds this: Note [a dropped model
                    # freed at once] in state.py)
                    parents[id(parent)] = (where[0], list(parent._modules.values()))
                    where = places.of.get(id(parent))
        self.parents = list(parents.values())

    def holds(self) -> bool:
        """Whether each of those modules holds the children it held (by identity: a list compare,
        ~3 us for 600 blocks, a few per cent of the fingerprint's cost)."""
        for parent_ref, children in self.parents:
            parent = parent_ref()
            if parent is None or list(parent._modules.values()) != children:  # (the dict read again: it may be
                return False  # replaced whole)
        return True


class WatchedChildren(dict):
    """A module's ``_modules`` whose writes are counted in ``WRITES`` (a write under a key already
    there changes no length: the tree's fingerprint sees the count instead)."""

    __slots__ = ()

    def __setitem__(self, key, value) -> None:
        dict.__setitem__(self, key, value)
        WRITES[0] += 1

    def update(self, *args, **kwargs) -> None:
        dict.update(self, *args, **kwargs)
        WRITES[0] += 1

    def __ior__(self, other):
        self.update(other)
        return self


def watch_parents(places: "Places", states: list) -> bool:
    """Make ``_modules`` a ``WatchedChildren`` on each module holding a module that holds a parameter
    of a unit of ``states`` (Note [a sharded submodule replaced]); whether any was made."""
    made = False
    for parent in _holding_parents(places, states):
        if not isinstance(parent._modules, WatchedChildren):
            object.__setattr__(parent, "_modules", WatchedChildren(parent._modules))
            made = True
    return made


class WatchedDicts:
    """Each watched module's ``_modules`` dict as last seen (it holds them: a replaced one's id is
    not reused while compared), so that a dict replaced whole is seen."""

    __slots__ = ("modules", "dicts", "roots")

    def __init__(self, places: "Places", states: list, roots: list = ()):
        watched = [m for m in _holding_parents(places, states) if isinstance(m._modules, WatchedChildren)]
        root_ids = set(map(id, roots))
        self.modules = [m for m in watched if id(m) not in root_ids]
        self.dicts = list(map(_CHILDREN, self.modules))
        # the roots' own, weakly (their modules hold this: Note [a dropped model freed at once] in state.py)
        self.roots = [(weakref.ref(m), m._modules) for m in watched if id(m) in root_ids]

    def hold(self) -> bool:
        """Whether each of those modules holds the same dict (by identity: a same-content copy is
        not watched)."""
        return all(map(is_, map(_CHILDREN, self.modules), self.dicts)) and \
            all(getattr(ref(), "_modules", None) is d for ref, d in self.roots)


def _holding_parents(places: "Places", states: list) -> list:
    """The modules in the tree holding a module that holds a parameter of a unit of ``states``, once each."""
    parents: dict = {}
    for st in states:
        if st.unit is None:
            continue
        for regs in st.unit.registrations:
            for m, _ in regs:
                where = places.of.get(id(m))
                parent = where[0]() if where is not None else None
                if parent is not None:
                    parents.setdefault(id(parent), parent)
    return list(parents.values())


class Places:
    """Where each module of the root's tree was when last seen: ``id -> (weak reference to the parent,
    key, module, path)`` (it holds the modules: an id stays theirs while it is here; not the parents, the
    root among them, whose module holds this: Note [a dropped model freed at once] in state.py)."""

    __slots__ = ("of",)

    def __init__(self, roots: list):
        self.of: dict = {}
        for root in roots:
            for path, m in root.named_modules(remove_duplicate=False):
                for key, child in m._modules.items():
                    if child is not None and id(child) not in self.of:
                        self.of[id(child)] = (weakref.ref(m), key, child, f"{path}.{key}" if path else key)


def check_replaced(places: Places, roots: list, states: list) -> None:
    """Refuse the forward if a module the units of ``states`` hold left the tree and a module new to
    it holds its place, or its ancestor's that left with it (Note [a sharded submodule replaced])."""
    present = {id(m) for root in roots for m in root.modules()}
    for st in states:
        unit = st.unit
        if unit is None:
            continue
        for m in held_modules(st):
            if id(m) in present or id(m) not in places.of:
                continue
            top = places.of[id(m)]
            while id(top[0]()) not in present and id(top[0]()) in places.of:
                top = places.of[id(top[0]())]
            parent_ref, key, old, path = top
            parent = parent_ref()
            now = parent._modules.get(key) if parent is not None else None
            if now is not None and id(now) not in places.of:
                _refuse(path, old, now, m, unit)


def held_modules(st) -> list:
    """The modules given to ``fully_shard`` for ``st``'s unit and those holding its parameters."""
    if st.unit is None:
        return list(st.modules)
    return list(st.modules) + [m for regs in st.unit.registrations for m, _ in regs]


def user_class_name(m) -> str:
    """The user's class of ``m`` (not the ``FullyShard...`` class fully_shard gave it)."""
    return next(c.__name__ for c in type(m).__mro__ if not c.__name__.startswith("FullyShard"))


def _refuse(path: str, old, now, m, unit) -> None:
    from .tree_names import unit_named  # (tree_names imports this module)

    inside = "" if m is old else f" (its submodule {user_class_name(m)} among them)"
    raise RuntimeError(
        f"fusedist.fully_shard: submodule '{path}' ({user_class_name(old)}) was replaced by a new "
        f"{user_class_name(now)} after the model's first forward; it held parameters of {unit_named(unit)}{inside}, "
        "sharded by fully_shard. The new module's parameters belong to no unit (each rank would train its own "
        "copy, their gradients never reduced) and the optimizer would step pieces no longer used. Put the old "
        "module back; to change values, load them into it (load_state_dict, fusedist.fsdp.load_full_state_dict); "
        "to change the architecture, build the new model and call fully_shard on it.")
