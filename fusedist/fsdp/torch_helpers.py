"""Reading which options torch's state-dict helpers (``torch.distributed.checkpoint.state_dict``)
were called with, from the call stack: a ``fully_shard`` module's state-dict hooks are told
nothing else.

Note [full state dict through torch's helpers]
    ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))`` gathers
    DTensors and ShardedTensors (``_gather_state_dict``) and passes any other tensor through:
    it would hand back the pieces. Neither hook it offers tells ``model.state_dict()`` which
    options were asked for, and both gatherers assume torch's even split, not fusedist's
    layout, so a piece cannot pose as either. So the state-dict hook looks up the call stack
    for torch's ``_get_model_state_dict`` frame (the function object is taken from torch's
    module, not matched by name) and reads its options: with ``full_state_dict`` the hook
    puts each parameter whole in the dict (one all-gather per unit, on every rank; moved to
    the CPU at once with ``cpu_offload``), and torch then keeps them on rank 0 only with
    ``cpu_offload``, as for FSDP2. A frame found without the options it expects (another torch
    version) raises instead of guessing. The other direction needs no hook: torch hands
    ``load_state_dict`` the whole tensors, and the load pre-hook cuts an entry of the whole
    parameter's shape to this rank's rows (so ``model.load_state_dict(full)`` works too).

    The frame also names the module whose state dict is taken (``model``), which tells a
    unit's hooks which of its parameters that dict will hold (Note [state-dict hooks on every
    module of a unit] in ``state_dict_hooks.py``).
"""

from __future__ import annotations

import inspect
import sys
from typing import Optional

from torch import nn

__all__ = ["torch_helper_options", "full_state_dict_requested", "full_load_without_broadcast"]


_TORCH_CALLERS: dict = {}


def _torch_helper_locals(function: str) -> Optional[dict]:
    """The local variables of torch's state-dict helper frame ``function`` (a function of
    ``torch.distributed.checkpoint.state_dict``) when the caller runs under it, else None."""
    helpers = sys.modules.get("torch.distributed.checkpoint.state_dict")
    if helpers is None:
        return None
    code = _TORCH_CALLERS.get(function)
    if code is None:
        fn = getattr(helpers, function, None)
        code = _TORCH_CALLERS[function] = inspect.unwrap(fn).__code__ if fn is not None else False
    if code is False:
        return None
    frame = sys._getframe(2)
    for _ in range(256):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals
        frame = frame.f_back
    return None


def torch_helper_options(function: str) -> Optional[tuple]:
    """``(full_state_dict, cpu_offload)`` of the options of the torch state-dict helper frame
    ``function`` (one that has an ``info`` local) when the caller runs under it, else None
    (Note [full state dict through torch's helpers]). Raises when the frame is found without
    the options it expects."""
    found = _torch_helper_locals(function)
    if found is None:
        return None
    info = found.get("info")
    if not (hasattr(info, "full_state_dict") and hasattr(info, "cpu_offload")):
        raise RuntimeError(
            f"fusedist.fully_shard: called by torch's {function}, whose options this fusedist cannot read "
            "in this torch version, so it cannot tell a full state dict from a sharded one. Use "
            "fusedist.fsdp.full_state_dict(model) for whole parameters, model.state_dict() for DCP, "
            "or fusedist.checkpoint.save for the model and its optimizer.")
    return bool(info.full_state_dict), bool(info.cpu_offload)


def full_state_dict_requested() -> Optional[tuple]:
    """``(cpu_offload, model)`` when ``state_dict()`` is called by torch's
    ``get_model_state_dict``/``get_state_dict`` asking for a full state dict, else None
    (Note [full state dict through torch's helpers]); ``model`` is the module the helper takes
    the state dict of (None if the frame does not say)."""
    found = torch_helper_options("_get_model_state_dict")
    if found is None or not found[0]:
        return None
    model = _torch_helper_locals("_get_model_state_dict").get("model")
    return found[1], model if isinstance(model, nn.Module) else None


# Note [full state dict loaded on some ranks only]
#     ``set_model_state_dict`` / ``set_optimizer_state_dict`` / ``set_state_dict`` with
#     ``StateDictOptions(full_state_dict=True)`` and no ``broadcast_from_rank0`` take the whole
#     dict on every rank (with ``cpu_offload=True`` torch's check lets an empty dict through). A
#     rank given ``{}`` skips the model load (torch returns before ``load_state_dict``) and
#     loads its optimizer's own state back, while the others load the dict: with FSDP2 the
#     ranks that load wait in ``distribute_tensor``'s collective for good; with pieces,
#     which each rank cuts from the whole tensor without communication, every rank went on and
#     the model was loaded on some ranks' rows only -- silently. So such a load is checked
#     across the ranks first, once per helper call: the optimizer's (every rank reaches it)
#     compares whether each rank was passed a dict, and the model's compares the keys each rank
#     lacks; a rank that never reaches the model's check (given ``{}``) is named by the stall
#     report of the check's collective instead of the job hanging.
def full_load_without_broadcast(function: str) -> Optional[tuple]:
    """``(info, locals)`` of torch's load helper frame ``function`` (``_load_model_state_dict``
    or ``_load_optim_state_dict``) when the caller runs under it loading a full state dict that
    each rank passes itself (``full_state_dict=True``, ``broadcast_from_rank0=False``), else
    None (Note [full state dict loaded on some ranks only])."""
    found = _torch_helper_locals(function)
    info = found.get("info") if found is not None else None
    if not getattr(info, "full_state_dict", False) or getattr(info, "broadcast_from_rank0", True):
        return None
    return info, found
