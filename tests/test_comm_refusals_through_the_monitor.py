"""Collectives launched on a given-up communicator are refused alike whichever failure gave it up -- a
failed exchange, a failed collective of gloo's own, the divergence probe's verdict -- and through the
monitor where one watches: a StallError with the stall report, whose "waiting_on" names the collective
the rank stopped at (a number it used), while the error names the refused collective by op and tag
(Note [refusing collectives of a given-up communicator] in fusedist/comm/torch_comm.py). Before, only
the builtin path went through the monitor (the other two were a bare CollectiveError), and the report
numbered the refused collective ``last_seq + 1``, a collective that never existed.

All three paths (and an exchange that failed before anything waited for it), each on its own group, in
one launch of two ranks."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from fusedist.testing import run_distributed

_TIMEOUT_S = 1.0
_BUILTIN_NUMEL = 256 // 4 + 7  # over SMALL_ALL_REDUCE_BYTES in float32: gloo's own all-reduce


def _group_comm(probe_s: float = 0.0):
    """A monitored communicator on a fresh group, with 1 s deadlines (fusedist's and gloo's)."""
    from fusedist.comm import get_communicator
    from fusedist.reliability import attach_monitor

    comm = get_communicator(dist.new_group([0, 1], timeout=datetime.timedelta(seconds=_TIMEOUT_S)))
    comm.timeout = datetime.timedelta(seconds=_TIMEOUT_S)
    monitor = attach_monitor(comm)
    assert monitor is not None
    monitor.probe_delay_s = probe_s
    return comm


def _refusal(comm) -> dict:
    try:
        comm.all_reduce(torch.ones(1), tag="after")
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return {"type": type(exc).__name__, "text": str(exc), "seq": getattr(exc, "seq", None),
                "op": getattr(exc, "op", None), "tag": getattr(exc, "tag", None)}
    return {"type": "no error"}


def _three_paths(rank: int, world: int) -> dict:
    out = {}
    # 1. a failed exchange: rank 1 skips a small all-reduce (the gloo exchange) that rank 0 waits for
    comm = _group_comm()
    x = torch.arange(3.0) + rank
    comm.all_reduce(x, tag="in step")
    reference = torch.arange(3.0) + rank
    dist.all_reduce(reference)  # torch's, on the default group
    out["in_step"] = (x.tolist(), reference.tolist())
    if rank == 0:
        with pytest.raises(Exception) as failed:
            comm.all_reduce(torch.ones(2), tag="skipped")
        out["exchange"] = (failed.value.seq, _refusal(comm))
    dist.barrier()
    # 2. a failed collective of gloo's own: the same with an all-reduce over SMALL_ALL_REDUCE_BYTES
    comm = _group_comm()
    if rank == 0:
        with pytest.raises(Exception) as failed:
            comm.all_reduce(torch.ones(_BUILTIN_NUMEL), tag="skipped")
        out["builtin"] = (failed.value.seq, _refusal(comm))
    dist.barrier()
    # 3. the divergence probe's verdict: the ranks all-reduce parts of different sizes, which never pair
    comm = _group_comm(probe_s=0.2)
    comm.all_reduce(torch.ones(1), tag="warm")
    with pytest.raises(Exception) as failed:
        comm.all_reduce(torch.ones(1 + rank), tag="skipped", async_op=True).wait()
    out["probe"] = (failed.value.seq, _refusal(comm))
    dist.barrier()
    # 4. an exchange that failed in the background, before anything waited for it (so before the monitor
    # reported it): the refusal is the first report, naming the collective launched last
    comm = _group_comm()
    if rank == 0:
        pending = comm.all_reduce(torch.ones(2), tag="skipped", async_op=True)
        time.sleep(_TIMEOUT_S + 1.0)  # (its deadline passes in the progress thread)
        out["background"] = (pending.seq, _refusal(comm))
    dist.barrier()
    # 5. Note [one entry per rank] in fusedist/reliability/monitor.py: rank 0 waits for three buckets rank 1
    # never launches; each wait fails, the first one's entry stays in the store. Rank 1 arrives later, and its
    # report reads rank 0's entry.
    comm = _group_comm()
    if rank == 0:
        buckets = [comm.all_reduce(torch.ones(_BUILTIN_NUMEL), tag=f"bucket {i}", async_op=True) for i in range(3)]
        failed = []
        for handle in buckets:
            with pytest.raises(Exception) as info:
                handle.wait()
            failed.append((handle.seq, type(info.value).__name__))
        out["first entry"] = failed
    dist.barrier()
    if rank == 1:
        with pytest.raises(Exception) as info:
            comm.all_reduce(torch.ones(_BUILTIN_NUMEL), tag="late")
        out["first entry"] = (type(info.value).__name__, str(info.value))
    dist.barrier()
    # a destroyed group's communicator refuses by op and tag too (it numbered the refused collective)
    comm = _group_comm()
    comm.all_reduce(torch.ones(1), tag="before")
    dist.destroy_process_group(comm.group)
    out["destroyed"] = _refusal(comm)
    return out


@pytest.fixture(scope="module")
def results():
    env = {"FUSEDIST_DIVERGENCE_PROBE_S": "0", "FUSEDIST_STALL_REPORT_S": "0.3"}
    return run_distributed(_three_paths, 2, timeout=90, pg_timeout=60, env=env)


@pytest.mark.parametrize("path,ranks", [("exchange", [0]), ("builtin", [0]), ("probe", [0, 1]), ("background", [0])])
def test_a_refused_collective_is_a_stall_error_naming_it_and_the_collective_the_rank_stopped_at(results, path,
                                                                                                ranks):
    for rank in (0, 1):
        ours, torchs = results[rank]["in_step"]
        assert ours == torchs == [1.0, 3.0, 5.0], (rank, ours, torchs)  # (before anything failed: as torch's)
    for rank in ranks:
        failed_seq, refused = results[rank][path]
        text = refused["text"]
        # Before: a bare CollectiveError for the exchange and probe paths (no report)
        assert refused["type"] == "StallError" and "Stall report" in text, (rank, path, refused)
        assert f"refused on rank {rank} of 2: all_reduce [after] was not launched" in text, (rank, path, text)
        assert "can no longer run collectives, because an earlier one failed" in text, (rank, path, text)
        # waiting_on: the collective that failed, by the number it used; the refused one has none.
        # Before: "all_reduce [after] (collective #<failed + 1>)", a collective that never existed.
        assert refused["seq"] == failed_seq >= 0 and refused["tag"] == "skipped", (rank, path, refused)
        assert f"failed waiting on all_reduce [skipped] (collective #{failed_seq})" in text, (rank, path, text)
        assert f"collective #{failed_seq + 1}" not in text, (rank, path, text)


def test_a_destroyed_groups_refusal_names_the_collective_without_a_number(results):
    for rank in (0, 1):
        refused = results[rank]["destroyed"]
        assert refused["type"] == "RuntimeError", (rank, refused)
        assert f"fusedist all_reduce [after] on rank {rank} of 2: not launched, the process group of this " \
            "communicator was destroyed" in refused["text"], (rank, refused)
        assert "collective #" not in refused["text"], (rank, refused)  # before: "(collective #1)", never used


def test_a_ranks_later_failures_keep_its_first_entry_which_the_peers_report_names(results):
    """Note [one entry per rank] in fusedist/reliability/monitor.py. Before, each failed bucket replaced
    the rank's entry: the peer's report said rank 0 had failed waiting on the last bucket."""
    failed = results[0]["first entry"]
    assert [name for _, name in failed] == ["StallError"] * 3, failed
    first, last = failed[0][0], failed[-1][0]
    kind, text = results[1]["first entry"]
    assert kind == "StallError" and "Stall report" in text, (kind, text)
    rank0 = next(line for line in text.splitlines() if line.startswith("  rank 0 "))
    assert f"failed waiting on all_reduce [bucket 0] (collective #{first})" in rank0, text
    assert "reached all_reduce [bucket 0]" in text and "waiting on all_reduce [bucket 2]" not in text, text
    assert f"reached all_reduce [bucket 2] (collective #{last})" not in text, text
