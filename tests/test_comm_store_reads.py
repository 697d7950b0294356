"""fusedist's reads of its peers' entries in the store never wait for a key a peer withdrew meanwhile (Note
[reading a key without waiting] in fusedist/comm/store_reads.py): each returns at once, as if the entry had
never been there, where the peer's withdrawal lands between seeing the key and reading it."""

from __future__ import annotations

import datetime
import json
import time

import pytest
import torch.distributed as dist

from fusedist.comm import aborted_groups
from fusedist.comm.store_reads import read_now
from fusedist.reliability import stall_report, wait_cycle

#: The store's own timeout here: what a read that waits for a withdrawn key waits out (600 s or more in a job).
_STORE_TIMEOUT_S = 3.0


class _WithdrawnWhenSeen:
    """A store whose keys a peer withdraws right after this rank saw them (``check`` found them)."""

    def __init__(self):
        self.store = dist.HashStore()
        self.store.set_timeout(datetime.timedelta(seconds=_STORE_TIMEOUT_S))

    def check(self, keys):
        found = self.store.check(keys)
        for key in keys:
            self.store.delete_key(key)
        return found

    def __getattr__(self, name):
        return getattr(self.store, name)


def _timed(fn):
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


def _entry(kind: str) -> str:
    return json.dumps({"kind": kind, "host": "h", "pid": 1, "error": "boom"})


@pytest.mark.parametrize("reader", ["aborted_peers", "crashed_peer", "read_entries", "collect", "wait_cycle"])
def test_an_entry_withdrawn_while_read_reads_as_absent_at_once(reader):
    store = _WithdrawnWhenSeen()
    if reader == "aborted_peers":
        store.set("fusedist/aborted_process/1", b"rank 1 aborted all its process groups")
        store.add("fusedist/aborted_process/count", 1)
        read = lambda: aborted_groups.aborted_peers(store, [1])  # noqa: E731
        present = lambda: {1: "rank 1 aborted all its process groups"}  # noqa: E731
    elif reader == "crashed_peer":
        store.set(stall_report._key("g", 0, 1), _entry("checking"))
        store.add(stall_report._crash_count_key("g", 0), 1)  # (another rank's crash, its entry not read here)
        read = lambda: stall_report.crashed_peer(store, "g", 0, 0, 2)  # noqa: E731
        present = lambda: None  # (a "checking" entry names no crash)  # noqa: E731
    elif reader in ("read_entries", "collect"):
        store.set(stall_report._key("g", 0, 1), _entry("waiting"))
        read = ((lambda: stall_report.read_entries(store, "g", 0, [1])) if reader == "read_entries"
                else (lambda: stall_report.collect(store, "g", 0, [1], 0.0)))
        present = lambda: {1: json.loads(_entry("waiting"))}  # noqa: E731
    else:
        store.set(wait_cycle._key(1), json.dumps({"rank": 1, "group": "other#0", "members": [0, 1], "seq": 3}))
        read = lambda: wait_cycle._read(store, 1)  # noqa: E731
        present = lambda: {"rank": 1, "group": "other#0", "members": [0, 1], "seq": 3}  # noqa: E731
    result, took = _timed(read)
    # before: the key seen, then withdrawn, then read -- a get waiting out the store's timeout
    assert took < _STORE_TIMEOUT_S / 2, f"{reader} waited {took:.1f} s for an entry its peer withdrew"
    # read before the withdrawal or after it: either is right, as long as the read returns
    absent = {"aborted_peers": {}, "crashed_peer": None, "read_entries": {1: None}, "collect": {},
              "wait_cycle": None}[reader]
    assert result == absent or result == present(), f"{reader}: {result!r}"


def test_read_now_returns_a_present_value_and_none_for_a_missing_key():
    store = dist.HashStore()
    store.set("present", b"value")
    prefixed = dist.PrefixStore("p", store)
    prefixed.set("k", "v")
    assert read_now(store, "present") == b"value"
    assert read_now(store, "missing") is None and not store.check(["missing"])  # (nothing written by the read)
    assert read_now(prefixed, "k") == b"v" and read_now(prefixed, "present") is None


def test_polls_of_counters_leave_no_key_where_none_was():
    """The polls a wait makes every second (any aborted process? any crash? how many failures did a peer
    publish?) read their counters without creating them: ``store.add(key, 0)`` left one key per job and per
    group in a TCPStore that never had one (a checkpoint save's store grew by a key when its barrier waited)."""
    from types import SimpleNamespace

    from fusedist.pipelining import told_peers

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S))
    monitor = SimpleNamespace(store=store, group_name="g", generation=0)
    keys = store.num_keys()  # (the store's own, if any)
    assert aborted_groups.aborted_peers(store, [1]) == {}
    assert stall_report.crashed_peer(store, "g", 0, 0, 2) is None
    assert told_peers._published(monitor, 1) == 0
    assert store.list_keys() == [] and store.num_keys() == keys
    # a counter that exists is read as add keeps it
    store.add(told_peers._count_key(monitor, 1), 2)
    assert told_peers._published(monitor, 1) == 2
