"""ZeroRedundancyOptimizer's side of the GradScaler protocol (Note [scaler protocol] in
``fusedist/amp/grad_scaler.py``), and its gradient clipping.

The scaler and clip need three things from a sharded optimizer: the gradients this rank holds
(its shard in stage 2, ``p.grad`` in stage 1), one all-reduce that makes the found-inf flag and
the sum of squares global, and a step that applies the inverse scale and clip coefficient it
was given. Those methods live here together, as a mixin over the optimizer's shards, so the
protocol can change in one place.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..optim._scaler_protocol import ScalerProtocol
from ..optim.grad_norms import flag_nan, norm_result_dtype, tensor_norms, unflag_nan
from ..reliability.clip_check import count_clip
from . import grow, step_flag, trainable_check
from .eager import eager_clip


class ZeroScalerProtocol(ScalerProtocol):
    """The scaler protocol over this rank's gradient shards; the inner step that consumes it."""

    def _fusedist_grad_params(self) -> list:
        """The parameters the global norm covers: all of them in stage 2 (their gradients are
        the shards), those with ``p.grad`` in stage 1."""
        grow.join_pending(self)  # (see _fusedist_check_and_norm)
        if self.stage == 2:
            return self._trainable_params()
        return [p for p in self._trainable_params() if p.grad is not None]

    @torch.compiler.disable  # its all-reduce, as step()'s (Note [a compiled step runs eagerly] in optimizer.py)
    @torch.no_grad()
    def _fusedist_check_and_norm(self, inv_scale: Optional[torch.Tensor]):
        """(found_inf, sum of squares of grad * inv_scale), global over all shards."""
        # Without DDP, parameters unfrozen since the last step join here, or the norm, the
        # found-inf check and the unscale before the step would miss their gradients (Note
        # [growing the partition]; with DDP they joined in backward). Every rank comes here (its
        # all-reduce below), which compares the sharded parameters first: they join once the
        # ranks agree, and until then their gradients count whole on rank 0 (Note [parameters join
        # after the comparison], Note [one comparison a step] in trainable_check.py).
        fingerprint = grow.fingerprint_entries(self)
        self._zero_fill_without_backward()  # Note [zero-filled gradients in stage 2] in grads.py
        grads = self._local_grads() + grow.awaiting_grads(self)
        device, dtype = self._device, self._norm_dtype()
        if grads:
            # Norms per tensor, then squares summed in fp32 (fp64 with fp64 parameters): a
            # non-finite gradient element makes its norm non-finite, so the same pass yields
            # the overflow flag.
            norms = tensor_norms(grads).to(dtype)
            if inv_scale is not None:
                norms = norms * inv_scale.reshape(()).to(dtype)
            sumsq = norms.pow(2).sum().reshape(1)
            found = (~torch.isfinite(sumsq)).float()
        else:
            sumsq = torch.zeros(1, device=device, dtype=dtype)
            found = torch.zeros(1, device=device)
        return self._fusedist_reduce_found_inf_and_norm(found, sumsq, fingerprint)

    def _norm_dtype(self) -> torch.dtype:
        """The dtype the global norms are taken and all-reduced in, the same on every rank: fp32,
        or fp64 where a parameter is fp64 (torch's clip measures fp64 gradients in fp64, and an
        fp32 norm left the clip coefficient of an fp64 model 1e-8 from torch's). The parameters
        waiting to join at this step's comparison count too: their gradients are in this step's
        norm (Note [parameters join after the comparison] in trainable_check.py)."""
        wide = (torch.float64, torch.complex128)
        params = self._trainable_params() + [self._params[i] for i in grow.awaiting(self)]
        return torch.float64 if any(p.dtype in wide for p in params) else torch.float32

    def _fusedist_reduce_found_inf_and_norm(self, found_inf: torch.Tensor, sumsq: torch.Tensor,
                                            fingerprint: Sequence[float] = ()):
        """One all-reduce of two numbers: the flags are summed (nonzero iff any rank found an
        inf/nan) and so are the shards' sums of squares -- and the ``fingerprint`` of the sharded
        parameters where one is compared (Note [one comparison a step] in trainable_check.py): in
        float64 then, where its sums are exact; its verdict stays on the device (Note [the
        comparison read without a synchronization])."""
        if self.comm is None or self.world_size == 1:
            return found_inf.reshape(1), sumsq.reshape(1)
        dtype = self._norm_dtype()
        wire = torch.float64 if fingerprint else dtype
        parts = [found_inf.reshape(1).to(wire), sumsq.reshape(1).to(wire)]
        if fingerprint:
            parts.append(torch.tensor(list(fingerprint), dtype=wire, device=sumsq.device))
        packed = torch.cat(parts).to(self.comm.device)
        self._join_announce()  # under join (Note [the announce] in join.py)
        self.comm.all_reduce(packed, tag="zero found_inf and grad norm")
        if fingerprint:
            grow.check_fingerprint_sums(self, packed[2:])
        packed = packed.to(sumsq.device)
        return (packed[0:1] > 0).float(), packed[1:2].to(dtype)

    def _fusedist_clear_protocol(self) -> None:
        """After a step: the next one compares the sharded parameters again (Note [one comparison a step]
        in trainable_check.py)."""
        super()._fusedist_clear_protocol()
        self._sharded_compared = False

    def _fusedist_step_ran(self, recorded):
        """The scaler protocol's decision, remembered for the step to take up again (Note [a
        refused or skipped sharded step and the LR scheduler] in step_flag.py)."""
        decided = super()._fusedist_step_ran(recorded)
        step_flag.remember(self, recorded, decided, self.found_inf)
        return decided

    def _fusedist_step_ran_given(self, recorded, found: Optional[torch.Tensor]):
        """The scaler protocol's decision had the step's found-inf flag been ``found``."""
        saved, self.found_inf = self.found_inf, found
        try:
            return super()._fusedist_step_ran(recorded)
        finally:
            self.found_inf = saved

    def _fusedist_has_grads(self) -> bool:
        # Stage 2: whether a synchronized backward left shards (the same on every rank).
        grow.join_pending(self)  # (see _fusedist_check_and_norm)
        self._zero_fill_without_backward()
        return self._has_any_grad() or grow.awaiting_with_grad(self)

    def _fusedist_local_grads(self) -> list:
        grow.join_pending(self)  # (see _fusedist_check_and_norm)
        self._zero_fill_without_backward()
        return self._local_grads() + grow.awaiting_grads(self)

    def _fusedist_grads_in_user_view(self) -> bool:
        # Stage 2's gradients are shards nobody else reads (p.grad is None): unscaled inline
        # by the update, which also spares the offload pipeline a second copy of each shard.
        return self.stage == 1

    def _fusedist_unscale_targets(self) -> list:
        # Stage 2 keeps gradients only as shards; stage 1 unscales what users see in p.grad.
        grow.join_pending(self)  # (see _fusedist_check_and_norm)
        if self.stage == 2:
            return self._local_grads()
        return [p.grad for p in self._trainable_params() if p.grad is not None]

    @eager_clip  # (Note [a compiled step runs eagerly] in optimizer.py)
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the global gradient norm (over every rank's shard) to ``max_norm``; returns the
        total norm before clipping, like ``torch.nn.utils.clip_grad_norm_``.

        The norm costs one all-reduce of two numbers (none after ``GradScaler.unscale_``, which
        already computed it); ``norm_type`` may be any order torch's takes (0, negative p and
        ``-inf``: one number per parameter). The clip coefficient is applied inside ``step()``;
        ``p.grad`` is not modified. Call it after backward (and after ``scaler.unscale_``),
        before ``step()``.
        """
        # Counted for the per-step check, as torch's clip is: after unscale_ this clip communicates
        # nothing, and one rank's clip scaled its shard's update alone, unseen (Note [a clip on some
        # ranks only] in fusedist/reliability/clip_check.py).
        count_clip(self._trainable_params(), max_norm)
        return self._clip_all_grads_(max_norm, norm_type, error_if_nonfinite)

    @torch.no_grad()
    def _clip_all_grads_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """:meth:`clip_grad_norm_`, uncounted (``fusedist.clip_grad_norm_`` counted the call already)."""
        norm_type = float(norm_type)
        ctx = self.step_context
        written = self._fusedist_check_grads_since_unscale()  # Note [gradients changed after unscale_]
        sumsq = ctx.grad_sumsq if norm_type == 2.0 else None
        self._join_clip = (max_norm, norm_type, error_if_nonfinite)  # announced with its all-reduce, under join
        try:
            if norm_type != 2.0:
                total = self._global_grad_norm(norm_type, ctx.inv_scale)
                if error_if_nonfinite and not bool(torch.isfinite(total)):
                    raise RuntimeError(
                        f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                        "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                        "anyway, set `error_if_nonfinite=False`")
                sumsq = total.double().square()  # record_clip takes a sum of squares (fp64: no overflow)
            elif sumsq is None or written:
                _, sumsq = self._fusedist_check_and_norm(ctx.inv_scale)
                if ctx.inv_scale is not None:
                    ctx.grad_sumsq = sumsq
        finally:
            self._join_clip = None
        # torch returns the norm in the gradients' dtype (their promotion): the parameters'
        # dtypes, whatever precision the shards hold them in.
        dtype = norm_result_dtype({p.dtype for p in self._trainable_params()})
        norm = ctx.record_clip(sumsq, max_norm, error_if_nonfinite, dtype)
        self._fusedist_record_clipped_grads()  # Note [gradients changed after the clip]
        return norm

    def _global_grad_norm(self, norm_type: float, inv_scale: Optional[torch.Tensor]) -> torch.Tensor:
        """The ``norm_type``-norm (not 2) of the gradients over every rank's shard: one small
        all-reduce, the max of the shards' norms for inf, else the sum of their p-th powers."""
        grow.join_pending(self, compare=True)  # (every rank comes here: its all-reduce below)
        self._zero_fill_without_backward()
        if not norm_type > 0:  # Note [norms that are not sums over elements] in grads.py
            slices = [s for _, s in self.gradient_slices()]
            return self._norm_tensor_by_tensor(slices, norm_type, "zero grad norm", inv_scale)
        grads = [g for g in self._local_grads() if g.numel()]  # (an empty tensor has no inf-norm)
        inf, dtype = norm_type == float("inf"), self._norm_dtype()
        local = torch.zeros(1, device=self._device, dtype=dtype)
        if grads:
            norms = tensor_norms(grads, norm_type).to(dtype)
            if inv_scale is not None:
                norms = norms * inv_scale.reshape(()).to(dtype)
            local = (norms.max() if inf else norms.pow(norm_type).sum()).reshape(1)
        if self.comm is not None and self.world_size > 1:
            packed = flag_nan(local).to(self.comm.device)  # Note [a NaN through a max all-reduce]
            self._join_announce()  # under join (Note [the announce] in join.py)
            self.comm.all_reduce(packed, op="max" if inf else "sum", tag="zero grad norm")
            local = unflag_nan(packed).to(self._device)
        return local.reshape(()) if inf else local.pow(1.0 / norm_type).reshape(())

    def _fusedist_record_clipped_grads(self) -> None:
        """Stage 1: ``p.grad``, as for any fused optimizer. Stage 2: the shards' version counts,
        which only a backward accumulating into them changes before the step."""
        if self.stage == 1:
            return super()._fusedist_record_clipped_grads()
        self.step_context.clipped_grads = [(None, shard, shard._version) for shard in self._grad_shards.values()]

    def _fusedist_settle_clip(self) -> None:
        """Stage 2: a backward after the clip added to the shards in place: torch's clip would
        have scaled only what came before, which is gone, so the step refuses (as for an in-place
        write to ``p.grad`` in stage 1)."""
        if self.stage == 1:
            return super()._fusedist_settle_clip()
        ctx = self.step_context
        if ctx.clipped_grads is None or ctx.clip_coef is None:
            return
        if any(shard._version != version for _, shard, version in ctx.clipped_grads):
            raise RuntimeError(
                "fusedist: ZeroRedundancyOptimizer(stage=2): a backward accumulated gradients after the clip "
                "recorded its coefficient for this step (the clip scales the gradient shards inside the step). "
                "torch's clip would have scaled only the gradients before that backward, which are gone, so "
                "stepping could not match it. Clip after the last backward of the step.")

    @torch.compiler.disable  # (Note [a compiled step runs eagerly] in optimizer.py)
    def clip_sharded_grads_(self, params: list, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = False) -> torch.Tensor:
        """``fusedist.clip_grad_norm_`` on this optimizer's parameters (the gradient-holder
        protocol of ``fusedist/ownership.py``): the global norm over every rank's shard."""
        # Frozen parameters never have gradients: whether the caller's list (e.g.
        # model.parameters()) or the optimizer's includes them does not matter.
        if {id(p) for p in params if p.requires_grad} != {id(p) for p in self._trainable_params()}:
            raise ValueError(
                "fusedist.clip_grad_norm_: these parameters are sharded by ZeroRedundancyOptimizer "
                "stage 2; pass exactly that optimizer's trainable parameters (or call "
                "optimizer.clip_grad_norm_)"
            )
        return self._clip_all_grads_(max_norm, norm_type, error_if_nonfinite)

    def _inner_step(self) -> None:
        """Step the inner optimizer over the pieces with this step's inverse scale, clip
        coefficient and found-inf flag: a fused one applies them in its update; any other gets
        its gradients multiplied first and is skipped on overflow, as torch's GradScaler does.

        An fp64 clip coefficient (a model with fp64 parameters: :meth:`_norm_dtype`) is applied
        to the gradients before a fused inner step too: the fused update takes its factors as
        fp32, and the coefficient rounded to fp32 left an fp64 model trained with clipping 1e-9
        from torch's, where torch multiplies the fp64 gradients by the fp64 coefficient."""
        # (a verdict kept on the device skips the step: Note [the comparison read without a synchronization])
        inner, found = self.inner, trainable_check.with_skip(self, self.found_inf)
        if getattr(inner, "_fusedist_fused", False):
            # The whole decision in one hand-over: the inner optimizer's step consumes a copy
            # of this step context (its own is cleared by that step).
            context = dataclasses.replace(self.step_context)
            clip = context.clip_coef
            fp64_clip = clip is not None and clip.dtype == torch.float64
            if fp64_clip:
                context.clip_coef = None
            aliased = self._scale_piece_grads(clip.reshape(1)) if fp64_clip else []
            try:
                inner.grad_scale = self.grad_scale
                inner.step_context = context
                inner.found_inf = found
                inner.step()
            finally:
                self._restore_aliased(aliased)
            return
        inv, clip = self._effective_inv_scale(), self.step_context.clip_coef
        mult = inv if clip is None else (clip.reshape(1) if inv is None else inv * clip.reshape(1))
        aliased = self._scale_piece_grads(mult) if mult is not None else []
        try:
            if found is None:
                inner.step()
            elif getattr(inner, "_step_supports_amp_scaling", False):
                inner.grad_scale, inner.found_inf = None, found.reshape(()).float()  # (0-dim, as torch's scaler gives)
                try:
                    inner.step()
                finally:
                    inner.grad_scale, inner.found_inf = None, None
            elif not bool(found.item()):  # host read, as torch's GradScaler does for such optimizers
                inner.step()
        finally:
            self._restore_aliased(aliased)

    def _scale_piece_grads(self, mult: torch.Tensor) -> list:
        """Multiply the gradients the inner step reads by ``mult``: the gradient shards this
        optimizer owns in place; gradients that are p.grad's own memory (Note [shards aliasing
        the parameters and gradients]) are not scaled in place: the piece gets a scaled copy.
        Returns the (piece tensor, its gradient view) pairs :meth:`_restore_aliased` restores."""
        aliased: list = []
        own = list(self._grad_shards.values())
        if own:
            torch._foreach_mul_(own, mult.reshape(()))
        store = self._piece_grads
        for piece, t in zip(self._partition.pieces, self._pieces):
            if t.grad is not None and store.aliases(piece.dtype):
                aliased.append((t, t.grad))
                t.grad = t.grad * mult.reshape(())
        return aliased

    @staticmethod
    def _restore_aliased(aliased: list) -> None:
        """Give the pieces :meth:`_scale_piece_grads` handed scaled copies their views back."""
        for t, grad in aliased:
            t.grad = grad
