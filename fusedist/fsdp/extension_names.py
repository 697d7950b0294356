"""FSDP2's DTensor names on extension pieces (torchao's float8 training weights, NF4 storage):
``placements``, ``device_mesh``, ``full_tensor()``, ``to_local()``.

Note [extension pieces read as DTensors]
    A unit's piece of a plain parameter is a ``ShardParam`` answering FSDP2's DTensor names
    (Note [parameters read as DTensors] in param_view.py). A piece of an extension parameter
    cannot be one: ``nn.Parameter`` keeps a tensor subclass with its own dispatch as that subclass
    (it only marks it a parameter), so the piece is torchao's ``WeightWithDynamicFloat8CastTensor``
    or ``NF4Tensor`` itself, and code written for FSDP2 -- ``{n: p.full_tensor() for n, p in
    model.named_parameters()}`` -- stopped with an AttributeError at the first float8 or NF4 weight.

    So each such piece is given a subclass of its own class that adds the four names (one per
    class, made once, named as the class): every op, every ``isinstance`` and torchao's own
    dispatch (``isinstance``-based, a classmethod) see torchao's class as before, and no torchao
    class gains a name, so tensors of that class outside a unit answer nothing new. FSDP2's
    answers on the same model and mesh (its parameters are DTensors over torchao's tensors):

    * ``placements``, ``device_mesh``: as a plain parameter's (``(Shard(0),)`` and the mesh).
    * ``full_tensor()``: a float8 weight's high-precision values, a plain tensor (FSDP2 gathers
      the inner tensor); an NF4 weight as the whole ``NF4Tensor`` (FSDP2 gathers its codes and
      scales). A collective, every rank calls it for the same parameter.
    * ``to_local()``: FSDP2's shard as torchao's class: a float8 piece viewed at its chunk's
      shape (its storage: writes reach the parameter; refused by name where the unit's layout
      cut it elsewhere, as a plain piece); an NF4 piece viewed whole: its rows are FSDP2's chunk
      (``fully_shard`` takes quantized storage only where the rows divide evenly). A view, not the
      piece itself: FSDP2 returns a new tensor (``view_as`` of its local one) over the same codes,
      so ``p.to_local().requires_grad_()`` changes no parameter's flag; given the piece, it
      unfroze the NF4 base weight, and the result answered ``full_tensor()`` where FSDP2's does not.

    A copy (``copy.deepcopy``, ``torch.save``) is torchao's class: no unit holds it, and a
    checkpoint loads where fusedist is not imported.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from .param_view import _device_mesh, _owned, _placements, _to_local

__all__ = ["answer_dtensor_names"]

_CLASSES: dict = {}  # torchao's class -> its subclass answering FSDP2's names


def _full_tensor(self):
    unit, index, _ = _owned(self, "full_tensor")
    if not unit.ext[index].packed:
        from .param_view import _full_tensor as plain_full_tensor

        return plain_full_tensor(self)

    def full_tensor() -> torch.Tensor:
        """The whole quantized weight from every rank's blocks (a collective, as FSDP2's)."""
        from .state_dict import gather_params

        return gather_params(unit, to_cpu=False, only={index})[index]

    return full_tensor


def _local(self):
    unit, index, _ = _owned(self, "to_local")
    if not unit.ext[index].packed:
        return _to_local(self)

    def to_local() -> torch.Tensor:
        """This rank's blocks of the quantized weight: FSDP2's shard, as its rows divide evenly; a new
        torchao tensor over the piece's storage, as FSDP2's ``view_as`` of its local tensor."""
        return self.view_as(self)

    return to_local


class _Names:
    """FSDP2's DTensor names on a unit's extension piece (Note [extension pieces read as DTensors])."""

    __slots__ = ()
    placements = property(_placements)
    device_mesh = property(_device_mesh)
    full_tensor = property(_full_tensor)
    to_local = property(_local)

    def __deepcopy__(self, memo):
        with _as_torchao(self):
            return copy.deepcopy(self, memo)

    def __reduce_ex__(self, protocol):
        with _as_torchao(self):
            return self.__reduce_ex__(protocol)


@contextmanager
def _as_torchao(piece):
    """``piece`` as its torchao class for the duration (what a copy or a pickle records)."""
    answering = type(piece)
    piece.__class__ = answering.__bases__[1]
    try:
        yield
    finally:
        piece.__class__ = answering


def answer_dtensor_names(piece: torch.Tensor) -> torch.Tensor:
    """``piece``, an extension piece, made to answer FSDP2's names in place (same object)."""
    cls = type(piece)
    if issubclass(cls, _Names):
        return piece
    answering = _CLASSES.get(cls)
    if answering is None:
        answering = _CLASSES[cls] = type(cls.__name__, (_Names, cls), {
            "__module__": __name__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__qualname__}, a piece of a fully_shard unit: answers FSDP2's DTensor names."})
    piece.__class__ = answering
    return piece
