"""The pipeline placement check (Note [stage counts that differ across ranks] in
fusedist/_pipeline_placement.py) on one rank's own stages, without a process group: the stages of one
rank built with different ``num_stages``, or a rank's stages that leave an index uncovered, are refused
naming the rank's view; a rank holding every stage of its pipeline passes. (The check across ranks runs
in tests/test_pipeline_failures_told_upstream.py's shared launch.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fusedist._pipeline_placement import check_placement


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
