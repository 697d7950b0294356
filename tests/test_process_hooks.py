"""fusedist's process-wide hooks: installed once per key, listed, and removable."""

import atexit
import sys

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


def _drain_hook_after_uninstall(rank, world):
    from fusedist.comm import get_communicator

    get_communicator()
    assert "drain in-flight exchanges" in hooks.installed()
    hooks.uninstall()
    get_communicator()  # the same group's communicator, already cached: used again
    return hooks.installed()


def test_a_communicator_in_use_is_drained_at_exit_again_after_uninstall():
    from fusedist.testing import run_distributed

    for installed in run_distributed(_drain_hook_after_uninstall, 2, timeout=60):
        assert "drain in-flight exchanges" in installed, installed


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
