"""The modules holding one parameter of a unit, the module given to ``fully_shard`` held weakly.

A unit swaps each parameter on every ``(module, attribute)`` holding it (Note [sharded
parameters] in unit.py), so it holds those modules. Most are submodules, which lead nowhere
back. But a module given to ``fully_shard`` may hold a parameter itself (a scale, a norm's
weight on the sharded module, an ``nn.Embedding`` sharded on its own): that module's hooks hold
its state, the state its unit -- a strong reference from the unit back to it made a cycle, and a
dropped model waited for the garbage collector (Note [a dropped model freed at once] in state.py).
Such modules are held weakly here; the others stay held strongly, so a submodule the program
detached from the tree keeps receiving the swaps as before.
"""

from __future__ import annotations

import weakref

__all__ = ["Registrations"]


class Registrations:
    """The ``(module, attribute)`` pairs holding one parameter, in the order found (iterating
    yields them; a pair whose weakly held module is gone is left out). ``strong`` and ``weak``
    are the two kinds apart, for the swap on the hot path (``ShardedUnit._register``)."""

    __slots__ = ("strong", "weak", "_order")

    def __init__(self, pairs, members):
        member_ids = {id(m) for m in members}
        self.strong: list = []  # (module, attribute)
        self.weak: list = []  # (weak reference to a module given to fully_shard, attribute)
        self._order: list = []  # (kind list, index in it) of each pair, in the order found
        for module, attr in pairs:
            kind, entry = (self.weak, (weakref.ref(module), attr)) if id(module) in member_ids else \
                (self.strong, (module, attr))
            self._order.append((kind, len(kind)))
            kind.append(entry)

    def __iter__(self):
        for kind, i in self._order:
            held, attr = kind[i]
            module = held() if kind is self.weak else held
            if module is not None:
                yield module, attr

    def __getitem__(self, index):
        return list(iter(self))[index]  # (iter: ``list(self)`` would ask ``__len__``, which asks this)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"Registrations({list(iter(self))!r})"
