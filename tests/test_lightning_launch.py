"""One launch of 2 ranks for the multi-rank scenarios of the test files whose ranks import
Lightning: the Lightning and Fabric files and a few more (this file holds no tests).

Each rank of a launch imports Lightning and warms up its first Trainer or Fabric: seconds per
launch (the first fit of a process took ~4 s on a loaded machine, the next ones under 1 s), more
than most scenarios take. A file registers its scenarios here (:func:`register`) and keeps its
tests and assertions; the first registered file whose ``launched`` fixture runs starts the ranks
once for the scenarios of the selected tests of every registered file, in turn
(shared_rank_launch.py: a scenario that raises fails its own test only), and each file reads its
own. Scenarios already shared a process with the earlier ones of their file; here they do with
other files' too, so each sets up what it relies on (``_launched_env``, its own seeds, Trainers
and Fabrics). The price of one launch: a rank that dies or hangs fails the tests of every
registered file, not of one.
"""

from __future__ import annotations

from fusedist.testing import run_distributed
from shared_rank_launch import _run_in_turn

WORLD = 2
# The files' budgets are each one's worst case and add up to hours; all their scenarios in one
# launch took 450-800 s on a machine loaded ~10x over its 2 cores: a hang stops at half an hour.
MOST_S = 1800
_REGISTERED: dict = {}  # module name -> (jobs(tmp_path_factory) -> {test: {scenario: (fn, args)}}, seconds)
_LAUNCHED: dict = {}  # session -> {module name: {scenario: per-rank (passed, result)}}, or what the launch raised


def register(jobs, seconds: float) -> None:
    """Run the scenarios ``jobs(tmp_path_factory)`` gives in the shared launch: {test function
    name: {scenario name: (fn, args)}}, called as ``fn(rank, world, *args)``; a test's name with
    its parameters keys one case's scenarios, a tuple of test names scenarios that run once when
    any of those tests is selected. ``seconds``: what they may take on a loaded machine, added to
    the launch's timeout (up to ``MOST_S``)."""
    _REGISTERED[jobs.__module__] = (jobs, seconds)


def shared_launch(request, tmp_path_factory) -> dict:
    """{scenario: per-rank (passed, result or traceback)} of ``request.module``'s selected tests,
    as ``launch_for_selected`` returns it (read it with ``results_of``)."""
    session = request.session
    if session not in _LAUNCHED:
        try:
            _LAUNCHED[session] = _launch(session, tmp_path_factory)
        except Exception as exc:  # noqa: BLE001 - every registered file's fixture reports it
            _LAUNCHED[session] = exc
            raise
    launched = _LAUNCHED[session]
    if isinstance(launched, Exception):
        raise RuntimeError("the launch shared by the files registered in test_lightning_launch.py failed "
                           "(its error is the first such file's)") from launched
    return launched.get(request.module.__name__, {})


def _launch(session, tmp_path_factory) -> dict:
    selected: dict = {}  # module name -> its selected tests, in the session's order
    for item in session.items:
        module = getattr(getattr(item, "module", None), "__name__", None)
        if module in _REGISTERED:
            # (a test function's name, and with its parameters: a file may list cases one by one)
            selected.setdefault(module, set()).update({getattr(item, "originalname", item.name), item.name})
    todo, seconds = [], 0.0
    for module, tests in selected.items():
        jobs, budget = _REGISTERED[module]
        todo += [((module, name), fn, args) for test, scenarios in jobs(tmp_path_factory).items()
                 if tests.intersection((test,) if isinstance(test, str) else test)
                 for name, (fn, args) in scenarios.items()]
        seconds += budget
    timeout = min(seconds, MOST_S)
    per_rank = run_distributed(_run_in_turn, WORLD, todo, timeout, timeout=timeout)
    out: dict = {module: {} for module in selected}
    for key, _, _ in todo:
        out[key[0]][key[1]] = [results[key] for results in per_rank]
    return out
