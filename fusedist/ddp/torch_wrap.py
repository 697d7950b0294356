"""A fusedist wrapper's module wrapped again by torch's ``DistributedDataParallel``.

Note [torch's DDP over a fusedist wrapper]
    A program (a second experiment in one process, a library that wraps what it is given) wraps a
    module in ``fusedist.DistributedDataParallel`` and later wraps it again in torch's DDP:

    * over the module itself (``TorchDDP(model)``, ``model`` wrapped by fusedist before): the
      fusedist wrapper still owned the parameters and saw a backward its own forward had not
      prepared; the next ``optimizer.step()`` was refused as unsynchronized;
    * over the fusedist wrapper (``TorchDDP(fusedist.DistributedDataParallel(model))``, or a module
      that holds one): both engines reduced the same gradients in the same backward, torch's
      reading ``p.grad`` while fusedist's wrote its average into it, and the step applied
      neither's average (0.04 off torch's DDP alone in three SGD steps), without a word.

    torch's DDP takes the module as its own: so now does fusedist. torch's ``__init__`` assigns the
    module to its wrapper (``self.module = module``), which runs torch's global submodule
    registration hook, where fusedist already listens (Note [parameters replaced after wrapping]
    in trainable.py): nothing is added to any forward, only to that one registration. There, over
    the same ranks:

    * a fusedist wrapper inside the module becomes a plain pass-through to its own module, as one
      nested inside a newer fusedist wrapper does (Note [a module wrapped again] in wrapper.py):
      its hooks come off and torch's wrapper reduces every gradient once;
    * a fusedist wrapper whose parameters the module holds, all of them, is retired: its hooks come
      off, its parameters are torch's wrapper's to synchronize, and a forward through it raises,
      naming torch's wrapper.

    Either way training through torch's wrapper gives torch's DDP alone, bit for bit. Left as they
    were (the step refused, naming torch's wrapper): torch's DDP over other ranks (the two averages
    are over different groups), over only some of the wrapper's parameters, or over a wrapper that
    a ZeroRedundancyOptimizer follows (its shards are the fusedist buckets). Retiring at
    construction rather than at torch's first forward: every rank constructs torch's wrapper, so
    every rank retires alike, before any gradient; a construction that fails after the assignment
    (parameter shapes that differ across ranks) leaves the fusedist wrapper retired, and the
    program is ending anyway.

Note [torch's DDP inside a fusedist wrapper]
    The other way round, ``fusedist.DistributedDataParallel(TorchDDP(m))`` (or over a module that
    holds one) also had both engines reduce the same gradients, wrongly (the same 0.04 off), where
    torch's DDP over its own DDP trains (each averages once more, which changes nothing). The
    fusedist wrapper, built over a torch wrapper over the same ranks, turns that one's gradient
    synchronization off (``require_backward_grad_sync = False``, as its ``no_sync()`` does for the
    length of a block): its forward prepares no backward, so its reducer leaves the gradients to
    the fusedist wrapper, which reduces each once. A backward through the torch wrapper alone is
    then unsynchronized and its step refused (Note [a backward no DDP forward prepared] in
    prepared.py). Refused at construction, by the torch wrapper's path, where that would change
    the numbers: a torch wrapper whose group was destroyed (named as such: a destroyed group spans no ranks,
    and read as "other ranks" it gave the wrong reason), one over other ranks (its average is another one), with a
    communication hook (which the fusedist wrapper would not apply), or with ``static_graph``
    (whose first backward torch's reducer schedules itself).
"""

from __future__ import annotations

import weakref

from torch.nn.parallel import DistributedDataParallel as TorchDDP

from .. import ownership
from ..comm.released_group import is_alive
from .._process_hooks import install_module_registration_hook
from .succession import followers_of, same_ranks, stage2_consumer

__all__ = ["listen", "quiet_torch_wrappers_inside", "retire_with"]

# wrapper -> how it retires when torch's DDP takes its module (a framework's own retirement)
_retirements: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def listen() -> None:
    """Have torch's DDP constructions over a fusedist wrapper's module noted (once per process)."""
    install_module_registration_hook("ddp wrapped again by torch's DistributedDataParallel",
                                     _registered)


class _Retirement:
    """The handle :func:`retire_with` returns."""

    def __init__(self, ddp) -> None:
        self._ddp = weakref.ref(ddp)

    def remove(self) -> None:
        ddp = self._ddp()
        if ddp is not None:
            _retirements.pop(ddp, None)


def retire_with(ddp, retire) -> _Retirement:
    """Retire ``ddp`` by ``retire(ddp, module)`` instead, when torch's DDP takes ``module`` (its module
    or one that holds it; a framework that swapped optimizers in retires them too); the handle's
    ``remove()`` undoes it."""
    listen()
    _retirements[ddp] = retire
    return _Retirement(ddp)


def _registered(parent, name: str, module):
    if name != "module" or not isinstance(parent, TorchDDP) or module is None:
        return None
    import torch

    if torch.compiler.is_compiling():
        return None
    _torch_takes(parent, module)
    return None  # the module is registered unchanged


def _torch_takes(torch_ddp, module) -> None:
    """torch's DDP ``torch_ddp`` is being built over ``module`` (Note [torch's DDP over a fusedist wrapper])."""
    from .replicate import ReplicatedModule
    from .wrapper import DistributedDataParallel

    group = getattr(torch_ddp, "process_group", None)
    inside = {id(m): m for m in module.modules()}
    held = {id(p) for p in module.parameters()}
    owners = {id(o): o for o in map(ownership.data_parallel_owner, module.parameters()) if o is not None}
    owners.update((id(m), m) for m in inside.values() if isinstance(m, DistributedDataParallel))
    for ddp in owners.values():
        if (not isinstance(ddp, DistributedDataParallel) or ddp._superseded_by is not None or ddp._nested
                or isinstance(ddp.module, ReplicatedModule) or group is None
                or not same_ranks(ddp.process_group, group)):
            continue
        if id(ddp) not in inside and not all(id(p) in held for p in ddp.reducer.params):
            continue  # (torch's wrapper takes some of its parameters: the step refuses, naming it)
        custom = _retirements.pop(ddp, None)
        if custom is None and (stage2_consumer(ddp) is not None or followers_of(ddp.reducer)):
            continue  # (a sharded optimizer follows its buckets: the step refuses, naming torch's wrapper)
        if id(ddp) in inside:
            _pass_through(ddp)
        if custom is not None:
            custom(ddp, module)  # (a framework's: its swapped-in optimizers too)
        elif id(ddp) not in inside:
            _retire(ddp, module)


def _release(ddp) -> None:
    """The parameters are torch's wrapper's: the step guard treats them as plain parameters."""
    ownership.release(ddp.module.parameters(), [ddp, ddp.watch])


def _pass_through(ddp) -> None:
    ddp.reducer.remove_hooks()
    ddp._nested = True
    _release(ddp)


def _retire(ddp, module) -> None:
    ddp._retire(
        f"fusedist.DistributedDataParallel (rank {ddp.rank}): this wrapper no longer reduces gradients: torch's "
        f"DistributedDataParallel wrapped its module (of type {type(module).__name__}) and synchronizes its "
        "gradients now. Train through torch's wrapper, or wrap the module in fusedist.DistributedDataParallel "
        "again to train it with fusedist")
    _release(ddp)


def quiet_torch_wrappers_inside(module, process_group, rank: int) -> None:
    """Turn off the gradient synchronization of the torch DDP wrappers inside ``module``, which a
    fusedist wrapper over ``process_group`` is built over (Note [torch's DDP inside a fusedist
    wrapper]); raise where that would change the numbers."""
    for path, inner in module.named_modules():
        if not isinstance(inner, TorchDDP):
            continue
        why = None
        if inner.process_group is not None and not is_alive(inner.process_group):
            raise RuntimeError(
                f"fusedist.DistributedDataParallel (rank {rank}): the module holds torch's DistributedDataParallel "
                f"at '{path or '<root>'}' whose process group was destroyed (torch.distributed."
                "destroy_process_group): its reducer would synchronize gradients over a group that no longer exists. "
                "Wrap its .module (the module inside torch's wrapper) instead")
        if not same_ranks(inner.process_group, process_group):
            why = "over other ranks than this wrapper's (the average of the two would be over both groups)"
        elif getattr(inner, "_comm_hooks", None) or getattr(inner, "_use_python_reducer", False):
            why = "with a communication hook registered (or the python reducer), which this wrapper would not apply"
        elif inner.static_graph:
            why = "with static_graph=True, whose reduction torch's reducer schedules itself"
        if why is not None:
            raise RuntimeError(
                f"fusedist.DistributedDataParallel (rank {rank}): the module holds torch's DistributedDataParallel "
                f"at '{path or '<root>'}' {why}: both wrappers would reduce the same gradients in one backward. "
                "Wrap the module inside torch's wrapper (its .module) instead, or train through torch's wrapper alone")
        inner.require_backward_grad_sync = False
