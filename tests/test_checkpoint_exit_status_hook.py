"""The status a lost save ends the process with is the program's own, never a stale one: a ``sys.exit``
hook of fusedist's left in the chain (another hook was chained after it while a save was in flight, as a
communicator that gave up chains its own) notes nothing once no save is in flight (Note [the status of a
save lost at exit] in fusedist/checkpoint/_exit_status.py). Single process, no launch.
"""

from __future__ import annotations

import sys

from fusedist import _process_hooks
from fusedist.checkpoint import _exit_status

_OTHER = "a hook chained after the save's"


def _exit_caught(status) -> None:
    try:
        sys.exit(status)
    except SystemExit:
        pass


def test_a_sys_exit_caught_while_no_save_is_in_flight_is_not_the_status_of_a_later_lost_save(monkeypatch):
    monkeypatch.setattr(sys, "exit", sys.exit)  # (put back whatever is chained here)
    monkeypatch.setattr(_exit_status, "_requested", None)
    try:
        _exit_status.watch()  # a save in flight
        _process_hooks.chain_sys_exit(_OTHER, lambda status: None)  # ours is now under it: left in place
        _exit_caught(3)  # the program asks for 3 while the save is in flight, and ends by it
        assert _exit_status.program_status() == 3
        _exit_status.unwatch()  # the save was waited for
        _exit_status.watch()  # another save, the program goes on and returns normally
        assert _exit_status.program_status() == 3  # (noted while in flight: the program's latest request)
        _exit_status.unwatch()
        monkeypatch.setattr(_exit_status, "_requested", None)
        _exit_caught(4)  # caught while no save is in flight: not the program's status at its end
        assert _exit_status.program_status() == 0
        _exit_status.watch()
        _exit_caught(5)  # noted again once a save is in flight
        assert _exit_status.program_status() == 5
    finally:
        _exit_status.unwatch()
        _process_hooks.remove(_OTHER)
