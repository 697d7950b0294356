"""The stall report's store calls are bounded on a client of their own (Note [a bound of its own on the store] in
fusedist/reliability/stall_report.py): the store's timeout, shared with torch and the program, is never
shortened while a report runs, and the report's calls do not queue behind another thread's blocking wait on the
store's connection. Single process, a TCPStore of its own (the job's kind of store)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from fusedist.reliability import stall_report

OWN_TIMEOUT = datetime.timedelta(seconds=30)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, OWN_TIMEOUT, wait_for_workers=False)


def test_a_report_waiting_for_entries_leaves_the_stores_timeout_to_its_other_users(store):
    """Before, the store read 5 s while a report waited for entries: a ``store.get`` another thread began then gave
    up after 5 s ("wait timeout after 5000ms") instead of its own 30 s."""
    seen = []
    report = threading.Thread(target=stall_report.collect, args=(store, "g", 0, [1], 0.6))
    report.start()
    try:
        while report.is_alive():
            seen.append(store.timeout)
            time.sleep(0.02)
    finally:
        report.join()
    assert len(seen) > 3 and set(seen) == {OWN_TIMEOUT}, seen


def test_the_reports_calls_are_bounded_on_a_client_of_their_own_that_shares_the_keys(store):
    client = stall_report._bounded(store)
    assert client is not store and client.timeout == datetime.timedelta(seconds=stall_report._BOUND_S)
    assert stall_report._bounded(store) is client  # (one per store)
    assert stall_report.publish(store, "g", 0, 1, {"kind": "failure", "error": "E"})
    assert stall_report.collect(store, "g", 0, [1], 0.0)[1]["error"] == "E"
    assert store.check([stall_report._key("g", 0, 1)])  # (the same server and keys)
    stall_report.withdraw(store, "g", 0, 1)
    assert not store.check([stall_report._key("g", 0, 1)])
    assert store.timeout == OWN_TIMEOUT


def test_a_report_does_not_wait_behind_another_threads_blocking_get(store):
    """torch's store client runs one call at a time: through the store itself, the report's entry waited until
    another thread's ``store.get`` of a key written 1 s later returned."""
    stall_report._bounded(store)  # (made beforehand, as default_store() makes it)
    writer = store.clone()
    got = []
    waiting = threading.Thread(target=lambda: got.append(store.get("late")))
    waiting.start()
    time.sleep(0.1)  # (the get is waiting)
    threading.Timer(1.0, lambda: writer.set("late", "here")).start()
    start = time.monotonic()
    written = stall_report.publish(store, "g", 0, 0, {"kind": "checking", "error": ""})
    took = time.monotonic() - start
    waiting.join()
    assert written and got == [b"here"]
    assert took < 0.5, f"the report's write took {took:.2f} s, behind the other thread's get"


def test_a_store_without_a_separate_client_is_used_as_it_is_and_its_timeout_kept():
    """A HashStore's clone is the store itself: setting the clone's timeout would set the store's."""
    hashed = dist.HashStore()
    hashed.set_timeout(OWN_TIMEOUT)
    assert stall_report._bounded(hashed) is hashed
    assert stall_report.publish(hashed, "g", 0, 0, {"kind": "failure", "error": ""})
    assert hashed.timeout == OWN_TIMEOUT
