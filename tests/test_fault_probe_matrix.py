"""Faults found by probing the reliability promises end to end (every rank exits within the
collective timeout + 60 s, with an error naming what diverged), each kept as a regression test.

Every scenario is bounded: collective timeouts of a few seconds (FUSEDIST_TIMEOUT_S), a short
report window (FUSEDIST_STALL_REPORT_S) and a wall-clock bound on the whole run.
"""

import time

import torch

import models
from fusedist.testing import run_distributed

FAST_FAILURE = {"FUSEDIST_TIMEOUT_S": "3", "FUSEDIST_STALL_REPORT_S": "1"}


def _train(model, opt, rank, steps, skip=None):
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x, y = models.MLP.batch(gen)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        if skip == step:
            continue
        loss.backward()
        opt.step()


# ---------------------------------------------------------------- the verdict without its details
def _skip_then_leave_worker(rank, world_size):
    """Rank 1 skips the backward of step 2 of 4, so its last backward pairs with rank 0's
    third; then it leaves (its loop is over). Rank 0 reads the verdict at its fourth forward
    and must learn that the ranks diverged, although rank 1 is gone before the exchange of the
    details (Note [verdict without details] in fusedist/reliability/step_check_text.py)."""
    import fusedist

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(models.MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from fusedist.reliability.step_check import unread_divergences

    try:
        _train(model, opt, rank, 4, skip=2 if rank == 1 else None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return (type(exc).__name__, str(exc), unread_divergences())
    # What this rank prints at exit (Note [verdicts unread at exit]).
    return ("finished", "", unread_divergences(wait_s=30))


def test_divergence_is_reported_when_the_diverged_rank_has_left():
    start = time.monotonic()
    results = run_distributed(_skip_then_leave_worker, 2, env=FAST_FAILURE, timeout=90)
    assert time.monotonic() - start < 80
    # Its last verdict is read at a forward it never runs: at exit it says so on its own stderr.
    assert results[1][:2] == ("finished", "")
    (message,) = results[1][2]
    assert "ranks diverged (this is rank 1) in synchronized backward #2" in message, message
    assert "forward: ranks range from 3 to 4 (rank 1: 4)" in message and "found at exit" in message
    kind, text, unread = results[0]
    assert unread == []  # read (and raised) at its fourth forward
    assert kind == "RankMismatchError", text
    assert "ranks diverged (detected on every rank that took part; this is rank 0) in synchronized backward #2" in text
    assert "forward: ranks range from 3 to 4 (rank 0: 3)" in text, text
    assert "exchanging the values failed, because a rank did not take part" in text
    assert "ddp step check details" in text  # the failed exchange, named


# ---------------------------------------------------------------- stall reports of diverged ranks
def _entry(op, tag, seq, context):
    return {"kind": "failure", "error": "timed out", "context": context, "recent": [],
            "waiting_on": {"op": op, "tag": tag, "seq": seq, "age_s": 5.0}}


def test_stall_report_says_ranks_wait_in_different_collectives_and_where_fully_shard_was():
    """A rank that skipped a backward of a fully_shard model waits in the next forward's
    all-gather while the others wait in this backward's: the report gives each rank's
    fully_shard position (not only its optimizer steps) and says the collectives never pair."""
    from fusedist.reliability import stall_report

    entries = {
        0: _entry("all_gather", "fully_shard gather 4 (Linear)", 25,
                  {"fully_shard_step": 2, "fully_shard_forwards": 3, "fully_shard_backward": 2,
                   "optimizer_steps": 2, "in_backward": True}),
        1: _entry("all_gather", "fully_shard gather 0 (Linear)", 25,
                  {"fully_shard_step": 2, "fully_shard_forwards": 4, "fully_shard_backward": 2,
                   "optimizer_steps": 2, "in_backward": False}),
    }
    report = stall_report.render(entries, 2, 1.0, 0)
    assert "at fully_shard step 2, 3 training forwards, 2 backwards, 2 optimizer steps, inside backward" in report
    assert "at fully_shard step 2, 4 training forwards, 2 backwards, 2 optimizer steps:" in report
    assert "ranks [0] reached all_gather [fully_shard gather 4 (Linear)] (collective #25)" in report
    assert "the ranks wait in different collectives, which never pair" in report

    # Ranks in the same collective: no such line.
    same = stall_report.render({0: entries[0], 1: dict(entries[1], waiting_on=entries[0]["waiting_on"])}, 2, 1.0, 0)
    assert "different collectives" not in same


# ---------------------------------------------------------------- collectives of different sizes
def _mismatched_small_all_reduces_worker(rank, world_size):
    """Rank 0 reduces two floats (ZeRO's found-inf and norm), rank 1 sixteen int64 (the step
    check): what a rank that skipped ``scaler.step()`` issues against one that did not. On
    gloo's own all-reduce that pairing kills a process (SIGABRT, "Received data size doesn't
    match expected size"); here both ranks raise, naming their collective."""
    from fusedist.comm import CollectiveError, get_communicator

    comm = get_communicator()
    start = time.monotonic()
    try:
        if rank == 0:
            comm.all_reduce(torch.zeros(2), tag="zero found_inf and grad norm")
        else:
            comm.all_reduce(torch.zeros(16, dtype=torch.int64), op="max", tag="ddp step check")
    except CollectiveError as exc:
        return ("error", str(exc), time.monotonic() - start)
    return ("completed", "", time.monotonic() - start)


def test_ranks_in_different_small_all_reduces_raise_instead_of_aborting():
    results = run_distributed(_mismatched_small_all_reduces_worker, 2, env=FAST_FAILURE, timeout=90,
                              expect_failure=True)
    for rank, (status, value) in enumerate(results):
        assert status == "ok", f"rank {rank}: {value}"  # not killed by gloo
        kind, text, waited = value
        assert kind == "error" and waited < 30, (rank, value)
    assert "all_reduce (tag 'zero found_inf and grad norm', collective #0) failed on rank 0" in results[0][1][1]
    assert "all_reduce (tag 'ddp step check', collective #0) failed on rank 1" in results[1][1][1]
    # (the exchange names this rank's part: Note [exchange tags])
    assert "all_reduce [2 x torch.float32 per rank] exchange" in results[0][1][1]
    assert "chunk 0 from rank 1" in results[0][1][1]


def _small_all_reduce_values_worker(rank, world_size):
    """The all-reduces that take the exchange give gloo's results, bit for bit."""
    from fusedist.comm import get_communicator

    comm = get_communicator()
    out = {}
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.uint8):
        for op in ("sum", "max", "min"):
            for n in (0, 1, 5, 32):
                base = torch.randn(n, generator=g) * 50
                local = base.to(dtype) if dtype.is_floating_point else base.abs().to(dtype)
                mine, builtin = local.clone(), local.clone()
                comm.all_reduce(mine, op=op, tag=f"check {dtype} {op} {n}")
                torch.distributed.all_reduce(builtin, op={"sum": torch.distributed.ReduceOp.SUM,
                                                          "max": torch.distributed.ReduceOp.MAX,
                                                          "min": torch.distributed.ReduceOp.MIN}[op])
                out[f"{dtype} {op} {n}"] = torch.equal(mine, builtin)
    handle = comm.all_reduce(torch.full((3,), float(rank)), op="max", async_op=True, tag="async")
    handle.wait()
    return out


def test_small_all_reduces_through_the_exchange_match_gloo():
    for world_size in (2, 3):
        for rank_result in run_distributed(_small_all_reduce_values_worker, world_size, timeout=120):
            bad = [k for k, same in rank_result.items() if not same]
            assert not bad, (world_size, bad)
