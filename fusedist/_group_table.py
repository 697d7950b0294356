"""torch.distributed's table of process groups as fusedist reads it: whether a group is alive, and what runs when
torch forgets groups.

Here, not in fusedist.comm, because fusedist/distributed.py needs both at its own import, before fusedist.comm
(which imports it) can be imported.

Note [one wrapper of torch's group-unregister functions]
    ``destroy_process_group()`` and ``_abort_process_group()`` call ``_unregister_process_group`` or
    ``_unregister_all_process_groups`` once the groups are gone from torch's table. Two parts of fusedist act
    there: the release of the destroyed groups' communicators (Note [when torch forgets a group] in
    comm/group_ends.py) and the drop of a destroyed group held by torch.distributed.nn's defaults (Note [binding
    torch.distributed.nn early] in distributed.py). Each wrapped both functions itself, so a destroy went through
    two layers of wrappers, each with its own way of telling whether it was still installed, and each asked
    "destroyed?" through its own copy of the question. One wrapper per function now
    (``_process_hooks.chain_module_function``, so ``uninstall()`` restores torch's own) runs the callbacks
    registered with :func:`after_groups_forgotten`, in the order they were first registered, each after torch's
    function returned or raised, none failing torch's destroy.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch.distributed as dist

from ._process_hooks import chain_module_function, installed

_UNREGISTERS = ("_unregister_process_group", "_unregister_all_process_groups")
#: The wrappers' keys among fusedist's process-wide hooks (Note [one wrapper of torch's group-unregister functions]).
KEYS = tuple(f"release a destroyed group: {name}" for name in _UNREGISTERS)

_lock = threading.Lock()
_callbacks: dict = {}  # key -> callback(), run when torch forgets groups


def is_alive(group) -> bool:
    """Whether torch.distributed still has ``group`` (a group object, not None), i.e. it was not destroyed."""
    world = getattr(dist.distributed_c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    if not dist.is_initialized():
        return False
    if pg_map is None:  # internals moved: the coarser public question only
        return True
    return group in pg_map


def after_groups_forgotten(key: str, callback: Callable[[], None]) -> None:
    """Run ``callback()`` each time torch forgets process groups (a destroy or an abort), once per ``key`` (a later
    one replaces it), and install the wrappers where ``uninstall()`` removed them."""
    with _lock:
        _callbacks[key] = callback
    from torch.distributed import distributed_c10d

    for wrapper_key, name in zip(KEYS, _UNREGISTERS):
        chain_module_function(wrapper_key, distributed_c10d, name, _wrapper(wrapper_key))


def watching(key: str) -> bool:
    """Whether ``key``'s callback runs at the next destroy: registered, and the wrappers in place."""
    with _lock:
        registered = key in _callbacks
    return registered and set(KEYS) <= set(installed())


def _wrapper(wrapper_key: str):
    def make(forget):
        def forgotten(*args, **kwargs):
            try:
                return forget(*args, **kwargs)
            finally:
                if wrapper_key in installed():  # (one left in place by a hook chained after it: inactive)
                    with _lock:
                        callbacks = list(_callbacks.values())
                    for callback in callbacks:
                        try:
                            callback()
                        except Exception:  # noqa: BLE001 - what a callback cleans up is fusedist's own
                            pass
        forgotten.__name__ = getattr(forget, "__name__", forgotten.__name__)
        forgotten.__doc__ = getattr(forget, "__doc__", None)
        forgotten.__wrapped__ = forget
        return forgotten
    return make
