"""How a process that fusedist ends itself, from an exit handler, gets the status and the flushed
output the interpreter's own shutdown would have given it.

Two exit handlers end the process with ``os._exit`` instead of letting the shutdown run: the one of
a communicator that gave up (its helper threads would keep the shutdown waiting: Note [ending after
given-up collectives] in comm/given_up_exit.py) and the one of a checkpoint lost at exit (Note [the
status of a save lost at exit] in checkpoint/_exit_status.py). Both make of ``sys.exit(n)`` the
status the interpreter would, end an interrupted program by SIGINT, and flush what ``os._exit``
would leave unwritten -- here, once.
"""

from __future__ import annotations

import os
import signal
import sys


def status_of_exit(argument) -> int:
    """The process status the interpreter makes of ``sys.exit(argument)``."""
    if argument is None:
        return 0
    if isinstance(argument, int):
        return argument & 0xFF  # (the C exit() keeps the low byte: -1 is 255)
    return 1  # (the interpreter printed the object to stderr)


def end_by_sigint() -> None:
    """End the process as an uncaught ``KeyboardInterrupt`` does: by SIGINT (the shell's status for
    it where no signal can be sent)."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except Exception:  # noqa: BLE001 - no signals here
        pass
    os._exit(128 + signal.SIGINT)


def flush_files(every_open_file: bool = True) -> None:
    """Flush the standard streams and, with ``every_open_file``, every open file object: the
    interpreter's shutdown, which ``os._exit`` skips, would have (a log file the program never
    closed keeps its last lines). A tenth of a second with torch loaded."""
    files = [sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__]
    if every_open_file:
        import gc
        import io

        try:
            files += [obj for obj in gc.get_objects() if issubclass(type(obj), io.IOBase)]
        except Exception:  # noqa: BLE001 - the standard streams at least
            pass
    for stream in files:
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:  # noqa: BLE001 - a stream that cannot flush: nothing more to do for it
            pass
