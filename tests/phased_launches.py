"""Scenarios in phases: a checkpoint test saves at one world size and restores at another, so its
scenarios cannot all share one launch of the ranks; but the saves of a file's tests can share one
launch, and their restores at each world size another. Each phase is a
:func:`shared_rank_launch.launch_for_selected` call over the file's selected tests; a scenario that
several tests need (one save that several restores read) runs once.

A step that must come between two scenarios of one launch (rank 0 corrupting a saved file before
the restore that reads it) is a scenario of its own: every rank finishes a scenario before any
starts the next (scenario_agreement.py), so the step is done before the restore begins.
"""

from __future__ import annotations

import pytest

from shared_rank_launch import launch_for_selected


def selected_tests(request) -> set:
    """The names of the tests of ``request.module`` pytest selected."""
    return {getattr(item, "originalname", item.name) for item in request.session.items
            if item.module is request.module}


def launch_phase(request, by_test: dict, world: int, timeout: float, **launch) -> dict:
    """Like :func:`launch_for_selected`, ``by_test`` is {test name: {scenario name: (fn, args)}},
    but a scenario named by several selected tests runs once, where the first of them lists it, and
    no ranks start where no selected test needs the phase, and a scenario's ``pytest.raises`` that saw
    nothing fails that scenario alone (:func:`failed_as_assertion`). Returns {scenario name: per-rank
    results}."""
    wanted = selected_tests(request)
    todo: dict = {}
    for test, scenarios in by_test.items():
        if test in wanted:
            for name, scenario in scenarios.items():
                fn, args = scenario
                todo.setdefault(name, (failed_as_assertion, (fn, *args)))
    if not todo:
        return {}
    owner = next(test for test in by_test if test in wanted)
    return launch_for_selected(request, {owner: todo}, world, timeout, **launch)


def on_rank_0(rank: int, world: int, fn, *args):
    """``fn(*args)`` on rank 0 only (a change to the files between two scenarios); its result
    on rank 0, None on the others."""
    return fn(*args) if rank == 0 else None


def failed_as_assertion(rank: int, world: int, fn, *args):
    """``fn(rank, world, *args)``, with pytest's ``Failed`` (what a ``pytest.raises`` that saw no
    exception raises, a BaseException) raised as an AssertionError: a shared launch reports an
    Exception as its scenario's failure and goes on, where a BaseException would end the launch
    and error every test of the file."""
    try:
        return fn(rank, world, *args)
    except pytest.fail.Exception as exc:
        raise AssertionError(f"{exc}") from exc
