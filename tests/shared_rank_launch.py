"""Several tests' multi-rank scenarios in one launch of the ranks: starting ranks (each imports
torch) costs seconds, often more than the scenario itself. A module-scoped fixture gathers the
scenarios of the file's tests that pytest selected, runs them in one ``run_distributed`` call,
and each test reads its own scenario's per-rank results.

A scenario is ``(module-level function, args)``, called as ``fn(rank, world, *args)``. One that
raises keeps its traceback as its result and the next one runs: a failure fails its own test
only, and the next scenarios run on a working group (Note [a scenario that fails on some
ranks] in scenario_agreement.py).
"""

from __future__ import annotations

import os
import time
import traceback

import pytest

from fusedist.testing import run_distributed
from scenario_agreement import AFTER_ABORT, ScenarioAgreement


#: a file each rank appends ``rank<TAB>seconds<TAB>scenario`` lines to, one per scenario it ran
#: (where a launch's time goes; unset: nothing is written)
TIMES_ENV = "FUSEDIST_TEST_SCENARIO_TIMES"


def _run_in_turn(rank: int, world: int, scenarios: list, wait_s: float = 3600.0) -> dict:
    """Each scenario in turn; the results by scenario name. ``wait_s``: the longest a rank
    waits for the others to finish a scenario (the launch's timeout ends them before)."""
    agreement = ScenarioAgreement.start(rank, world, wait_s)
    results = {}
    for index, (name, fn, args) in enumerate(scenarios):
        start = time.perf_counter()
        try:
            results[name] = (True, fn(rank, world, *args))
        except (Exception, pytest.fail.Exception):  # noqa: BLE001 - the scenario's test reports it (a missed
            # pytest.raises too: a BaseException, which ended the whole launch and failed every test of the file)
            trace = traceback.format_exc()
            results[name] = (False, agreement.failure_text(index, trace) if agreement else f"rank {rank}:\n{trace}")
        if agreement:
            agreement.settle(index, results[name][0])
        _note_time(rank, name, time.perf_counter() - start)
    if agreement:
        agreement.close()
    return results


def _note_time(rank: int, name, seconds: float) -> None:
    path = os.environ.get(TIMES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{rank}\t{seconds:.2f}\t{name}\n")


def launch_for_selected(request, by_test: dict, world: int, timeout: float, **launch) -> dict:
    """``by_test``: {test function name: {scenario name: (fn, args)}}, in the order to run.
    Runs the scenarios of the tests of ``request.module`` that were collected (``launch``: more
    of ``run_distributed``'s keywords, e.g. ``env``); returns {scenario name: per-rank (passed,
    result or traceback)}."""
    wanted = {getattr(item, "originalname", item.name) for item in request.session.items
              if item.module is request.module}
    todo = [(name, fn, args) for test, scenarios in by_test.items() if test in wanted
            for name, (fn, args) in scenarios.items()]
    per_rank = run_distributed(_run_in_turn, world, todo, timeout, timeout=timeout, **launch)
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
    """The per-rank results of ``scenario``; fails the calling test with the failed ranks'
    tracebacks, the ranks that failed of their own first."""
    assert scenario in launched, f"{scenario} was not run (its test was not selected when the ranks started)"
    failures = [value for passed, value in launched[scenario] if not passed]
    failures.sort(key=lambda text: AFTER_ABORT in text.split("\n", 1)[0])
    assert not failures, f"{scenario} raised on " + "\n".join(failures)
    return [value for _, value in launched[scenario]]


def refused(call):
    """What ``call()`` raised, as ``"Type: message"``, or None where it returned: a scenario's refusal
    carried back to its test as text."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        return f"{type(e).__name__}: {e}"
    return None
