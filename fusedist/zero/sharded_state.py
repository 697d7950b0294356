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

import operator
from typing import Optional

import torch

from .._tensor_tree import to_cpu
from ..comm.objects import gather_object
from ..ddp.layout import flat_like, shaped_like
from . import state as zstate
from .owner_ref import HeldByOptimizer
from .shard_state_dict import ShardStateDict
from .hyper_checks import check_loaded_hyperparameters
from .offload import check_offload_group


def _is_group_rank(to, world_size: int) -> bool:
    try:
        return 0 <= operator.index(to) < world_size
    except TypeError:
        return False


def _destination_error(to, rank: int, world_size: int, cause: str = "") -> ValueError:
    """``consolidate_state_dict(to=...)`` names a rank of the optimizer's process group, as torch's
    (whose optimizer gathers nowhere then, and whose ``state_dict()`` fails later). ``cause``: on a
    subgroup, which global ranks the group holds (a global rank is a likely mistake there)."""
    return ValueError(
        f"ZeroRedundancyOptimizer.consolidate_state_dict (rank {rank}): to={to!r} is not a rank of the "
        f"optimizer's process group, whose ranks are 0..{world_size - 1} (world size {world_size}); "
        "pass the rank (within that group) that should receive the full state dict" + (f" ({cause})" if cause else ""))


class ShardedState(HeldByOptimizer):
    """Saving and loading the state of one ZeroRedundancyOptimizer (``zero``)."""

    def __init__(self, zero):
        self._hold(zero)  # weakly (owner_ref.py)
        # consolidate_state_dict's full state on its ``to`` rank, returned by state_dict()
        # until a step or load changes the state, as torch's optimizer does.
        self.consolidated: Optional[dict] = None
        # Note [loaded state of parameters not sharded yet]: index -> assembled item.
        self.pending: dict[int, dict] = {}
        # Note [loaded masters that do not match the parameters]: index -> this rank's slice of
        # a loaded master that did not round to its parameter, until the next step.
        self.unmatched: dict[int, torch.Tensor] = {}

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

    def _without_step(self) -> bool:
        """Whether the full state dict leaves the step counts out, as the inner class's own does
        (FusedSGD: torch's SGD keeps none, and DCP loads by the target's keys)."""
        from ..optim.sgd import FusedSGD

        return issubclass(inner_class(self.zero), FusedSGD)

    def invalidate(self) -> None:
        """The optimizer state moves on (a step, a load, a new group): a consolidated copy is stale."""
        self.consolidated = None

    @torch.no_grad()
    def state_dict(self) -> dict:
        """``ZeroRedundancyOptimizer.state_dict``: the consolidated state while it is current, else the shard."""
        z = self.zero
        if self.consolidated is not None:
            return zstate.to_torch_format(self.consolidated, z._params, self._group_dicts(),
                                          without_step=self._without_step())
        return ShardStateDict(self.shard())  # Note [a shard read as the full state]

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
                                           optimizer_name=inner_class(z).__name__,
                                           why="it cannot be split across ranks")
                fragments[e.index] = [{
                    "range": (e.lo, e.hi),
                    "master": z._masters.slice(e.dtype, e.pos, e.pos + e.numel).clone(),
                    "state": state,
                }]
        fragments.update(z._empty.fragments())  # Note [parameters with no elements] in empty_params.py
        if z.rank == 0:  # Note [loaded state of parameters not sharded yet]: every rank holds it whole
            fragments.update({i: [{"range": (0, z._params[i].numel()), **item}] for i, item in self.pending.items()})
        return {
            "format": zstate.FORMAT,
            "stage": z.stage,
            "world_size": z.world_size,
            "rank": z.rank,
            "optimizer_class": inner_class(z).__name__,
            "algorithm": class_algorithm(inner_class(z)),  # what a load compares (algorithm_difference)
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
        alone = z.comm is None or z.world_size == 1
        # Every rank refuses a bad ``to`` alike, before any collective: each checks the same
        # value against the same group size, so no rank waits in a gather the others left.
        if not _is_group_rank(to, 1 if alone else z.world_size):
            cause = "" if alone or not isinstance(to, int) else z.comm._outside_group()
            raise _destination_error(to, z.rank, 1 if alone else z.world_size,
                                     cause if "global" in cause else "")
        to = operator.index(to)
        local = to_cpu(self.shard())
        if alone:
            everyone = [local]
        else:
            # Through the monitored path: a rank that never calls it is named in a StallError.
            everyone = gather_object(z.comm, local, to, tag="ZeroRedundancyOptimizer.consolidate_state_dict")
            if z.rank != to:
                return None
        merged = zstate.merge_fragments(everyone)
        self.consolidated = zstate.assemble(merged, z._params, range(len(z._params)),
                                             source="consolidate_state_dict", keep_empty=True, name=z._param_name)
        return zstate.to_torch_format(self.consolidated, z._params, self._group_dicts(),
                                      without_step=self._without_step())

    def load(self, state_dict, refusal=None) -> None:
        """``ZeroRedundancyOptimizer.load_state_dict``: validate everything, compare the
        hyperparameters it would install across ranks (Note [the same hyperparameters on every
        rank] in ``hyper_checks.py``), then apply. A refusal on some ranks only (``refusal``: one
        raised before, by a user's pre-hook) is raised on every rank, after the comparison, instead
        of leaving the others waiting in it."""
        z = self.zero
        prepared = None
        try:
            if refusal is None:
                prepared = self.prepare_load(state_dict)
        except Exception as exc:  # noqa: BLE001 - raised as it is, once the ranks have compared
            refusal = exc
        groups = z.param_groups if prepared is None else [{**h, "params": g["params"]}
                                                           for g, h in zip(z.param_groups, prepared[1])]
        check_loaded_hyperparameters(z, groups, refusal)
        self.apply(*prepared)

    def prepare_load(self, state_dict, source: str = "state dict"):
        """Validate ``state_dict`` and return ``(assembled, hyperparameters)`` for :meth:`apply`;
        raises :class:`StateDictError` without changing anything: every check the load could
        fail, the inner optimizer's own included (:meth:`_check_inner_accepts`), runs here."""
        z = self.zero
        sds = state_dict if isinstance(state_dict, (list, tuple)) else [state_dict]
        if not sds:
            raise zstate.StateDictError(f"{source}: empty list of state dicts")
        if all(isinstance(sd, dict) and sd.get("format") == zstate.FORMAT for sd in sds):
            self._check_shard_set(sds, source)
            self._check_algorithm(sds[0], source)
            meta = self._meta()
            for sd in sds:
                if [tuple(m["shape"]) for m in sd["param_meta"]] != [m["shape"] for m in meta]:
                    raise zstate.StateDictError(f"{source}: parameter shapes differ from the optimizer's")
            frags = zstate.merge_fragments(sds)
            groups = sds[0]["param_groups"]
        elif all(isinstance(sd, dict) and "state" in sd and "param_groups" in sd for sd in sds) and len(sds) == 1:
            frags = zstate.fragments_from_full(sds[0], z._params, z._param_name)
            groups = sds[0]["param_groups"]
        else:
            raise zstate.StateDictError(f"{source}: not a ZeroRedundancyOptimizer or torch optimizer state dict")
        from ..checkpoint._adam_family import keep_own_setting  # (the checkpoint package imports this one)

        groups = keep_own_setting({"param_groups": groups}, z)["param_groups"]
        zstate.check_groups(groups, z.param_groups, source)
        # Every parameter is assembled (and so validated) now; the rank keeps its own ranges.
        assembled = zstate.assemble(frags, z._params, range(len(z._params)), source=source, keep_empty=True,
                                    name=z._param_name)
        if sds[0].get("format") == zstate.FORMAT:
            zstate.relayout(assembled, z._params, sds[0]["param_meta"])
        hyper = self._check_inner_accepts(assembled, [zstate.hyperparameters(g) for g in groups], source)
        return assembled, hyper

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

    def _check_algorithm(self, shard: dict, source: str) -> None:
        """A shard of another algorithm (SGD's momentum into AdamW) is refused by name: its
        state may even load, and the optimizer would then step with the other algorithm's
        hyperparameters. A group saved without weight decay runs Adam or AdamW alike (Note [Adam
        without weight decay is AdamW without it] in ``checkpoint/_adam_family.py``), as a
        checkpoint's load reads it."""
        from ..checkpoint._adam_family import read_as_loading, recorded

        z = self.zero
        cls, saved_groups = inner_class(z), shard.get("param_groups")
        if saved_groups is not None:
            saved_groups = read_as_loading(saved_groups, recorded(saved_groups),
                                           list(group_algorithms(class_algorithm(cls), z.param_groups)))
        difference = algorithm_difference(shard.get("optimizer_class", "?"), shard.get("algorithm"), cls,
                                          saved_groups=saved_groups, groups=z.param_groups)
        if difference is not None:
            raise zstate.StateDictError(f"{source}: {difference}; nothing was changed")

    def _check_inner_accepts(self, assembled: dict, hyper: list[dict], source: str) -> list[dict]:
        """Run what :meth:`apply` hands the inner optimizer -- the saved groups' hyperparameters,
        one element of every state -- through a probe of the inner class: its construction, its
        own ``load_state_dict`` and, with offload, the host Adam's group check. These refusals (a
        tensor learning rate in a fused optimizer, another algorithm's state, amsgrad under
        offload) came after ``apply`` had changed the groups, the masters and the pieces, or at
        every later step. Returns each group's hyperparameters as the load installs them (Note
        [loaded groups replace the optimizer's]).

        Note [loaded groups replace the optimizer's]
            torch's ``Optimizer.load_state_dict`` takes each saved group as it is: a setting the
            saved group lacks (``initial_lr``, set by an LR scheduler built after the save) is
            gone after the load, and the class's ``__setstate__`` fills in its own defaults
            (AdamW: ``foreach``, ``differentiable``, ...). Merging the saved group into the
            rank's own kept such settings. The probe loads the saved groups as the inner class
            does, so its groups after the load are torch's result for that class.

        Note [probing the inner optimizer]
            The probe's parameters have one element (none for an empty parameter), so the
            checks cost nothing next to the load; every check an optimizer's loader makes is
            per-key, per-shape or per-group, so one element of each state exercises them all.
        """
        z = self.zero
        params, groups, state = [], [], {}
        for gi, group in enumerate(z.param_groups):
            merged = {**zstate.hyperparameters(group), **hyper[gi]}  # (to build the probe with)
            ids = []
            for index in [i for i in z._trainable if z._group_of[i] == gi] or [None]:
                ids.append(len(params))
                # complex for a complex parameter: its states are complex (a real probe casts them)
                dtype = z._master_dtype(z._params[index].dtype) if index is not None else torch.float32
                params.append(torch.zeros(min(1, z._params[index].numel()) if index is not None else 1,
                                          dtype=dtype if dtype.is_complex else torch.float32, requires_grad=True))
                item = assembled.get(index)
                if item is not None and item["state"]:
                    state[ids[-1]] = {k: self._probe_value(v, params[-1]) for k, v in item["state"].items()}
            groups.append((merged, ids))
        try:
            probe = z._optimizer_factory([{**merged, "params": [params[i] for i in ids]} for merged, ids in groups],
                                         **z._inner_defaults)
            probe.load_state_dict({"state": state,
                                   "param_groups": [{**h, "params": ids} for h, (_, ids) in zip(hyper, groups)]})
        except Exception as exc:  # noqa: BLE001 - whatever the inner loader raises, before anything changes
            raise zstate.StateDictError(
                f"{source}: the inner {inner_class(z).__name__} refuses it ({type(exc).__name__}: {exc}): "
                f"hyperparameters it cannot run, or the state of another algorithm than "
                f"{class_algorithm(inner_class(z))}'s; nothing was changed") from exc
        loaded = [zstate.hyperparameters(g) for g in probe.param_groups]
        for gi, h in enumerate(loaded if z.offload else ()):
            try:
                check_offload_group(h, gi)
            except (TypeError, ValueError) as exc:
                raise zstate.StateDictError(f"{source}: {exc}; nothing was changed") from exc
        return loaded

    @classmethod
    def _probe_value(cls, v, probe: torch.Tensor):
        """A state value as :meth:`apply` would hand it over, cut to ``probe``'s elements."""
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.reshape(-1)[:probe.numel()].to(cls._state_dtype(v, probe), copy=True)
        return v.clone() if isinstance(v, torch.Tensor) else v

    @torch.no_grad()
    def apply(self, assembled: dict, hyper: list[dict]) -> None:
        """Install a validated load: hyperparameters, then masters and inner-optimizer state of
        this rank's ranges (the optimizer state is created first if no step has run yet)."""
        z = self.zero
        self.invalidate()
        for group, h in zip(z.param_groups, hyper):  # Note [loaded groups replace the optimizer's]
            params = group["params"]
            group.clear()
            group["params"] = params
            group.update(h)
        z._ensure_state()
        z.wait_for_params()
        if z._offload is not None:
            z._offload.wait_host_buffers()
        self.unmatched = {}
        assembled = self._without_stale_masters(assembled)
        # Parameters with different scalar state (a step count, or no state at all: never
        # stepped) must not share a piece (Note [piece splitting]).
        z._split_pieces(z._cuts_between_states(assembled))
        new_state = self._fill_pieces(assembled)
        # Through the inner optimizer's own load_state_dict, so it places each state tensor
        # where it wants it (e.g. torch keeps a non-capturable Adam's ``step`` on the CPU).
        index_of = {}
        groups = []
        for group, inner_group in zip(z.param_groups, z.inner.param_groups):
            ids = []
            for t in inner_group["params"]:
                index_of[t] = len(index_of)
                ids.append(index_of[t])
            groups.append(dict(zstate.hyperparameters(group), params=ids))
        z.inner.state.clear()
        z.inner.load_state_dict({"state": {index_of[t]: st for t, st in new_state.items() if st},
                                    "param_groups": groups})
        zstate.keep_loaded_strings(z.inner.state, new_state)
        z._empty.load(assembled)  # Note [parameters with no elements] in empty_params.py
        sharded = set(z._trainable)
        self.pending = {i: item for i, item in assembled.items() if i not in sharded and z._params[i].numel()}
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

    def _fill_pieces(self, assembled: dict) -> dict:
        """Write the masters of this rank's ranges of the parameters in ``assembled`` into the
        master shards, and return their optimizer state per piece (piece tensor -> state; the
        pieces were cut so that each holds one consistent state)."""
        z = self.zero
        part = z._partition
        new_state: dict = {t: {} for t in z._pieces}
        for e in part.entries:
            item = assembled.get(e.index)
            if item is None:
                continue
            k = part.piece_index(e)
            piece, t = part.pieces[k], z._pieces[k]
            if not z._masters.aliases(e.dtype):  # (aliased: the parameter, written whole by the caller)
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
        return new_state

    # Note [loaded state of parameters not sharded yet]
    #     A load may carry the state of a parameter the optimizer holds but does not shard yet:
    #     resuming progressive unfreezing, the program unfreezes a layer and adds its group
    #     before loading, and with DDP the parameter joins the partition only in the backward
    #     after the next training forward (Note [growing the partition] in ``grow.py``). Its
    #     state was dropped: the layer restarted from fresh Adam moments and step count, where
    #     torch's optimizers (its ZeroRedundancyOptimizer too) resume it. So such state is kept,
    #     whole on every rank, installed into the rank's slices when the parameter joins
    #     (:meth:`install_joined`), and saved meanwhile with rank 0's shard (a frozen
    #     parameter's state stays in the state dicts, as in torch's). Its master, if any, is not
    #     written into the parameter: it is checked against it when installed (Note [loaded
    #     masters that do not match the parameters]).
    @torch.no_grad()
    def install_joined(self, indices) -> None:
        """Give the parameters ``indices``, just sharded, the state a load kept for them (Note
        [loaded state of parameters not sharded yet])."""
        z = self.zero
        items = {i: self.pending.pop(i) for i in indices if i in self.pending}
        if not items or z.inner is None:
            return
        items = self._without_stale_masters(items)  # (the parameter may have been written since the load)
        z._split_pieces(z._cuts_between_states(items))
        filled = {t: st for t, st in self._fill_pieces(items).items() if st}
        state_dict = z.inner.state_dict()  # (its indices: the pieces in param-group order)
        position = {id(t): n for n, t in enumerate(t for g in z.inner.param_groups for t in g["params"])}
        state_dict["state"].update({position[id(t)]: st for t, st in filled.items()})
        z.inner.load_state_dict(state_dict)

    # Note [loaded masters that do not match the parameters]
    #     A master the state dict carries may not belong to the parameters the program holds:
    #     torch's optimizers carry a ``master_param`` entry they do not know forward unchanged,
    #     so a consolidated state dict of bf16 parameters, resumed and trained on by torch's
    #     AdamW and loaded here again, holds the masters of the older step, while the model was
    #     given the newer weights; writing those masters into the parameters silently undid the
    #     steps trained meanwhile. The rule is fusedist.optim's (Note [loaded masters checked
    #     against the parameters] in ``fusedist/optim/_base.py``): a master this optimizer wrote
    #     the parameter from rounds to it exactly, so a consistent one is kept bit for bit; one
    #     that does not is dropped and the parameter taken, as when there is no master. Checked
    #     at load, after the model's load as ``fusedist.checkpoint.load`` does it. A program
    #     may load the optimizer first: then the parameters do not match yet, and the model's
    #     load bumps their versions, so the next step takes them into the masters (Note
    #     [parameters changed outside the optimizer] in ``shards.py``) -- rounded, losing what
    #     the FP32 masters hold. So this rank's slices of the dropped masters are kept until the
    #     next step, which takes a slice whose parameter it refreshes instead of the parameter
    #     if it rounds to it now (:meth:`take_matching_masters`), as fusedist.optim's check at
    #     the first step after a load keeps them in either order.
    def _without_stale_masters(self, assembled: dict) -> dict:
        """``assembled`` with the masters that do not round to their parameters dropped (Note
        [loaded masters that do not match the parameters])."""
        z = self.zero
        out = dict(assembled)
        for index, item in assembled.items():
            master, p = item["master"], z._params[index]
            if master is None or p.is_meta or p.numel() == 0:
                continue
            if not torch.equal(master.to(p.device, p.dtype), flat_like(p.detach(), p)):
                out[index] = {**item, "master": None}
                e = z._partition.entry_of.get(index)
                if e is not None and not z._masters.aliases(e.dtype):  # (aliased: the parameter is the master)
                    self.unmatched[index] = master[e.lo:e.hi].clone()
        return out

    @torch.no_grad()
    def take_matching_masters(self, entries) -> None:
        """After the masters of ``entries`` were refreshed from their parameters: take the
        loaded master slices kept for them instead where they round to the parameters now (Note
        [loaded masters that do not match the parameters])."""
        z = self.zero
        for e in entries:
            master = self.unmatched.pop(e.index, None)
            if master is None or z._masters.aliases(e.dtype):
                continue
            p = z._params[e.index]
            if torch.equal(master.to(p.device, p.dtype), flat_like(p.detach(), p)[e.lo:e.hi]):
                z._masters.slice(e.dtype, e.pos, e.pos + e.numel).copy_(master)

    @staticmethod
    def _state_dtype(v: torch.Tensor, t: torch.Tensor) -> torch.dtype:
        return v.dtype if v.is_floating_point() else t.dtype


# ---------------------------------------------------------------------------- algorithms
def inner_class(zero) -> type:
    """The class of the optimizer ``zero`` steps its shard with: ``optimizer_class``, which the
    construction resolved to the class a factory builds (``optimizer_type`` in factory.py),
    else -- a factory that could not be probed there -- the class of the inner optimizer it built.
    Why: ``optimizer_class=lambda groups, **kw: AdamW(groups, **kw)`` trains, but a lambda names
    no class, and ``fusedist.checkpoint.save`` failed on it reading the algorithm it records (and
    a load compares)."""
    cls = zero.optimizer_class
    if isinstance(cls, type) or zero.inner is None:
        return cls
    return type(zero.inner)


def class_algorithm(cls: type) -> str:
    """The algorithm an optimizer class runs, whichever implementation runs it: torch's and
    fusedist's fused class of one algorithm share it (AdamW for both ``torch.optim.AdamW``
    and ``FusedAdamW``), and a subclass defined elsewhere has the nearest torch or fusedist
    optimizer's among its bases. States of one algorithm load into each other."""
    from ..optim._base import FusedOptimizerBase

    for base in cls.__mro__:
        if base in (torch.optim.Optimizer, FusedOptimizerBase):
            break
        if base.__module__.startswith(("torch.optim.", "fusedist.optim.")):
            return unfused(base.__name__)
    return unfused(cls.__name__)


def unfused(name: str) -> str:
    return name[len("Fused"):] if name.startswith("Fused") and len(name) > len("Fused") else name


# Note [Adam and AdamW are one class in torch]
#     torch's AdamW is Adam with ``decoupled_weight_decay=True`` (a subclass that only sets it),
#     and the setting is read per param group; fusedist's FusedAdam takes it too. So the class
#     names one of two algorithms and the groups tell which: the state of torch's AdamW is the
#     state of ``Adam(decoupled_weight_decay=True)``, and was refused as another algorithm's.
#     Where the groups are known, the Adam family is compared by each group's setting (a group
#     without it runs its class's default); ``Adam`` saved with decoupled decay everywhere is
#     AdamW, and the other way round. Adam's L2 decay loaded into AdamW (or into Adam with
#     decoupled decay) stays refused: the loaded groups would switch the algorithm.
_ADAM_FAMILY = ("Adam", "AdamW")


def group_algorithms(algorithm: str, groups) -> Optional[tuple]:
    """Per param group, the algorithm it runs (Note [Adam and AdamW are one class in torch]):
    ``algorithm`` in every group, except that Adam's family reads each group's
    ``decoupled_weight_decay``. None where the groups are not known."""
    if groups is None:
        return None
    if algorithm not in _ADAM_FAMILY:
        return tuple(algorithm for _ in groups)
    default = algorithm == "AdamW"
    return tuple("AdamW" if bool(g.get("decoupled_weight_decay", default)) else "Adam" for g in groups)


def algorithm_difference(saved_class: str, saved_algorithm: Optional[str], cls: type, *,
                         saved_groups=None, groups=None) -> Optional[str]:
    """Why the state of ``saved_class`` (running ``saved_algorithm``, when recorded) cannot load
    into an optimizer of class ``cls``, or None. State saved before algorithms were recorded is
    compared only when its class is one of torch's or fusedist's (a class of its own names no
    algorithm). ``saved_groups`` / ``groups``: the param groups saved and of the optimizer loading
    them, where known; with them Adam and AdamW are told apart by their groups' settings (Note
    [Adam and AdamW are one class in torch])."""
    from .. import optim as fused

    algorithm = class_algorithm(cls)
    saved = saved_algorithm or unfused(saved_class)
    if saved in _ADAM_FAMILY and algorithm in _ADAM_FAMILY and groups is not None:
        mine = group_algorithms(algorithm, groups)
        theirs = group_algorithms(saved, saved_groups) if saved_groups is not None else None
        if theirs is None or len(theirs) != len(mine):
            theirs = tuple(saved for _ in mine)  # (the class's algorithm in every group)
        if theirs == mine:
            return None
        i = next(i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b)
        decoupled = groups[i].get("decoupled_weight_decay", algorithm == "AdamW")
        return (f"it holds the state of {saved_class} ({theirs[i]}), the optimizer here runs {cls.__name__} "
                f"({mine[i]}) in param group {i} (decoupled_weight_decay={decoupled!r}): its state and weight "
                "decay would be run as another algorithm's")
    if saved == algorithm:
        return None
    if saved_algorithm is None and not (hasattr(torch.optim, saved) or hasattr(fused, "Fused" + saved)):
        return None
    return (f"it holds the state of {saved_class} ({saved}), the optimizer here runs {cls.__name__} ({algorithm}): "
            "its state and hyperparameters would be read as another algorithm's")
