"""Reading a key of the job's store that a peer may delete meanwhile, without waiting for it.

Note [reading a key without waiting]
    fusedist reads its peers' entries in the store (stall reports, blocked-wait records, abort records) as
    ``store.get(key) if store.check([key])``. A peer withdraws such an entry when its wait ends or when it makes
    a new communicator; landing between the two calls, the withdrawal left ``get`` waiting for a key nobody
    would write again -- for the store's own timeout, the process group's (600 s with fusedist's default, 30
    min with torch's), inside a divergence probe, a watchdog's poll of crashed peers or a store wait's poll of
    aborted ones, each of which is meant to take one round trip. So the read is one atomic call that never
    waits: ``compare_set(key, absent, absent)`` returns the key's value where it exists and ``absent``, setting
    nothing, where it does not (the semantics of torch's TCPStore, its libuv server, FileStore, HashStore and
    PrefixStore alike). ``absent`` is a value no entry has. A store without ``compare_set`` is read as before.
    A counter kept with ``store.add`` is read the same way (:func:`read_count`): ``add(key, 0)`` would create
    the key on every store a poll found without it, one key per job or group left for the job's life.
"""

from __future__ import annotations

import json
from typing import Optional

#: What ``compare_set`` returns for a missing key: never the value of an entry (fusedist writes text or JSON).
_ABSENT = "\x00fusedist: no such key\x00"


def read_now(store, key: str) -> Optional[bytes]:
    """``key``'s value in ``store``, or None where it has none, without waiting for it (Note [reading a key
    without waiting]). Raises what the store raises where it cannot be reached."""
    try:
        value = store.compare_set(key, _ABSENT, _ABSENT)
    except (NotImplementedError, AttributeError, RuntimeError) as error:
        if isinstance(error, RuntimeError) and "not implemented" not in str(error).lower():
            raise  # (an unreachable store: the caller's to handle)
        return store.get(key) if store.check([key]) else None  # (a store of the program's own without it)
    if isinstance(value, str):
        value = value.encode()
    return None if value == _ABSENT.encode() else value


def read_json_now(store, key: str) -> Optional[dict]:
    """The JSON entry under ``key``, or None where there is none, without waiting for it (:func:`read_now`)."""
    value = read_now(store, key)
    return json.loads(value.decode()) if value is not None else None


def read_count(store, key: str) -> int:
    """The counter ``store.add`` keeps under ``key``, 0 where it has none, read without creating it (Note
    [reading a key without waiting])."""
    value = read_now(store, key)
    return int(value) if value is not None else 0
