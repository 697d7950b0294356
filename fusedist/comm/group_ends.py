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
    ``aborted_groups.aborting()`` (Note [one wrapper of torch's abort] in aborted_groups.py). The wrappers of
    the two unregister functions are fusedist's only ones, shared with torch.distributed.nn's defaults (Note [one
    wrapper of torch's group-unregister functions] in fusedist/_group_table.py).

Note [a communicator remembers its group's abort]
    Released at the next lookup, an aborted group's communicator read as a destroyed one, and before that as a
    live one: a DDP forward on it ran, and the first collective was refused naming a destroy that never
    happened. So an abort marks each communicator whose group it took from torch (``ended_by_abort``: why, for
    its messages; None while not aborted), an attribute set once here and read by what refuses work on it
    (Note [a forward after its group was destroyed] in fusedist/ddp/destroyed_group.py): one attribute read,
    nothing asked of torch per forward. Only communicators built by this process are marked (those
    ``released_group`` tracks), and only while fusedist's hooks are installed.
"""

from __future__ import annotations

from typing import Callable

from .._group_table import after_groups_forgotten
from ..distributed import follow_nn_defaults
from . import aborted_groups, released_group

#: The key of the release among the callbacks of torch's group-unregister functions (Note [one wrapper of torch's
#: group-unregister functions] in fusedist/_group_table.py).
_KEY = "release a destroyed group's communicators"


def watch(on_forgotten: Callable[[bool], None]) -> None:
    """Call ``on_forgotten(aborted)`` each time torch forgets process groups (``aborted``: by an abort)."""
    def forgotten():
        aborted = aborted_groups.aborting()
        if aborted:
            _run(_mark_aborted, aborted)
        _run(on_forgotten, aborted)

    after_groups_forgotten(_KEY, forgotten)
    aborted_groups.install()  # (tells an abort from a destroy: Note [one wrapper of torch's abort])
    follow_nn_defaults()  # (put back after uninstall() as these are: Note [binding torch.distributed.nn early])


def _run(on_forgotten: Callable[[bool], None], aborted: bool) -> None:
    """``on_forgotten``, never failing torch's destroy (what it cleans up is fusedist's own)."""
    try:
        on_forgotten(aborted)
    except Exception:  # noqa: BLE001
        pass


#: What an aborted group's communicator says of its end (Note [a communicator remembers its group's abort]).
ABORTED_HERE = "it was aborted on this rank (torch.distributed's _abort_process_group)"


def _mark_aborted(_aborted: bool = True) -> None:
    """Mark each communicator whose group the abort in progress took from torch (Note [a communicator remembers
    its group's abort])."""
    for comm in released_group.unreleased(()):
        group = getattr(comm, "_group_obj", None)
        if group is not None and getattr(comm, "ended_by_abort", None) is None and not released_group.is_alive(group):
            comm.ended_by_abort = ABORTED_HERE
