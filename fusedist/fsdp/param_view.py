"""What FSDP2's DTensor parameters answer, on ``fully_shard``'s pieces: ``placements``,
``device_mesh``, ``full_tensor()`` and ``to_local()``.

Note [parameters read as DTensors]
    FSDP2's ``model.parameters()`` are DTensors, and code written for it reads them as such:
    ``p.placements`` / ``p.device_mesh`` to tell how a parameter is laid out, ``p.full_tensor()``
    to log or export a whole weight, ``p.to_local()`` for this rank's shard (torchtitan's
    utilities do all four). fusedist's parameters are this rank's pieces, plain tensors, so
    these raised AttributeError. The first ``fully_shard`` gives ``nn.Parameter`` the four
    names, answering for the pieces of live units only (any other parameter still raises
    AttributeError, so ``hasattr(p, "to_local")`` stays False for it), with FSDP2's answers --
    those of the state-dict entries (Note [entries read as DTensors] in dtensor_view.py):

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

    What still differs: ``isinstance(p, DTensor)`` is False; ``p.shape``, ``p.numel()`` and
    ``p.size()`` are the piece's (FSDP2's are the whole parameter's: count parameters as
    ``sum(p.full_tensor().numel() ...)``, or by ``fusedist.fsdp.full_state_dict``'s shapes);
    ``p.grad`` is the piece's gradient, a ``ShardGrad`` (a tensor subclass) answering the same names (Note
    [gradients read as DTensors] in grad_view.py; the clip and ``get_total_norm`` measure the
    global norm: Note [torch's clip on sharded gradients] in optim/torch_clip.py);
    ``DTensor.from_local(p.to_local(), p.device_mesh, p.placements)`` works where ``to_local()`` does.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["install", "piece_view", "param_name", "is_fsdp2_shard", "local_getter"]

_NAMES = ("placements", "device_mesh", "full_tensor", "to_local")


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
    from .tree_names import param_path

    if unit.path is None:
        return f"'{unit.names[index]}' of fully_shard({unit.name or 'root'})"
    named = f"'{param_path(unit, index)}'"
    return f"{named} of fully_shard({unit.name or 'root'})" if with_unit else named


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


def install() -> None:
    """Give ``nn.Parameter`` the names (Note [parameters read as DTensors]); idempotent, and nothing
    where torch already defines one of them. (The pieces' gradients answer them as ``ShardGrad``s:
    Note [gradients read as DTensors] in grad_view.py.)"""
    if getattr(nn.Parameter, "_fusedist_dtensor_names", False):
        return
    names = [n for n in _NAMES if n not in vars(nn.Parameter) and not hasattr(torch.Tensor, n)]
    getters = dict(zip(_NAMES, (_placements, _device_mesh, _full_tensor, _to_local)))
    for name in names:
        setattr(nn.Parameter, name, property(getters[name]))
    nn.Parameter._fusedist_dtensor_names = True
