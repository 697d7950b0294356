"""Piece splitting: the tensors the inner optimizer steps (Note [piece splitting] in
``partition.py``).

The inner optimizer steps one FP32 view of the flat master shard per run of a param group, a
*piece*. A piece is stepped or skipped as a whole and carries one set of scalar state (a step
count), so parameters skipped in a step (no gradient), or loaded with a different state, are
cut into pieces of their own. This mixin keeps ``_pieces``, the inner optimizer's param groups
and state, and the offload segments consistent with the partition's pieces when they are cut.
"""

from __future__ import annotations

import torch

from . import state as zstate


class PieceSplittingMixin:
    """Cutting pieces, and saying which pieces a step updates."""

    @torch.no_grad()
    def _split_pieces(self, cuts: dict) -> None:
        """Cut the pieces at ``cuts`` (partition.split), keeping ``self._pieces``, the inner
        optimizer's param groups and state, and the offload segments consistent with them."""
        part = self._partition
        old_pieces = list(part.pieces)
        replaced = part.split(cuts)
        if not replaced:
            return
        inner = self.inner
        ready = getattr(inner, "_fusedist_ready", None)
        tensors: list[torch.Tensor] = []
        for k, (piece, t) in enumerate(zip(old_pieces, self._pieces)):
            subs = replaced.get(k)
            if subs is None:
                tensors.append(t)
                continue
            st = inner.state.pop(t, None) or {}
            if ready is not None:
                ready.discard(id(t))
            new = []
            for sub in subs:
                u = self._masters.slice(sub.dtype, sub.start, sub.end)
                u.grad = self._piece_grads.slice(sub.dtype, sub.start, sub.end)
                if st:
                    inner.state[u] = self._slice_state(st, piece, sub)
                new.append(u)
            params = inner.param_groups[piece.group]["params"]
            at = next(j for j, x in enumerate(params) if x is t)  # identity: == is elementwise
            params[at:at + 1] = new
            tensors.extend(new)
        self._pieces = tensors
        if self._offload is not None:
            self._offload.build_segments()

    def _slice_state(self, st: dict, piece, sub) -> dict:
        # Views: the pieces together still use the same memory.
        return zstate.slice_state(st, piece.end - piece.start, sub.start - piece.start, sub.end - piece.start,
                                  copy=False, optimizer_name=self.optimizer_class.__name__,
                                  why="it cannot be split between parameters")

    def _pieces_to_step(self, skipped) -> list[bool]:
        """Split the pieces around the ``skipped`` parameters and say which pieces this step
        updates: those holding a parameter with a gradient, and shards of padding only."""
        part = self._partition
        if not skipped:
            return [True] * len(part.pieces)
        self._split_pieces(part.cuts_around(skipped))
        skipped = set(skipped)
        has_entry = [False] * len(part.pieces)
        stepped = [False] * len(part.pieces)
        for e in part.entries:
            k = part.piece_index(e)
            has_entry[k] = True
            if e.index not in skipped:
                stepped[k] = True
        return [s or not h for s, h in zip(stepped, has_entry)]

    def _restore_piece_grads(self, tensors) -> None:
        part = self._partition
        index = {id(t): k for k, t in enumerate(self._pieces)}
        for t in tensors:
            piece = part.pieces[index[id(t)]]
            t.grad = self._piece_grads.slice(piece.dtype, piece.start, piece.end)

    def _cuts_between_states(self, assembled: dict) -> dict:
        """Cuts separating neighbouring parameters whose loaded state differs in its keys or
        scalar values (or that has state next to one that has none), so each piece gets one
        consistent state."""
        def signature(index):
            item = assembled.get(index)
            if item is None or not item["state"]:
                return None
            sig = []
            for key, v in sorted(item["state"].items()):
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    sig.append((key, "elementwise"))
                else:
                    sig.append((key, float(v) if isinstance(v, torch.Tensor) else v))
            return tuple(sig)

        part = self._partition
        cuts: dict = {}
        previous = None
        for e in part.entries:
            sig = signature(e.index)
            if previous is not None and previous[0] == e.dtype and previous[1] != sig:
                cuts.setdefault(e.dtype, set()).add(part.owned_start[e.index])
            previous = (e.dtype, sig)
        return cuts
