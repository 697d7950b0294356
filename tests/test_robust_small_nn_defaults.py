"""torch.distributed.nn.functional's ``group`` defaults, when the program's own import captured the live default
group, are dropped at its destroy (Note [binding torch.distributed.nn early] in fusedist/distributed.py) -- also
after ``fusedist._process_hooks.uninstall()``, once a communicator was looked up again, as fusedist's other
hooks are put back. The reference: an import of torch.distributed.nn before init_process_group, whose defaults
hold None (the default group of each call). In this process: one gloo rank of its own."""

from __future__ import annotations

import gc
import os
import tempfile
import types
import weakref

import torch.distributed as dist
import torch.distributed.nn.functional as F

import fusedist.distributed as fd
from fusedist import _process_hooks
from fusedist.comm import get_communicator, given_up_exit


def _own_function(fn) -> bool:
    return isinstance(fn, types.FunctionType) and fn.__module__ == F.__name__


def _group_defaults() -> dict:
    """Each function's defaults that are process groups, by function name."""
    return {name: [v for v in (fn.__defaults__ or ()) if isinstance(v, dist.ProcessGroup)]
            for name, fn in vars(F).items() if _own_function(fn)}


def _capture(group) -> dict:
    """What an import of torch.distributed.nn after init_process_group leaves: ``group`` for each ``group``
    default; returns the defaults to put back."""
    before = {}
    for fn in vars(F).values():
        if _own_function(fn) and fn.__defaults__:
            names = fn.__code__.co_varnames[fn.__code__.co_argcount - len(fn.__defaults__):fn.__code__.co_argcount]
            if "group" in names:
                before[fn] = fn.__defaults__
                fn.__defaults__ = tuple(group if n == "group" else v for n, v in zip(names, fn.__defaults__))
    return before


def test_defaults_captured_by_the_programs_import_are_dropped_at_the_destroy_after_uninstall(monkeypatch):
    monkeypatch.setattr(given_up_exit, "watch_exit_requests", lambda: None)  # (no sys.exit chained here)
    path = os.path.join(tempfile.mkdtemp(prefix="fusedist-nn-defaults-"), "rdzv")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    saved = _capture(dist.group.WORLD)
    try:
        assert saved and all(held for held in _group_defaults().values() if held), _group_defaults()
        fd._bind_nn_defaults()  # (fusedist imported after that import: it follows those defaults)
        _process_hooks.uninstall()
        get_communicator()  # (the lookup that puts every hook back)
        world = weakref.ref(dist.group.WORLD)
        gc.disable()  # (freed by the destroy itself, as torch frees a group nothing else holds)
        try:
            dist.destroy_process_group()
            freed = world() is None
        finally:
            gc.enable()
        held = {name: groups for name, groups in _group_defaults().items() if groups}
        assert held == {}, f"still held after the destroy: {held}"
        assert freed, "the destroyed default group is still alive"
    finally:
        for fn, defaults in saved.items():
            fn.__defaults__ = defaults
        if dist.is_initialized():
            dist.destroy_process_group()
        _process_hooks.uninstall()  # (the process's hooks as a lookup would install them anew)
