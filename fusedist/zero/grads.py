"""Which gradients a ZeroRedundancyOptimizer has, and where they are.

Stage 1 reads this rank's slices of the full averaged gradients in ``p.grad`` and collects
them into its flat FP32 gradient shard at ``step()``; stage 2 receives the shard itself from
DDP's reduce-scatter (``grad_sync.py``), which reports the parameters no rank gave a
gradient. The step skips trainable parameters without a gradient (Note [piece splitting] in
``partition.py``) and refuses frozen ones that have one. A mixin: a few methods over the
optimizer's gradient shards (``_grad_shards``, ``_grads_present``, ``_stage2_with_grad``,
``_stage2_zero_filled``).

Note [zero-filled gradients in stage 2]
    ``zero_grad(set_to_none=False)`` leaves torch's parameters with zero-filled gradients, and
    a parameter that had one keeps it from then on: when no rank uses it in a later backward
    (DDP's ``find_unused_parameters``) its gradient is zeros, not None, so torch's optimizer
    still steps it -- Adam's moments decay and the update goes on, weight decay applies.
    Stage 2 keeps no ``p.grad``; the parameters a step treats as having a gradient are those a
    synchronized backward reduced since the last step (``_stage2_with_grad``) and, after
    ``zero_grad(set_to_none=False)``, those that had a gradient in earlier steps
    (``_stage2_zero_filled``), whose gradient-shard slices hold the zeros DDP fills unused
    slots with -- or, when no backward ran since, zeros the step writes itself
    (``_zero_fill_without_backward``). ``zero_grad(set_to_none=True)`` forgets them, as torch sets every gradient to
    None. ``module.zero_grad()`` cannot reach the optimizer: it counts as setting to None, its
    default.

Note [per-parameter gradient slices]
    Per-parameter gradient quantities (the norms a logger shows, Note [gradient norms under ZeRO
    stage 2] in ``fusedist/integrations/lightning_grad_norm.py``) need each parameter's part of
    this rank's gradients without knowing the flat layout. ``gradient_slices()`` yields one
    pair per parameter that has a gradient, also where this rank holds none of it (an empty
    slice: the parameter lies in other ranks' parts of its bucket, or has no elements), so the
    sequence is the same on every rank and a caller's reduction of one number per pair lines
    up; which parameters have a gradient is decided as the step decides it (Note [zero-filled
    gradients in stage 2]). A parameter meets a rank's shard in at most one contiguous range
    (Note [flat partition]), so one slice per parameter covers it; the slices of one parameter
    over all ranks are its whole gradient, in its memory order.

Note [clipping some of the parameters in stage 2]
    A clip over some of the parameters (timm's ``clip_grad_norm_`` that leaves the head out)
    measures and scales those gradients only. The step's clip coefficient is one factor for
    every piece, so such a clip cannot be deferred to the step: it applies any pending unscale
    and recorded clip to the shards first (the values torch's ``p.grad`` would hold), takes
    the norm of the parameters' slices (one all-reduce of two numbers) and scales those slices
    in place, as torch's clip scales ``p.grad``. It costs a pass over the shards, as torch's
    clip does. Under ``join()`` it is refused: a joined rank replays the clip of all the
    parameters it is announced (Note [the announce] in ``join.py``).
"""

from __future__ import annotations


import torch

from ..ddp.layout import flat_like
from ..optim._negated import memory_view
from ..optim.grad_norms import flag_nan, norm_result_dtype, per_tensor_global_norms, tensor_norms, unflag_nan
from . import grow


class GradientsMixin:
    """Reading, collecting and accounting for this rank's gradients."""

    def _stage1_grad_views(self):
        """(shard entry, source view) pairs of this rank's gradient slices in ``p.grad``."""
        part = self._partition
        pairs = []
        for e in part.entries:
            g = self._params[e.index].grad
            if g is None:
                continue
            if g.is_sparse:
                raise self._sparse_grad_error(e.index)
            flat = flat_like(g, self._params[e.index])  # the slot's (memory) order
            pairs.append((e, flat[e.lo:e.hi]))
        return pairs

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's gradient slices, wherever they live now (read-only use)."""
        if self.stage == 2:
            return list(self._grad_shards.values()) if self._grads_present else []
        return [src for _, src in self._stage1_grad_views()]

    # ---- the stage-2 reduce-scatter's three calls (Note [stage 2 gradients] in grad_sync.py)
    def bucket_shard(self, bucket_index: int) -> tuple:
        """``(lo, hi)``: this rank's element range of DDP bucket ``bucket_index``."""
        bs = self._partition.bucket_shards[bucket_index]
        return bs.lo, bs.hi

    def store_reduced(self, bucket_index: int, value: torch.Tensor, post: float = 1.0) -> None:
        """This rank's slice of an averaged bucket (still to be divided by ``post``): copied
        into the gradient shard after a step or ``zero_grad``, else added (torch's
        accumulation over synchronized backward passes)."""
        bs = self._partition.bucket_shards[bucket_index]
        offload = self._offload
        if offload is not None:
            offload.before_grad_write(bs)
        dst = self._grad_shards[bs.bucket.dtype][bs.pos:bs.pos + bs.hi - bs.lo]
        if self._grads_present:
            value = value.to(dst.dtype)
            if post != 1.0:
                value = value / post
            dst.add_(value)
        else:
            dst.copy_(value)
            if post != 1.0:
                dst.div_(post)
        if offload is not None:
            offload.grad_ready(bs)  # Note [offload pipeline]: down while backward goes on

    def end_reduction(self, reducer) -> None:
        """After each synchronized backward: which parameters no rank gave a gradient (DDP
        left their grad None, Note [unused parameters]; their slices hold zeros), and the
        gradients DDP averaged outside its buckets (parameters it took on in this backward)."""
        caught = grow.store_caught_up(self, reducer, self._grads_present)  # Note [growing the partition]
        # A parameter trainable again after being frozen was inactive in this backward, so DDP
        # lists it without a gradient, although it took it on (averaged) at the end: it has one.
        without = set(reducer.params_without_grad).difference(caught)
        self._note_params_without_grad([i for i, p in enumerate(self._params) if p in without])
        self._grads_present = True

    def _zero_fill_without_backward(self) -> None:
        """Stage 2: with no synchronized backward since ``zero_grad(set_to_none=False)``,
        torch's parameters still hold zero gradients and its optimizer steps them (moments
        decay, weight decay applies); the shard is made those zeros, so a step, a clip or a
        scaler's check sees what torch's would (Note [zero-filled gradients in stage 2]). A
        later backward adds onto them, as it adds onto torch's zeros."""
        if self.stage != 2 or self._grads_present or not self._stage2_zero_filled:
            return
        for shard in self._grad_shards.values():
            shard.zero_()  # the offload pipeline copies a changed shard down (its version moved)
        self._grads_present = True

    def _has_any_grad(self) -> bool:
        if self.stage == 2:
            return self._grads_present
        return any(self._params[i].grad is not None for i in self._trainable)

    def _note_params_without_grad(self, indices) -> None:
        """Stage 2, after each synchronized backward: ``indices`` are the parameters DDP left
        without a gradient (no rank used them). The others count as having a gradient until
        the step consumes the shard (Note [piece splitting])."""
        if not self._grads_present:
            self._stage2_with_grad = set()
        self._stage2_with_grad.update(set(self._trainable).difference(indices))

    def _params_without_grad(self) -> list[int]:
        """Trainable parameters the coming step skips, as torch would (their grad is None)."""
        if self.stage == 2:
            held = self._stage2_with_grad | self._stage2_zero_filled  # Note [zero-filled gradients in stage 2]
            return [i for i in self._trainable if i not in held]
        return [i for i in self._trainable if self._params[i].grad is None]

    def _forget_grads(self, set_to_none: bool, stepped: bool = False) -> None:
        """After a step (``stepped``) or ``zero_grad``: the next synchronized backward starts a
        new gradient shard. Which parameters keep a (zero-filled) gradient in torch's terms:
        Note [zero-filled gradients in stage 2]."""
        if stepped:
            self._stage2_stepped = self._stage2_with_grad | self._stage2_zero_filled
        elif set_to_none:
            self._stage2_zero_filled, self._stage2_stepped = set(), set()
        else:
            self._stage2_zero_filled |= self._stage2_stepped | self._stage2_with_grad
        self._grads_present = False  # the next reduce-scatter overwrites the shard
        self._stage2_with_grad = set()

    def _sparse_grad_error(self, index: int) -> RuntimeError:
        """A sparse gradient (``nn.Embedding(sparse=True)``) has no flat slices to shard; torch's
        ZeroRedundancyOptimizer refuses it too. Checked before the frozen-parameter check: DDP
        averages such a weight outside its buckets, so it is never sharded and would be
        reported as frozen, which points the wrong way."""
        return RuntimeError(
            f"ZeroRedundancyOptimizer (rank {self.rank}): {self._param_name(index)} has a sparse gradient; "
            "ZeRO shards dense gradients only (as torch's ZeroRedundancyOptimizer). Build the module with "
            "sparse=False, or give this parameter to an optimizer of its own outside ZeroRedundancyOptimizer.")

    def _check_frozen_grads(self) -> None:
        kept = self._trainable_verdict is not None  # (a parameter refused with the other ranks at the next step:
        for i in self._frozen:                      # Note [the comparison read without a synchronization])
            if kept and self._params[i].requires_grad:
                continue
            grad = self._params[i].grad
            if grad is not None and grad.is_sparse:
                raise self._sparse_grad_error(i)
            if grad is not None:
                raise RuntimeError(
                    f"ZeroRedundancyOptimizer: {self._param_name(i)} has a gradient, but it is not sharded: "
                    "it had requires_grad=False when the optimizer was constructed and "
                    + ("its DistributedDataParallel model does not reduce it yet (it takes a parameter on "
                       "in the synchronized backward of a training forward that saw it trainable)"
                       if self.ddp is not None else "it still has requires_grad=False")
                    + ". Set requires_grad=True before the forward that trains it (it then joins the "
                    "shards), or set its grad to None."
                )

    @torch.no_grad()
    def _collect_stage1_grads(self) -> None:
        for shard in self._grad_shards.values():
            shard.zero_()  # slices of parameters without a gradient are skipped, not read
        store = self._grad_store
        for e, src in self._stage1_grad_views():
            dst = store.slice(e.dtype, e.pos, e.pos + e.numel)
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)  # (copy_ reads a negated or conjugated view's values)
            elif src.is_neg() or src.is_conj():  # Note [lazily flagged gradients over their bucket view]
                self._resolve_in_place(e.index)
            # (else aliased: p.grad is its bucket view already)

    # Note [lazily flagged gradients over their bucket view]
    #     In stage 1 with DDP, ``p.grad`` is a view of its bucket, which is the gradient shard's
    #     memory (Note [shards aliasing the parameters and gradients] in ``shard_store.py``), so
    #     the step reads it without a copy. A program may replace it by a lazily negated or
    #     conjugated view of the same memory (``p.grad = torch._neg_view(g.neg_())``,
    #     ``p.grad = g.conj_physical_().conj()``: the values are the same, the memory holds their
    #     negation or conjugate). The shard then held ``-value`` and was stepped the wrong way,
    #     where torch's optimizers read the values. The memory is made to hold the values (a
    #     copy of the view onto itself, element by element) and ``p.grad`` becomes the plain
    #     view of it again, with the values it had: the bucket view, as DDP made it.
    def _resolve_in_place(self, index: int) -> None:
        p = self._params[index]
        g = p.grad
        plain = memory_view(g)  # (the negative bit cleared: the memory as it is)
        if plain.is_conj():
            plain = plain.conj()  # (the conjugate bit cleared, a view)
        plain.copy_(g)
        p.grad = plain

    @torch.no_grad()
    def gradient_slices(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, slice)`` for every parameter with a gradient for the coming step (torch's
        ``p.grad is not None``), in the optimizer's parameter order: ``slice`` is the flat
        part of its averaged gradient this rank holds, empty where it holds none (Note
        [per-parameter gradient slices]). Read-only views: stage 2's of the gradient shards
        (scaled while a GradScaler's unscale is pending: ``step_context.inv_scale``), stage
        1's of ``p.grad``. The same parameters in the same order on every rank, so a caller
        can all-reduce one number per pair; a collective where parameters may have joined
        since the last step (Note [parameters unfrozen on some ranks only] in trainable_check.py)."""
        # As the scaler's check: every rank calls it (Note [one comparison a step] in trainable_check.py).
        grow.join_pending(self, compare=True)
        self._zero_fill_without_backward()
        if self.stage == 2:
            if not self._grads_present:
                return []
            shards = self._grad_shards
            views = {e.index: shards[e.dtype][e.pos:e.pos + e.numel] for e in self._partition.entries}
        else:
            shards = {}
            views = {e.index: src for e, src in self._stage1_grad_views()}
        without = set(self._params_without_grad())
        pairs = []
        for i in self._trainable:
            if i in without:
                continue
            p = self._params[i]
            view = views.get(i)
            if view is None:  # no element of it on this rank (or none at all: zero elements)
                like = shards.get(p.dtype, p.grad)
                view = (like if like is not None else p).new_empty(0)
            pairs.append((p, view))
        return pairs

    @torch.compiler.disable  # an all-reduce (Note [a compiled step runs eagerly] in optimizer.py)
    @torch.no_grad()
    def clip_grads_of_(self, params: list, max_norm: float, norm_type: float = 2.0,
                       error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over ``params``, some or all of this optimizer's
        parameters: the norm of their gradients over every rank's shard (all of them: the
        coefficient is applied in the step; some: Note [clipping some of the parameters in
        stage 2]). A collective: every rank passes the same parameters."""
        trainable = {id(p) for p in self._trainable_params()}
        wanted = {id(p) for p in params if p.requires_grad}
        if wanted == trainable or self.stage != 2:
            return self.clip_sharded_grads_(params, max_norm, norm_type, error_if_nonfinite)
        norm_type = float(norm_type)
        if wanted - trainable:
            raise ValueError("fusedist.clip_grad_norm_: some of these parameters are not trained by the "
                             "ZeroRedundancyOptimizer(stage=2) that holds the others' gradients")
        if self._join_config.enable:
            raise NotImplementedError(
                "fusedist.clip_grad_norm_: ZeroRedundancyOptimizer(stage=2) under join() clips all of its "
                f"parameters or none ({len(wanted)} of its {len(trainable)} trainable parameters were given): "
                "a rank out of data replays the clip of all of them. Clip all of the optimizer's parameters "
                "(optimizer.clip_grad_norm_), or use stage=1.")
        slices = [s for p, s in self.gradient_slices() if id(p) in wanted]
        self._fusedist_materialize_unscale()  # the shards hold torch's p.grad values from here
        if norm_type > 0:
            total = self._norm_of_slices([s for s in slices if s.numel()], norm_type)
        else:
            total = self._norm_tensor_by_tensor(slices, norm_type, "zero grad norm of some parameters")
        slices = [s for s in slices if s.numel()]
        dtypes = {p.dtype for p in params if id(p) in wanted}
        total = total.to(norm_result_dtype(dtypes))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped (over every rank's shard; every rank raises this). To disable this error "
                "and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)  # torch's, in the gradients' dtype
        if slices:
            torch._foreach_mul_(slices, coef.to(device=slices[0].device, dtype=slices[0].dtype.to_real()))
        return total

    def _norm_of_slices(self, slices: list, norm_type: float) -> torch.Tensor:
        """The ``norm_type``-norm over every rank's ``slices`` (fp64): one all-reduce of the
        local max or sum of p-th powers, with its NaN flag (Note [a NaN through a max
        all-reduce] in ``fusedist/optim/grad_norms.py``)."""
        inf = norm_type == float("inf")
        local = torch.zeros(1, dtype=torch.float64, device=self._device)
        if slices:
            norms = tensor_norms(slices, norm_type, at_least=torch.float64)
            local = (norms.max() if inf else norms.pow(norm_type).sum()).reshape(1).to(self._device)
        if self.comm is not None and self.world_size > 1:
            packed = flag_nan(local).to(self.comm.device)
            self.comm.all_reduce(packed, op="max" if inf else "sum", tag="zero grad norm of some parameters")
            local = unflag_nan(packed).to(self._device)
        return local.reshape(()) if inf else local.pow(1.0 / norm_type).reshape(())

    # Note [norms that are not sums over elements]
    #     torch's total norm is the norm of the per-tensor norms. For p > 0 (and inf) that is
    #     the p-norm of all the elements, so the shards' flat sums (padding and gradients of
    #     zeros included) give it. For the orders torch also takes that are not -- 0 (the count
    #     of tensors with a nonzero gradient), negative p and -inf (a zero anywhere, the padding
    #     between slices included, pulls them to 0) -- each parameter's norm is first taken
    #     over every rank's slice of it, then torch's norm of those norms.
    def _norm_tensor_by_tensor(self, slices: list, norm_type: float, tag: str,
                               inv_scale=None) -> torch.Tensor:
        """torch's total ``norm_type``-norm (0, negative or -inf) of the gradients whose slices on
        this rank are ``slices`` (one per parameter, empty where this rank holds none, the same
        parameters on every rank), fp64, times ``inv_scale`` where given (Note [norms that are
        not sums over elements]). One all-reduce of a number (and a NaN flag for -inf) per
        parameter."""

        def all_reduce(t: torch.Tensor, op: str) -> None:
            if self.comm is None or self.world_size == 1:
                return
            # a max travels with NaN flags (Note [a NaN through a max all-reduce] in grad_norms.py)
            packed = (flag_nan(t) if op == "max" else t).to(self.comm.device)
            self._join_announce()  # under join (Note [the announce] in join.py)
            self.comm.all_reduce(packed, op=op, tag=tag)
            packed = packed.to(t.device)
            t.copy_(unflag_nan(packed) if op == "max" else packed)

        if not slices:  # (no gradients on any rank: torch's norm of no tensors)
            return torch.zeros((), dtype=torch.float64, device=self._device)
        norms = per_tensor_global_norms(slices, norm_type, self._device, all_reduce)
        if inv_scale is not None and norm_type != 0.0:  # (a count of nonzeros does not scale)
            norms = norms * inv_scale.double().reshape(())
        return torch.linalg.vector_norm(norms, norm_type)

    def gradient_shards(self) -> dict:
        """This rank's averaged gradient shard per dtype (stage 2; after backward), flat FP32
        over the rank's slices of the buckets (Note [flat partition]). With a GradScaler the
        shards hold the scaled gradients until ``step()``, ``unscale_`` included (Note [lazy
        unscale] in ``fusedist/amp/grad_scaler.py``)."""
        return dict(self._grad_shards) if self._grads_present else {}
