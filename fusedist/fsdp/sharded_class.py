"""The class a sharded module takes (``FullyShard<Original>``), and what constructing or copying
through it gives: a module of the original class, as torch FSDP2's.

Note [constructing through a sharded class]
    ``fully_shard`` swaps a module's class for a subclass of ``(FullyShardedModule, original)``.
    Code that builds a sibling of a module through its class -- a container's slice
    (``seq[1:]`` is ``type(seq)(...)``), a script's ``type(model)()`` for a fresh model of the
    same architecture -- did not give the new module to ``fully_shard``, so it gets the original
    class, built by the original ``__init__`` with the arguments given, none included: FSDP2's
    ``__new__``. A constructor that needs arguments fails as the original's does
    (``type(sharded_linear)()`` names ``in_features``). Before, a call without arguments gave an
    object whose ``__init__`` never ran (no ``_modules``, no ``in_features``), which failed later
    at its first use.

    ``copy.copy`` does not construct: it makes the object with ``cls.__new__(cls)`` and gives it
    the module's attributes. It has its own path (``shallow_copy``): an object of the original
    class with this module's attributes -- FSDP2's result where the original constructs without
    arguments; where it does not, FSDP2's copy fails in the original's ``__init__`` and this one
    still copies.

    Pickling (``torch.save(model)``, ``pickle.dumps``) is refused by name (``refuse_pickling``):
    the pieces are bound to this process's units and process group, and the class is made at
    sharding, so pickle could not name it; it failed with "attribute lookup FullyShard... failed"
    (FSDP2's fails alike, on its ``FSDP...`` class).
"""

from __future__ import annotations

import pickle

_CLASSES: dict = {}  # original class -> its sharded class


def sharded_class(cls: type, base: type) -> type:
    """``cls``'s sharded class, a subclass of ``(base, cls)``, made once per class."""
    if issubclass(cls, base):
        return cls
    sharded = _CLASSES.get(cls)
    if sharded is None:
        sharded = _CLASSES[cls] = type(f"FullyShard{cls.__name__}", (base, cls), {})
    return sharded


def original_class(cls: type, base: type) -> type:
    """The class ``fully_shard`` found the module with: the one after ``base`` in ``cls``'s MRO
    (also for a subclass made of the sharded class later, e.g. by a parametrization)."""
    mro = cls.__mro__
    return mro[mro.index(base) + 1]


def shallow_copy(module, base: type):
    """``copy.copy(module)`` as if its class were the original one (Note [constructing through a
    sharded class])."""
    original = original_class(type(module), base)
    own = getattr(original, "__copy__", None)
    if own is not None:  # the original class says how it copies
        return own(module)
    copied = original.__new__(original)
    copied.__setstate__(module.__getstate__())
    return copied


class ShardedModulePicklingError(pickle.PicklingError, TypeError):
    """A sharded module was pickled. A ``PicklingError``, as pickling one failed before (and
    FSDP2's does), and a ``TypeError``, as refusing its deep copy is."""


def refuse_pickling(module):
    """Pickling a sharded module: an error that says what to save instead (Note [constructing
    through a sharded class])."""
    raise ShardedModulePicklingError(
        f"fusedist.fully_shard: a sharded module ({type(module).__name__}) cannot be pickled "
        "(torch.save(model), pickle.dumps): its parameters are this rank's pieces, bound to its units and "
        "process group. Save its weights instead: fusedist.checkpoint.save(directory, model), "
        "torch.save(fusedist.fsdp.full_state_dict(model)) for the whole tensors, or model.state_dict() "
        "(this rank's pieces)")
