"""FSDP2's functions over modules already sharded: ``register_fsdp_forward_method`` and
``share_comm_ctx``, with torch's signatures. A module torch's own ``fully_shard`` sharded is
handed to torch's function, so code that mixes the imports keeps working."""

from __future__ import annotations

import functools

import torch
from torch import nn

from .api import FullyShardedModule, fully_shard
from .state import state_of

__all__ = ["register_fsdp_forward_method", "share_comm_ctx"]


def _no_composable_state(module: nn.Module):
    """``fully_shard.state(module)``, torch's composable-API accessor of its ``FSDPState``:
    refused, naming what to use instead (it used to be an AttributeError on the function)."""
    raise NotImplementedError(
        f"fusedist.fully_shard.state({type(module).__name__}): fusedist keeps no torch composable-API state "
        "(FSDPState, its param groups and comm context) on a sharded module: its units are fusedist's own. "
        "Use the FSDPModule methods (set_is_last_backward, unshard, reshard, ...) on the module, or "
        "isinstance(module, fusedist.FSDPModule) to ask whether it was sharded.")


fully_shard.state = _no_composable_state


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` gather before and reshard after, as ``forward`` does,
    for methods that use the weights without calling ``forward`` (``generate``); torch's
    FSDP2 function. The method may call the module itself: the unit stays gathered until it
    returns (Note [a unit called inside its own call]). A no-op for a module fusedist did not
    shard, so the same code runs unsharded; a module torch's ``fully_shard`` sharded is handed
    to torch's function."""
    if not isinstance(module, FullyShardedModule):
        _register_torch_forward_method(module, method_name)
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def as_forward(self, *args, **kwargs):
        st = state_of(self)
        args, kwargs = st._pre_forward(self, args, kwargs)
        return st._post_forward(self, args, method(*args, **kwargs))

    setattr(module, method_name, as_forward.__get__(module, type(module)))


def share_comm_ctx(modules: list) -> None:
    """torch FSDP2's ``share_comm_ctx``: let several roots (pipeline-parallel model chunks)
    share their communication context, validated as torch does (an empty list is a no-op; a
    module that is not sharded raises ``ValueError``). What it means for fusedist: Note
    [one communicator per mesh]. Modules torch's ``fully_shard`` sharded go to torch's
    function; mixing the two libraries' modules is refused, naming the first of the other kind."""
    if len(modules) == 0:
        return
    for module in modules:
        if not isinstance(module, (FullyShardedModule, _torch_fsdp_module_class())):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
    ours = [isinstance(m, FullyShardedModule) for m in modules]
    if not any(ours):
        torch.distributed.fsdp.share_comm_ctx(modules)
    elif not all(ours):
        other = modules[ours.index(False)]
        raise ValueError(f"share_comm_ctx: {type(other).__name__} was sharded by torch's fully_shard and "
                         f"{type(modules[ours.index(True)]).__name__} by fusedist's; the two libraries' modules "
                         "share no communication context")


# Note [a unit called inside its own call]
#     A method registered with ``register_fsdp_forward_method`` often calls the module itself
#     (``generate`` running ``self(ids)`` per token, then reading ``self.head.weight``), and
#     a module's forward may call itself. The inner call's post-forward resharded the unit
#     (under ``reshard_after_forward``) while the outer call still ran: the rest of it read
#     this rank's pieces and computed silently on them (FSDP2's block fails there, on the mix
#     of tensors and DTensors; its root's returns a DTensor). So each state counts its running
#     calls (``_depth``), and only the outermost call's end reshards the unit; the outer call
#     is "in its own forward" (``reshard()`` waits) until then. The count is cleared where an
#     aborted call's state is (the root's end of forward, the end of a backward,
#     ``reset_iter_state``).


# Note [one communicator per mesh]
#     torch's ``share_comm_ctx`` makes FSDP2 roots (the model chunks of pipeline parallelism)
#     use the first one's communication context: its CUDA streams for all-gathers, reduce-
#     scatters and all-reduces, and the state FSDP2 keeps on them, so the chunks do not split
#     the caching allocator's memory across more streams. It changes no value and no
#     collective. fusedist keeps no per-root context: every unit's gathers and reductions
#     run on the communicator of its mesh / process group (``fusedist.comm.get_communicator``,
#     one per group and device), whose streams every root on that group already shares. So
#     the call validates its argument as torch's does and has nothing else to do; roots on
#     different process groups keep their own communicators (their collectives could not
#     share one anyway).


def _torch_fsdp_module_class() -> tuple:
    """torch FSDP2's ``FSDPModule`` class, if this torch has it (else nothing matches)."""
    fsdp = getattr(getattr(torch.distributed, "fsdp", None), "_fully_shard", None)
    cls = getattr(fsdp, "FSDPModule", None)
    return (cls,) if cls is not None else ()


def _register_torch_forward_method(module: nn.Module, method_name: str) -> None:
    """torch's ``register_fsdp_forward_method`` for a module its ``fully_shard`` sharded."""
    if isinstance(module, _torch_fsdp_module_class()):
        torch.distributed.fsdp.register_fsdp_forward_method(module, method_name)
