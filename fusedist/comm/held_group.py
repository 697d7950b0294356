"""A ``process_group`` attribute held by a weak reference: the DDP wrapper's and the ZeroRedundancyOptimizer's.

Note [a process group attribute, held weakly]
    torch's DistributedDataParallel and ZeroRedundancyOptimizer expose ``process_group`` and hold it
    strongly: a model or optimizer kept past ``destroy_process_group()`` (at module scope, or anywhere past
    the end of main) kept the destroyed gloo group alive into the interpreter's finalization, where freeing a
    gloo group can abort the finished process. The communicator lets go of a destroyed group (Note [a
    released communicator lets go of its group] in released_group.py); fusedist's wrapper (Note [the process
    group, held weakly] in fusedist/ddp/torch_surface.py) and optimizer do too, through this one attribute: it
    reads torch's group while torch.distributed has it, and None once it was destroyed -- freed, or still held
    by the program but no longer usable.
"""

from __future__ import annotations

import weakref

from .released_group import is_alive


class HeldProcessGroup:
    """The ``process_group`` attribute, held by a weak reference."""

    @property
    def process_group(self):
        """torch's attribute: the data-parallel group; None once torch.distributed destroyed it."""
        try:
            held = self.__dict__["_process_group_held"]
        except KeyError:
            raise AttributeError("process_group") from None  # (before construction set it)
        group = held()
        if group is not None and isinstance(held, weakref.ref) and not is_alive(group):
            return None
        return group

    @process_group.setter
    def process_group(self, group) -> None:
        self.__dict__["_process_group_held"] = _held(group)


def _held(group):
    """A callable returning ``group``: a weak reference to a process group; anything else (None: no
    torch.distributed, or the default group kept as None) held as it is."""
    if group is not None:
        try:
            return weakref.ref(group)
        except TypeError:  # (not a process group: nothing torch destroys)
            pass
    return lambda: group
