"""fusedist's process-wide hooks: installed once per key, listed, and removable."""

import atexit
import sys

import pytest
import torch

from fusedist import _process_hooks as hooks


def test_each_kind_installs_once_and_uninstall_restores_the_process(monkeypatch):
    # A registry of its own: fusedist's real hooks (installed by earlier tests) stay in place.
    monkeypatch.setattr(hooks, "_removers", {})
    calls = []
    exit_funcs = []
    monkeypatch.setattr(atexit, "register", exit_funcs.append)
    monkeypatch.setattr(atexit, "unregister", exit_funcs.remove)
    before_hook = sys.excepthook
    try:
        hooks.install_optimizer_step_hooks("test step hooks", lambda *a: calls.append("pre"),
                                           lambda *a: calls.append("post"))
        hooks.install_optimizer_step_hooks("test step hooks", lambda *a: calls.append("again"),
                                           lambda *a: calls.append("again"))
        hooks.chain_excepthook("test excepthook", lambda t, e, tb: calls.append(t.__name__))
        def on_exit():
            calls.append("exit")

        hooks.at_exit("test exit", on_exit)
        assert hooks.installed() == ["test step hooks", "test excepthook", "test exit"]
        assert on_exit in exit_funcs
        p = torch.nn.Parameter(torch.ones(1))
        p.grad = torch.ones(1)
        torch.optim.SGD([p], lr=0.1).step()
        assert calls == ["pre", "post"]  # the second registration under the same key was ignored
        assert sys.excepthook is not before_hook
    finally:
        hooks.uninstall()
    assert hooks.installed() == [] and sys.excepthook is before_hook
    torch.optim.SGD([p], lr=0.1).step()
    assert calls == ["pre", "post"]
    assert on_exit not in exit_funcs  # the exit hook was unregistered


def test_fusedist_reinstalls_what_it_needs_after_uninstall(monkeypatch):
    from fusedist.reliability import optimizer_guard

    monkeypatch.setattr(hooks, "_removers", {})

    optimizer_guard.install()
    assert "DDP optimizer-step guard" in hooks.installed()
    hooks.uninstall()
    optimizer_guard.install()
    assert "DDP optimizer-step guard" in hooks.installed()


def _hooks_after_uninstall(rank, world):
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    import fusedist.comm
    from fusedist.comm import get_communicator, group_ends

    out = {}
    torch_abort, torch_barrier = distributed_c10d._abort_process_group, dist.barrier
    out["torch's own at start"] = torch_abort.__module__ == "torch.distributed.distributed_c10d"
    # the abort hook in place before this process's first exchange (then a subgroup's abort closes it as ever)
    group_ends.watch(fusedist.comm._groups_forgotten)
    get_communicator()
    assert "drain in-flight exchanges" in hooks.installed()
    first = dist.new_group([0, 1])
    first_closing = get_communicator(first)._closing
    store = distributed_c10d._get_default_store()
    _abort_and_read(store, rank, "subgroup", lambda: distributed_c10d._abort_process_group(first), first_closing, out)
    hooks.uninstall()
    out["restored"] = distributed_c10d._abort_process_group is torch_abort
    out["barrier restored"] = dist.barrier is torch_barrier and distributed_c10d.barrier is torch_barrier
    get_communicator()  # the same group's communicator, already cached: used again
    out["installed"] = hooks.installed()
    out["cached: abort and barrier hooked again"] = (distributed_c10d._abort_process_group is not torch_abort
                                                    and dist.barrier is not torch_barrier)
    # a new communicator installs the abort hook again: a whole-process abort closes and tells as before
    second = dist.new_group([0, 1])
    second_closing = get_communicator(second)._closing
    out["reinstalled"] = distributed_c10d._abort_process_group is not torch_abort
    _abort_and_read(store, rank, "whole", lambda: distributed_c10d._abort_process_group(), second_closing, out)
    if rank == 0:
        distributed_c10d._abort_process_group()
        store.set("hooks/whole/read", b"")
    else:
        store.wait(["hooks/whole/read"], datetime.timedelta(seconds=60))
    return out


def _abort_and_read(store, rank, name, abort, closing, out) -> None:
    """Rank 1 aborts; rank 0 then reads what rank 1 left for that group's peers and in the job's abort record."""
    import datetime

    from fusedist.comm import aborted_groups

    # both ranks have built the group and its communicator first (an abort while the peer's gloo still
    # connected the group's mesh failed that peer's new_group with "Connection closed by peer")
    store.set(f"hooks/{name}/ready/{rank}", b"")
    store.wait([f"hooks/{name}/ready/{peer}" for peer in (0, 1)], datetime.timedelta(seconds=60))
    if rank == 1:
        abort()
        store.set(f"hooks/{name}/aborted", b"")
        return
    store.wait([f"hooks/{name}/aborted"], datetime.timedelta(seconds=60))
    out[f"{name}: left for the group's peers"] = closing.left_by(1, 0.0)
    out[f"{name}: record"] = aborted_groups.aborted_peers(store, [1])


@pytest.fixture(scope="module")
def after_uninstall():
    from fusedist.testing import run_distributed

    return run_distributed(_hooks_after_uninstall, 2, timeout=60)


def test_a_communicator_in_use_is_drained_at_exit_again_after_uninstall(after_uninstall):
    for out in after_uninstall:
        assert "drain in-flight exchanges" in out["installed"], out
        assert "release a destroyed group: _unregister_process_group" in out["installed"], out
        assert out["cached: abort and barrier hooked again"], out


def test_uninstall_restores_torchs_abort_and_a_new_communicator_hooks_it_again(after_uninstall):
    """Note [one wrapper of torch's abort] (fusedist/comm/aborted_groups.py): before, the wrapper that closes an
    aborted group's connections stayed in place after uninstall()."""
    for out in after_uninstall:
        assert out["torch's own at start"] and out["restored"] and out["reinstalled"], out
        assert out["barrier restored"], out


@pytest.mark.parametrize("name", ["subgroup", "whole"])
def test_an_abort_closes_and_tells_as_before_whichever_hook_came_first(after_uninstall, name):
    """A subgroup's abort, its hook in place before the process's first exchange, and a whole-process abort after
    uninstall() and a new communicator: the peers read the abort (and, for the whole process, the job's record)."""
    out = after_uninstall[0]
    assert out[f"{name}: left for the group's peers"].startswith(
        "rank 1 aborted its process groups (torch.distributed's _abort_process_group)"), out
    expected = {1: "rank 1 aborted all its process groups (torch.distributed's _abort_process_group)"}
    assert out[f"{name}: record"] == (expected if name == "whole" else {}), out


def test_parameter_registration_hook_installs_once_and_is_removed(monkeypatch):
    monkeypatch.setattr(hooks, "_removers", {})
    seen = []
    try:
        hooks.install_parameter_registration_hook("test registration", lambda m, n, p: seen.append(n))
        hooks.install_parameter_registration_hook("test registration", lambda m, n, p: seen.append("again"))
        assert hooks.installed() == ["test registration"]
        layer = torch.nn.Linear(2, 2)
        layer.weight = torch.nn.Parameter(torch.zeros(2, 2))
        assert seen[-1] == "weight" and "again" not in seen
    finally:
        hooks.uninstall()
    count = len(seen)
    layer.bias = torch.nn.Parameter(torch.zeros(2))
    assert len(seen) == count and hooks.installed() == []
