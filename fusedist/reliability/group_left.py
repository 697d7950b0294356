"""A group's entries in the job's store go with the last rank to leave it.

Note [the last rank to leave a group clears its entries]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A rank leaves entries under its group's keys for its peers' reports: an ``exit`` entry when the group is
destroyed on it (the peers still in the group read that it left), the entry of its first failure, a crash
entry and the group's crash counter, and the reason a failed gloo exchange closed its connections (Note
[connections a peer closed] in comm/closed_connections.py). Nothing removed them: every group a program
created and destroyed left an ``exit`` entry per rank in the store for the job's life -- a job that makes a
group per evaluation or per elastic round grew the store without bound (under torchrun the store is the
agent's, which outlives the workers). Once every rank of the group has left it, no peer waits in it and no
report reads them. So each process counts its leaving in the group's ``left`` counter (one ``add`` at the
destroy, through the bounded client of Note [a bound of its own on the store] in stall_report.py), and the
process whose count completes the group deletes the group's entries and the counter. Monitors of one group
in one process (a CPU and a CUDA communicator of an NCCL group) count once, and none of them writes to the
group after it was counted. A rank that never leaves (its process died; it made no communicator on the
group) leaves the entries in place, as before: its peers may still read them.
"""

from __future__ import annotations

from ..comm.closed_connections import entry_keys as closed_connection_keys
from . import stall_report


#: What more keys a module writes under a group (``keys_of(monitor) -> list``), deleted with the group's entries.
_more_keys: list = []


def delete_with_group(keys_of) -> None:
    """Delete ``keys_of(monitor)`` too when the last rank leaves a monitor's group: for a module that keeps its
    own keys per group (Note [the last rank to leave a group clears its entries])."""
    if keys_of not in _more_keys:
        _more_keys.append(keys_of)


def _left_key(group: str, generation: int) -> str:
    return f"{stall_report.KEY_PREFIX}/{group}/{generation}/left"


def leave(monitor) -> None:
    """Count this process's leaving of ``monitor``'s group; the last to leave deletes the group's entries (Note
    [the last rank to leave a group clears its entries]). Never raises."""
    from .monitor import _monitors

    if monitor.store is None or monitor.has_left:
        return
    same = [m for m in list(_monitors) if m.store is monitor.store and m.group_name == monitor.group_name
            and m.generation == monitor.generation]
    for other in same + [monitor]:
        other.has_left = True
    client = stall_report.bounded(monitor.store)
    try:
        if client.add(_left_key(monitor.group_name, monitor.generation), 1) < monitor.comm.world_size:
            return
        for key in _group_keys(monitor):
            client.delete_key(key)
    except Exception:  # noqa: BLE001 - a store that does not answer keeps the entries, as before
        return


def _group_keys(monitor) -> list:
    """Every key the group's ranks may have written, its ``left`` counter last."""
    keys = stall_report.group_keys(monitor.group_name, monitor.generation, monitor.comm.world_size)
    if monitor.torch_group_name:
        keys += closed_connection_keys(monitor.torch_group_name, monitor.members)
    for keys_of in list(_more_keys):
        keys += keys_of(monitor)
    return keys + [_left_key(monitor.group_name, monitor.generation)]
