"""A process whose collectives were given up ends soon after its error, not at their deadline.

Note [ending after given-up collectives]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
When a communicator gives up -- the divergence probe found ranks waiting in collectives that can
never pair (Note [divergence probe] in fusedist/reliability/divergence.py), an exchange failed, or
a wait for one of gloo's own collectives did (Note [no collectives after a failed builtin collective]
in torch_comm.py) -- the collectives left pending on gloo still run until their deadline
(``FUSEDIST_TIMEOUT_S``, 600 s by default): a gloo transfer cannot be cancelled
(``ProcessGroup.abort()`` does not end a pending receive, and torch binds no abort for a single
receive). The error and its stall report came at once, but the process did not end: the exit drain
waited for the pending exchanges (up to ``DRAIN_TIMEOUT_S``, Note [draining at exit] in
``__init__.py``), the step check's exit read for its all-reduce (5 s), and a helper thread still
blocked when the interpreter's shutdown began could abort the process there ("terminate called
without an active exception"). Measured with two ranks, a skipped backward and a 60 s timeout: the
error 0.6 s after the divergence, the exit 33 s after the error (one rank of two aborted). A job
under torchrun should end, non-zero, soon after the error, so that the agent restarts it (as the
direct-NCCL watchdog ends its process at once).

So, when such an error reaches the top of the program (an uncaught exception while a cached
communicator has given up):

* every exit handler still runs, in the interpreter's order -- the drain and the step check's read
  skip what belongs to a given-up communicator (it can never complete), the rank's other
  communicators are drained as before, checkpoints and timelines are finished;
* then the standard streams and open files are flushed, and the process ends with the status the
  interpreter would have used (1; a KeyboardInterrupt ends it by SIGINT, as Python does) through
  ``os._exit``, skipping the interpreter's shutdown: the helpers of the given-up communicator are
  still blocked in gloo, and nothing left to do there could still matter.

A program that catches the error and then ends by ``sys.exit(n)`` (the usual way to log a failure
and leave with a status of one's own) ends the same way, with status ``n`` (0 for None; 1, after
the message the interpreter prints, for any other object). Its status cannot be read back at exit
-- the interpreter keeps it in a C variable -- and waiting as the interpreter's shutdown must (next
paragraph) let two ranks that both did this wait for each other until the drain's bound (30 s). So
from the moment a communicator gives up (:func:`watch_exit_requests`, called where it gives up),
``sys.exit`` notes its argument, on the main thread, before it raises as always. (After a failed
gloo exchange nothing waits that long -- the failure closed the connection, so what the group left
queued fails at once -- but such a program ends the same way: as its uncaught error would end it.)

How: the excepthook (chained through fusedist/_process_hooks.py), or that ``sys.exit``, registers
the finishing handler anew, so that it is the newest exit handler and runs first; it runs all the
others itself (``atexit._run_exitfuncs``), then ends the process. A program that catches the error
and goes on otherwise is untouched: it ends as the interpreter makes it (falling off the end, or
``raise SystemExit``), with its own status, and its exit still waits for the given-up
communicator's helper threads (bounded: Note [draining at exit]; they end as soon as the peers
exit), because the interpreter's shutdown must not begin while one is blocked in gloo. (A program
that catches the ``SystemExit`` of ``sys.exit`` itself and goes on ends with the status it asked
for: nothing at exit tells the two apart.) The step check's exit read skips a check of a given-up
communicator either way. A clean run never takes this path, and its ``sys.exit`` is Python's own.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Optional

from .._exit_codes import end_by_sigint, flush_files, status_of_exit

#: ``id()`` of the uncaught exception that ends the process (set by the excepthook while a
#: communicator has given up), checked against ``sys.last_value`` at exit. Not the exception
#: itself: a program that passes a caught one to the hook and goes on would keep its frames alive.
_uncaught: Optional[int] = None
#: Whether that exception is a KeyboardInterrupt (ended by SIGINT, as Python ends such a process).
_interrupted = False
#: Whether the exit handlers run on the way to ``os._exit`` (so nothing waits for given-up work).
_ending = False
#: The argument of the last ``sys.exit`` call on the main thread after a communicator gave up, in
#: a 1-tuple (None is a status too); None when there was none.
_exit_request: Optional[tuple] = None


def gave_up(comm) -> bool:
    """Whether ``comm`` gave up after a failure: its pending collectives may never complete, so
    nothing at exit waits for them."""
    try:
        return bool(comm.aborted)
    except Exception:  # noqa: BLE001 - at exit, never fail on a half-torn-down communicator
        return False


def skips_waits(comm) -> bool:
    """Whether the exit handlers leave ``comm``'s helper threads behind without waiting: it gave up,
    and the process ends by ``os._exit``. A process that ends through the interpreter's shutdown
    still waits for them (bounded): a helper woken there, by a peer's exit or the deadline, would
    abort the process."""
    return _ending and gave_up(comm)


def any_gave_up() -> bool:
    """Whether a cached communicator of this process gave up."""
    from . import _cache

    return any(gave_up(comm) for _, comm in list(_cache.values()))


def on_uncaught(exc_type, exc, tb) -> None:
    """The excepthook's part: an exception reaches the top while a communicator has given up, so
    the process will end by it; make the finishing handler the first exit handler to run."""
    global _uncaught, _interrupted
    try:
        if not any_gave_up():
            return
        _uncaught, _interrupted = id(exc), isinstance(exc, KeyboardInterrupt)
        atexit.unregister(_finish)
        atexit.register(_finish)
    except Exception:  # noqa: BLE001 - an excepthook must not raise
        pass


def watch_exit_requests() -> None:
    """Make ``sys.exit`` note its argument from now on (Note [ending after given-up collectives]);
    called where a communicator gives up: the divergence probe's verdict (sliced_wait.py), a failed
    gloo exchange (exchange_progress.py), a failed wait for one of gloo's own collectives
    (torch_comm.py). Once per process; removed by ``_process_hooks.uninstall``."""
    from .._process_hooks import chain_sys_exit

    chain_sys_exit("end a process whose collectives were given up, by sys.exit", on_exit_request)


def on_exit_request(status) -> None:
    """``sys.exit(status)``'s part: on the main thread, while a communicator has given up, the
    process ends by it unless the program catches it; make the finishing handler the first exit
    handler to run. (On another thread ``sys.exit`` ends only that thread.)"""
    global _exit_request
    try:
        if threading.current_thread() is not threading.main_thread() or not any_gave_up():
            return
        _exit_request = (status,)
        atexit.unregister(_finish)
        atexit.register(_finish)
    except Exception:  # noqa: BLE001 - sys.exit must raise its SystemExit whatever happens here
        pass


def _finish() -> None:
    """The first exit handler (Note [ending after given-up collectives]): run the others, then end
    the process with the interpreter's status, skipping its shutdown."""
    global _ending
    atexit.unregister(_finish)
    # An interactive session that stays after the error is not an end of the process; neither is a
    # hook called by hand (a program that logs an error through sys.excepthook and goes on), unless
    # the program then called sys.exit.
    if sys.flags.inspect or os.environ.get("PYTHONINSPECT"):
        return
    uncaught = _uncaught is not None and id(getattr(sys, "last_value", None)) == _uncaught
    if not uncaught and _exit_request is None:
        return
    _ending = True
    atexit._run_exitfuncs()  # (clears them: none runs twice)
    flush_files()
    if not uncaught:
        os._exit(status_of_exit(_exit_request[0]))
    if _interrupted:  # Python ends such a process by SIGINT
        end_by_sigint()
    os._exit(1)
