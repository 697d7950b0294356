"""A fusedist wrapper and the optimizers swapped in for it, retired when the framework is done
with them (Lightning's teardown at the end of a fit, Fabric's ``strategy.teardown()``), so the
module and the optimizer the user kept are as the framework's own DDP leaves them (Note [the
wrapper retires at teardown] in ``lightning.py``)."""

from __future__ import annotations

import weakref

from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ._optimizer_swap import retire_successor, successors_over

__all__ = ["retire", "retire_when_torch_wraps"]


def retire(ddp, optimizers) -> None:
    """``ddp`` and ``optimizers`` (swapped-in optimizers, or wrappers of them with an
    ``_optimizer``) stop acting on the module's parameters; a kept optimizer takes its state
    back at its next use (Note [a kept optimizer after its sharded successor retires] in
    ``_optimizer_swap.py``)."""
    from fusedist import ownership

    inner = [getattr(o, "_optimizer", o) for o in optimizers]
    watch = ddp.__dict__.pop("_fusedist_torch_wrap_hook", None)
    if watch is not None:  # (Note [a torch DDP over a module set up before])
        watch.remove()
    ddp._retire(  # Note [a forward through a retired wrapper]
        f"fusedist.DistributedDataParallel (rank {ddp.rank}): this wrapper was retired when its strategy was "
        "torn down (strategy.teardown(), or the end of trainer.fit): it no longer synchronizes its module's "
        "gradients, so the ranks would diverge. Set the module up again (fabric.setup(model, optimizer)) to "
        "train it data-parallel, or train the unwrapped module")
    ownership.release(ddp.module.parameters(), [ddp, ddp.watch, *inner])
    for optimizer in inner:
        retire_successor(optimizer)


# Note [a forward through a retired wrapper]
# Fabric hands the program the wrapped module, which it may keep using after strategy.teardown().
# With its hooks removed, a forward and backward through the retired wrapper trained each rank on
# its own gradients without a word (the ranks' weights drifted apart at the first step); Fabric's
# DDP wrapper would still synchronize, but only for as long as nothing else owns the parameters.
# A forward through it now raises, as one through a wrapper superseded by a newer one does (Note
# [a module wrapped again] in fusedist/ddp/wrapper.py), naming what to do.


def retire_when_torch_wraps(ddp) -> None:
    """Retire ``ddp``, and the optimizers swapped in over its module's parameters, at the first
    forward of its module through a torch ``DistributedDataParallel`` (Note [a torch DDP over a
    module set up before]). The hook holds ``ddp`` weakly, not the strategy (which the program may
    have dropped), and comes off with the retirement; the hook of an earlier wrapper of the module
    comes off here."""
    module = ddp.module
    earlier = _WATCHES.pop(module, None)
    if earlier is not None:
        earlier.remove()
    watch = _TorchWrapWatch(ddp)
    watch.handle = module.register_forward_pre_hook(watch)
    _WATCHES[module] = ddp._fusedist_torch_wrap_hook = watch  # (off when the strategy retires it itself)


class _TorchWrapWatch:
    """The forward pre-hook of :func:`retire_when_torch_wraps`. A copy of the module (deepcopy,
    pickle) gets one that watches nothing: the copy has no fusedist wrapper."""

    def __init__(self, ddp=None) -> None:
        self.ddp, self.handle = None if ddp is None else weakref.ref(ddp), None

    def __reduce__(self):
        return _TorchWrapWatch, ()

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.handle = self.ddp = None

    def __call__(self, module, args) -> None:
        active = TorchDDP._active_ddp_module  # (torch sets it around its wrapper's module forward)
        if self.ddp is None or active is None or getattr(active, "module", None) is not module:
            return
        wrapper = self.ddp()
        self.remove()
        if _WATCHES.get(module) is self:
            del _WATCHES[module]
        if wrapper is not None and wrapper.module is module and wrapper._superseded_by is None:
            retire(wrapper, successors_over(module.parameters()))  # (those of another module train on)


_WATCHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # module -> its watch


# Note [a torch DDP over a module set up before]
# Fabric never tears its strategy down: a program that runs a second experiment in the same process
# with Fabric(strategy="ddp") (or wraps the model in torch's DDP itself) over the module and optimizer
# a fusedist strategy set up, with no strategy.teardown() in between, was refused at its first step
# ("a backward pass that was not synchronized"): the fusedist wrapper still owned the parameters and
# saw a backward that its own forward had not started, and the kept optimizer forwarded to the
# swapped-in one. (Unsharded, whether it was refused hung on whether the garbage collector had taken
# the unreferenced wrapper yet; a stage-2 optimizer keeps its wrapper alive, and was refused always.)
# Fabric's DDP in both places just trains on. The first forward of the module through
# a torch DistributedDataParallel (torch marks its wrapper as active around that forward, on every
# rank alike) now retires the fusedist wrapper and its swapped-in optimizers as strategy.teardown()
# does: the kept optimizer takes its state back at its next step (a collective every rank reaches)
# and trains on as torch's. A forward through model.module of a live fusedist wrapper is no such
# forward and is still refused at the step.
