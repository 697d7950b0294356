"""The state dicts of a ZeroRedundancyOptimizer: its shard, the consolidated full state, and
loading either at any world size.

A shard holds, per parameter, the fragments of master and optimizer state this rank owns (Note
[fragments] in ``state.py``, which has the layout-independent format and its checks); this
module maps them to and from the optimizer's flat masters and pieces. :class:`ShardedState`
owns the one piece of state that only state dicts need: the full state gathered by
``consolidate_state_dict`` (returned by ``state_dict()`` until the state moves on, as torch's
ZeroRedundancyOptimizer does). The shards exist from the optimizer's construction, so a load
is applied at once, whenever it comes.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._tensor_tree import to_cpu
from ..comm.objects import gather_object
from ..ddp.layout import flat_like, shaped_like
from . import state as zstate


class ShardedState:
    """Saving and loading the state of one ZeroRedundancyOptimizer (``zero``)."""

    def __init__(self, zero):
        self.zero = zero
        # consolidate_state_dict's full state on its ``to`` rank, returned by state_dict()
        # until a step or load changes the state, as torch's optimizer does.
        self.consolidated: Optional[dict] = None

    def _meta(self) -> list[dict]:
        z = self.zero
        return zstate.param_meta(z._params)

    def _group_dicts(self) -> list[dict]:
        z = self.zero
        out, start = [], 0
        for g in z.param_groups:
            n = len(g["params"])
            out.append(dict(zstate.hyperparameters(g), params=list(range(start, start + n))))
            start += n
        return out

    def invalidate(self) -> None:
        """The optimizer state moves on (a step, a load, a new group): a consolidated copy is stale."""
        self.consolidated = None

    @torch.no_grad()
    def state_dict(self) -> dict:
        """``ZeroRedundancyOptimizer.state_dict``: the consolidated state while it is current, else the shard."""
        z = self.zero
        if self.consolidated is not None:
            return zstate.to_torch_format(self.consolidated, z._params, self._group_dicts())
        return self.shard()

    def shard(self) -> dict:
        """``ZeroRedundancyOptimizer.shard_state_dict``."""
        z = self.zero
        z.wait_for_params()
        fragments: dict[int, list] = {}
        if z.inner is not None:  # (before the first step or load there is no state to save)
            part = z._partition
            piece_tensor = {piece: t for piece, t in zip(part.pieces, z._pieces)}
            for e in part.entries:
                piece = part.piece_of(e)
                st = z.inner.state.get(piece_tensor[piece], {})
                if not st:
                    continue
                off = e.pos - piece.start
                state = zstate.slice_state(st, piece.end - piece.start, off, off + e.numel, copy=True,
                                           optimizer_name=z.optimizer_class.__name__,
                                           why="it cannot be split across ranks")
                fragments[e.index] = [{
                    "range": (e.lo, e.hi),
                    "master": z._masters.slice(e.dtype, e.pos, e.pos + e.numel).clone(),
                    "state": state,
                }]
        return {
            "format": zstate.FORMAT,
            "stage": z.stage,
            "world_size": z.world_size,
            "rank": z.rank,
            "optimizer_class": z.optimizer_class.__name__,
            "param_groups": self._group_dicts(),
            "param_meta": self._meta(),
            # Informational: loading never needs it (fragments are layout independent).
            "layout": [
                {"bucket": bs.bucket.index, "dtype": str(bs.bucket.dtype), "numel": bs.bucket.numel,
                 "shard": (bs.lo, bs.hi)} for bs in z._partition.bucket_shards],
            "fragments": fragments,
        }

    def consolidate(self, to: int = 0) -> Optional[dict]:
        """``ZeroRedundancyOptimizer.consolidate_state_dict`` (a collective)."""
        z = self.zero
        local = to_cpu(self.shard())
        if z.comm is None or z.world_size == 1:
            everyone = [local]
        else:
            # Through the monitored path: a rank that never calls it is named in a StallError.
            everyone = gather_object(z.comm, local, to, tag="ZeroRedundancyOptimizer.consolidate_state_dict")
            if z.rank != to:
                return None
        merged = zstate.merge_fragments(everyone)
        self.consolidated = zstate.assemble(merged, z._params, range(len(z._params)),
                                             source="consolidate_state_dict")
        return zstate.to_torch_format(self.consolidated, z._params, self._group_dicts())

    def load(self, state_dict) -> None:
        """``ZeroRedundancyOptimizer.load_state_dict``: validate everything, then apply."""
        self.apply(*self.prepare_load(state_dict))

    def prepare_load(self, state_dict, source: str = "state dict"):
        """Validate ``state_dict`` and return ``(assembled, hyperparameters)`` for :meth:`apply`;
        raises :class:`StateDictError` without changing anything."""
        z = self.zero
        sds = state_dict if isinstance(state_dict, (list, tuple)) else [state_dict]
        if not sds:
            raise zstate.StateDictError(f"{source}: empty list of state dicts")
        if all(isinstance(sd, dict) and sd.get("format") == zstate.FORMAT for sd in sds):
            self._check_shard_set(sds, source)
            meta = self._meta()
            for sd in sds:
                if [tuple(m["shape"]) for m in sd["param_meta"]] != [m["shape"] for m in meta]:
                    raise zstate.StateDictError(f"{source}: parameter shapes differ from the optimizer's")
            frags = zstate.merge_fragments(sds)
            groups = sds[0]["param_groups"]
        elif all(isinstance(sd, dict) and "state" in sd and "param_groups" in sd for sd in sds) and len(sds) == 1:
            frags = zstate.fragments_from_full(sds[0], z._params)
            groups = sds[0]["param_groups"]
        else:
            raise zstate.StateDictError(f"{source}: not a ZeroRedundancyOptimizer or torch optimizer state dict")
        zstate.check_groups(groups, z.param_groups, source)
        # Every parameter is assembled (and so validated) now; the rank keeps its own ranges.
        assembled = zstate.assemble(frags, z._params, range(len(z._params)), source=source)
        if sds[0].get("format") == zstate.FORMAT:
            zstate.relayout(assembled, z._params, sds[0]["param_meta"])
        return assembled, [zstate.hyperparameters(g) for g in groups]

    def _check_shard_set(self, sds: list, source: str) -> None:
        """Shards load as a complete set: every rank of the world that saved them. A partial set
        would silently give the parameters of the missing ranks no state (a parameter without
        fragments was never stepped, as far as the fragments tell)."""
        z = self.zero
        if any(sd.get("replicated") for sd in sds):
            return  # written by earlier versions: each holds the whole state (merge_fragments takes one)
        given = sorted((sd.get("rank"), sd.get("world_size")) for sd in sds)
        sizes = {size for _, size in given}
        if len(sizes) == 1 and [r for r, _ in given] == list(range(next(iter(sizes)))):
            return
        raise zstate.StateDictError(
            f"{source}: got the ZeroRedundancyOptimizer shard(s) of ranks {[r for r, _ in given]} of a world "
            f"of {sorted(sizes)} (this is rank {z.rank} of {z.world_size}); a shard holds one rank's "
            "part of the state, so the other ranks' parameters would load without state. Pass every "
            "rank's shard (a list) or a full state dict: on the saving side, "
            "consolidate_state_dict(to=0) and then state_dict() on rank 0, or fusedist.checkpoint.save"
        )

    @torch.no_grad()
    def apply(self, assembled: dict, hyper: list[dict]) -> None:
        """Install a validated load: hyperparameters, then masters and inner-optimizer state of
        this rank's ranges (the optimizer state is created first if no step has run yet)."""
        z = self.zero
        self.invalidate()
        for group, h in zip(z.param_groups, hyper):
            group.update(h)
        z._ensure_state()
        z.wait_for_params()
        if z._offload is not None:
            z._offload.wait_host_buffers()
        part = z._partition
        # Parameters with different scalar state (a step count, or no state at all: never
        # stepped) must not share a piece (Note [piece splitting]).
        z._split_pieces(z._cuts_between_states(assembled))
        new_state: dict = {t: {} for t in z._pieces}
        for e in part.entries:
            item = assembled.get(e.index)
            if item is None:
                continue
            k = part.piece_index(e)
            piece, t = part.pieces[k], z._pieces[k]
            if not z._masters.aliases(e.dtype):  # (aliased: the parameter, written whole below)
                master = z._masters.slice(e.dtype, e.pos, e.pos + e.numel)
                p = z._params[e.index]
                master.copy_(item["master"][e.lo:e.hi] if item["master"] is not None
                             else flat_like(p.detach(), p)[e.lo:e.hi])
            st = new_state[t]
            n_piece = piece.end - piece.start
            off = e.pos - piece.start
            for key, v in item["state"].items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    if key not in st:
                        st[key] = torch.zeros(n_piece, dtype=self._state_dtype(v, t), device=t.device)
                    st[key][off:off + e.numel].copy_(v[e.lo:e.hi])
                else:
                    st.setdefault(key, v.clone().to(t.device) if isinstance(v, torch.Tensor) else v)
        # Through the inner optimizer's own load_state_dict, so it places each state tensor
        # where it wants it (e.g. torch keeps a non-capturable Adam's ``step`` on the CPU).
        for group, inner_group in zip(z.param_groups, z.inner.param_groups):
            inner_group.update(zstate.hyperparameters(group))
        index_of = {}
        groups = []
        for inner_group in z.inner.param_groups:
            ids = []
            for t in inner_group["params"]:
                index_of[t] = len(index_of)
                ids.append(index_of[t])
            groups.append(dict(zstate.hyperparameters(inner_group), params=ids))
        z.inner.state.clear()
        z.inner.load_state_dict({"state": {index_of[t]: st for t, st in new_state.items() if st},
                                    "param_groups": groups})
        # The parameters take the loaded masters' values now, whole and on every rank (the
        # assembled state holds every parameter): aliased masters (Note [shards aliasing the
        # parameters and gradients]) are the parameters, and writing only this rank's slices
        # of them left the ranks' parameters different until the next step's all-gather; a
        # half-precision parameter is its master rounded, as the step's publish writes it.
        for i in z._trainable:
            item, p = assembled.get(i), z._params[i]
            if item is not None and item["master"] is not None:
                p.detach().copy_(shaped_like(item["master"], p))
        # The loaded masters are current (Note [parameters changed outside the optimizer]).
        z._record_param_versions()

    @staticmethod
    def _state_dtype(v: torch.Tensor, t: torch.Tensor) -> torch.dtype:
        return v.dtype if v.is_floating_point() else t.dtype
