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
    or the exit releases those groups, as before. An abort is told from a destroy by
    ``aborted_groups.aborting()`` (Note [one wrapper of torch's abort] in aborted_groups.py).
"""

from __future__ import annotations

from typing import Callable

from .._process_hooks import chain_module_function, installed
from . import aborted_groups

_KEYS = ("release a destroyed group: _unregister_process_group",
         "release a destroyed group: _unregister_all_process_groups")


def watch(on_forgotten: Callable[[bool], None]) -> None:
    """Call ``on_forgotten(aborted)`` each time torch forgets process groups (``aborted``: by an abort)."""
    from torch.distributed import distributed_c10d

    def after(forget):
        def forgotten(*args, **kwargs):
            try:
                return forget(*args, **kwargs)
            finally:
                if _KEYS[0] in installed():
                    _run(on_forgotten, aborted_groups.aborting())
        forgotten.__name__ = getattr(forget, "__name__", forgotten.__name__)
        forgotten.__doc__ = getattr(forget, "__doc__", None)
        forgotten.__wrapped__ = forget
        return forgotten

    chain_module_function(_KEYS[0], distributed_c10d, "_unregister_process_group", after)
    chain_module_function(_KEYS[1], distributed_c10d, "_unregister_all_process_groups", after)
    aborted_groups.install()  # (tells an abort from a destroy: Note [one wrapper of torch's abort])


def _run(on_forgotten: Callable[[bool], None], aborted: bool) -> None:
    """``on_forgotten``, never failing torch's destroy (what it cleans up is fusedist's own)."""
    try:
        on_forgotten(aborted)
    except Exception:  # noqa: BLE001
        pass
