"""The divergence probe compares the labels that pair the gloo exchange's messages (Note [exchange labels in
the divergence probe] in fusedist/reliability/divergence.py): ranks in alike collectives under different
labels end about a second past the probe's delay, not at the collective timeout; collectives whose messages
are not matched by label publish none."""

import contextlib
import time

import pytest
import torch

from fusedist.reliability.divergence import diverged
from fusedist.reliability.monitor import CollectiveMonitor
from fusedist.testing import run_distributed

_TIMEOUT_S = 20  # the collective timeout the diverged ranks would otherwise wait out
_ENV = {"FUSEDIST_TIMEOUT_S": str(_TIMEOUT_S), "FUSEDIST_DIVERGENCE_PROBE_S": "0.3",
        "FUSEDIST_STALL_REPORT_S": "0.5"}


def _labels_across_ranks(rank, world_size):
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, TorchCommunicator, get_communicator
    from fusedist.reliability import attach_monitor

    comm = get_communicator()
    monitor = attach_monitor(comm)
    assert monitor.probe_delay_s == 0.3
    g = torch.Generator().manual_seed(time.time_ns() % 2**31 + rank)
    out = {}
    # Healthy collectives first, against torch's: a label is recorded only where it pairs the messages.
    part = torch.randn(5, generator=g)
    ours, theirs = torch.empty(5 * world_size), [torch.empty(5) for _ in range(world_size)]
    comm.all_gather(ours, part, tag="unit A")
    dist.all_gather(theirs, part)
    out["all_gather"] = (ours, torch.cat(theirs), monitor.label_of(comm.last_seq))
    # All-reduces of one size pair whatever their tags (a joined rank's shadows): no label.
    values = torch.randn(3, generator=g)
    ours, theirs = values.clone(), values.clone()
    if rank == 1:
        time.sleep(0.6)  # (rank 0 waits past the probe's delay, at the same collective)
    comm.all_reduce(ours, op="max", tag=f"shadow of rank {rank}")
    dist.all_reduce(theirs, op=dist.ReduceOp.MAX)
    out["all_reduce"] = (ours, theirs, monitor.label_of(comm.last_seq))
    # A broadcast from rank 1, rank 0 waiting past the delay at it: the variant is published and alike.
    values = torch.randn(4, generator=g)
    ours, theirs = values.clone(), values.clone()
    if rank == 0:
        time.sleep(0.6)
    comm.broadcast(ours, src=1, tag="from the last rank")
    dist.broadcast(theirs, src=1)
    out["broadcast"] = (ours, theirs, monitor.variant_of(comm.last_seq))
    # A converted layer on the global batch, as torch's BatchNorm on the batches of every rank.
    from fusedist.nn import SyncBatchNorm

    x = torch.randn(5, 4, generator=g)
    everyone = [torch.empty(5, 4) for _ in range(world_size)]
    dist.all_gather(everyone, x)
    layer, reference = SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm1d(4)), torch.nn.BatchNorm1d(4)
    out["sync_batch_norm"] = (layer(x).detach(), reference(torch.cat(everyone))[5 * rank:5 * (rank + 1)].detach(),
                              layer.running_var.clone(), reference.running_var.clone())
    # A rank whose layer (in a group of its own) never ran a training forward -- in eval() here -- and went on
    # to another collective of the layer's communicator, while the other waits in the statistics gather.
    group = dist.new_group([0, 1], backend="gloo")
    layer = SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm1d(4), process_group=group)
    start = time.monotonic()
    try:
        if rank == 0:
            layer(x)
        else:
            layer.eval()
            layer(x)
            get_communicator(group).all_gather(torch.empty(6 * world_size), torch.randn(6), tag="after eval")
        out["eval on one rank"] = ("no error", time.monotonic() - start)
    except CollectiveError as exc:
        out["eval on one rank"] = (str(exc), time.monotonic() - start)
    # Note [reduce ops and roots in the divergence probe]: each on a group of its own (a verdict gives it up).
    # A small all-reduce (the exchange) with max on rank 0, sum on rank 1; torch's gloo completes it, folding
    # each element with one rank's op or the other's.
    out["different reduce ops"] = _diverged_on_new_group(lambda c: c.all_reduce(
        torch.randn(3, generator=g), op="max" if rank == 0 else "sum", tag="found inf"))
    # A reduce-scatter (the exchange) with max on rank 0, sum on rank 1: each rank folded with its own op and
    # went on with a result no rank asked for.
    out["different reduce ops, reduce-scatter"] = _diverged_on_new_group(lambda c: c.reduce_scatter(
        torch.empty(4), torch.randn(4 * world_size, generator=g), op="max" if rank == 0 else "sum"))
    # A broadcast from each rank's own rank, through the exchange and through gloo's own broadcast (both hang
    # until the timeout, as torch's does).
    out["different sources"] = _diverged_on_new_group(lambda c: c.broadcast(torch.randn(4, generator=g), src=rank))
    out["different sources, gloo's own"] = _diverged_on_new_group(
        lambda c: c.broadcast(torch.randn(4, generator=g), src=rank, async_op=True), builtin=True)
    # Note [the stall monitor from construction]: a layer held on another device than the CPU (meta stands in
    # for CUDA here) asks for no communicator when it is built -- for CUDA that would be a collective.
    import fusedist.nn.sync_batch_norm as sync_batch_norm

    asked, ask = [], sync_batch_norm.get_communicator
    sync_batch_norm.get_communicator = lambda group=None, device=None: asked.append(str(device)) or ask(group, device)
    try:
        SyncBatchNorm(4, device="meta"), SyncBatchNorm(4)
    finally:
        sync_batch_norm.get_communicator = ask
    out["communicators asked for at construction"] = asked
    # Healthy barriers, the last rank late (past the probe's delay on the exchange): every rank waits for it.
    builtin_comm = TorchCommunicator(dist.new_group([0, 1], backend="gloo"), gloo_collectives="builtin")
    out["barrier waits"] = []
    for c, late in ((comm, 0.6), (builtin_comm, 0.3)):
        start = time.monotonic()
        if rank == world_size - 1:
            time.sleep(late)
        c.barrier()
        out["barrier waits"].append((time.monotonic() - start, late))
    # A barrier on rank 0 against a one-element sum all-reduce on rank 1: they paired, the all-reducing rank going
    # on with its own value. Through the exchange and through gloo's own. One rank's probe gives the verdict, the
    # other's never would (Note [the verdict before the closed connections]): it learns from the closed connection.
    for builtin in (False, True):
        out[f"barrier against all_reduce, builtin {builtin}, causes"] = causes = []
        out[f"barrier against all_reduce, builtin {builtin}"] = _diverged_on_new_group(
            lambda c: c.barrier() if rank == 0 else c.all_reduce(torch.ones(1), tag="one value"), builtin=builtin,
            verdict_on=int(builtin), causes=causes)
    # An all-reduce on rank 0 against a reduce-scatter of as many elements and the same op on rank 1. gloo's own
    # reduce-scatter is an all-reduce of its input: the two paired and both ranks went on out of step.
    for how in ("exchange", "builtin", "builtin async"):
        out[f"all_reduce against reduce_scatter, {how}"] = _diverged_on_new_group(
            lambda c: c.all_reduce(torch.ones(8), async_op=how.endswith("async")) if rank == 0 else
            c.reduce_scatter(torch.empty(4), torch.ones(8), async_op=how.endswith("async")),
            builtin=how.startswith("builtin"))
    # gloo's own reduce-scatter (an all-reduce of a copy): healthy against torch's all-reduce, then with max on
    # rank 0 and sum on rank 1, launched both ways -- it completed, each rank going on with a result of both ops.
    values = torch.randn(4 * world_size, generator=g)
    ours, theirs = torch.empty(4), values.clone()
    builtin_comm.reduce_scatter(ours, values, op="max", async_op=True).wait()
    dist.all_reduce(theirs, op=dist.ReduceOp.MAX)
    out["gloo's own reduce-scatter"] = (ours, theirs[4 * rank:4 * (rank + 1)])
    for async_op in (False, True):
        out[f"different reduce ops, gloo's own reduce-scatter, async {async_op}"] = _diverged_on_new_group(
            lambda c: c.reduce_scatter(torch.empty(4), torch.randn(4 * world_size, generator=g),
                                       op="max" if rank == 0 else "sum", async_op=async_op), builtin=True)
    # Note [waits across groups in the divergence probe] in fusedist/reliability/wait_cycle.py: two groups'
    # collectives entered in different orders on the two ranks.
    first, second = (get_communicator(dist.new_group([0, 1], backend="gloo")) for _ in range(2))
    names = [attach_monitor(c).group_name for c in (first, second)]
    for c in (first, second):
        c.all_gather(torch.empty(2 * world_size), torch.randn(2), tag="healthy")
    start = time.monotonic()
    try:
        for c in (first, second) if rank == 0 else (second, first):
            c.all_gather(torch.empty(3 * world_size), torch.randn(3), tag="ordered")
        out["groups in different orders"] = ("no error", time.monotonic() - start, names)
    except CollectiveError as exc:
        out["groups in different orders"] = (str(exc), time.monotonic() - start, names)
    # Rank 1 late at the next collective, its record of the cycle still in the store: rank 0 is only waiting.
    if rank == 1:
        time.sleep(0.8)
    part = torch.randn(2, generator=g)
    ours, theirs = torch.empty(2 * world_size), [torch.empty(2) for _ in range(world_size)]
    try:
        comm.all_gather(ours, part, tag="after the cycle")
    except CollectiveError as exc:
        ours = str(exc)
    dist.all_gather(theirs, part)
    out["after the cycle"] = (ours, torch.cat(theirs))
    # Alike all-gathers (same sequence number, op and part size) of different units: they never pair.
    start = time.monotonic()
    try:
        comm.all_gather(torch.empty(4 * world_size), torch.randn(4), tag="blocks.1" if rank == 0 else "blocks.2")
        out["diverged"] = ("no error", time.monotonic() - start)
    except CollectiveError as exc:
        out["diverged"] = (str(exc), time.monotonic() - start)
    return out


def _diverged_on_new_group(collective, builtin: bool = False, verdict_on=None, causes=None):
    """Run ``collective(comm)`` on a new group's monitored communicator, and wait for the handle it returns:
    (the error, seconds it took, whether the collective had ended a second later). With ``verdict_on``, only that
    rank's probe finds the divergence, and it closes the connections a while before it publishes its failure.
    ``causes``: a list given the text of each error the error was raised from."""
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, TorchCommunicator, get_communicator
    from fusedist.reliability import attach_monitor

    group = dist.new_group([0, 1], backend="gloo")
    comm = TorchCommunicator(group, gloo_collectives="builtin") if builtin else get_communicator(group)
    attach_monitor(comm)
    start, handle = time.monotonic(), None
    try:
        with _verdict_on(verdict_on):
            handle = collective(comm)
            if handle is not None:  # (a barrier returns none)
                handle.wait()
        message = "no error"
    except CollectiveError as exc:
        message, cause = str(exc), exc.__cause__ or exc.__context__
        while causes is not None and cause is not None and len(causes) < 8:
            causes.append(str(cause))
            cause = cause.__cause__ or cause.__context__
    elapsed = time.monotonic() - start
    work = handle._work if handle is not None else None
    while work is not None and not work.is_completed() and time.monotonic() < start + elapsed + 1:
        time.sleep(0.05)
    return message, elapsed, work is None or work.is_completed()


@contextlib.contextmanager
def _verdict_on(rank):
    """Only ``rank``'s probe finds a divergence; it waits a while after closing the connections (before the report
    it publishes), so the other rank meets the closed connection before any later entry of its."""
    if rank is None:
        yield
        return
    import torch.distributed as dist

    from fusedist.comm import torch_comm
    from fusedist.reliability import divergence

    close, diverged_at = torch_comm.close_connections, divergence.diverged
    if dist.get_rank() == rank:
        torch_comm.close_connections = lambda *args: (close(*args), time.sleep(0.3))
    else:
        divergence.diverged = lambda entries: None
    try:
        yield
    finally:
        torch_comm.close_connections, divergence.diverged = close, diverged_at


@pytest.fixture(scope="module")
def results():
    return run_distributed(_labels_across_ranks, 2, env=_ENV, expect_failure=True, timeout=_TIMEOUT_S + 60)


def test_healthy_exchanges_match_torch_and_record_labels_only_where_they_pair(results):
    for rank, (status, out) in enumerate(results):
        assert status == "ok", out
        ours, theirs, label = out["all_gather"]
        assert torch.equal(ours, theirs) and label == "unit A", (rank, label)
        ours, theirs, label = out["all_reduce"]
        assert torch.equal(ours, theirs) and label is None, (rank, label)
        ours, theirs, variant = out["broadcast"]
        assert torch.equal(ours, theirs) and variant == "from rank 1", (rank, variant)


@pytest.mark.parametrize("case, named", [
    ("different reduce ops", ["ranks [0] in all_reduce (op max) (collective #0, 3 x torch.float32 per rank)",
                              "ranks [1] in all_reduce (op sum) (collective #0, 3 x torch.float32 per rank)"]),
    ("different reduce ops, reduce-scatter", ["ranks [0] in reduce_scatter (op max)",
                                              "ranks [1] in reduce_scatter (op sum)"]),
    ("different sources", ["ranks [0] in broadcast (from rank 0)", "ranks [1] in broadcast (from rank 1)"]),
    ("different sources, gloo's own", ["ranks [0] in broadcast (from rank 0)", "ranks [1] in broadcast (from rank 1)"]),
])
def test_alike_collectives_of_other_reduce_ops_or_roots_fail_every_rank_soon_after_the_delay(results, case, named):
    """Note [reduce ops and roots in the divergence probe]: same sequence number, op and part size, another
    reduce op or root -- they compared equal and waited out the collective timeout."""
    for rank, (status, out) in enumerate(results):
        assert status == "ok", out
        message, elapsed, ended = out[case]
        assert all(n in message for n in named), (rank, message)
        assert "Stall report" in message and elapsed < 6, (rank, elapsed, message)
        # Note [closing the connections of an abandoned collective] in fusedist/comm/torch_comm.py: gloo's own
        # broadcast, abandoned, no longer stays queued until the group's timeout (the process could not end).
        assert ended, rank


@pytest.mark.parametrize("async_op", [False, True])
def test_gloo_s_own_reduce_scatter_with_different_ops_fails_on_every_rank(results, async_op):
    """gloo's own reduce-scatter is an all-reduce: with max on one rank and sum on the other it completed, each rank
    going on with garbage. Now its parts (op included) are agreed like gloo's own all-reduce's."""
    for rank, (status, out) in enumerate(results):
        assert status == "ok", out
        ours, theirs = out["gloo's own reduce-scatter"]
        assert torch.equal(ours, theirs), rank
        message, elapsed, ended = out[f"different reduce ops, gloo's own reduce-scatter, async {async_op}"]
        assert "rank 0: 8 x torch.float32 (shape (8,)), op max" in message, (rank, message)
        assert "rank 1: 8 x torch.float32 (shape (8,)), op sum" in message, (rank, message)
        assert "reduce_scatter" in message and elapsed < 6 and ended, (rank, elapsed, message)


def test_a_barrier_waits_for_every_rank(results):
    for rank, (status, out) in enumerate(results):
        assert status == "ok", out
        for waited, late in out["barrier waits"]:
            assert waited >= late - 0.05, (rank, waited, late)


@pytest.mark.parametrize("builtin", [False, True])
def test_a_barrier_never_pairs_with_a_one_element_all_reduce(results, builtin):
    """The barrier was a one-element sum all-reduce: against a rank's own such all-reduce it completed, that rank
    going on with its own value. Now it pairs with nothing else, and the probe names both -- in the first line on
    every rank: the rank whose probe gave the verdict closed the connections, and the other one's error began with
    gloo's "Connection closed by peer ... remote worker crashing" (Note [the verdict before the closed
    connections] in fusedist/reliability/divergence.py)."""
    first = int(builtin)  # (the rank whose probe alone finds the divergence)
    for rank, (status, out) in enumerate(results):
        assert status == "ok", out
        message, elapsed, ended = out[f"barrier against all_reduce, builtin {builtin}"]
        line = message.splitlines()[0]
        assert f"cannot complete on rank {rank} of 2: every rank of the group has been blocked" in line, (rank, line)
        assert "ranks [0] in barrier" in line and "ranks [1] in all_reduce" in line, (rank, line)
        assert (f"rank {first} gave this verdict first" in line) == (rank != first), (rank, line)
        assert "Stall report" in message and elapsed < 6 and ended, (rank, elapsed, message)
        if not builtin:  # (the exchange carries the barrier as a one-element all-reduce; its errors say barrier)
            causes = out["barrier against all_reduce, builtin False, causes"]
            named = "barrier exchange: " if rank == 0 else "all_reduce [1 x torch.float32 per rank] exchange: "
            assert any(c.startswith(named) for c in causes), (rank, causes)


@pytest.mark.parametrize("how, named", [
    ("exchange", ["ranks [0] in all_reduce (collective #0, 8 x torch.float32 per rank)",
                  "ranks [1] in reduce_scatter (collective #0, 4 x torch.float32 per rank)"]),
    ("builtin", ["rank 0: all_reduce of 8 x torch.float32", "rank 1: reduce_scatter of 8 x torch.float32",
                 "launched on no rank"]),
    ("builtin async", ["rank 0: all_reduce of 8 x torch.float32", "rank 1: reduce_scatter of 8 x torch.float32",
                       "the tensor holds garbage"]),
])
def test_an_all_reduce_never_pairs_with_a_reduce_scatter(results, how, named):
    """Note [the collective's kind in a fingerprint] in fusedist/comm/part_agreement.py: gloo's own reduce-scatter
    is an all-reduce, and its fingerprint did not say which collective it served: against an all-reduce of as many
    elements and one op it completed on both ranks. Every rank now fails at once, naming both collectives."""
    for rank, (status, out) in enumerate(results):
        assert status == "ok", out
        message, elapsed, ended = out[f"all_reduce against reduce_scatter, {how}"]
        assert all(n in message for n in named), (rank, message)
        assert elapsed < 6 and ended, (rank, elapsed, message)


def test_groups_entered_in_different_orders_fail_every_rank_soon_after_the_delay(results):
    """Rank 0 in the first group's collective, rank 1 in the second's, each waiting for the other: each probe read
    its own group's entries only, and both waited out the collective timeout."""
    for rank, (status, out) in enumerate(results):
        assert status == "ok", out
        message, elapsed, (first, second) = out["groups in different orders"]
        assert "waiting for each other" in message, (rank, message)
        assert f"of group {first}#0 for rank 1" in message and f"of group {second}#0 for rank 0" in message, message
        assert "Stall report" in message and elapsed < 6, (rank, elapsed, message)
        # A record its rank left after the verdict closes that cycle only: the next collective, one rank late,
        # completes as torch's does.
        ours, theirs = out["after the cycle"]
        assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs), (rank, ours)


def test_alike_collectives_under_different_labels_fail_every_rank_soon_after_the_delay(results):
    """Same sequence number, op and part size, different labels: they compared equal ("only slow") and
    waited out the collective timeout."""
    for rank, (status, out) in enumerate(results):
        assert status == "ok", out
        message, elapsed = out["diverged"]
        assert "'blocks.1'" in message and "'blocks.2'" in message, (rank, message)
        assert "Stall report" in message and elapsed < 6, (rank, elapsed, message)


def test_a_rank_that_never_trained_its_layer_is_told_apart_from_a_slow_one(results):
    """Note [the stall monitor from construction] in fusedist/nn/sync_batch_norm.py: the monitor came with the
    first training forward, so the rank in eval() published nothing and the other waited out the timeout."""
    for rank, (status, out) in enumerate(results):
        assert status == "ok", out
        ours, theirs, ours_var, theirs_var = out["sync_batch_norm"]
        # fp32 statistics merged over ranks vs one pass over the global batch: a few ulps apart
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_var, theirs_var, rtol=1e-5, atol=1e-6)
        assert out["communicators asked for at construction"] == ["cpu"], out["communicators asked for at construction"]
        message, elapsed = out["eval on one rank"]
        assert "sync_batch_norm" in message and "after eval" in message, (rank, message)
        assert "Stall report" in message and elapsed < 6, (rank, elapsed, message)


def _entry(seq, op, part, label=None, kind="waiting"):
    waiting_on = {"op": op, "tag": f"tag {seq}", "seq": seq, "part": part}
    if label is not None:
        waiting_on["label"] = label
    return {"kind": kind, "context": {}, "waiting_on": waiting_on}


def test_labels_are_compared_only_where_every_rank_published_one():
    """No false verdict for ranks at one collective whose tags differ where the tags do not pair the
    messages (no label published), nor where one rank's entry has none."""
    assert diverged({0: _entry(3, "all_reduce", "3 x torch.float32"),
                     1: _entry(3, "all_reduce", "3 x torch.float32")}) is None
    assert diverged({0: _entry(3, "all_gather", "4 x torch.float32", "a"),
                     1: _entry(3, "all_gather", "4 x torch.float32")}) is None
    assert diverged({0: _entry(3, "all_gather", "4 x torch.float32", "a"),
                     1: _entry(3, "all_gather", "4 x torch.float32", "a")}) is None
    found = diverged({0: _entry(3, "all_gather", "4 x torch.float32", "a"),
                      1: _entry(3, "all_gather", "4 x torch.float32", "b", kind="failure")})
    assert found == ("they wait in the same collective under different labels (whose messages never pair) -- "
                     "ranks [0] in all_gather 'a' (collective #3, 4 x torch.float32 per rank); ranks [1] in "
                     "all_gather 'b' (collective #3, 4 x torch.float32 per rank)"), found


def test_variants_are_compared_only_where_every_rank_published_one():
    """A reduce op or root differs only where each rank's entry names one (an entry from a refusal, or a
    collective launched more than HISTORY collectives ago, has none)."""
    def at(variant=None, op="all_reduce"):
        entry = _entry(3, op, "3 x torch.float32")
        if variant is not None:
            entry["waiting_on"]["variant"] = variant
        return entry

    assert diverged({0: at("op max"), 1: at("op max")}) is None
    assert diverged({0: at("op max"), 1: at()}) is None
    assert diverged({0: at("op max"), 1: at("op sum")}) == (
        "they wait in the same collective with different reduce ops -- ranks [0] in all_reduce (op max) (collective "
        "#3, 3 x torch.float32 per rank); ranks [1] in all_reduce (op sum) (collective #3, 3 x torch.float32 per rank)")
    found = diverged({0: at("from rank 0", "broadcast"), 1: at("from rank 1", "broadcast")})
    assert found.startswith("they wait in the same collective from or to different roots -- "), found


def test_a_failure_entry_keeps_the_part_of_the_collective_its_error_names(monkeypatch):
    """A probe's verdict names its own collective (its error has a sequence number): the entry that replaces
    the probe's keeps the part, as the probe's had it. Before, it dropped it, and a peer still probing read
    that rank as waiting with no part -- "parts of different sizes" where the parts were alike."""
    import datetime

    from fusedist.comm.base import CollectiveError, CommHandle
    from fusedist.reliability import monitor as monitor_module

    class _Comm:
        rank, world_size, timeout, last_seq, last_label = 0, 2, datetime.timedelta(seconds=20), 3, ""

    entries = []
    monkeypatch.setattr(monitor_module.stall_report, "exchange", lambda *args: entries.append(args[5]))
    comm = _Comm()
    monitor = monitor_module.CollectiveMonitor(comm)
    handle = CommHandle(comm, None, op="all_reduce", tag="t", seq=3, timeout=comm.timeout)
    handle.part, handle.variant = torch.ones(3), "op max"
    monitor.on_launch(comm, handle)
    monitor.on_failure(comm, handle, CollectiveError("cannot complete", op="all_reduce", tag="t", rank=0, seq=3))
    waiting = entries[0]["waiting_on"]
    assert (waiting["part"], waiting["variant"]) == ("3 x torch.float32", "op max"), waiting


class _Store:
    """The store calls the cycle search makes, over a dict."""

    def __init__(self, records):
        import json

        self.keys = {f"fusedist/stall/blocked/{r['rank']}": json.dumps(r).encode() for r in records}

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def get(self, key):
        return self.keys[key]


def _blocked(rank, group, seq, launched, members=(0, 1, 2)):
    return {"rank": rank, "group": group, "members": list(members), "op": "all_gather", "tag": "t", "seq": seq,
            "launched": launched}


def test_a_wait_cycle_needs_every_edge_to_be_a_collective_the_peer_has_not_launched():
    """Note [waits across groups in the divergence probe]: a peer blocked in another group that launched this
    group's collective asynchronously before (it still completes) is no edge; a rank whose wait leads into a
    cycle it is not on is told too; a peer blocked in the same group is the group's own probe's to compare."""
    from fusedist.reliability.wait_cycle import find

    a0, b1 = _blocked(0, "A#0", 5, {"A#0": 5, "B#0": 2}), _blocked(1, "B#0", 3, {"A#0": 4, "B#0": 3})
    verdict, _, waits = find(_Store([a0, b1]), a0)
    assert waits == [[0, "A#0", 5], [1, "B#0", 3]], waits
    assert verdict.startswith("rank 0 waits in all_gather (tag 't', collective #5) of group A#0 for rank 1; rank 1 "
                              "waits in all_gather (tag 't', collective #3) of group B#0 for rank 0"), verdict
    assert find(_Store([a0, dict(b1, launched={"A#0": 5})]), a0) is None  # rank 1 launched A's #5 already
    assert find(_Store([a0, dict(b1, group="A#0", seq=6)]), a0) is None
    assert find(_Store([a0]), a0) is None  # rank 1 not blocked past the delay (it may be computing)
    c2 = _blocked(2, "C#0", 0, {}, members=(2, 0))  # waits for rank 0, itself on the cycle
    verdict, _, _ = find(_Store([a0, b1, c2]), c2)
    assert verdict.startswith("rank 2 waits on ranks blocked in a cycle: rank 0 waits"), verdict
    # A record kept after its rank's verdict closes only the cycle that verdict named: the rank has gone on.
    assert find(_Store([a0, dict(b1, gave_up=waits)]), a0) is not None
    assert find(_Store([dict(a0, seq=9), dict(b1, gave_up=waits)]), dict(a0, seq=9)) is None


def test_a_record_kept_after_a_cycle_verdict_goes_at_the_next_launch_in_any_group(monkeypatch):
    """The record a rank keeps after its cycle verdict (for the peers still probing that cycle) goes at the
    process's next launch in any of its groups, a group made since included (Note [work at a monitor's next
    launch] in fusedist/reliability/monitor.py); a monitor with nothing pending launches through its class's
    hook alone."""
    import datetime
    import weakref
    from types import SimpleNamespace

    import torch.distributed as dist

    from fusedist.reliability import monitor as monitor_module, wait_cycle

    class _Comm:
        rank, world_size, timeout, last_seq, last_label = 0, 2, datetime.timedelta(seconds=20), 0, ""

    def launch(monitor, seq):
        monitor.on_launch(monitor.comm, SimpleNamespace(seq=seq, op="all_reduce", tag="t", _work=None))

    store, key = dist.HashStore(), "fusedist/stall/blocked/0"
    monkeypatch.setattr(monitor_module, "_monitors", weakref.WeakSet())
    monkeypatch.setattr(wait_cycle, "kept", None)
    first, second = monitor_module.CollectiveMonitor(_Comm(), "a"), monitor_module.CollectiveMonitor(_Comm(), "b")
    assert "on_launch" not in vars(first) and "on_launch" not in vars(second)
    record = _blocked(0, "a#0", 3, {"a#0": 3, "b#0": 0})
    wait_cycle.keep(store, record, [[0, "a#0", 3], [1, "b#0", 1]])
    assert store.check([key]) and wait_cycle.kept is not None
    made_since = monitor_module.CollectiveMonitor(_Comm(), "c")
    launch(made_since, 0)
    assert not store.check([key]) and wait_cycle.kept is None and [h[0] for h in made_since.history] == [0]
    wait_cycle.keep(store, record, [[0, "a#0", 3], [1, "b#0", 1]])
    launch(second, 1)
    assert not store.check([key]) and wait_cycle.kept is None and "on_launch" not in vars(second)
    launch(first, 4)
    assert "on_launch" not in vars(first) and [h[0] for h in first.history] == [4]
    launch(made_since, 1)
    assert all("on_launch" not in vars(m) for m in (first, second, made_since))


class _KeyValueStore:
    """The store calls the probe and its peers make, over a dict."""

    def __init__(self):
        self.keys = {}

    def set(self, key, value):
        self.keys[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.keys[key]

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def delete_key(self, key):
        self.keys.pop(key, None)


class _GroupRank(CollectiveMonitor):
    """What the probe and a failed rank's publication read of a rank's monitor (and its next-launch actions): one
    rank of a 3-rank group."""

    group_name, generation, check_announced = "world", 0, False

    def __init__(self, store, rank):  # (the monitor's own needs a communicator)
        import datetime
        import types

        self.store, self.reports, self.history = store, [], []
        self.comm = types.SimpleNamespace(rank=rank, world_size=3, last_seq=6, timeout=datetime.timedelta(seconds=20))

    def context(self):
        return {}


def test_a_peer_that_failed_elsewhere_is_named_at_the_first_read_past_the_delay(monkeypatch):
    """Note [a peer that failed elsewhere, in the divergence probe]: rank 1 failed outside the group and waits
    to tell it, rank 2 computes still (no entry). The probe waited for every rank to be stuck, then told "their
    programs diverged"; now it names rank 1 and its message at once -- only in a collective rank 1 had not launched,
    and only while rank 1's entry is there."""
    import weakref

    from fusedist.reliability import failed_elsewhere
    from fusedist.reliability import monitor as monitor_module
    from fusedist.reliability.divergence import WaitProbe

    store = _KeyValueStore()
    failed = _GroupRank(store, 1)
    monkeypatch.setattr(monitor_module, "_monitors", weakref.WeakSet([failed]))
    written = failed_elsewhere.publish("stage 1 failed at micro-batch 2's loss: ValueError: refused")
    assert written == [failed], written
    probe = WaitProbe(_GroupRank(store, 0), "all_reduce", "ddp bucket 0", 7, delay_s=0.3)
    verdict = probe.check()
    assert verdict is not None and verdict.startswith(
        "rank 1 failed elsewhere: stage 1 failed at micro-batch 2's loss: ValueError: refused. "), verdict
    assert "programs diverged" not in verdict and "(20 s, FUSEDIST_TIMEOUT_S)" in verdict, verdict
    probe.close()
    launched = WaitProbe(_GroupRank(store, 0), "all_reduce", "ddp bucket 0", 6, delay_s=0.3)
    assert launched.check() is None  # (rank 1 launched #6 before it failed: it may still complete)
    launched.close()
    failed_elsewhere.withdraw(written)  # (told: a later wait is probed as before)
    later = WaitProbe(_GroupRank(store, 0), "all_reduce", "ddp bucket 1", 8, delay_s=0.3)
    assert later.check() is None
    later.close()



def test_a_verdict_reaches_the_store_before_the_wait_is_ended_and_goes_where_the_wait_completed_after_all(monkeypatch):
    """Note [the verdict before the closed connections]: the probe's failure entry, with its verdict, is in the
    store when the watcher ends the wait (closing the connections), so a peer that meets the closed connection
    reads it; where the wait had completed after all, the rank goes on and its waiting entry is back (then
    withdrawn as usual), not a failure a peer would take for a verdict."""
    import json
    import types
    import weakref

    from fusedist.comm.watched_wait import WatchedWait
    from fusedist.reliability import failed_elsewhere
    from fusedist.reliability import monitor as monitor_module
    from fusedist.reliability.divergence import WaitProbe, peer_verdict

    store = _KeyValueStore()
    failed = _GroupRank(store, 1)
    monkeypatch.setattr(monitor_module, "_monitors", weakref.WeakSet([failed]))
    failed_elsewhere.publish("stage 1 failed at its loss")
    waiting = _GroupRank(store, 0)
    waiting.divergence_probe = lambda op, tag, seq, part: WaitProbe(waiting, op, tag, seq, 0.3, part)
    mine, seen = "fusedist/stall/world/0/0", []

    def end_watched_wait(work, verdict):
        seen.append((json.loads(store.get(mine))["kind"], peer_verdict(_GroupRank(store, 2)), verdict))
        return False  # (it completed meanwhile)

    comm = types.SimpleNamespace(observer=waiting, _end_watched_wait=end_watched_wait)
    work = types.SimpleNamespace(is_completed=lambda: False)
    watched = WatchedWait(types.SimpleNamespace(_comm=comm, _work=work, op="all_reduce", tag="t", seq=7, part=None),
                          delay_s=3600.0)  # (stepped here, not by the watcher thread)
    assert watched._step() is None and watched.verdict is None
    [(kind, (peer, told), verdict)] = seen
    assert kind == "failure" and peer == 0 and told == verdict and verdict.startswith("rank 1 failed elsewhere"), seen
    assert json.loads(store.get(mine))["kind"] == "waiting"
    watched.close()
    assert not store.check([mine]) and peer_verdict(_GroupRank(store, 2)) is None
