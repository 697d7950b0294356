"""A fusedist wrapper and the optimizers swapped in for it, retired when the framework is done
with them (Lightning's teardown at the end of a fit, Fabric's ``strategy.teardown()``), so the
module and the optimizer the user kept are as the framework's own DDP leaves them (Note [the
wrapper retires at teardown] in ``lightning.py``)."""

from __future__ import annotations

from ..ddp.torch_wrap import retire_with
from ._optimizer_swap import retire_successor, successors_over

__all__ = ["retire", "retire_when_torch_wraps"]


_TORN_DOWN = ("its strategy was torn down (strategy.teardown(), or the end of trainer.fit): it no longer "
              "synchronizes its module's gradients, so the ranks would diverge. Set the module up again "
              "(fabric.setup(model, optimizer)) to train it data-parallel, or train the unwrapped module")


def retire(ddp, optimizers, cause: str = _TORN_DOWN) -> None:
    """``ddp`` and ``optimizers`` (swapped-in optimizers, or wrappers of them with an
    ``_optimizer``) stop acting on the module's parameters; a kept optimizer takes its state
    back at its next use (Note [a kept optimizer after its sharded successor retires] in
    ``_optimizer_swap.py``). ``cause`` (what retired it, and what to do) completes the text a
    forward through it raises."""
    from fusedist import ownership

    inner = [getattr(o, "_optimizer", o) for o in optimizers]
    watch = ddp.__dict__.pop("_fusedist_torch_wrap_hook", None)
    if watch is not None:  # (Note [a torch DDP over a module set up before])
        watch.remove()
    # Note [a forward through a retired wrapper]
    ddp._retire(f"fusedist.DistributedDataParallel (rank {ddp.rank}): this wrapper was retired when {cause}")
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
    """Retire ``ddp``, and the optimizers swapped in over its module's parameters, when a torch
    ``DistributedDataParallel`` is built over its module (Note [a torch DDP over a module set up
    before]). Undone when the strategy retires it itself."""
    ddp._fusedist_torch_wrap_hook = retire_with(ddp, _retire_for_torch)


def _retire_for_torch(ddp, module) -> None:
    cause = (f"torch's DistributedDataParallel wrapped its module (of type {type(module).__name__}; a Fabric "
             "with strategy=\"ddp\" set it up again, or the program wrapped it) and synchronizes its gradients "
             "now. Train through torch's wrapper, or set the module up again (fabric.setup(model, optimizer)) "
             "to train it with fusedist")
    retire(ddp, successors_over(ddp.module.parameters()), cause)  # (those of another module train on)


# Note [a torch DDP over a module set up before]
# Fabric never tears its strategy down: a program that runs a second experiment in the same process
# with Fabric(strategy="ddp") (or wraps the model in torch's DDP itself) over the module and optimizer
# a fusedist strategy set up, with no strategy.teardown() in between, was refused at its first step
# ("a backward pass that was not synchronized"): the fusedist wrapper still owned the parameters and
# saw a backward that its own forward had not started, and the kept optimizer forwarded to the
# swapped-in one. (Unsharded, whether it was refused hung on whether the garbage collector had taken
# the unreferenced wrapper yet; a stage-2 optimizer keeps its wrapper alive, and was refused always.)
# Fabric's DDP in both places just trains on. The construction of a torch DistributedDataParallel
# over the module (on every rank alike: Note [torch's DDP over a fusedist wrapper] in
# fusedist/ddp/torch_wrap.py) now retires the fusedist wrapper and its swapped-in optimizers as
# strategy.teardown() does: the kept optimizer takes its state back at its next step (a collective every rank reaches)
# and trains on as torch's. A forward through model.module of a live fusedist wrapper is no such
# forward and is still refused at the step.
