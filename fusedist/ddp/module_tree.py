"""The wrapped module's tree as last seen, compared at every training forward.

Note [submodules written without the registration hook]
    torch's global submodule registration hook fires for ``setattr`` and ``add_module`` only.
    Other writes into a module's ``_modules`` dict register a submodule silently:
    ``ModuleList.insert`` and ``Sequential.insert`` (which shift the later entries' names), and
    code that writes ``module._modules[name] = sub`` itself (torch's quantization ``convert`` and
    model-surgery utilities do). A Parameter brought in that way has no gradient hook: it trains
    on each rank's gradient alone, silently (torch's DDP and replicate do so). So the wrapper
    keeps the submodules of every module of the tree, in one flat list; each training forward
    builds that list again (C-level ``map``/``chain`` over the ``_modules`` dicts, one element per
    submodule, no Python loop; a leaf costs one length) and compares it by identity: about the
    cost of the requires_grad flags already compared per parameter (a 1,200-module stack: ~0.1 ms
    on a loaded 2-core CPU, as the flags). When it differs -- a submodule written, replaced,
    deleted or renumbered, a ``_modules`` dict replaced -- the tree is walked once: submodules the
    wrapper does not follow yet are handled as added ones (one with parameters refused at that
    forward, naming its path), and the followed parameters are renamed to their current paths.

Note [names follow the module]
    The engine names its parameters in its messages (unused parameters, the step check, gradient
    hooks, the trainable-set check) by the names it was built with. An entry inserted before
    others, or one deleted from a ModuleList or Sequential, renumbers the later ones: the old
    names would then point at other submodules. After each change of the tree the followed
    parameters still in the module take their current (first) path; those that left it keep the
    name they had, which the messages give as no longer in the module. A Parameter or submodule
    registered through torch's hooks is named under the current path too: the hook compares the
    tree first (``_current_entries`` in trainable.py), so one assigned after an insertion, before
    any forward saw it, is not named by the entry it displaced.

Note [modules that left the tree]
    The wrapper follows each module of the tree (a weak entry per module: it keeps no module
    alive) to hear of Parameters and submodules assigned into it. When a change of the tree is
    found, the modules that left it are no longer followed: a Parameter assigned into a head
    swapped out, or into a layer deleted, is not the model's and is not noted under the path
    the module had, and a fine-tuning run that swaps submodules in and out leaves no entries
    behind. A module that comes back is handled as an added one.
"""

from __future__ import annotations

import weakref
from itertools import chain
from operator import attrgetter

__all__ = ["ModuleTree", "rename_followed"]

_CHILDREN = attrgetter("_modules")


class ModuleTree:
    """The modules of a tree that hold submodules and, flattened, the submodules each held when
    last seen; and the leaves, which held none (most modules: only their emptiness is read).
    ``hold_root=False``: the root itself is held weakly (a structure the root owns, which must not
    keep it alive); the others are below it and do not lead back to it."""

    __slots__ = ("parents", "leaves", "children", "_root_ref")

    def __init__(self, root, hold_root: bool = True):
        self._root_ref = None if hold_root else weakref.ref(root)
        self.snapshot(root)

    def snapshot(self, root) -> None:
        modules = list(root.modules())
        if self._root_ref is not None:  # (``modules()`` walks the root first)
            self._root_ref, modules = weakref.ref(root), modules[1:]
        self.parents = [m for m in modules if m._modules]
        self.leaves = [m for m in modules if not m._modules]
        self.children = self._now()

    def _root(self) -> list:
        """The weakly held root, as a list (empty where held strongly; [None] once freed)."""
        return [] if self._root_ref is None else [self._root_ref()]

    def _now(self) -> list:
        below = list(chain.from_iterable(map(dict.values, map(_CHILDREN, self.parents))))
        if self._root_ref is None:
            return below
        root = self._root_ref()
        return (list(root._modules.values()) if root is not None else [None]) + below

    def modules(self) -> list:
        """The modules of the tree when last seen."""
        return [m for m in self._root() if m is not None] + self.parents + self.leaves

    def left(self, before: list) -> list:
        """Those of ``before`` that are not in the tree as last seen (by identity)."""
        present = set(map(id, self.parents)) | set(map(id, self.leaves)) | set(map(id, self._root()))
        return [m for m in before if id(m) not in present]

    def forget(self) -> None:
        """Have the next comparison differ (the tree's root was replaced)."""
        self.children = None

    def unchanged(self) -> bool:
        """Whether no ``_modules`` dict of the tree changed (flat comparisons, by identity)."""
        return self._now() == self.children and not any(map(len, map(_CHILDREN, self.leaves)))


def rename_followed(owner, tracker) -> None:
    """Give the engine's parameters their current paths in ``owner.module`` (Note [names follow
    the module]); those no longer in it keep theirs."""
    current: dict = {}
    for name, p in owner.module.named_parameters():
        current.setdefault(id(p), name)

    def renamed(params, names) -> list:
        return [current.get(id(p), n) for p, n in zip(params, names)]

    reducer = owner.reducer
    reducer.names = renamed(reducer.params, reducer.names)
    for bucket in reducer.layout.buckets:
        bucket.names = renamed(bucket.params, bucket.names)
    sparse = owner._sparse
    sparse.names = renamed(sparse.params, sparse.names)
    tracker.names = renamed(tracker.params, tracker.names)
    tracker.position = {n: i for i, n in enumerate(tracker.names)}
    tracker.sparse = dict(zip(renamed(tracker.sparse.values(), tracker.sparse), tracker.sparse.values()))
