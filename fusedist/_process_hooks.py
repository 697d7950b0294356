"""Every process-wide hook fusedist installs, in one place, each removable.

fusedist reaches outside its own objects in a few places, and each is here:

* torch's global optimizer step hooks (``register_optimizer_step_pre/post_hook``): the DDP
  step guard sees every ``optimizer.step()`` of any optimizer holding a DDP model's
  parameters (fusedist/reliability/optimizer_guard.py), and the ``fully_shard`` post-step
  hook that drops gathered copies of units the step changed (fusedist/fsdp/stale.py);
* torch's global module parameter-registration hook
  (``register_module_parameter_registration_hook``): a Parameter assigned into a module that
  a DDP wrapper follows is noted, so the wrapper's next forward raises instead of training the
  new Parameter unsynchronized (Note [parameters replaced after wrapping] in
  fusedist/ddp/trainable.py), and its module registration hook
  (``register_module_module_registration_hook``) for submodules added there the same way, and
  ``fully_shard``'s count of submodule registrations, the cheap part of its module tree's
  fingerprint (Note [the tree's fingerprint] in fusedist/fsdp/tree_names.py), and to hear of
  torch's DistributedDataParallel built over a fusedist wrapper or its module
  (fusedist/ddp/torch_wrap.py);
* a chained ``sys.excepthook``: an uncaught exception is published to the other ranks'
  stall reports before the process dies (fusedist/reliability/monitor.py), and one that ends
  a process whose communicator gave up does so right after the exit handlers, not at the
  deadline of the collectives left pending (fusedist/comm/given_up_exit.py);
* a chained ``sys.exit``, installed only once a communicator gave up: the status a program that
  caught the error asks for is noted, so the process ends with it right after the exit handlers
  (fusedist/comm/given_up_exit.py); and while a checkpoint save is in flight, so that a save lost
  at exit keeps the program's own non-zero status (fusedist/checkpoint/_exit_status.py);
* torch.distributed's internal functions that forget process groups (``_unregister_process_group``,
  ``_unregister_all_process_groups``, which every destroy and abort calls once the group is gone) and
  ``_abort_process_group``: a destroyed group's communicator is released at once
  (fusedist/comm/group_ends.py), an aborted group's gloo connections close and a whole-process abort is
  left in the store for the peers (one wrapper: Note [one wrapper of torch's abort] in
  fusedist/comm/aborted_groups.py), and an aborted group's communicators remember the abort (Note [a
  communicator remembers its group's abort] in fusedist/comm/group_ends.py); where the program imported
  torch.distributed.nn after init_process_group, the same unregister functions also drop a destroyed group
  from its functions' ``group`` defaults (Note [binding torch.distributed.nn early] in fusedist/distributed.py);
* torch.distributed's ``destroy_process_group`` (both names), once a checkpoint writer exists: a
  ``Checkpointer`` save still in flight is finished first (fusedist/checkpoint/_destroy_waits.py);
* torch.distributed's ``barrier``, once a gloo exchange exists: a barrier that fails on a connection a peer
  closed names that peer and why (fusedist/comm/barrier_closed.py);
* threading's exit callbacks (the start of the interpreter's shutdown): a checkpoint still being
  written is finished, and one that failed ends the process with status 1 (Note [a save that fails
  at exit] in fusedist/checkpoint/_writer.py);
* ``atexit`` callbacks, run in reverse order of installation: a checkpoint still being
  written is finished (one begun during the shutdown), in-flight exchanges are drained before the interpreter finalizes
  (fusedist/comm), a rank leaving early says so to the others, a timeline is flushed.

Each is installed lazily by the code that needs it, at most once per key, and
:func:`uninstall` removes all of them (for embedding applications and tests that must leave
the process as they found it). :func:`installed` lists what is in place.
"""

from __future__ import annotations

import atexit
import sys
import threading
from typing import Callable

__all__ = ["at_exit", "chain_excepthook", "chain_sys_exit", "chain_module_function", "install_module_registration_hook",
           "install_optimizer_step_hooks", "install_parameter_registration_hook", "installed", "uninstall"]

_lock = threading.Lock()
# key -> a function that removes the hook
_removers: dict[str, Callable[[], None]] = {}


def install_optimizer_step_hooks(key: str, pre: Callable, post: Callable) -> None:
    """torch's global optimizer step pre- and post-hooks, once per ``key``."""
    with _lock:
        if key in _removers:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        handles = (register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post))
        _removers[key] = lambda: [h.remove() for h in handles]


def install_parameter_registration_hook(key: str, hook: Callable) -> None:
    """torch's global ``hook(module, name, param)`` on every Parameter registration, once per ``key``
    (run as plain Python outside traces: Note [registration hooks called outside a trace])."""
    with _lock:
        if key in _removers:
            return
        from torch.nn.modules.module import register_module_parameter_registration_hook

        _removers[key] = register_module_parameter_registration_hook(_outside_traces(hook)).remove


def install_module_registration_hook(key: str, hook: Callable) -> None:
    """torch's global ``hook(module, name, submodule)`` on every submodule registration, once per ``key``
    (run as plain Python outside traces: Note [registration hooks called outside a trace])."""
    with _lock:
        if key in _removers:
            return
        from torch.nn.modules.module import register_module_module_registration_hook

        _removers[key] = register_module_module_registration_hook(_outside_traces(hook)).remove


# Note [registration hooks called outside a trace]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Called while dynamo's frame hook is active but outside any trace, dynamo compiled each global
# registration hook as a frame of its own. Compiled autograd does exactly that inside a
# ``torch.compile``d training step under ``torch._dynamo.config.compiled_autograd``: it compiles the
# captured backward with ``torch.compile``, whose ``OptimizedModule`` registers its child
# ``_orig_mod`` while half built, and dynamo, building the hook's arguments, failed on it
# ("InternalTorchDynamoError: KeyError: _orig_mod"). Once any fusedist wrapper had installed the
# hooks, every such backward in the process failed so, torch's DDP and FSDP2 included. So such a
# call runs the hook (and what it calls) as plain Python, as without dynamo; where dynamo traces a
# registration (inside a compiled function) it still inlines the hook (Note [registrations while
# dynamo traces] in fusedist/ddp/trainable.py).
def _outside_traces(hook: Callable) -> Callable:
    """``hook`` (returned), run without dynamo when called outside a trace (Note [registration hooks
    called outside a trace]); any torch without dynamo's frame strategies leaves it as it is."""
    try:  # (private API)
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

        set_code_exec_strategy(hook.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    except Exception:  # noqa: BLE001
        pass
    return hook


def chain_excepthook(key: str, before: Callable[[type, BaseException, object], None]) -> None:
    """Run ``before(exc_type, exc, tb)`` for an uncaught exception, then the hook that was in
    place (Python's default, or an application's). ``before`` must not raise."""
    with _lock:
        if key in _removers:
            return
        previous = sys.excepthook

        def hook(exc_type, exc, tb):
            before(exc_type, exc, tb)
            previous(exc_type, exc, tb)

        sys.excepthook = hook

        def remove():
            if sys.excepthook is hook:  # else someone chained after us: leave theirs in place
                sys.excepthook = previous

        _removers[key] = remove


def chain_sys_exit(key: str, before: Callable[[object], None]) -> None:
    """Run ``before(status)`` when ``sys.exit(status)`` is called, then the ``sys.exit`` that was in
    place (it raises SystemExit as always). ``before`` must not raise."""
    with _lock:
        if key in _removers:
            return
        previous = sys.exit

        def exit(status=None):  # (named as what it stands in for: tracebacks show sys.exit's frame)
            before(status)
            previous(status)

        exit.__doc__ = previous.__doc__
        sys.exit = exit

        def remove():
            if sys.exit is exit:  # else someone chained after us: leave theirs in place
                sys.exit = previous

        _removers[key] = remove


def chain_module_function(key: str, module, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``module.name`` by ``make(original)``, once per ``key`` (nothing where the module has no
    such function). Looked up by name when called, so it reaches callers that imported the module, not
    the function."""
    with _lock:
        if key in _removers:
            return
        previous = getattr(module, name, None)
        if previous is None:
            return
        replacement = make(previous)
        setattr(module, name, replacement)

        def remove():
            if getattr(module, name, None) is replacement:  # else someone chained after us: leave theirs
                setattr(module, name, previous)
        _removers[key] = remove


def at_exit(key: str, fn: Callable[[], None]) -> None:
    """``fn`` at interpreter exit, once per ``key``."""
    with _lock:
        if key in _removers:
            return
        atexit.register(fn)
        _removers[key] = lambda: atexit.unregister(fn)


def installed() -> list[str]:
    """The keys of the hooks in place, in installation order."""
    with _lock:
        return list(_removers)


def remove(key: str) -> None:
    """Remove the hook installed under ``key``, if any (a later install puts it back)."""
    with _lock:
        remover = _removers.pop(key, None)
    if remover is not None:
        remover()


def uninstall() -> None:
    """Remove every hook fusedist installed; later use installs them again as needed."""
    with _lock:
        removers = list(_removers.values())
        _removers.clear()
    for remove in reversed(removers):
        remove()
