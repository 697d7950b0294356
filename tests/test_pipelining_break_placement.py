"""The pipeline placement check (Note [stage counts that differ across ranks] in
fusedist/pipelining/placement.py) on one rank's own stages, without a process group: the stages of one
rank built with different ``num_stages``, or a rank's stages that leave an index uncovered, are refused
naming the rank's view; a rank holding every stage of its pipeline passes. (The check across ranks runs
in tests/test_pipeline_failures_told_upstream.py's shared launch.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fusedist.pipelining.placement import check_placement


def _stage(index: int, count: int) -> SimpleNamespace:
    return SimpleNamespace(stage_index=index, num_stages=count, group_rank=0, group_size=1)


def test_one_ranks_stages_built_with_different_stage_counts_are_refused():
    stages = [_stage(0, 2), _stage(1, 3)]
    with pytest.raises(RuntimeError) as raised:
        check_placement(stages[0], stages)
    message = str(raised.value)
    assert "the stages of one rank were built with different num_stages" in message, message
    assert "rank 0: num_stages=several, stages [0, 1]" in message, message


def test_one_ranks_stages_that_leave_an_index_uncovered_are_refused_and_a_whole_pipeline_passes():
    stages = [_stage(0, 3), _stage(2, 3)]
    with pytest.raises(RuntimeError, match=r"do not cover 0\.\.2 once each \(rank 0: num_stages=3, stages \[0, 2\]"):
        check_placement(stages[0], stages)
    whole = [_stage(0, 3), _stage(1, 3), _stage(2, 3)]
    check_placement(whole[0], whole)


class _Recorded(Exception):
    """A simulated rank reached an all-gather not every rank has sent to yet."""


def _check_across_ranks(monkeypatch, held: dict) -> tuple:
    """check_placement on each simulated rank of a ``len(held)``-rank group (``held``: rank -> its stages'
    (index, num_stages)), each all-gather answered with what every rank sent to it: run again and again,
    each pass recording the vectors of the first all-gather some rank had not sent to. Returns the
    all-gathers each rank made, and what each raised (None where it passed)."""
    import torch.distributed as dist

    world = len(held)
    stages = {r: [SimpleNamespace(stage_index=i, num_stages=n, group_rank=r, group_size=world, device="cpu",
                                  group=None) for i, n in held[r]] for r in held}
    sent = {r: [] for r in held}
    while True:
        calls, raised, recorded = {}, {}, False
        for r in held:
            calls[r] = 0

            def gathering(every, mine, group=None, r=r):
                k, calls[r] = calls[r], calls[r] + 1
                if len(sent[r]) == k:
                    sent[r].append(mine.clone())
                if any(len(sent[other]) <= k for other in held):
                    raise _Recorded()
                for other, out in enumerate(every):
                    out.copy_(sent[other][k])

            monkeypatch.setattr(dist, "all_gather", gathering)
            try:
                check_placement(stages[r][0], stages[r])
                raised[r] = None
            except _Recorded:
                recorded = True
            except RuntimeError as e:
                raised[r] = str(e)
        if not recorded:
            return calls, raised


def test_the_check_across_ranks_takes_one_all_gather_and_names_every_ranks_view(monkeypatch):
    """Note [stage counts that differ across ranks]: one all-gather a set-up (there were two: the counts, then
    the indices), a second only where a rank holds more stages than the first has room for; the same refusal
    on every rank naming each rank's count and stages."""
    calls, raised = _check_across_ranks(monkeypatch, {0: [(0, 4), (2, 4)], 1: [(1, 4), (3, 4)]})
    assert calls == {0: 1, 1: 1} and raised == {0: None, 1: None}, (calls, raised)
    calls, raised = _check_across_ranks(monkeypatch, {0: [(0, 3)], 1: [(1, 4)], 2: [(2, 3)]})
    assert calls == {0: 1, 1: 1, 2: 1}, calls
    assert len(set(raised.values())) == 1, raised
    assert ("the ranks were built with different num_stages (rank 0: num_stages=3, stages [0]; rank 1: "
            "num_stages=4, stages [1]; rank 2: num_stages=3, stages [2]" in raised[0]), raised[0]
    many = {0: [(i, 20) for i in range(0, 20, 2)], 1: [(i, 20) for i in range(1, 20, 2)]}  # (10 a rank)
    calls, raised = _check_across_ranks(monkeypatch, many)
    assert calls == {0: 2, 1: 2} and raised == {0: None, 1: None}, (calls, raised)
    many[1] = many[1][:-1]
    calls, raised = _check_across_ranks(monkeypatch, many)
    assert calls == {0: 2, 1: 2} and len(set(raised.values())) == 1, (calls, raised)
    assert "do not cover 0..19 once each (rank 0: num_stages=20, stages [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]; " \
        "rank 1: num_stages=20, stages [1, 3, 5, 7, 9, 11, 13, 15, 17]" in raised[0], raised[0]
