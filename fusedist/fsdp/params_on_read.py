"""A module's parameter table that reports each read or write of a parameter before it happens,
so ``init_parameters`` (and ``model.apply(fn)`` through it) makes units whole only for an
``fn`` that reads or writes parameters (Note [whole only when read] in param_init.py).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["ParamsOnRead", "watch_params", "unwatch_params", "modules_holding"]


class ParamsOnRead(dict):
    """``module._parameters`` while an initialization runs: every method that hands out or
    changes a value calls ``on_read()`` first. Membership tests and key listings do not:
    ``setattr(module, "flag", x)`` asks whether ``flag`` is a parameter, and a flag is no
    reason to make a unit whole."""

    __slots__ = ("on_read",)

    def __init__(self, items, on_read: Callable[[], None]):
        super().__init__(items)
        self.on_read = on_read

    def __iter__(self):
        # defined so that ``dict(table)`` and ``{**table}`` read the values through ``__getitem__``
        # (CPython copies a dict subclass's storage directly unless it defines its own iteration)
        return dict.__iter__(self)


def _reported(name: str):
    method = getattr(dict, name)

    def reported(self, *args, **kwargs):
        self.on_read()
        return method(self, *args, **kwargs)

    reported.__name__ = reported.__qualname__ = name
    return reported


for _name in ("__getitem__", "get", "items", "values", "copy", "pop", "popitem", "setdefault", "__setitem__",
              "__delitem__", "update", "__or__", "__ior__"):
    setattr(ParamsOnRead, _name, _reported(_name))


def watch_params(modules, on_read: Callable[[], None]) -> list:
    """Give each of ``modules`` a :class:`ParamsOnRead` table with its parameters; the
    ``(module, original table, watching table)`` triples that :func:`unwatch_params` undoes."""
    watched = []
    for m in modules:
        original = m.__dict__["_parameters"]
        table = ParamsOnRead(dict.items(original), on_read)
        m.__dict__["_parameters"] = table
        watched.append((m, original, table))
    return watched


def unwatch_params(watched: list) -> None:
    """Put each module's own table object back, holding what the watching table holds now (a
    module whose table was replaced meanwhile keeps the replacement)."""
    for m, original, table in watched:
        if m.__dict__.get("_parameters") is table:
            original.clear()
            original.update(dict.items(table))
            m.__dict__["_parameters"] = original


def modules_holding(units) -> list:
    """Every module that holds a parameter of ``units`` (their own and tied ones held elsewhere), once."""
    found: dict = {}
    for unit in units:
        for regs in unit.registrations:
            for m, _ in regs:
                found.setdefault(id(m), m)
        for _, _, regs in unit.borrowed:
            for m, _ in regs:
                found.setdefault(id(m), m)
    return list(found.values())
