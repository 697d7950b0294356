"""What runs the moment torch.distributed forgets process groups (Note [when torch forgets a group]).

Note [when torch forgets a group]
    ``destroy_process_group()`` (of one group or of all) and ``_abort_process_group()`` remove the
    groups from torch's tables, then call ``_unregister_process_group`` / ``_unregister_all_process_groups``.
    fusedist hears of it there -- whatever name the program called destroy by, as torch looks these up
    when it calls them -- and, for a destroy, releases their communicators (Note [releasing destroyed
    groups] in __init__.py): before, a destroyed group's communicator and monitor stayed cached, and
    held the group, until the next ``get_communicator`` or the process's exit. An abort releases
    nothing here: it may come from another thread while a collective is blocked on the group, and
    a release waits for the communicator's helper threads, which only the abort's closed connections
    (Note [aborting a group closes its connections] in aborted_groups.py) set free; the next lookup
    or the exit releases those groups, as before.
"""

from __future__ import annotations

import threading
from typing import Callable

from .._process_hooks import chain_module_function, installed

_KEYS = ("release a destroyed group: _unregister_process_group",
         "release a destroyed group: _unregister_all_process_groups",
         "release a destroyed group: _abort_process_group")
_aborts = threading.local()


def watch(on_forgotten: Callable[[bool], None]) -> None:
    """Call ``on_forgotten(aborted)`` each time torch forgets process groups (``aborted``: by an abort)."""
    from torch.distributed import distributed_c10d

    def after(forget):
        def forgotten(*args, **kwargs):
            try:
                return forget(*args, **kwargs)
            finally:
                if _KEYS[0] in installed():
                    _run(on_forgotten, getattr(_aborts, "depth", 0) > 0)
        return _like(forgotten, forget)

    def counting(abort):
        def _abort_process_group(*args, **kwargs):
            _aborts.depth = getattr(_aborts, "depth", 0) + 1
            try:
                return abort(*args, **kwargs)
            finally:
                _aborts.depth -= 1
        return _like(_abort_process_group, abort)

    chain_module_function(_KEYS[0], distributed_c10d, "_unregister_process_group", after)
    chain_module_function(_KEYS[1], distributed_c10d, "_unregister_all_process_groups", after)
    chain_module_function(_KEYS[2], distributed_c10d, "_abort_process_group", counting)


def _run(on_forgotten: Callable[[bool], None], aborted: bool) -> None:
    """``on_forgotten``, never failing torch's destroy (what it cleans up is fusedist's own)."""
    try:
        on_forgotten(aborted)
    except Exception:  # noqa: BLE001
        pass


def _like(wrapper, original):
    """``wrapper`` named and documented as ``original`` (and marked, for code that looks for markers)."""
    wrapper.__name__ = getattr(original, "__name__", wrapper.__name__)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__wrapped__ = original
    for marker in ("_fusedist_closes_connections",):  # (aborted_groups.py looks for its own wrapper by it)
        if getattr(original, marker, False):
            setattr(wrapper, marker, True)
    return wrapper
