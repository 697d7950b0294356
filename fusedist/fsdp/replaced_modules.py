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
    tree; taken again when the tree changed). A direct write replacing a module inside a unit that
    was not given to ``fully_shard`` (``block._modules["fc"] = ...``) is seen at the next full
    comparison: the next registration anywhere, or ``check_consistency()``.
"""

from __future__ import annotations

__all__ = ["Spine", "Places", "check_replaced", "user_class_name"]


class Spine:
    """The modules on the way from the root's modules down to those given to ``fully_shard``, each
    with its children as last seen."""

    __slots__ = ("parents",)

    def __init__(self, places: "Places", states: list):
        parents: dict = {}
        for st in states:
            for m in st.modules:
                where = places.of.get(id(m))
                while where is not None and id(where[0]) not in parents:
                    parent = where[0]
                    parents[id(parent)] = (parent, list(parent._modules.values()))
                    where = places.of.get(id(parent))
        self.parents = list(parents.values())

    def holds(self) -> bool:
        """Whether each of those modules holds the children it held (by identity: a list compare,
        ~3 us for 600 blocks, a few per cent of the fingerprint's cost)."""
        for parent, children in self.parents:
            if list(parent._modules.values()) != children:  # (the dict read again: it may be replaced whole)
                return False
        return True


class Places:
    """Where each module of the root's tree was when last seen: ``id -> (parent, key, module, path)``
    (it holds them: an id stays theirs while it is here)."""

    __slots__ = ("of",)

    def __init__(self, roots: list):
        self.of: dict = {}
        for root in roots:
            for path, m in root.named_modules(remove_duplicate=False):
                for key, child in m._modules.items():
                    if child is not None and id(child) not in self.of:
                        self.of[id(child)] = (m, key, child, f"{path}.{key}" if path else key)


def check_replaced(places: Places, roots: list, states: list) -> None:
    """Refuse the forward if a module the units of ``states`` hold left the tree and a module new to
    it holds its place, or its ancestor's that left with it (Note [a sharded submodule replaced])."""
    present = {id(m) for root in roots for m in root.modules()}
    for st in states:
        unit = st.unit
        if unit is None:
            continue
        held = list(st.modules) + [m for regs in unit.registrations for m, _ in regs]
        for m in held:
            if id(m) in present or id(m) not in places.of:
                continue
            top = places.of[id(m)]
            while id(top[0]) not in present and id(top[0]) in places.of:
                top = places.of[id(top[0])]
            parent, key, old, path = top
            now = parent._modules.get(key)
            if now is not None and id(now) not in places.of:
                _refuse(path, old, now, m, unit)


def user_class_name(m) -> str:
    """The user's class of ``m`` (not the ``FullyShard...`` class fully_shard gave it)."""
    return next(c.__name__ for c in type(m).__mro__ if not c.__name__.startswith("FullyShard"))


def _refuse(path: str, old, now, m, unit) -> None:
    inside = "" if m is old else f" (its submodule {user_class_name(m)} among them)"
    raise RuntimeError(
        f"fusedist.fully_shard: submodule '{path}' ({user_class_name(old)}) was replaced by a new "
        f"{user_class_name(now)} after the model's first forward; it held parameters of unit {unit.label}{inside}, "
        "sharded by fully_shard. The new module's parameters belong to no unit (each rank would train its own "
        "copy, their gradients never reduced) and the optimizer would step pieces no longer used. Put the old "
        "module back; to change values, load them into it (load_state_dict, fusedist.fsdp.load_full_state_dict); "
        "to change the architecture, build the new model and call fully_shard on it.")
