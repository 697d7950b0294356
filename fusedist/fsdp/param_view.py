"""What FSDP2's DTensor parameters answer, on ``fully_shard``'s pieces: ``placements``,
``device_mesh``, ``full_tensor()`` and ``to_local()``.

Note [parameters read as DTensors]
    FSDP2's ``model.parameters()`` are DTensors, and code written for it reads them as such:
    ``p.placements`` / ``p.device_mesh`` to tell how a parameter is laid out, ``p.full_tensor()``
    to log or export a whole weight, ``p.to_local()`` for this rank's shard (torchtitan's
    utilities do all four). fusedist's parameters are this rank's pieces, so these raised
    AttributeError. Each piece is a ``ShardParam``, an ``nn.Parameter`` subclass that answers the
    four names while it is a live unit's piece (else AttributeError, so ``hasattr(p, "to_local")``
    is False for a piece whose model was dropped), with FSDP2's answers -- those of the state-dict
    entries (Note [entries read as DTensors] in dtensor_view.py):

    * ``placements``, ``device_mesh``: FSDP2's, no collective.
    * ``full_tensor()``: the whole (global, under tensor parallelism) parameter, a collective
      as FSDP2's (every rank of the shard and tensor-parallel groups calls it for the same
      parameter); a copy, outside autograd (FSDP2's is differentiable).
    * ``to_local()``: where the piece is FSDP2's shard (a parameter sharded on another dim
      than 0 by ``shard_placement_fn``, or one the flat layout happens to cut as ``torch.chunk``
      on every rank, in a unit without tensor-parallel parameters), a view of the piece, as
      FSDP2's local tensor: no collective, writes reach the parameter. Elsewhere the piece holds
      other rows than FSDP2's shard on some rank and it raises, on every rank alike, naming the
      parameter: FSDP2's
      ``to_local()`` is never a collective, and a gathered copy would neither take writes nor
      be safe to call on one rank (logging on rank 0).

    The names live on the subclass, not on ``nn.Parameter``: they used to be properties the first
    ``fully_shard`` added to ``nn.Parameter`` itself, so every parameter of the process, of any
    model, answered ``hasattr(p, "device_mesh")`` by a lookup, and code telling DTensor-like
    parameters by those names (another library, torch's own checks) saw every parameter changed.
    ``ShardParam`` is a plain parameter to every op (``__torch_function__`` disabled, as
    ``nn.Parameter``'s), prints as one, is saved as one (``torch.load(weights_only=True)`` knows no
    ``ShardParam``; a deep copy is a ``ShardParam`` no unit holds, answering none of the names), and
    is added to torch's foreach type lists (``torch.optim``'s and the clip's) as torch adds DTensor,
    so optimizers keep their foreach default. A conversion torch cannot make in place gives a piece
    a new plain ``nn.Parameter`` (``to_empty`` from the meta device): the unit makes it a
    ``ShardParam`` as it adopts it (``as_piece``). An extension piece (torchao's float8 and NF4
    weights) keeps its own class and answers the names through a subclass of it (Note [extension
    pieces read as DTensors] in extension_names.py).

    What still differs: ``isinstance(p, DTensor)`` is False; ``type(p)`` is ``ShardParam``; ``p.shape``,
    ``p.numel()`` and ``p.size()`` are the piece's (FSDP2's are the whole parameter's: count parameters as
    ``sum(p.full_tensor().numel() ...)``, or by ``fusedist.fsdp.full_state_dict``'s shapes);
    ``p.grad`` is the piece's gradient, a ``ShardGrad`` (a tensor subclass) answering the same names (Note
    [gradients read as DTensors] in grad_view.py; the clip and ``get_total_norm`` measure the
    global norm: Note [torch's clip on sharded gradients] in optim/torch_clip.py);
    ``DTensor.from_local(p.to_local(), p.device_mesh, p.placements)`` works where ``to_local()`` does.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ShardParam", "as_piece", "list_for_foreach", "piece_view", "param_name", "is_fsdp2_shard", "local_getter"]


def piece_view(p: torch.Tensor):
    """``(unit, index, its description)`` of ``p`` if it is a live unit's piece, else None."""
    from .dtensor_view import describe_entry
    from .owners import owner_of

    owned = owner_of(p)
    if owned is not None:
        unit, index = owned
        if index < len(unit.sharded) and unit.sharded[index] is p:
            view = describe_entry(unit, index)
            if view is not None:
                return unit, index, view
    return None


def _owned(p: torch.Tensor, what: str) -> tuple:
    """``(unit, index, its description)`` of the piece ``p``; AttributeError for any other
    parameter (an original parameter a unit replaced, a plain model's), as before."""
    found = piece_view(p)
    if found is None:
        raise AttributeError(f"'{type(p).__name__}' object has no attribute '{what}'")
    return found


def param_name(unit, index: int, with_unit: bool = False) -> str:
    """Parameter ``index`` of ``unit`` for messages: its path from the root once the root ran
    forward (with its unit's class too if ``with_unit``), else its name in the unit; current
    after a renumbering (Note [unit paths follow the module] in tree_names.py)."""
    from .tree_names import param_path, unit_owner

    if unit.path is None:
        return f"'{unit.names[index]}' of {unit_owner(unit)}"
    named = f"'{param_path(unit, index)}'"
    return f"{named} of {unit_owner(unit)}" if with_unit else named


def _placements(self) -> tuple:
    return _owned(self, "placements")[2].placements


def _device_mesh(self):
    return _owned(self, "device_mesh")[2].device_mesh


def _full_tensor(self):
    unit, index, _ = _owned(self, "full_tensor")

    def full_tensor() -> torch.Tensor:
        """The whole parameter from every rank's piece (a collective, as FSDP2's)."""
        from .state_dict_hooks import as_entry
        from .whole_entry import full_tensor_of

        return full_tensor_of(as_entry(self, unit, index))

    return full_tensor


def _to_local(self):
    unit, index, view = _owned(self, "to_local")
    return local_getter(self, unit, index, view, "parameter")


# what ``to_local()`` is called on, what its piece is, what to use instead: per noun
_LOCAL_WORDS = {
    "parameter": ("to_local()", "this rank's piece",
                  "Use the piece itself (the parameter) for this rank's values, p.full_tensor() (on every rank) for "
                  "the whole parameter, or model.state_dict()[name].to_local() (on every rank) for FSDP2's shard"),
    "gradient": ("p.grad.to_local()", "this rank's piece of the gradient",
                 "Use p.grad itself for this rank's part (its norm, summed over the ranks, is the global one), or "
                 "p.grad.full_tensor() (on every rank) for the whole gradient"),
}


def local_getter(t: torch.Tensor, unit, index: int, view, noun: str):
    """``to_local`` of ``t``, the piece of parameter ``index`` of ``unit`` or its gradient (``noun``):
    FSDP2's shard, a view of ``t`` where ``t`` is that shard, else a refusal naming the parameter."""
    call, piece, instead = _LOCAL_WORDS[noun]

    def to_local() -> torch.Tensor:
        """This rank's FSDP2 shard: a view of the piece, where the piece is that shard."""
        if not is_fsdp2_shard(unit, index, view):
            raise RuntimeError(
                f"fusedist.fully_shard: {call} of parameter {param_name(unit, index)} (shape "
                f"{tuple(view.local_shape)}): {piece}, shape {tuple(t.shape)}, is not the shard FSDP2 gives it "
                f"(torch.chunk on dim {view.dim}, shape {view.chunk_shape()}) on every rank -- the unit's flat "
                f"layout cut it elsewhere -- and to_local() takes no collective. {instead}; "
                "shard_placement_fn=lambda p: Shard(1) lays 2-D weights out as FSDP2's chunks.")
        return t.view(view.chunk_shape())

    return to_local


def is_fsdp2_shard(unit, index: int, view) -> bool:
    """Whether the piece is FSDP2's shard on every rank of the mesh: a unit's layout is the same on
    the ranks of its shard and replicate groups, but under tensor parallelism each tensor-parallel
    rank lays out its own local tensors (13 vocabulary rows: 7 and 6), so a piece cut as
    ``torch.chunk`` by chance on one may not be on another -- only a dim-sharded section is so
    everywhere. The same verdict on every rank: no rank raises where another goes on to a
    collective."""
    if view.packed or not view.aligned:
        return False
    return unit.tp_comm is None or unit.layout.section_of(index)[0].chunked


class ShardParam(nn.Parameter):
    """A unit's piece: an ``nn.Parameter`` to every op, that answers FSDP2's DTensor names while it is
    a live unit's piece (Note [parameters read as DTensors])."""

    placements = property(_placements)
    device_mesh = property(_device_mesh)
    full_tensor = property(_full_tensor)
    to_local = property(_to_local)

    def __new__(cls, data=None, requires_grad: bool = True):
        list_for_foreach(ShardParam, optimizers=True)
        return super().__new__(cls, data, requires_grad)

    def __repr__(self) -> str:
        # as a plain parameter prints (torch names a subclass: "Parameter(ShardParam(...))")
        text = repr(self.detach())
        return "Parameter containing:\n" + (text[:-1] + ", requires_grad=True)" if self.requires_grad else text)


def as_piece(p: torch.Tensor) -> torch.Tensor:
    """``p`` as a unit's piece: a plain ``nn.Parameter`` a conversion made becomes a ``ShardParam``
    in place (same object, what the modules and an optimizer hold), an extension subclass (torchao's)
    answers the same names through a subclass of its own (Note [extension pieces read as DTensors] in
    extension_names.py); a ``ShardParam`` is left as it is."""
    if type(p) is nn.Parameter:
        list_for_foreach(ShardParam, optimizers=True)
        p.__class__ = ShardParam
    elif hasattr(p, "fsdp_pre_all_gather"):
        from .extension_names import answer_dtensor_names

        answer_dtensor_names(p)
    return p


_LISTED: set = set()


def list_for_foreach(cls, optimizers: bool) -> None:
    """Put ``cls``, a plain tensor to every kernel, on torch's foreach type lists, as torch lists
    DTensor (they take the foreach paths only for the types listed): the clip's and, with
    ``optimizers``, ``torch.optim``'s, whose foreach default reads the parameters' types. Once per
    class (``ShardParam`` here, ``ShardGrad`` in grad_view.py)."""
    if cls in _LISTED:
        return
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    lists = (_foreach_utils._foreach_supported_types,) + ((optimizer._foreach_supported_types,) if optimizers else ())
    for types in lists:
        if cls not in types:
            types.append(cls)
    _LISTED.add(cls)
