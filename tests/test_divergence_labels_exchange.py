"""The divergence probe compares the labels that pair the gloo exchange's messages (Note [exchange labels in
the divergence probe] in fusedist/reliability/divergence.py): ranks in alike collectives under different
labels end about a second past the probe's delay, not at the collective timeout; collectives whose messages
are not matched by label publish none."""

import time

import pytest
import torch

from fusedist.reliability.divergence import diverged
from fusedist.testing import run_distributed

_TIMEOUT_S = 20  # the collective timeout the diverged ranks would otherwise wait out
_ENV = {"FUSEDIST_TIMEOUT_S": str(_TIMEOUT_S), "FUSEDIST_DIVERGENCE_PROBE_S": "0.3",
        "FUSEDIST_STALL_REPORT_S": "0.5"}


def _labels_across_ranks(rank, world_size):
    import torch.distributed as dist

    from fusedist.comm import CollectiveError, get_communicator
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
    # Alike all-gathers (same sequence number, op and part size) of different units: they never pair.
    start = time.monotonic()
    try:
        comm.all_gather(torch.empty(4 * world_size), torch.randn(4), tag="blocks.1" if rank == 0 else "blocks.2")
        out["diverged"] = ("no error", time.monotonic() - start)
    except CollectiveError as exc:
        out["diverged"] = (str(exc), time.monotonic() - start)
    return out


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
