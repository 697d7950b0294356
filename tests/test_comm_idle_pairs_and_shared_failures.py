"""All-to-all pairs without rows through the gloo exchange; failures a group's communicators share.

* A pair with rows one way only (an idle expert: a rank that receives no rows but sends its own)
  sends only the rows' messages, and the result equals torch's ``all_to_all_single``; a pair with
  no rows either way sends one empty message, not two. Before, every empty direction sent an
  empty message of its own.
* Ranks that disagree on the rows of either direction of a pair still fail on both ranks at the
  timeout, naming the exchange, with none of the messages paired (gloo would terminate the
  process whose receive is smaller).
* Two communicators of one process group: after a collective of one failed, the other refuses
  collectives at once, naming that failure. Before, it went on with the group's closed
  connections and out-of-step ranks.
* A process group destroyed from another thread while a collective waits: the collective's error
  says so. Before, it read as a plain timeout, a peer that never joined.
* A rank whose peer gave up first and closed the connection names that peer and the peer's own
  error. Before, it reported gloo's bare "Connection closed by peer ... remote worker crashing".
  So does a launch that posts its receives after the peer closed the connection.
* An asynchronous exchange that fails in the progress thread, never waited for, stops the group's
  other communicators at once. Before, the failure was recorded only when the failing
  communicator's ``aborted`` was next read.
* A part empty on one rank only, under a monitor: both ranks fail within seconds naming both parts
  (the divergence probe, run for a synchronous exchange from the watcher thread). Before, at the
  timeout.
"""

import threading
import time

import pytest
import torch

from shared_rank_launch import launch_for_selected, results_of


def _counting(comm):
    """Wrap the exchange's message posting; returns the {"send": n, "recv": n} it counts."""
    counts = {"send": 0, "recv": 0}
    exchange = comm.exchange
    send_later, irecv = exchange._send_later, exchange._irecv

    def counted_send(*args):
        counts["send"] += 1
        return send_later(*args)

    def counted_recv(*args):
        counts["recv"] += 1
        return irecv(*args)

    exchange._send_later, exchange._irecv = counted_send, counted_recv
    return counts


def _one_way_rows(rank, world, seed):
    """Rank 0 sends its 3 rows to rank 1 and receives none; rank 1 sends none. Then no rows at all."""
    import torch.distributed as dist

    from fusedist.comm import get_communicator

    comm = get_communicator(dist.new_group(list(range(world))))
    counts = _counting(comm)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    in_splits = [2, 3] if rank == 0 else [0, 4]  # rank r -> rank j
    out_splits = [2, 0] if rank == 0 else [3, 4]
    x = torch.randn(sum(in_splits), 5, generator=gen)
    got = torch.full((sum(out_splits), 5), float("nan"))
    comm.all_to_all_single(got, x, out_splits, in_splits, tag="experts")
    want = torch.empty_like(got)
    dist.all_to_all_single(want, x.clone(), out_splits, in_splits)
    one_way = dict(counts)
    counts.update(send=0, recv=0)
    none = torch.empty(0, 5)
    comm.all_to_all_single(torch.empty(0, 5), none, [0, 0], [0, 0], tag="idle")
    return torch.equal(got, want), one_way, dict(counts)


def _disagreeing_back(rank, world, seed):
    """Rank 0 sends 2 rows and expects none back; rank 1 expects the 2 rows and sends 3 back."""
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator

    comm = get_communicator(dist.new_group(list(range(world))))
    in_splits = [1, 2] if rank == 0 else [3, 1]
    out_splits = [1, 0] if rank == 0 else [2, 1]
    x = torch.randn(sum(in_splits), 4, generator=torch.Generator().manual_seed(seed + rank))
    out = torch.zeros(sum(out_splits), 4)
    start = time.monotonic()
    try:
        comm.all_to_all_single(out, x, out_splits, in_splits, tag="disagree")
    except CollectiveError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def _two_communicators_one_group(rank, world):
    """A collective of one communicator fails (parts of different sizes); the other is then used."""
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator
    from fusedist.comm.torch_comm import TorchCommunicator

    group = dist.new_group(list(range(world)))
    first, second = get_communicator(group), TorchCommunicator(group)
    x = torch.ones(2 if rank == 0 else 3)
    try:
        first.all_gather(torch.empty(world * x.numel()), x, tag="differs")
    except CollectiveError:
        pass
    start = time.monotonic()
    try:
        second.all_reduce(torch.ones(4), tag="after")
        outcome = "no error"
    except CollectiveError as exc:
        outcome = str(exc)
    return outcome, time.monotonic() - start


def _failed_in_the_background(rank, world):
    """An asynchronous all-gather of one communicator fails in its progress thread (parts of
    different sizes) while nobody waits for it; another communicator of the group is then used."""
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator
    from fusedist.comm.torch_comm import TorchCommunicator

    group = dist.new_group(list(range(world)))
    first, second = get_communicator(group), TorchCommunicator(group)
    x = torch.ones(2 if rank == 0 else 3)
    handle = first.all_gather(torch.empty(world * x.numel()), x, tag="unwaited", async_op=True)
    while not handle.is_completed():  # (the progress thread gives up at the timeout, 1 s)
        time.sleep(0.05)
    start = time.monotonic()
    try:
        second.all_reduce(torch.ones(4), tag="after")
        outcome = "no error"
    except CollectiveError as exc:
        outcome = str(exc)
    return outcome, time.monotonic() - start


def _destroyed_while_waiting(rank, world):
    """Rank 0 waits for an all-gather rank 1 never joins; another thread destroys the group."""
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator

    group = dist.new_group(list(range(world)))
    comm = get_communicator(group)
    joined = torch.full((1,), float(rank))
    comm.all_reduce(joined, op="max", tag="both")  # the group works
    outcome = ""
    if rank == 0:
        ender = threading.Timer(0.3, dist.destroy_process_group, args=(group,))
        ender.start()
        try:
            comm.all_gather(torch.empty(4), torch.ones(2), tag="alone")
            outcome = "no error"
        except CollectiveError as exc:
            outcome = str(exc)
        ender.join()
    dist.barrier()  # (the default group: rank 1 waits here for rank 0's timeout)
    if rank == 1:
        dist.destroy_process_group(group)
    return joined.item(), outcome


def _closed_by_the_peer(rank, world):
    """Parts of different sizes; rank 0 gives up after 1 s, rank 1 would wait 10 s."""
    import datetime

    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator

    comm = get_communicator(dist.new_group(list(range(world))))
    if rank == 1:
        comm.timeout = datetime.timedelta(seconds=10)
    x = torch.ones(2 if rank == 0 else 3)
    start = time.monotonic()
    try:
        comm.all_gather(torch.empty(world * x.numel()), x, tag="closing")
        outcome = "no error"
    except CollectiveError as exc:
        outcome = str(exc)
    return outcome, time.monotonic() - start


def _late_after_the_peer_closed(rank, world):
    """Rank 1 gives up an all-gather rank 0 has not joined yet (1 s) and closes the connection;
    rank 0 then launches it."""
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator

    comm = get_communicator(dist.new_group(list(range(world))))
    if rank == 0:
        dist.barrier()  # (the default group: rank 1 gets here once it gave up)
    start, outcome = time.monotonic(), "no error"
    try:
        comm.all_gather(torch.empty(world * 2), torch.ones(2), tag="late")
    except CollectiveError as exc:
        outcome = str(exc)
    elapsed = time.monotonic() - start
    if rank == 1:
        dist.barrier()
    return outcome, elapsed, comm.aborted


def _empty_on_one_rank(rank, world):
    """An all-gather whose part is empty on rank 0 only, under a monitor (as DDP, ZeRO and SyncBatchNorm
    attach), with a communicator timeout of 60 s and the divergence probe after 0.5 s."""
    import datetime

    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator
    from fusedist.reliability import attach_monitor

    comm = get_communicator(dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60)))
    comm.timeout = datetime.timedelta(seconds=60)
    attach_monitor(comm).probe_delay_s = 0.5
    x = torch.ones(3 * rank)
    start, outcome = time.monotonic(), "no error"
    try:
        comm.all_gather(torch.empty(world * x.numel()), x, tag="rows")
    except CollectiveError as exc:
        outcome = str(exc)
    return outcome, time.monotonic() - start


SCENARIOS = {
    "test_pairs_with_rows_one_way_send_only_those": {"one_way": (_one_way_rows, (3,))},
    "test_ranks_that_disagree_on_the_rows_back_fail_on_both": {"disagree": (_disagreeing_back, (4,))},
    "test_a_failure_of_one_communicator_stops_the_others_of_its_group": {
        "two_comms": (_two_communicators_one_group, ())},
    "test_a_background_failure_stops_the_other_communicators_at_once": {
        "background": (_failed_in_the_background, ())},
    "test_a_receive_posted_after_the_peer_closed_names_the_peer": {"late": (_late_after_the_peer_closed, ())},
    "test_an_empty_part_on_one_rank_fails_promptly_naming_both_parts": {"empty": (_empty_on_one_rank, ())},
    "test_a_group_destroyed_during_a_wait_is_named": {"destroyed": (_destroyed_while_waiting, ())},
    "test_a_connection_the_peer_closed_names_the_peer_and_its_error": {"closed": (_closed_by_the_peer, ())},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, 2, timeout=120, env={"FUSEDIST_TIMEOUT_S": "1"})


def test_pairs_with_rows_one_way_send_only_those(launched):
    (equal0, one_way0, none0), (equal1, one_way1, none1) = results_of(launched, "one_way")
    assert equal0 and equal1  # same rows as torch's all_to_all_single, bit for bit (a copy)
    assert one_way0 == {"send": 1, "recv": 0}, one_way0  # its rows to rank 1; nothing back
    assert one_way1 == {"send": 0, "recv": 1}, one_way1
    assert (none0, none1) == ({"send": 1, "recv": 0}, {"send": 0, "recv": 1}), (none0, none1)


def test_ranks_that_disagree_on_the_rows_back_fail_on_both(launched):
    for rank, (message, elapsed) in enumerate(results_of(launched, "disagree")):
        assert "all_to_all_single" in message and f"rank {rank} of 2" in message, (rank, message)
        assert elapsed < 20, (rank, elapsed)  # at its own timeout (1 s)


def test_a_failure_of_one_communicator_stops_the_others_of_its_group(launched):
    for rank, (outcome, elapsed) in enumerate(results_of(launched, "two_comms")):
        assert "can no longer run collectives" in outcome, (rank, outcome)
        assert "all_gather" in outcome and "another communicator of this process group" in outcome, (rank, outcome)
        assert elapsed < 0.5, (rank, elapsed)  # refused at the launch, not at a timeout


def test_a_group_destroyed_during_a_wait_is_named(launched):
    (joined0, outcome0), (joined1, outcome1) = results_of(launched, "destroyed")
    assert joined0 == joined1 == 1.0  # as torch's all-reduce (max of the ranks)
    assert "was destroyed (torch.distributed.destroy_process_group()) while this collective" in outcome0, outcome0
    assert "all_gather" in outcome0 and "rank 0 of 2" in outcome0, outcome0


def test_a_connection_the_peer_closed_names_the_peer_and_its_error(launched):
    (outcome0, elapsed0), (outcome1, elapsed1) = results_of(launched, "closed")
    assert "timed out" in outcome0 and "[2 x torch.float32 per rank]" in outcome0, outcome0
    # rank 1 learns at once that rank 0 ended the connection, and why (its own part named too),
    # not gloo's bare "Connection closed by peer", nor a timeout of its own
    assert "rank 0 closed the connection because its side of a collective failed first" in outcome1, outcome1
    assert "[2 x torch.float32 per rank]" in outcome1 and "[3 x torch.float32 per rank]" in outcome1, outcome1
    assert "fusedist's collective timeout" not in outcome1, outcome1
    assert elapsed1 < 8, elapsed1  # (its own timeout: 10 s)


def test_a_background_failure_stops_the_other_communicators_at_once(launched):
    for rank, (outcome, elapsed) in enumerate(results_of(launched, "background")):
        assert "can no longer run collectives" in outcome, (rank, outcome)
        assert "unwaited" in outcome or "all_gather" in outcome, (rank, outcome)
        assert "another communicator of this process group" in outcome, (rank, outcome)
        assert elapsed < 0.5, (rank, elapsed)  # refused at the launch, not at a timeout


def test_a_receive_posted_after_the_peer_closed_names_the_peer(launched):
    (outcome0, elapsed0, aborted0), (outcome1, _, aborted1) = results_of(launched, "late")
    assert "timed out" in outcome1 and aborted1, outcome1
    # rank 0's launch finds the connection closed: it names rank 1 and rank 1's own error, not gloo's bare
    # "Connection closed by peer ... remote worker crashing", and the group is given up
    assert "posting the receive from rank 1 failed: rank 1 closed the connection because its side of a " \
           "collective failed first" in outcome0, outcome0
    assert "receiving chunk 0 from rank 0 did not complete" in outcome0 and "crashing" not in outcome0, outcome0
    assert aborted0 and elapsed0 < 3, (aborted0, elapsed0)  # (the peer's entry is read at once)


def test_an_empty_part_on_one_rank_fails_promptly_naming_both_parts(launched):
    for rank, (outcome, elapsed) in enumerate(results_of(launched, "empty")):
        # within seconds (the probe's delay and confirmation, the peer's entry), not at the 60 s timeout
        assert elapsed < 15, (rank, elapsed, outcome)
        assert "the same collective with parts of different sizes" in outcome, (rank, outcome)
        assert "0 x torch.float32 per rank" in outcome and "3 x torch.float32 per rank" in outcome, (rank, outcome)
