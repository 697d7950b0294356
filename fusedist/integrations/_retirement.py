"""A fusedist wrapper and the optimizers swapped in for it, retired when the framework is done
with them (Lightning's teardown at the end of a fit, Fabric's ``strategy.teardown()``), so the
module and the optimizer the user kept are as the framework's own DDP leaves them (Note [the
wrapper retires at teardown] in ``lightning.py``)."""

from __future__ import annotations

from ._optimizer_swap import retire_successor

__all__ = ["retire"]


def retire(ddp, optimizers) -> None:
    """``ddp`` and ``optimizers`` (swapped-in optimizers, or wrappers of them with an
    ``_optimizer``) stop acting on the module's parameters; a kept optimizer takes its state
    back at its next use (Note [a kept optimizer after its sharded successor retires] in
    ``_optimizer_swap.py``)."""
    from fusedist import ownership

    inner = [getattr(o, "_optimizer", o) for o in optimizers]
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
