"""The status a process ends with when a checkpoint still being written at exit fails there.

Note [the status of a save lost at exit]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A save that fails at exit ends the process with a non-zero status (Note [a save that fails at exit]
in _writer.py). It ended it with 1 whatever the program had chosen: a program that ended by
``sys.exit(3)`` -- a status a job scheduler reads, say "out of data" -- ended with 1, and one ended
by Ctrl-C with 1 instead of by SIGINT. The status the program chose now stands where it is not 0;
only 0 (a success the lost checkpoint belies) becomes 1, and the printed error says which.

The interpreter keeps the status of ``sys.exit(n)`` in a C variable, out of reach at exit. So while
a save is in flight -- submitted to a writer and not yet waited for, the only time it can fail at
exit -- ``sys.exit`` notes its argument on the main thread before raising as always (chained through
fusedist/_process_hooks.py); once no save is in flight ``sys.exit`` is Python's own again, and where a hook
chained after ours keeps ours in place (a communicator that gave up during the save chains its own), ours
notes nothing until a save is in flight again: a status the program asked for and caught then is not the one
a later lost save would end the process with. A ``sys.exit(n)`` the program catches while a save is in
flight is taken for its status all the same (nothing tells, at exit, whether it was caught): its process,
returning normally later, ends with ``n`` where 1 was due -- non-zero either way. A program that raises
``SystemExit(n)`` itself is not seen: it ends with 1, as before. An uncaught exception ends the process
with 1 (a ``KeyboardInterrupt``: by SIGINT), as Python would.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

from .. import _process_hooks
from .._exit_codes import end_by_sigint, status_of_exit

_HOOK = "note the status of a program whose checkpoint is being written"

#: The argument of the last ``sys.exit`` on the main thread while a save was in flight, in a
#: 1-tuple (None is a status too); None when there was none.
_requested: Optional[tuple] = None

#: Whether a save is in flight (between :func:`watch` and :func:`unwatch`): only then is a status noted.
_in_flight = False

#: What :func:`program_status` gives for a process ended by a ``KeyboardInterrupt``.
BY_SIGINT = -signal.SIGINT


def watch() -> None:
    """Note the status of ``sys.exit`` from now on: a save was submitted."""
    global _in_flight
    _in_flight = True
    _process_hooks.chain_sys_exit(_HOOK, _note)


def unwatch() -> None:
    """``sys.exit`` is Python's own again: no save is in flight. (A hook chained after ours is left
    in place, and ours under it, by the remover: it notes nothing while no save is in flight.)"""
    global _in_flight
    _in_flight = False
    _process_hooks.remove(_HOOK)


def _note(status) -> None:
    """``sys.exit(status)``'s part (on another thread it ends only that thread)."""
    global _requested
    if _in_flight and threading.current_thread() is threading.main_thread():
        _requested = (status,)


def program_status() -> int:
    """The status the interpreter would end the process with, as far as it can be told at exit:
    an uncaught exception's, then the noted ``sys.exit``'s, else 0; :data:`BY_SIGINT` for a
    ``KeyboardInterrupt``."""
    uncaught = getattr(sys, "last_value", None)  # (set by the interpreter for the exception that ends it)
    if isinstance(uncaught, KeyboardInterrupt):
        return BY_SIGINT
    if uncaught is not None:
        return 1
    if _requested is None:
        return 0
    status = _requested[0]
    return status_of_exit(status)


def status_after_a_lost_save(status: int) -> int:
    """The program's status, but 1 where it was 0 (Note [the status of a save lost at exit])."""
    return 1 if status == 0 else status


def words(status: int) -> str:
    """What the error about the lost save says of the process's status."""
    if status == BY_SIGINT:
        return "the process ends by SIGINT, as the interrupted program would"
    if status == 0:
        return "the process ends with status 1, not 0: the checkpoint was lost"
    return f"the process ends with status {status}, the program's own"


def end(status: int) -> None:
    """End the process with ``status`` (streams flushed by the caller)."""
    if status == BY_SIGINT:
        end_by_sigint()
    os._exit(status_after_a_lost_save(status))
