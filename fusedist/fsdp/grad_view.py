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

    The names live on ``torch.Tensor`` (a gradient is a plain tensor), and answer only for a
    tensor that is now the ``.grad`` of a live unit's piece (one a reduction stored, or grew in
    place since: accumulation, a clip, ``zero_grad(set_to_none=False)``). Nothing is recorded per
    gradient when it is made -- a table kept per parameter would cost every step, also for code
    that never reads these names -- only a count of the reductions that stored gradients (one per
    unit's reduction). A read looks the tensor up in a table of the pieces' gradients, by
    identity, made afresh when a reduction stored gradients since it was made (so ``for p in
    model.parameters(): p.grad.full_tensor()`` makes it once) and checked against the piece's
    ``.grad``. Any other tensor -- one the user assigned as ``.grad``, a clone of a gradient, a
    model's plain tensors -- still raises AttributeError, so ``hasattr(t, "to_local")`` stays
    False for it. Tensor subclasses that define the names (DTensor, the state-dict entries) keep
    their own.

    What differs from FSDP2: ``isinstance(p.grad, DTensor)`` is False, its shape is the
    piece's, ``full_tensor()`` is a copy outside autograd, and ``p.grad.clone()`` (or any
    result of an op on it) is a plain tensor without these names.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

__all__ = ["note_reduced", "install"]


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
    _, unit, index, view = _owned(self, "to_local")

    def to_local() -> torch.Tensor:
        """This rank's FSDP2 shard of the gradient: a view of it, where the piece is that shard."""
        from .param_view import is_fsdp2_shard

        if not is_fsdp2_shard(unit, index, view):
            raise RuntimeError(
                f"fusedist.fully_shard: p.grad.to_local() of parameter {_name(unit, index)} (shape "
                f"{tuple(view.local_shape)}): this rank's piece of the gradient, shape {tuple(self.shape)}, is not the "
                f"shard FSDP2 gives it (torch.chunk on dim {view.dim}, shape {view.chunk_shape()}) on every rank -- "
                "the unit's flat layout cut it elsewhere -- and to_local() takes no collective. Use p.grad itself "
                "for this rank's part (its norm, summed over the ranks, is the global one), or p.grad.full_tensor() "
                "(on every rank) for the whole gradient; shard_placement_fn=lambda p: Shard(1) lays 2-D weights out "
                "as FSDP2's chunks.")
        return self.view(view.chunk_shape())

    return to_local


def _name(unit, index: int) -> str:
    from .param_view import param_name

    return param_name(unit, index)


GETTERS = {"placements": _placements, "device_mesh": _device_mesh, "full_tensor": _full_tensor,
           "to_local": _to_local}


def install(names) -> None:
    """Give ``torch.Tensor`` the getters of ``names`` (those torch defines on neither class)."""
    for name in names:
        setattr(torch.Tensor, name, property(GETTERS[name]))
