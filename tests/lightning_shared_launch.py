"""One launch of ranks for several tests of a file: starting ranks that import torch and
Lightning costs more than most of the fits they run, so a module-scoped fixture runs the jobs
of the file's selected tests in one ``run_distributed`` call and each test reads its own.

A job is ``(module-level function, args)``; it is called as ``fn(rank, world, *args)``. A job
that raises gives its traceback as its result and the next one runs, so one failing test does
not fail the others (a job whose ranks stop at different collectives still ends within the
process group's timeout).
"""

from __future__ import annotations

import traceback

from fusedist.testing import run_distributed


def _jobs_worker(rank: int, world: int, jobs: list) -> dict:
    out = {}
    for name, fn, args in jobs:
        try:
            out[name] = ("ok", fn(rank, world, *args))
        except Exception:  # noqa: BLE001 - reported by the job's test
            out[name] = ("error", traceback.format_exc())
    return out


def launch_selected(request, jobs: dict, world: int, timeout: float) -> dict:
    """``jobs``: {test name (without parameters): {job name: (fn, args)}}. Runs the jobs of the
    tests of ``request.module`` that pytest collected, in ``jobs``' order; returns {job name:
    per-rank results}."""
    selected = {item.name.split("[")[0] for item in request.session.items if item.module is request.module}
    todo = [(name, fn, args) for test, named in jobs.items() if test in selected
            for name, (fn, args) in named.items()]
    per_rank = run_distributed(_jobs_worker, world, todo, timeout=timeout)
    return {name: [results[name] for results in per_rank] for name, _, _ in todo}


def outcome(launched: dict, job: str) -> list:
    """The per-rank values of ``job``; a rank that raised fails the calling test with its traceback."""
    values = []
    for rank, (status, value) in enumerate(launched[job]):
        assert status == "ok", f"{job}, rank {rank} raised:\n{value}"
        values.append(value)
    return values
