"""The gradient holder of ``fully_shard``'s parameters (``fusedist/ownership.py``).

A sharded parameter's ``.grad`` is this rank's piece of the gradient, so anything global
about the gradients -- the norm a clip scales by, whether any is inf/nan -- is a sum or a
max over the ranks. One holder serves every unit on one communicator (process group): a
clip over the whole model is then one small all-reduce, not one per unit.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..optim.grad_norms import flag_nan, per_tensor_global_norms, tensor_norms, unflag_nan
from ..optim.step_context import materialize_unscales
from ..ownership import register_gradient_holder
from .held_alike import check_held_alike, with_nonfinite_figures

__all__ = ["ShardedGradHolder", "holder_for", "joint_holder"]

_holders: "weakref.WeakValueDictionary[tuple, ShardedGradHolder]" = weakref.WeakValueDictionary()


class ShardedGradHolder:
    """Global gradient quantities over the pieces of ``fully_shard`` units on one communicator."""

    def __init__(self, comm, replicate=None, tp=None):
        self.comm = comm
        #: HSDP: the replicate group's communicator. Norms need only the shard group (replicas hold
        #: the same gradient shard after the all-reduce); the found-inf flag is also taken across
        #: replicas (Note [replicate all-reduce] in replicate.py)
        self.replicate = replicate
        #: tensor parallelism: the tensor-parallel group's communicator. Norms and the found-inf
        #: flag span it too, a piece every tensor-parallel rank holds alike counted once (Note
        #: [tensor-parallel parameters] in tensor_parallel.py)
        self.tp = tp
        self._tp_replicated = WeakIdKeyDictionary()  # pieces held alike by the tensor-parallel ranks
        #: whether ``all_reduce_sum`` of a sum over the pieces is the global sum (not with tensor
        #: parallelism, where the pieces of replicated parameters would be counted per rank)
        self.sums_exactly = tp is None

    def register(self, params, tp_replicated=None) -> None:
        """``tp_replicated``: for each of ``params``, whether every tensor-parallel rank holds the
        same values (a ``Replicate()`` or plain parameter of a tensor-parallel unit)."""
        register_gradient_holder(params, self)
        for p, same in zip(params, tp_replicated or ()):
            if same:
                self._tp_replicated[p] = True

    # Note [one norm on every tensor-parallel rank]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A parameter the tensor-parallel ranks hold alike is cut into pieces where each rank's
    # flat layout puts it, and the layouts differ between tensor-parallel ranks when their local
    # tensors differ in size (13 vocabulary rows over 2 ranks). Its pieces' sums of squares,
    # added over the data-parallel group, then group the same values differently on each
    # tensor-parallel rank: totals an ulp apart, a clip coefficient an ulp apart, and the
    # copies of that parameter drifting apart by ulps -- seen as a checkpoint round trip off by
    # 7e-9 on the second tensor-parallel rank. So the figure of such parameters is the first
    # tensor-parallel rank's, spread by the same all-reduce that sums the tensor-parallel
    # parts: every rank ends with the same bits.
    @torch.compiler.disable  # a collective: eager in a compiled step (Note [a compiled step runs eagerly] in zero)
    @torch.no_grad()
    def grad_norm(self, params, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of all ranks' pieces of these parameters' gradients (a collective: every
        rank calls it with the same parameters, also a rank whose pieces are empty). In float32,
        float64 where a gradient is float64: torch's norm of float64 gradients is not rounded to
        float32, nor is the clip coefficient taken from it (complex128 ones alike). With tensor
        parallelism it raises, on every rank, where gradients the tensor-parallel ranks should hold
        alike differ (Note [checking what is held alike] in held_alike.py)."""
        norm_type = float(norm_type)
        with_grad = [p for p in params if p.grad is not None]
        grads = [p.grad for p in with_grad]
        device = grads[0].device if grads else self.comm.device
        acc = torch.float64 if any(g.dtype in (torch.float64, torch.complex128) for g in grads) else torch.float32
        if norm_type == 0.0 or norm_type < 0.0:  # Note [norms that are not sums over pieces]
            norms = [n for n in self._global_norms(list(params), norm_type) if n is not None]
            if not norms:  # (torch's norm of no gradients)
                return torch.zeros((), dtype=acc, device=device)
            return torch.linalg.vector_norm(torch.stack(norms), norm_type).to(device=device, dtype=acc)
        alike = [self.tp is not None and p in self._tp_replicated for p in with_grad]
        if norm_type == float("inf"):
            return self._inf_norm(with_grad, alike, acc, device)
        k = sum(alike)
        # [0]: pieces each tensor-parallel rank holds its own part of; [1]: pieces they hold alike;
        # [2:]: each of those alone (Note [checking what is held alike] in held_alike.py)
        local = torch.zeros(2 + k, dtype=acc, device=device)
        if grads:
            powered = tensor_norms([g.detach() for g in grads], norm_type).to(acc).pow(norm_type)
            mask = torch.tensor(alike, dtype=torch.bool, device=device)
            local[0] += powered[~mask].sum()
            local[1] += powered[mask].sum()
            local[2:] = powered[mask]
        all_reduce_on_comm_device(self.comm, local, "sum", "fully_shard grad norm")
        if self.tp is None:
            return local.sum().pow(1.0 / norm_type)
        # Note [one norm on every tensor-parallel rank]: the first tensor-parallel rank's figure of
        # the pieces held alike; every rank's figures of each in slots of its own, to check them
        size, rank = self.tp.world_size, self.tp.rank
        slots = torch.zeros(2 + size * k, dtype=acc, device=device)
        slots[0] = local[0]
        if rank == 0:
            slots[1] = local[1]
        slots[2 + rank * k:2 + (rank + 1) * k] = local[2:]
        all_reduce_on_comm_device(self.tp, slots, "sum", "fully_shard grad norm (tensor-parallel)")
        total = slots[:2].sum()
        check_held_alike(slots[2:].view(size, k), [p for p, a in zip(with_grad, alike) if a], norm_type, total)
        # Note [a non-finite gradient held alike on one rank] in held_alike.py
        return with_nonfinite_figures(total, slots[2:]).pow(1.0 / norm_type)

    def _inf_norm(self, with_grad: list, alike: list, acc, device) -> torch.Tensor:
        """``grad_norm`` of order inf: the max over the pieces, by the max all-reduces the
        groups make anyway; with tensor parallelism each rank's max of each piece held alike
        rides in slots of its own for the check (Note [checking what is held alike])."""
        k = sum(alike)
        local = torch.zeros(1 + k, dtype=acc, device=device)  # [0]: every piece; [1:]: each held alike
        j = 1
        for p, same in zip(with_grad, alike):
            m = p.grad.detach().abs().max().to(acc) if p.grad.numel() else local.new_zeros(())
            local[0] = torch.maximum(local[0], m)
            if same:
                local[j] = m
                j += 1
        local = flag_nan(local)  # Note [a NaN through a max all-reduce] in optim/grad_norms.py
        all_reduce_on_comm_device(self.comm, local, "max", "fully_shard grad norm (inf)")
        local = unflag_nan(local)
        if self.tp is None:
            return local[0]
        size, rank = self.tp.world_size, self.tp.rank
        # (the other ranks' slots add nothing to a max; a NaN in a slot leaves it non-finite, unchecked)
        slots = torch.full((size, k), -float("inf"), dtype=acc, device=device)
        slots[rank] = local[1:]
        packed = torch.cat([flag_nan(local[:1]), slots.view(-1)])
        all_reduce_on_comm_device(self.tp, packed, "max", "fully_shard grad norm (inf, tensor-parallel)")
        total = unflag_nan(packed[:2])[0]
        check_held_alike(packed[2:].view(size, k), [p for p, a in zip(with_grad, alike) if a], float("inf"), total)
        return total

    @torch.compiler.disable  # a collective: eager in a compiled step (Note [a compiled step runs eagerly] in zero)
    @torch.no_grad()
    def parameter_grad_norms(self, params, norm_type: float = 2.0) -> list:
        """Each parameter's global gradient norm over all ranks' pieces, None where its piece
        has no ``.grad`` (then it has none on any rank, Note [rank-independent reductions] in
        grads.py): one all-reduce of one number per parameter over the shard group, which
        holds the whole gradient (HSDP replicas hold copies); with tensor parallelism one more
        over the tensor-parallel group, for the parameters whose local tensors are parts of the
        global one (those the tensor-parallel ranks hold alike keep the first one's figure, and
        every rank's rides beside it for the check of Note [checking what is held alike]).
        A collective: every rank of the groups calls it with the same parameters in the same
        order. The norms are in float64, for the caller to cast."""
        params = list(params)
        materialize_unscales(params)
        return self._global_norms(params, norm_type)

    # Note [norms that are not sums over pieces]
    #     torch's total norm is the norm of the per-tensor norms (FSDP2's too, each DTensor's
    #     norm reduced over the ranks first). For p > 0 and inf that is the p-norm of all the
    #     elements, so every rank's sum of p-th powers (its max) over its pieces gives it. For
    #     the other orders torch takes it is not -- 0 counts the tensors with a nonzero
    #     gradient, a negative p or -inf is pulled to 0 by one zero gradient -- so each
    #     parameter's norm is taken over every rank's piece first (``_global_norms``), then
    #     torch's norm of those norms.
    def _global_norms(self, params: list, norm_type: float) -> list:
        """``parameter_grad_norms`` without the unscale: each of ``params``' global gradient norm
        (float64), None where it has no ``.grad``. A collective."""
        norm_type = float(norm_type)
        device = self.comm.device
        held = [self.tp is not None and p in self._tp_replicated for p in params]
        alike = torch.tensor(held, dtype=torch.bool, device=device)
        k, n = sum(held), len(params)
        checked = {}  # the tensor-parallel ranks' figures of the pieces held alike, and the reduced values

        def reduce(t: torch.Tensor, op: str) -> None:
            all_reduce_on_comm_device(self.comm, t, op, "fully_shard per-parameter grad norms")
            if self.tp is None:
                return
            # Note [one norm on every tensor-parallel rank]: rank 0's for those held alike (the others
            # add nothing: 0 to a sum, -inf to a max, whose values may be negative); every rank's
            # figures of those in slots of their own, for the check (Note [checking what is held alike])
            nothing = -float("inf") if op == "max" else 0.0
            size, rank = self.tp.world_size, self.tp.rank
            # (the values only: NaN flags beside them are every rank's, Note [a non-finite gradient
            # held alike on one rank] in held_alike.py)
            mask = torch.cat([alike, alike.new_zeros(t.numel() - n)])
            slots = torch.full((size, k), nothing, dtype=t.dtype, device=t.device)
            slots[rank] = t[:n][alike]
            packed = torch.cat([t.masked_fill(mask, nothing) if rank != 0 else t, slots.view(-1)])
            all_reduce_on_comm_device(self.tp, packed, op, "fully_shard per-parameter grad norms (tensor-parallel)")
            t.copy_(packed[:t.numel()])
            checked["figures"] = figures = packed[t.numel():].view(size, k)
            if k:
                held_at = alike.nonzero().view(-1)
                t[held_at] = with_nonfinite_figures(t[held_at], figures, dim=0)

        def all_reduce(t: torch.Tensor, op: str) -> None:
            if op != "max":
                reduce(t, op)
                checked["values"] = t.clone()
                return
            # NaN flags beside the values (Note [a NaN through a max all-reduce] in optim/grad_norms.py)
            packed = flag_nan(t)
            reduce(packed, op)
            t.copy_(unflag_nan(packed))
            checked["values"] = t.clone()

        norms = per_tensor_global_norms(
            [p.grad.detach() if p.grad is not None else None for p in params], norm_type, device, all_reduce)
        if k:
            values = checked["values"].abs()
            total = values.max() if abs(norm_type) == float("inf") else values.sum()
            check_held_alike(checked["figures"], [p for p, a in zip(params, held) if a], norm_type, total)
        return [norms[i] if p.grad is not None else None for i, p in enumerate(params)]

    @torch.compiler.disable  # a collective: eager in a compiled step (Note [a compiled step runs eagerly] in zero)
    @torch.no_grad()
    def clip_sharded_grads_(self, params, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the sharded parameters ``params``: the
        global norm (one all-reduce), and every rank scales its pieces by the same factor."""
        params = list(params)
        materialize_unscales(params)
        total = self.grad_norm(params, norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"fusedist.clip_grad_norm_: the total norm of order {float(norm_type)} of the sharded "
                "gradients is non-finite, so it cannot be clipped (every rank raises this). Set "
                "error_if_nonfinite=False to clip anyway.")
        grads = [p.grad for p in params if p.grad is not None]
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total

    @torch.compiler.disable  # a collective: eager in a compiled step (Note [a compiled step runs eagerly] in zero)
    def all_reduce_found_inf(self, found_inf: torch.Tensor) -> torch.Tensor:
        """Max of the ranks' inf/nan flags, in place (GradScaler: every rank skips together)."""
        all_reduce_on_comm_device(self.comm, found_inf, "max", "fully_shard found inf")
        if self.replicate is not None:
            all_reduce_on_comm_device(self.replicate, found_inf, "max", "fully_shard found inf (replicas)")
        if self.tp is not None:
            all_reduce_on_comm_device(self.tp, found_inf, "max", "fully_shard found inf (tensor-parallel)")
        return found_inf

    @torch.compiler.disable  # a collective: eager in a compiled step (Note [a compiled step runs eagerly] in zero)
    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (GradScaler: the global sum of squares of the pieces)."""
        all_reduce_on_comm_device(self.comm, value, "sum", "fully_shard grad sumsq")
        return value


def all_reduce_on_comm_device(comm, t: torch.Tensor, op: str, tag: str) -> None:
    """All-reduce ``t`` in place over ``comm``, through the communicator's device when ``t`` is
    elsewhere: with ``CPUOffloadPolicy`` on CUDA the pieces and their gradients live in host
    memory, where the NCCL communicator cannot reduce (a few numbers: the copies cost nothing)."""
    if t.device == comm.device:
        comm.all_reduce(t.view(-1), op=op, tag=tag)
        return
    moved = t.to(comm.device)
    comm.all_reduce(moved.view(-1), op=op, tag=tag)
    t.copy_(moved)


def holder_for(comm, replicate=None, tp=None) -> ShardedGradHolder:
    """The one holder of ``comm`` and, on HSDP, the replicate group's ``replicate``, with
    tensor parallelism the tensor-parallel group's ``tp`` (created on first use; kept alive by
    the units using it)."""
    key = (id(comm), id(replicate), id(tp))
    holder = _holders.get(key)
    if holder is None or holder.comm is not comm or holder.replicate is not replicate or holder.tp is not tp:
        from ..amp.torch_scaler import install  # Note [torch's scaler on sharded gradients]

        install()
        holder = ShardedGradHolder(comm, replicate, tp)
        _holders[key] = holder
    return holder


# Note [plain units beside tensor-parallel ones]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In a tensor-parallel model a unit with no tensor-parallel parameter (``fully_shard(m.head)`` on a
# plain module left out of the plan, on ``mesh["dp"]``) knows nothing of the tensor-parallel group
# by itself. Its parameters are held alike by the tensor-parallel ranks (they see the same
# inputs), like a ``Replicate()`` parameter of a tensor-parallel unit, and what is global about its
# gradients spans that group too: a clip over the whole model is one norm, its pieces counted
# once over the tensor-parallel ranks (Note [one norm on every tensor-parallel rank]), and an inf
# in its gradient on one tensor-parallel rank must skip the step on all of them -- else the ranks
# that stepped and those that skipped hold different copies from then on, and different scales
# (an optimizer over the plain unit alone reduced its flag over the data-parallel group only; so
# does torch's GradScaler over FSDP2 for a gradient replicated over the tensor-parallel mesh,
# whose found-inf it reduces over its sharded mesh dims only: FSDP2's ranks part there). So
# a ``fully_shard`` call whose modules hold the units of one tensor-parallel holder (the root's
# call, made last, sees them all) moves the plain units on the same data-parallel and replicate
# communicators to that holder (``share_tensor_parallel_holder`` in held_alike.py): the same
# decision on every rank, as it follows the model's structure. Units sharded without such a
# common call are measured together by the clip all the same (``joint_holder``). Whether those
# pieces really are alike is checked by the clip (Note [checking what is held alike] in
# held_alike.py).
def joint_holder(groups: list):
    """One holder measuring every ``(holder, params)`` of ``groups`` together, with ``params``
    concatenated: ``(holder, params)``, or None where their norms do not combine (other
    data-parallel or replicate communicators, two tensor-parallel groups, not ``fully_shard``
    holders). Same on every rank of a data-parallel group: the holders follow the units."""
    holders = [h for h, _ in groups]
    first = holders[0]
    if not all(isinstance(h, ShardedGradHolder) for h in holders):
        return None
    if any(h.comm is not first.comm or h.replicate is not first.replicate for h in holders):
        return None
    tps = {id(h.tp): h.tp for h in holders if h.tp is not None}
    if len(tps) != 1:
        return None
    joint = ShardedGradHolder(first.comm, first.replicate, next(iter(tps.values())))
    params = []
    for h, ps in groups:
        for p in ps:
            params.append(p)
            if h.tp is None or p in h._tp_replicated:
                joint._tp_replicated[p] = True
    return joint, params
