"""A failure entry a rank published for its data-parallel peers (Note [a failure outside the group's collectives]
in fusedist/reliability/failed_elsewhere.py) goes at the rank's next launch in that group, and only that entry
(Note [a failure entry withdrawn at the next launch]). One process, a store of its own: no ranks to start."""

from __future__ import annotations

import types
import weakref

import torch.distributed as dist

from fusedist.reliability import failed_elsewhere, stall_report
from fusedist.reliability import monitor as monitor_module


class _Monitor(monitor_module.CollectiveMonitor):
    """A group's monitor with what publishing reads, without a communicator, its launch hook counting the
    launches (the monitor's own next-launch actions run before it)."""

    def __init__(self, store, rank: int):  # (the monitor's own needs a communicator)
        self.store, self.reports, self.group_name, self.generation = store, [], "dp", 0
        self.comm = types.SimpleNamespace(rank=rank, world_size=2, last_seq=4)
        self.history, self.launched = [], []

    def context(self) -> dict:
        return {}

    def on_launch(self, comm, handle) -> None:
        self.launched.append(handle)


def _entry(monitor):
    return stall_report.read_entries(monitor.store, monitor.group_name, monitor.generation, [monitor.comm.rank])[
        monitor.comm.rank]


def _launch(monitor, handle) -> None:
    """As the communicator tells its observer of a launch."""
    monitor.on_launch(monitor.comm, handle)


def test_the_next_launch_withdraws_the_failure_entry_and_nothing_written_since(monkeypatch):
    """The entry said the rank waits in no collective of the group from #5 on and was kept for good, so a peer's
    later wait past the probe's delay was told the old failure. The rank's next launch now withdraws it (and the
    monitor still records the launch); an entry written in its place since (a check's) stays; an entry withdrawn
    already (told at a pipeline's step end) leaves the next launch alone."""
    store = dist.HashStore()
    mine = _Monitor(store, 1)
    monkeypatch.setattr(monitor_module, "_monitors", weakref.WeakSet([mine]))

    written = failed_elsewhere.publish("stage 1 failed at micro-batch 0's loss")
    assert written == [mine] and _entry(mine)["failed_elsewhere"] == "stage 1 failed at micro-batch 0's loss"
    assert _entry(mine)["waiting_on"]["seq"] == 5
    _launch(mine, "#5")
    assert _entry(mine) is None and mine.launched == ["#5"]
    _launch(mine, "#6")
    assert mine.launched == ["#5", "#6"] and "on_launch" not in vars(mine)  # (the monitor's own hook again)

    failed_elsewhere.publish("stage 1 failed again")
    checking = {"kind": "checking", "error": "", "context": {}, "recent": []}
    stall_report.publish(store, mine.group_name, mine.generation, 1, checking)  # (replaces it)
    _launch(mine, "#7")
    assert _entry(mine)["kind"] == "checking" and mine.launched[-1] == "#7"

    failed_elsewhere.withdraw(failed_elsewhere.publish("stage 1 failed, told"))
    assert "on_launch" not in vars(mine)
    stall_report.publish(store, mine.group_name, mine.generation, 1, checking)
    _launch(mine, "#8")
    assert _entry(mine)["kind"] == "checking" and mine.launched[-1] == "#8"
