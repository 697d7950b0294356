"""Which sharded unit holds a parameter: the table a later ``fully_shard`` call reads to borrow a
weight tied across units instead of sharding it twice, and that a conversion updates when it
replaces pieces."""

from __future__ import annotations

import weakref
from typing import Optional

from torch.utils.weak import WeakIdKeyDictionary

from ..ownership import register_step_watch
from .held_alike import held_alike_flags

# Every parameter a unit took over -- the original and its piece -- maps to (weak reference to
# the unit, index). Weak both ways: the unit holds the parameter, so a strong value would keep
# the whole model alive for good.
_OWNED: WeakIdKeyDictionary = WeakIdKeyDictionary()


class Held:
    """``p in Held()``: whether a live unit holds ``p`` (a dropped model's parameters are free)."""

    def __contains__(self, p) -> bool:
        return owner_of(p) is not None


def owner_of(p) -> Optional[tuple]:
    """``(unit, index)`` of the unit holding ``p`` (an original parameter or its piece), or None."""
    owned = _OWNED.get(p)
    unit = owned[0]() if owned is not None else None
    return (unit, owned[1]) if unit is not None else None


# Every module slot a unit swaps (``(module, attr)`` of its registrations) -> (weak reference to the
# unit, index): while the unit is gathered, the slot holds the unsharded parameter, which
# ``_OWNED`` does not know, so a later ``fully_shard`` of a module inside it (sharded after its
# parent, after a forward that kept the parent gathered) took that parameter as a new one of its
# own, and two units swapped one slot. Weak on the module: a dropped model's modules are freed.
_SLOTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def record_slots(unit) -> None:
    """The module slots ``unit``'s parameters are registered in, for :func:`slot_owner`."""
    for index, regs in enumerate(unit.registrations):
        for module, attr in regs:
            _SLOTS.setdefault(module, {})[attr] = (weakref.ref(unit), index)


def slot_owner(module, attr: str) -> Optional[tuple]:
    """``(unit, index)`` of the live unit that swaps ``module.attr`` in and out, or None."""
    held = _SLOTS.get(module, {}).get(attr)
    unit = held[0]() if held is not None else None
    if unit is None or not any(m is module and a == attr for m, a in unit.registrations[held[1]]):
        return None
    return unit, held[1]


def record_owner(unit, index: int, *params) -> None:
    """``params`` (a parameter and its piece) are the unit's ``index``-th parameter."""
    for p in params:
        _OWNED[p] = (weakref.ref(unit), index)


def register_pieces(state, adopted: list) -> None:
    """Register pieces a conversion replaced where their predecessors were registered: the
    tied-weight table, the gradient holder and the step watch."""
    if not adopted:
        return
    unit = state.unit
    for i, piece in adopted:
        record_owner(unit, i, piece)
    pieces = [piece for _, piece in adopted]
    # (a tensor-parallel holder's pieces held alike stay counted once: Note [one norm on every
    # tensor-parallel rank] in holder.py)
    unit.holder.register(pieces, held_alike_flags(unit, [i for i, _ in adopted]))
    watch = state.ctx.watch if state.ctx is not None else None
    if watch is not None:
        register_step_watch(pieces, watch)
