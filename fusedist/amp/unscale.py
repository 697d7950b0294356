"""The passes of ``GradScaler.unscale_`` and ``step`` over an optimizer's gradients: torch's
per-device unscale with host-safe copies, the fused optimizers' refusals before an in-place
unscale, the flags combined over the ranks that hold pieces of one gradient, and a device flag
read without stalling the stream."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch

from ..optim._complex import memory_view as complex_memory_view
from ..optim._negated import memory_view as negated_memory_view
from ..optim._scaler_protocol import _addresses_and_versions as addresses_and_versions
from ..ownership import gradient_holders_of


class LazyHostFlag:
    """Reads a device flag without stalling the stream: the value is copied to host memory
    asynchronously and looked at on a later call, once the copy has completed."""

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, Any]] = []

    def record(self, flag: torch.Tensor) -> None:
        if flag.device.type == "cuda":
            host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((host, event))
        else:
            self._pending.append((flag.clone(), None))

    def poll(self) -> bool:
        """True if any completed copy held a nonzero value (completed ones are dropped)."""
        hit, keep = False, []
        for host, event in self._pending:
            if event is not None and not event.query():
                keep.append((host, event))
            elif bool(host.any()):
                hit = True
        self._pending = keep
        return hit


# -- [sharded gradients] ----------------------------------------------------------------------
# A parameter whose gradient holder (fusedist/ownership.py) offers ``all_reduce_found_inf`` --
# fully_shard's pieces -- has only this rank's piece of its gradient in ``p.grad``, so the
# inf/nan flag (and the sum of squares) measured over it are this rank's. They are combined
# over the holder's ranks (max / sum), so every rank skips the step together.
def combine_over_shards(optimizer, found_inf: torch.Tensor, sumsq: Optional[torch.Tensor] = None):
    holders = [h for h in gradient_holders_of(optimizer) if hasattr(h, "all_reduce_found_inf")]
    for holder in holders:
        holder.all_reduce_found_inf(found_inf)
        if sumsq is not None and not getattr(holder, "sums_exactly", True):
            sumsq = None  # not known globally (tensor parallelism): measured afresh where needed
        if sumsq is not None:
            holder.all_reduce_sum(sumsq)
    return found_inf, sumsq
# -- end [sharded gradients] ------------------------------------------------------------------


# Note [a clip before unscale_]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's documented order is unscale_, then clip. A script (or a framework: Lightning's
# manual optimization) may clip first: torch's clip then scales the still-scaled gradients
# by min(1, max_norm / scaled norm), and unscale_ divides the result -- a clip at
# max_norm / scale in true units. fusedist's clip records that coefficient for the step
# instead of scaling p.grad, so unscale_ keeps it (it used to drop it, and the step went
# unclipped); a gradient replaced or written since the clip is settled first, as the step
# would settle it (Note [gradients changed after the clip]).
def clip_before_unscale(optimizer):
    """The clip coefficient recorded before this ``unscale_``, settled; None without one."""
    if optimizer.step_context.clip_coef is None:
        return None
    optimizer._fusedist_settle_clip()
    return optimizer.step_context.clip_coef


def refuse_fp16_in_place(optimizer) -> None:
    """fp16 gradients unscaled in place lose what loss scaling kept: unscaled values below
    fp16's normal range (6e-5) keep a few bits or become zero (measured: 9% error at 3e-7),
    and Adam's per-element normalization makes such small gradients count fully. torch's
    unscale_ refuses them; the fused update unscales in fp32 instead (lazy_unscale)."""
    if any(g.dtype == torch.float16 for g in optimizer._fusedist_unscale_targets()):
        raise ValueError(
            f"GradScaler.unscale_: {type(optimizer).__name__} has float16 gradients; unscaling them "
            "in place would round the small values loss scaling preserves to subnormals or zero "
            "(torch's GradScaler refuses float16 gradients too). Build the scaler with "
            "lazy_unscale=True and clip with fusedist.clip_grad_norm_ (the update unscales in fp32), "
            "or call scaler.step(optimizer) without unscale_."
        )


# Note [host gradients under a device scaler]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's scaler unscales each device's gradients with copies of the inverse scale and the
# inf flag made for that device by non-blocking copies. For gradients in host memory under a
# GPU scaler (CPUOffloadPolicy) those are device-to-host copies that have not landed when the
# host kernel reads the scale and sets the flag at once: it unscaled by whatever the buffer
# held, and the late copy overwrote the flag (seen on an H200: norms unlike the device run's
# from the first step, an inf on one rank not seen, the scale grown instead of backed off).
# So the copies to the host are blocking here; between devices they stay asynchronous.
def unscale_per_device(optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool) -> dict:
    """torch's ``GradScaler._unscale_grads_`` (same grouping, checks and kernel), with the
    scale and flag copied to the host synchronously: the flag of each device, by device."""
    grads: dict = defaultdict(lambda: defaultdict(list))
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if grad.is_sparse:
                    # Duplicate indices add up on coalescing, which can overflow in fp16: check
                    # the coalesced values, as torch does.
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grad = _memory_view(grad)  # Note [negated and conjugated gradients in unscale_]
                grads[grad.device][grad.dtype].append(grad)
        flags = {}
        for device, by_dtype in grads.items():
            flags[device] = flag = copy_to(found_inf, device)
            inv = copy_to(inv_scale, device)
            for same_dtype in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, flag, inv)
    return flags


# Note [negated and conjugated gradients in unscale_]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A gradient may be a lazily negated view (``z.conj().imag``, torch's negative bit) or a lazily
# conjugated one (``p.grad = z.conj()``): torch's unscale kernel refuses either ("fallback doesn't
# currently support mutable TensorLists with negation inputs"), and so did torch's GradScaler.
# Its inf/nan check and its product with a real inverse scale give the same answer on the
# tensor's memory (``-value``, ``conj(value)``), so the kernel is handed the plain view of that
# memory (the bit cleared, no copy) and the gradient itself is unscaled in place. A complex
# gradient, which the kernel does not take at all, is handed as its real view (both parts are
# checked and scaled alike).
def _memory_view(grad: torch.Tensor) -> torch.Tensor:
    return complex_memory_view(negated_memory_view(grad))


def copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` on ``device``; blocking when that is the host, where a kernel reads and
    writes it at once (Note [host gradients under a device scaler])."""
    return t.to(device=device, non_blocking=torch.device(device).type != "cpu", copy=True)


def settle_unstepped(optimizer) -> None:
    """Leave in ``p.grad`` what torch's unscale_ (and clip) would have left there, for a fused
    optimizer that was unscaled but not stepped this iteration (Note [an iteration without a
    step] in grad_scaler.py): a pending lazy inverse scale and a recorded clip coefficient are
    applied to the gradients, so a program that goes on accumulating into them adds to the
    values torch's would hold. Gradients written since unscale_, and gradient shards nobody
    else reads, are left as they are."""
    recorded = optimizer.step_context.grad_versions
    if recorded is None or not optimizer._fusedist_grads_in_user_view():
        return
    if recorded == addresses_and_versions(optimizer._fusedist_unscale_targets()):
        optimizer._fusedist_materialize_unscale()
