"""How a stage module's next backward is made to reduce its gradients or only accumulate them: the
switches of fusedist's data parallelism (Note [pipeline stages of fully_shard modules] and Note [pipeline
stages of DDP modules] in __init__.py), set per backward, not per forward."""

from __future__ import annotations

import contextlib
from typing import Optional



def _torch_data_parallel(module) -> bool:
    """A module of torch's own data parallelism, whose passes torch's stage runs (it switches
    their gradient sync itself)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    return isinstance(module, (FSDPModule, TorchDDP))


@contextlib.contextmanager
def _micro_batch(module, last: bool):
    """Accumulate without communication, parameters kept gathered, unless it is the stage's
    last backward of the step (and the user has not switched gradient sync off); the module's
    own settings come back afterwards."""
    states = module._fs_states()
    saved = [(owner, name, getattr(owner, name)) for st in states
             for owner, names in ((st, ("requires_all_reduce",)), (st.grads, ("reduce_grads", "all_reduce_grads")),
                                  (st.unit, ("reshard_after_backward",)))
             if owner is not None for name in names]
    # the user's own set_requires_gradient_sync(False) (accumulating across steps) still holds
    module.set_requires_gradient_sync(last and _user_sync(module))
    module.set_reshard_after_backward(last)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _sync_switch(module):
    """How to make the next backward of a stage module synchronize its gradients or only
    accumulate them: a context manager taking ``last``, or None for a module fusedist does not
    reduce (Note [pipeline stages of fully_shard modules])."""
    from ..fsdp import FullyShardedModule

    if isinstance(module, FullyShardedModule):
        return lambda last: _micro_batch(module, last)
    engine = ddp_engine_of(module)
    if engine is None:
        return None
    return lambda last: _ddp_backward(engine, last and _user_sync(module))  # (the user's no_sync() still holds)


def ddp_engine_of(module):
    """The fusedist DDP engine of a stage module: the module itself (a DistributedDataParallel), a
    ``fusedist.replicate`` module's (built at its first forward), or None."""
    from ..ddp import DistributedDataParallel
    from ..ddp.replicate import wrapper_of

    return module if isinstance(module, DistributedDataParallel) else wrapper_of(module)


def _user_sync(module) -> Optional[bool]:
    """The user's own switch of a stage module fusedist reduces: False under
    ``set_requires_gradient_sync(False)`` or DDP's ``no_sync`` (accumulating across steps),
    None for a module fusedist does not reduce."""
    from ..ddp import DistributedDataParallel
    from ..ddp.replicate import _STATE, wrapper_of
    from ..fsdp import FullyShardedModule

    if isinstance(module, FullyShardedModule):
        return all(st.grads.reduce_grads for st in module._fs_states() if st.grads is not None)
    if isinstance(module, DistributedDataParallel):
        return module.require_backward_grad_sync
    if wrapper_of(module) is None:
        return None
    return bool(module.__dict__[_STATE].requires_gradient_sync)


@contextlib.contextmanager
def _ddp_backward(engine, last: bool):
    """The DDP engine's next backward synchronizes only if it is the step's last: its switch is
    read when a backward begins, not at the forward, which a pipeline runs micro-batches ahead."""
    engine.reducer.next_backward_sync = last
    engine.reducer.prepared = True  # each micro-batch's forward prepared it, runs ago
    try:
        yield
    finally:
        engine.reducer.next_backward_sync = True
