"""Several tests' multi-rank scenarios in one launch of the ranks: starting ranks (each imports
torch) costs seconds, often more than the scenario itself. A module-scoped fixture gathers the
scenarios of the file's tests that pytest selected, runs them in one ``run_distributed`` call,
and each test reads its own scenario's per-rank results.

A scenario is ``(module-level function, args)``, called as ``fn(rank, world, *args)``. One that
raises keeps its traceback as its result and the next one runs: a failure fails its own test
only (ranks that stopped at different collectives meet again within the process group's
timeout).
"""

from __future__ import annotations

import os
import traceback

from fusedist.testing import run_distributed


def _run_in_turn(rank: int, world: int, scenarios: list) -> dict:
    results = {}
    for name, fn, args in scenarios:
        try:
            results[name] = (True, fn(rank, world, *args))
        except Exception:  # noqa: BLE001 - the scenario's test reports it
            results[name] = (False, f"rank {rank}:\n{traceback.format_exc()}")
    return results


def launch_for_selected(request, by_test: dict, world: int, timeout: float, **launch) -> dict:
    """``by_test``: {test function name: {scenario name: (fn, args)}}, in the order to run.
    Runs the scenarios of the tests of ``request.module`` that were collected (``launch``: more
    of ``run_distributed``'s keywords, e.g. ``env``); returns {scenario name: per-rank (passed,
    result or traceback)}."""
    wanted = {getattr(item, "originalname", item.name) for item in request.session.items
              if item.module is request.module}
    todo = [(name, fn, args) for test, scenarios in by_test.items() if test in wanted
            for name, (fn, args) in scenarios.items()]
    per_rank = run_distributed(_run_in_turn, world, todo, timeout=timeout, **launch)
    return {name: [results[name] for results in per_rank] for name, _, _ in todo}


def fresh_compiler(rank: int, world: int, fn, *args):
    """``fn(rank, world, *args)`` after ``torch._dynamo.reset()``: a compiled scenario compiles as
    in a launch of its own, not from an earlier scenario's caches."""
    import torch

    torch._dynamo.reset()
    return fn(rank, world, *args)


def with_fresh_compiler(by_test: dict) -> dict:
    """``by_test`` with scenarios given as ``(fn, *args)``, each run by :func:`fresh_compiler`, in
    the form :func:`launch_for_selected` takes."""
    return {test: {name: (fresh_compiler, (fn, *args)) for name, (fn, *args) in scenarios.items()}
            for test, scenarios in by_test.items()}


def under_env(rank: int, world: int, env: dict, fn, *args):
    """``fn(rank, world, *args)`` with ``env`` in this rank's environment (a value of None: unset),
    restored after: scenarios of one launch that were written for other settings (timeouts read at
    each collective, check periods read when a model is wrapped) each see their own."""
    saved = {name: os.environ.get(name) for name in env}
    try:
        _set_env(env)
        return fn(rank, world, *args)
    finally:
        _set_env(saved)


def _set_env(env: dict) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def results_of(launched: dict, scenario: str) -> list:
    """The per-rank results of ``scenario``; fails the calling test with a rank's traceback."""
    assert scenario in launched, f"{scenario} was not run (its test was not selected when the ranks started)"
    for passed, value in launched[scenario]:
        assert passed, f"{scenario} raised on {value}"
    return [value for _, value in launched[scenario]]
