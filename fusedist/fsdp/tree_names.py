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
    (``ModuleTree``: flat comparisons by identity, about 0.1 ms for a 1,200-module stack on a
    loaded 2-core CPU) and compares it when a forward of the root begins and at
    ``check_consistency()``; when it changed, each unit takes its current path and the step
    watch its parameters' current names -- a parameter's first path in ``named_parameters()``,
    by identity, so a renumbering inside a unit is followed too. A unit or parameter no longer
    in the tree keeps the name it had. Each unit's parameters' names in the unit (``names``:
    what its messages say after its path -- a piece of another size, a mixed conversion, a
    refused tie, the held-alike check, ``to_local()``) are taken again then too, from its
    modules' tree as ``fully_shard`` took them at wrapping (``fqns``, kept as they were), so a
    module inserted into or deleted from a Sequential inside a unit does not leave a message
    naming its neighbour.
"""

from __future__ import annotations

from torch.utils.weak import WeakIdKeyDictionary

from ..ddp.module_tree import ModuleTree

__all__ = ["RootTree", "name_units"]


class RootTree:
    """The root's modules' trees as last seen (Note [unit paths follow the module])."""

    __slots__ = ("modules", "trees")

    def __init__(self, modules: list):
        self.modules = list(modules)
        self.trees = [ModuleTree(m) for m in self.modules]

    def refresh(self, states: list, watch=None) -> bool:
        """Rename the units of ``states`` and ``watch``'s parameters if the tree changed since
        last seen; whether it did."""
        if all(tree.unchanged() for tree in self.trees):
            return False
        for tree, module in zip(self.trees, self.modules):
            tree.snapshot(module)
        name_units(states, {id(m): n for member in self.modules for n, m in member.named_modules()})
        if watch is not None:
            params = WeakIdKeyDictionary()  # (weak: a parameter that leaves the tree is not kept alive)
            for member in self.modules:
                for n, p in member.named_parameters():
                    if p not in params:
                        params[p] = n
            watch.names_changed(params)
        return True


def name_units(states: list, names: dict) -> None:
    """Give the units of ``states`` their paths in ``names`` (module id -> path under the root)
    and their parameters' current names in the unit; a unit not found keeps its path."""
    for st in states:
        if st.unit is not None:
            path = st.path_in(names)
            if path is not None:
                st.unit.path = path
            st.unit.names = _names_in_unit(st.unit, st.modules)


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
