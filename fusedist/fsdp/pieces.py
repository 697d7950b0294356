"""Where each parameter's piece lies in a unit's shard, and keeping pieces there.

A ``ShardedUnit`` (``unit.py``) holds one flat shard per unit and hands each parameter out as
a piece on its storage (Note [sharded parameters] in ``unit.py``). This mixin answers what
the rest of the library asks about a piece -- its view of the shard, its values, its place in
the whole (or global, tensor-parallel) parameter, the elements it holds -- and puts pieces
back on the shard after a conversion replaced their data (``module.to()``, ``to_empty``:
Note [units built on the meta device] in ``unit.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .layout import DimShardedError, alias
from .param_view import as_piece
from .tree_names import param_path, unit_named, unit_owner


class PieceMixin:
    """The piece bookkeeping of ``ShardedUnit`` (its layout, shards, pieces and registrations)."""

    def piece_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s piece on the shard storage (Note [sharded parameters])."""
        k = self.section_index(index)
        sec, piece = self.layout.sections[k], self.layout.piece(index, self.rank)
        return alias(self.shards[k], piece.shard_offset - sec.shard_base, piece.shape)

    def piece_data(self, index: int) -> torch.Tensor:
        """Piece ``index``'s values as a plain tensor: the piece, or the tensor an extension
        subclass wraps (Note [all-gather extension] in extension.py)."""
        sp = self.sharded[index]
        return self.ext[index].inner(sp) if self.ext[index] is not None else sp

    def _point_piece(self, index: int, view: torch.Tensor) -> None:
        """Piece ``index``'s data becomes ``view``: ``.data``, or an extension subclass's inner
        tensor (setting a wrapper's ``.data`` would leave the tensor its ops read behind)."""
        if self.ext[index] is not None:
            self.ext[index].set_inner(self.sharded[index], view)
        else:
            self.sharded[index].data = view

    def _register(self, index: int, tensor: nn.Parameter) -> None:
        holders = self.registrations[index]  # (per parameter and swap: the two lists read directly)
        for module, attr in holders.strong:
            module._parameters[attr] = tensor
        for module_ref, attr in holders.weak:
            module = module_ref()
            if module is not None:
                module._parameters[attr] = tensor

    def _aliases_shard(self, index: int) -> bool:
        shard, sp = self.shards[self.section_index(index)], self.piece_data(index)
        return sp.device == shard.device and sp.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()

    def realias(self, index: int) -> None:
        """Point piece ``index`` at its place in the shard again, if a conversion gave it other
        data of the shard's device and dtype (the shard's values are the piece's)."""
        sp, shard = self.sharded[index], self.shards[self.section_index(index)]
        if sp.device == shard.device and sp.dtype == shard.dtype and not self._aliases_shard(index):
            self._point_piece(index, self.piece_view(index))
            self.mark_pieces()

    def mark_pieces(self) -> None:
        """Record where each piece's data lies now that it is on the shard (Note [a submodule
        converted on its own])."""
        self._marks = [None if e is not None else _mark(sp) for sp, e in zip(self.sharded, self.ext)]

    def converted_on_its_own(self) -> bool:
        """Whether a conversion of a submodule without a unit of its own (``block.fc.double()``)
        gave a piece other data since the unit last placed it (Note [a submodule converted on its
        own])."""
        return any(m is not None and _mark(sp) != m for sp, m in zip(self.sharded, self._marks))

    def piece_of_whole(self, index: int, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of parameter ``index`` cut from ``whole`` (the whole parameter's
        shape): a view -- rows of it, a flat range, or the chunk on its dim (Note [dim-sharded
        sections] in chunk_layout.py), which need not be contiguous."""
        sec, j = self.layout.section_of(index)
        piece = sec.layout.piece(j, self.rank)
        if sec.chunked:
            return whole.narrow(self.layout.dims[index], piece.rows[0], piece.rows[1] - piece.rows[0])
        start = self.layout.element_range(index, self.rank)[0]
        return whole.reshape(-1)[start:start + piece.numel].view(piece.shape)

    def whole_shape(self, index: int) -> tuple:
        """The shape of parameter ``index`` as the model has it: the global shape of a
        tensor-parallel parameter (Note [tensor-parallel parameters]), the canonical bytes of
        quantized storage (Note [quantized storage] in packed.py), else the unit's slot."""
        spec = self.tp[index]
        if self.ext[index] is not None and self.ext[index].packed:  # (Note [quantized storage] in packed.py)
            return (self.ext[index].canonical_bytes,)
        return tuple(spec.global_shape) if spec is not None else tuple(self.layout.slots[index].shape)

    def placement(self, index: int) -> Optional[tuple]:
        """``(local shape, offsets in the global parameter)`` of a tensor-parallel parameter's
        local tensor, None for a plain one: what its state-dict entries carry
        (``ShardedPiece.placement``)."""
        spec = self.tp[index]
        return (spec.local_shape, spec.offsets) if spec is not None else None

    def element_range(self, index: int, rank: Optional[int] = None) -> tuple[int, int]:
        """The elements ``[start, end)`` of parameter ``index`` (flattened) that ``rank``'s
        piece holds. A piece of a parameter sharded on another dim is no such range: refused,
        naming it (Note [dim-sharded sections] in chunk_layout.py)."""
        try:
            return self.layout.element_range(index, self.rank if rank is None else rank)
        except DimShardedError as e:
            raise NotImplementedError(
                f"fusedist.fully_shard: parameter '{param_path(self, index)}' of {unit_named(self)} (shape "
                f"{tuple(self.layout.slots[index].shape)}, Shard({e.dim}), rank {self.rank}) is sharded on dim "
                f"{e.dim}; this operation reads each piece as a range of the flattened parameter and supports only "
                "Shard(0) parameters. Save and load such a model with torch.distributed.checkpoint "
                "(model.state_dict(), get_state_dict) or fusedist.fsdp.full_state_dict.") from None

    # ------------------------------------------------------------------ conversions
    @torch.no_grad()
    def repack(self) -> list:
        """After ``module.to()``/``.double()``/``.to_empty()`` replaced the sharded parameters' data:
        rebuild the shard (and the unsharded buffer) from them, so pieces and buffers alias
        again. Returns ``(index, piece)`` for each parameter whose piece is a new tensor (Note
        [units built on the meta device]): the caller registers it where the old one was."""
        self.reshard()
        adopted = self._adopt_replaced()
        self._check_uniform()
        self._check_piece_sizes()
        first = self.sharded[0]
        # the unit takes its first parameter's new dtype; in a mixed-dtype unit each section
        # takes its own first parameter's (Note [dtype sections])
        dtypes = [self.piece_data(sec.indices[0]).dtype if self.layout.mixed else first.dtype
                  for sec in self.layout.sections]
        if all(self._aliases_shard(i) for i in range(len(self.sharded))) and \
                dtypes == [s.dtype for s in self.shards]:
            self.mark_pieces()
            return adopted
        device = torch.device("cpu") if self.offload and not first.is_meta else first.device
        self._new_shard(dtypes, device)
        for i, sp in enumerate(self.sharded):
            view = self.piece_view(i)
            view.copy_(self.piece_data(i).reshape(view.shape))
            self._point_piece(i, view)
        if not self.layout.mixed:
            param_dtype = first.dtype if self.param_dtype == self.dtype else self.param_dtype
            self.dtype, self.param_dtype = first.dtype, param_dtype
        if not first.is_meta:
            self.shard_device = device
            if not self.offload:
                self.device = device
        self._new_full()
        self.mark_pieces()
        return adopted

    def _check_uniform(self) -> None:
        """Refuse pieces a conversion left in several dtypes (or devices) where the unit holds
        them in one flat shard: a submodule converted on its own (Note [a submodule converted on
        its own]). FSDP2 refuses them too ("FSDP expects uniform original parameter dtype")."""
        problem = self.mixed_conversion()
        if problem is not None:
            raise ValueError(problem)

    def _check_piece_sizes(self) -> None:
        """Take a piece whose data was replaced -- ``param.data =``, ``param.set_()``, or a
        parametrization's setter (``module.weight = value`` calls ``original.set_(value)``) --
        as its new values: the piece's shape as it is, the whole parameter's shape cut to this
        rank's piece. Anything else is refused, naming it, before the shard is rebuilt. The rule
        reads only shapes the layout gives every rank alike: a rank whose piece is the whole
        parameter cannot tell the whole value from its piece, so refusing the whole on the
        others would leave it waiting in the gather (Note [replaced piece data])."""
        for i in range(len(self.sharded)):
            data, want = self.piece_data(i), self.layout.piece(i, self.rank)
            if data.numel() == want.numel:
                continue
            whole = self.whole_shape(i)
            if tuple(data.shape) == whole and self.ext[i] is None and self.tp[i] is None:
                self._point_piece(i, self.piece_of_whole(i, data))
                continue
            pieces = ", ".join(f"rank {r}: {tuple(self.layout.piece(i, r).shape)}" for r in range(self.world_size))
            raise ValueError(
                f"fusedist.fully_shard: parameter '{param_path(self, i)}' of {unit_named(self)} (shape {whole}) now "
                f"holds a tensor of shape {tuple(data.shape)}, neither the whole parameter nor this rank's piece "
                f"(pieces: {pieces}): its data was replaced by a tensor of another size (param.data = ..., "
                "param.set_(...), or module.weight = value on a parametrized module, which calls set_). "
                "Assign the whole parameter's shape, or set a sharded model's values through its state dict "
                "(fusedist.fsdp.load_full_state_dict, load_state_dict), or before calling fully_shard.")

    def mixed_conversion(self):
        """Why the pieces cannot be packed in the unit's shards again -- a conversion left them in
        several dtypes (or devices) where the unit holds them in one flat shard -- or None."""
        n = len(self.sharded)
        data = [self.piece_data(i) for i in range(n)]
        groups = [list(sec.indices) for sec in self.layout.sections] if self.layout.mixed else [range(n)]
        for indices, what in [(g, "dtype") for g in groups] + [(range(n), "device")]:
            kinds: dict = {}
            for i in indices:
                kinds.setdefault(getattr(data[i], what), param_path(self, i))
            if len(kinds) > 1:
                found = ", ".join(f"'{fqn}' {kind}" for kind, fqn in kinds.items())
                return (f"fusedist.fully_shard: a conversion changed the {what} of some parameters of "
                        f"{unit_owner(self)} and not others ({found}); the unit holds them in one flat shard of "
                        f"one {what}. Convert the whole module given to fully_shard (or the root), e.g. "
                        "model.to(dtype), or convert the submodule before calling fully_shard, which takes "
                        "parameters of several dtypes.")
        return None

    def _adopt_replaced(self) -> list:
        """Take as piece ``i`` the tensor the module now holds where piece ``i`` was (a new
        ``nn.Parameter`` when the conversion could not change the piece in place), and hold
        it on every module sharing the parameter."""
        adopted = []
        for i, regs in enumerate(self.registrations):
            module, attr = regs[0]
            held = module._parameters.get(attr)
            if held is not None and held is not self.sharded[i]:
                self.sharded[i] = held
                adopted.append((i, held))
            as_piece(self.sharded[i])  # (a plain parameter a conversion made: Note [parameters read as DTensors])
            self._register(i, self.sharded[i])
        return adopted

    @torch.no_grad()
    def relink_borrowed(self) -> None:
        """Hold the owners' pieces again where this unit borrows them: a conversion of this
        unit's modules replaced the borrowed piece (or its data) after its owner repacked."""
        for owner, index, regs in self.borrowed:
            owner.realias(index)
            for module, attr in regs:
                module._parameters[attr] = owner.sharded[index]


def _mark(t: torch.Tensor) -> tuple:
    """Where a tensor's data lies: a conversion gives a piece a new pointer, dtype or device."""
    return t.data_ptr(), t.dtype, t.device


# Note [replaced piece data]
#     A parameter's data replaced by the user (``param.data = w``, ``set_``, a parametrization's
#     setter) is seen at the next forward or conversion, on each rank from its own piece. Under the
#     row-aligned layout a parameter may lie wholly on one rank: there the whole value has the
#     piece's shape and is taken, while a rank holding an empty piece sees a tensor of another size.
#     Refusing it there alone left the first rank waiting in the all-gather until the stall report.
#     So every rank takes a whole-shaped value, cut to its piece: the parameter then holds what was
#     assigned. FSDP2 keeps its old local shard instead (the assignment is silently lost), so no
#     refusal is matched here. Values of any other shape are refused with the same message on
#     every rank (it names every rank's piece, not this rank's alone).
