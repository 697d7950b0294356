"""A rank that skips a backward the others run and goes on to ``check_consistency()`` meets them in
no collective: they wait inside that backward, it waits in the check (Note [a rank behind at the
check] in fusedist/reliability/engine_watch.py). The stall report then names the ranks behind, by
how many backwards, and the ones waiting in ``check_consistency()``, whose position is in the store
while they wait (and gone once a check returns)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fusedist.reliability import stall_report
from fusedist.testing import run_distributed

# Short timeouts: the stall is the expected outcome, so it must end within a second.
_ENV = {"FUSEDIST_TIMEOUT_S": "1", "FUSEDIST_STALL_REPORT_S": "0.5"}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _skip_last_backward(rank, model, opt, watch, late_s: float = 0.0) -> tuple:
    """Two steps, a check that passes, then rank 1 computes a loss and skips its backward and
    step (``if loss is None: continue``) and every rank calls check_consistency(). ``late_s``:
    rank 1 reaches the first backward so much later (a slow rank, not a diverged one)."""
    import torch.distributed as dist

    for step in range(2):
        loss = model(torch.randn(5, 8)).square().mean()
        if rank == 1 and step == 0:
            time.sleep(late_s)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.check_consistency()
    monitor = watch.monitor
    key = stall_report._key(monitor.group_name, monitor.generation, rank)
    left_behind = dist.distributed_c10d._get_default_store().check([key])  # (withdrawn: none)
    loss = model(torch.randn(5, 8)).square().mean()
    began = time.monotonic()
    try:
        if rank == 0:
            loss.backward()
            opt.step()
        model.check_consistency()
        return left_behind, "no error", time.monotonic() - began
    except Exception as exc:  # noqa: BLE001 - the test reads its type and text
        return left_behind, f"{type(exc).__name__}: {exc}", time.monotonic() - began


def _ddp_worker(rank, world_size, late_s=0.0):
    import fusedist
    from fusedist.reliability import step_check

    step_check.EXIT_WAIT_S = 0.1  # (rank 0's check of the backward it never finished stays pending at exit)
    model = fusedist.DistributedDataParallel(_model())
    result = _skip_last_backward(rank, model, torch.optim.SGD(model.parameters(), lr=0.1), model.watch, late_s)
    try:  # after the failure the group is refused at once (it would pair with the collectives left pending)
        model.comm.all_reduce(torch.ones(1), tag="after")
        after = "no error"
    except Exception as exc:  # noqa: BLE001 - the test reads its text
        after = f"{type(exc).__name__}: {exc}"
    return result + (after,)


def _fully_shard_worker(rank, world_size):
    import fusedist

    model = _model()
    fusedist.fully_shard(model[0])
    fusedist.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(5, 8)).sum().backward()  # (the root's watch exists from the first forward)
    opt.zero_grad()
    return _skip_last_backward(rank, model, opt, model._fs_state().ctx.watch)


def _assert_rank_1_named(results, forwards, backwards):
    for rank, (left_behind, text, *_) in enumerate(results):
        assert not left_behind, (rank, "a check that returned left its entry in the store")
        assert text.startswith("StallError"), (rank, text)
        assert "the ranks' training positions differ:" in text, (rank, text)
        assert f"backwards (the one in progress included): ranks [1]: {backwards}; ranks [0]: {backwards + 1}" \
            in text, (rank, text)
        assert "ranks [1] are behind by 1 backward(s); ranks [1] wait in check_consistency()" in text, (rank, text)
        assert "ranks [1] ran a training forward without its backward" in text, (rank, text)
        assert f"{forwards} training forwards" in text and "inside check_consistency()" in text, (rank, text)
        assert "training forwards: ranks" not in text, (rank, text)  # (rank 1 ran its forward: equal counts)


def test_ddp_rank_that_skipped_its_last_backward_is_named_in_the_stall_report_long_before_the_timeout():
    # Note [divergence probe] in fusedist/reliability/divergence.py: rank 1 waits in the check, rank 0
    # inside the backward; both have blocked past the probe's delay, so every rank fails about a second
    # later with the report, not at the collective timeout (4 s; the exit drain still waits for it).
    env = {"FUSEDIST_TIMEOUT_S": "4", "FUSEDIST_STALL_REPORT_S": "0.5", "FUSEDIST_DIVERGENCE_PROBE_S": "0.3"}
    # (rank 1 is 1 s late to the first backward: rank 0's probe runs, finds a rank not blocked and
    # keeps waiting; the check after two steps then passes, its entries withdrawn)
    results = run_distributed(_ddp_worker, 2, 1.0, timeout=60, pg_timeout=4, env=env)
    _assert_rank_1_named(results, forwards=3, backwards=2)
    for rank, (_, text, seconds, after) in enumerate(results):
        assert "found by the divergence probe" in text, (rank, text)
        assert after.startswith("StallError") and "can no longer run collectives" in after \
            and "found by the divergence probe" in after, (rank, after)
        assert "ranks [1] wait in check_consistency()'s collective, ranks [0] in a collective outside it" in text, \
            (rank, text)
        assert seconds < 3.5, (rank, f"the error came {seconds:.1f} s after the divergence", text)


def test_fully_shard_rank_that_skipped_its_last_backward_is_named_in_the_stall_report():
    # (fully_shard's backwards count from the warm-up step: 4 training forwards, 3 backwards on rank 1)
    _assert_rank_1_named(run_distributed(_fully_shard_worker, 2, timeout=60, pg_timeout=3, env=_ENV), forwards=4,
                         backwards=3)


def _entry(kind, **context):
    return {"kind": kind, "context": context, "recent": [], "host": "h", "pid": 1,
            "waiting_on": {"op": "all_reduce", "tag": "t", "seq": 3}}


def test_report_names_ranks_behind_by_backwards_or_whole_iterations_with_global_ranks():
    # HSDP's replicate group [1, 3]: global rank 3 in check_consistency() after skipping a whole
    # iteration (one forward fewer, equal backwards), global rank 1 inside its next forward.
    entries = {0: _entry("failure", fully_shard_step=2, fully_shard_backward=2, fully_shard_forwards=3,
                         optimizer_steps=2, in_backward=False),
               1: _entry("checking", fully_shard_step=2, fully_shard_backward=2, fully_shard_forwards=2,
                         optimizer_steps=2, in_backward=False, in_check=True)}
    text = stall_report.render(entries, 2, 0.5, 0, named=[1, 3])
    assert "rank 1 (global rank 3) on h pid 1: waits in check_consistency()" in text, text
    assert "training forwards: global ranks [3]: 2; global ranks [1]: 3" in text, text
    assert "global ranks [3] are behind by 1 training forward(s); global ranks [3] wait in check_consistency()" \
        in text, text
    assert "backwards (the one in progress" not in text, text
    # DDP: rank 0 inside its third backward, rank 1 past two and at the check
    entries = {0: _entry("failure", ddp_step=2, ddp_backward=2, ddp_forwards=3, optimizer_steps=2, in_backward=True),
               1: _entry("failure", ddp_step=2, ddp_backward=2, ddp_forwards=3, optimizer_steps=2, in_check=True)}
    text = stall_report.render(entries, 2, 0.5, 1)
    assert "at DDP step 2, 3 training forwards, 2 backwards, 2 optimizer steps, inside backward" in text, text
    assert "ranks [1] are behind by 1 backward(s); ranks [1] wait in check_consistency()" in text, text
    # fully_shard: rank 1 computed a loss without its backward, ran its next forward and reached the
    # backward; rank 0 waits inside the backward rank 1 skipped (equal backwards, one more forward)
    entries = {0: _entry("failure", fully_shard_step=1, fully_shard_backward=1, fully_shard_forwards=2,
                         optimizer_steps=1, in_backward=True),
               1: _entry("failure", fully_shard_step=1, fully_shard_backward=1, fully_shard_forwards=3,
                         optimizer_steps=1, in_backward=True)}
    text = stall_report.render(entries, 2, 0.5, 0)
    assert "ranks [1] ran a training forward without its backward" in text, text
    assert "are behind by" not in text, text  # (rank 0 ran fewer forwards, but skipped nothing)
    # agreeing positions (ranks stuck for another reason), or entries without one: nothing said
    same = {r: _entry("failure", ddp_step=2, ddp_backward=2, ddp_forwards=3, optimizer_steps=2) for r in (0, 1)}
    assert stall_report.behind(same) == [] and stall_report.behind({0: _entry("exit"), 1: _entry("exit")}) == []


def test_a_rank_ended_by_another_groups_stall_is_reported_as_crashed_not_as_exited(monkeypatch):
    # HSDP: a rank's shard group stalled (its StallError ends the process, uncaught); its replicate
    # group's report said it had "EXITED without an error" after running fewer iterations.
    import datetime
    import json
    import types
    import weakref

    import torch.distributed as dist

    from fusedist.reliability import monitor as monitor_mod

    monkeypatch.setattr(monitor_mod, "_monitors", weakref.WeakSet())  # (only this test's monitors)
    monkeypatch.setattr(monitor_mod, "_crashed", False)
    comm = types.SimpleNamespace(timeout=datetime.timedelta(seconds=30), rank=1, world_size=2, group=None,
                                 watchdog=None)
    shard, replicate = (monitor_mod.CollectiveMonitor(comm, name) for name in ("shard", "replicate"))
    store = dist.HashStore()
    for monitor in (shard, replicate):
        monitor.store = store
    shard.reports.append("the shard group's own report")  # (its failure entry is published)
    stall_report.publish(store, "shard", 0, 1, _entry("failure"))
    error = monitor_mod.StallError("fusedist: all_gather (tag 'fully_shard gather 0', collective #16) failed",
                                   report=None, cause=TimeoutError(), op="all_gather", seq=16)
    monitor_mod._publish_uncaught(type(error), error, None)
    monitor_mod._publish_exit()  # (atexit: leaves both entries alone)
    entries = {group: json.loads(store.get(stall_report._key(group, 0, 1)).decode())
               for group in ("shard", "replicate")}
    assert entries["shard"]["kind"] == "failure", entries
    assert entries["replicate"]["kind"] == "crash" and entries["replicate"]["error"].startswith("StallError"), entries
    text = stall_report.render({1: entries["replicate"]}, 2, 0.5, 0)
    assert "CRASHED with StallError: fusedist: all_gather" in text and "another group failed" in text, text
    assert "EXITED" not in text, text


def test_probe_verdicts_and_its_setting(monkeypatch):
    from fusedist.reliability import config, divergence

    def at(seq, op="all_reduce", in_check=False, tag="t"):
        return {"kind": "waiting", "waiting_on": {"op": op, "tag": tag, "seq": seq}, "context": {"in_check": in_check}}

    # the same collective (tags may differ: a joined rank's shadows) is a slow one, not a divergence
    assert divergence.diverged({0: at(7, tag="ddp bucket 0"), 1: at(7, tag="ddp join shadow")}) is None
    assert divergence.diverged({0: at(7, in_check=True), 1: at(7, in_check=True)}) is None
    text = divergence.diverged({0: at(7), 1: at(7, "all_gather"), 2: at(8)})
    assert "ranks [0] in all_reduce (collective #7); ranks [1] in all_gather (collective #7); ranks [2] in " \
           "all_reduce (collective #8)" in text, text
    parts = [at(7), at(7)]
    parts[0]["waiting_on"]["part"], parts[1]["waiting_on"]["part"] = "3 x torch.float32", "4 x torch.float32"
    assert "they wait in the same collective with parts of different sizes -- ranks [0] in all_reduce (collective " \
           "#7, 3 x torch.float32 per rank); ranks [1]" in divergence.diverged(dict(enumerate(parts)))
    parts[1]["waiting_on"]["part"] = "3 x torch.float32"
    assert divergence.diverged(dict(enumerate(parts))) is None
    text = divergence.diverged({0: at(7, tag="b"), 1: at(7, in_check=True, tag="c")})
    assert "ranks [1] wait in check_consistency()'s collective, ranks [0] in a collective outside it" in text, text
    # a peer's report read while this rank still waits names where it waits
    entries = {0: dict(at(7), host="h", pid=1), 1: _entry("failure")}
    text = stall_report.render(entries, 2, 0.5, 1)
    assert "rank 0 on h pid 1: waits in all_reduce [t] (collective #7) (blocked past the divergence probe's delay" \
        in text, text
    monkeypatch.delenv("FUSEDIST_DIVERGENCE_PROBE_S", raising=False)
    assert config.divergence_probe_s() == config.DIVERGENCE_PROBE_S
    for good, seconds in (("0", 0.0), (" 2.5 ", 2.5)):
        monkeypatch.setenv("FUSEDIST_DIVERGENCE_PROBE_S", good)
        assert config.divergence_probe_s() == seconds
    for bad in ("soon", "-1", "inf", "nan", ""):
        monkeypatch.setenv("FUSEDIST_DIVERGENCE_PROBE_S", bad)
        with pytest.raises(ValueError, match="FUSEDIST_DIVERGENCE_PROBE_S must be a finite number of seconds >= 0"):
            config.divergence_probe_s()
