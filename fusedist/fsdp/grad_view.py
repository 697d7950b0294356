"""What FSDP2's DTensor gradients answer, on the gradients of ``fully_shard``'s pieces:
``placements``, ``device_mesh``, ``full_tensor()`` and ``to_local()``.

Note [gradients read as DTensors]
    Under FSDP2 a sharded parameter's ``.grad`` is a DTensor laid out as the parameter, and
    code written for it reads it as one: a custom clip or a per-parameter gradient-norm log
    calls ``p.grad.full_tensor()`` or ``p.grad.to_local()``, or tells a sharded gradient by
    ``p.grad.placements``. A piece's ``.grad`` is a plain tensor (this rank's piece of the
    reduced gradient), so these raised AttributeError. So the gradient a reduction stored as a
    piece's ``.grad`` (Note [unit gradients] in grads.py) answers the four names as the piece
    does (Note [parameters read as DTensors] in param_view.py), with FSDP2's answers for its
    gradient: the parameter's ``placements`` and ``device_mesh``; ``full_tensor()`` the whole
    gradient, a collective over the shard (and tensor-parallel) group; ``to_local()`` a view of
    the gradient where the piece is FSDP2's shard, else a refusal on every rank alike, naming
    the parameter.

    The names live on a tensor subclass, ``ShardGrad``, not on ``torch.Tensor``: a reduction stores
    each piece's gradient as one (an alias of its slice of the reduced shard, ~1 us per gradient per
    step), so no other tensor of the process gains them (they used to be properties added to
    ``torch.Tensor`` at the first ``fully_shard``: every tensor answered ``hasattr(t, "to_local")`` by a
    lookup). The subclass disables ``__torch_function__``: every op -- autograd, torch.optim's foreach
    and fused kernels, the clip, a GradScaler's unscale, DCP -- sees a plain tensor, at a plain
    tensor's cost, and returns plain tensors. It answers only while it is the ``.grad`` of a live
    unit's piece (it grows in place through accumulation, a clip, ``zero_grad(set_to_none=False)``):
    nothing is recorded per gradient -- only a count of the reductions that stored gradients (one
    per unit's reduction) -- and a read looks the tensor up in a table of the pieces' gradients, by
    identity, made afresh when a reduction stored gradients since it was made (so ``for p in
    model.parameters(): p.grad.full_tensor()`` makes it once) and checked against the piece's
    ``.grad``. A ``ShardGrad`` that is no longer such a gradient (a piece's ``.grad`` replaced, its
    model dropped), and any other tensor -- one the user assigned as ``.grad``, a clone -- raise
    AttributeError, so ``hasattr(t, "to_local")`` is False for them.

    torch's foreach paths (the clip's scaling, ``_has_foreach_support``) take only the types in
    ``torch.utils._foreach_utils._foreach_supported_types``; ``ShardGrad``, a plain tensor to every
    kernel, is added to that list when the first one is made, as torch adds DTensor (else the clip
    scaled each gradient in a kernel launch of its own).

    What differs from FSDP2: ``isinstance(p.grad, DTensor)`` is False, its shape is the
    piece's, ``full_tensor()`` is a copy outside autograd, and ``p.grad.clone()`` (or any
    result of an op on it, ``copy.deepcopy`` and ``torch.save`` of it) is a plain tensor without
    these names; ``type(p.grad)`` is ``ShardGrad`` (it prints as a plain tensor).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .param_view import list_for_foreach

__all__ = ["ShardGrad", "as_shard_grad", "note_reduced"]


class _GradTable:
    """The pieces' gradients by identity (Note [gradients read as DTensors])."""

    def __init__(self):
        self.units: "weakref.WeakSet" = weakref.WeakSet()  # units whose reductions stored gradients
        self.stored = 0  # reductions that stored gradients so far
        self.made_at = -1  # ``stored`` when ``by_id`` was made
        self.by_id: dict = {}  # id(gradient) -> weak reference to its piece

    def piece_of(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        piece = self._looked_up(t)
        if piece is None and self.made_at != self.stored:
            self.by_id = {id(sp.grad): weakref.ref(sp) for unit in list(self.units) for sp in unit.sharded
                          if sp.grad is not None}
            self.made_at = self.stored
            piece = self._looked_up(t)
        return piece

    def _looked_up(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        ref = self.by_id.get(id(t))
        piece = ref() if ref is not None else None
        # (an id a freed gradient had may be another tensor's now: the piece's .grad says)
        return piece if piece is not None and piece.grad is t else None


_TABLE = _GradTable()


def note_reduced(unit) -> None:
    """A reduction stored (or added to) the ``.grad`` of some of ``unit``'s pieces."""
    _TABLE.units.add(unit)
    _TABLE.stored += 1


def _owned(t: torch.Tensor, what: str) -> tuple:
    """``(piece, unit, index, its description)`` of the gradient ``t``; AttributeError for any
    other tensor, as before."""
    from .param_view import piece_view

    piece = _TABLE.piece_of(t)
    found = piece_view(piece) if piece is not None else None
    if found is None:
        raise AttributeError(f"'{type(t).__name__}' object has no attribute '{what}'")
    return (piece,) + found


def _placements(self) -> tuple:
    return _owned(self, "placements")[3].placements


def _device_mesh(self):
    return _owned(self, "device_mesh")[3].device_mesh


def _full_tensor(self):
    _, unit, index, view = _owned(self, "full_tensor")

    def full_tensor() -> torch.Tensor:
        """The whole gradient from every rank's piece of it (a collective, as FSDP2's)."""
        from .state_dict_hooks import as_entry
        from .whole_entry import full_tensor_of

        if view.packed:
            raise NotImplementedError(
                f"fusedist.fully_shard: full_tensor() of the gradient of {_name(unit, index)}: the parameter is held "
                "as quantized storage, whose gradient is not a piece of the parameter's elements.")
        return full_tensor_of(as_entry(self, unit, index))

    return full_tensor


def _to_local(self):
    from .param_view import local_getter

    _, unit, index, view = _owned(self, "to_local")
    return local_getter(self, unit, index, view, "gradient")


def _name(unit, index: int) -> str:
    from .param_view import param_name

    return param_name(unit, index)


class ShardGrad(torch.Tensor):
    """The ``.grad`` a reduction stores on a piece: a plain tensor to every op, that answers FSDP2's
    DTensor names while it is that piece's gradient (Note [gradients read as DTensors])."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    placements = property(_placements)
    device_mesh = property(_device_mesh)
    full_tensor = property(_full_tensor)
    to_local = property(_to_local)

    def __repr__(self) -> str:
        # printed as the plain tensor it is to every op (torch names a subclass: "ShardGrad(...)")
        return repr(self.as_subclass(torch.Tensor))

    def __reduce_ex__(self, protocol):
        # saved as the plain tensor it is to every op: ``torch.load(weights_only=True)`` knows no ShardGrad
        return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)

    def __deepcopy__(self, memo):
        # a plain copy, as a clone: no longer the piece's gradient (torch's own refuses this subclass)
        if id(self) not in memo:
            memo[id(self)] = self.as_subclass(torch.Tensor).__deepcopy__({})
        return memo[id(self)]


def as_shard_grad(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a slice of a reduced shard) as the gradient a piece stores: an alias of it."""
    list_for_foreach(ShardGrad, optimizers=False)
    return t.as_subclass(ShardGrad)
