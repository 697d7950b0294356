"""Autograd functions of SyncBatchNorm: batch statistics (synchronized or local) and
running statistics (never synchronized).

Gradients (x̂ = (x - mean) * invstd, n = global count, w = weight):

    grad_weight = sum(dy * x̂)            grad_bias = sum(dy)          (this rank's batch)
    grad_x      = w * invstd * (dy - sum_g(dy) / n - x̂ * sum_g(dy * x̂) / n)

where sum_g is over the global batch: the two per-channel sums are all-reduced together in
one collective. Weight and bias gradients stay local, as in torch.nn.SyncBatchNorm: the data
parallel wrapper reduces them with every other parameter gradient.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch._C import _functions as _autograd_functions

from .._dtypes import compute_dtype
from ..comm import Communicator
from . import _bn_ops as ops
from . import _grad_order
from ._bn_reference import _per_channel
from ._layout import NCSLayout, as_ncs, like_layout, torch_output_format
from ._sync_stats import GRAD_TAG, IDENTITY_LEN, combine, gather_messages, read_gather, write_layer_identity


_NO_DOUBLE_BACKWARD = (
    b"fusedist SyncBatchNorm: double backward is not supported (a gradient computed with "
    b"create_graph=True through this layer is being differentiated again); torch.nn.SyncBatchNorm "
    b"has no double backward either"
)


def _first_order_only(backward, differentiable=None):
    """``once_differentiable`` that also catches double backward when the incoming gradient is
    a constant; where the layer runs as torch's ``F.batch_norm`` would (Note [double backward
    where torch's layer has one]), ``differentiable(ctx, *grads)`` gives the gradients as a
    graph instead under ``create_graph=True`` (None where it does not apply).

    Note [double backward]: torch's ``once_differentiable`` marks the returned gradients as
    non-differentiable only when an incoming *gradient* requires grad. Ours depend on the
    saved input and weight too, so with a constant upstream gradient (``autograd.grad(
    (y * c).sum(), x, create_graph=True)``, a gradient penalty) it returned a gradient with
    no graph, and a penalty built from it silently contributed nothing. Under
    ``create_graph=True`` every gradient returned here is therefore attached to an error node:
    differentiating it raises, naming the layer; only using it as a value works.
    """

    @torch.compiler.disable  # (a backward inside a compiled training step: Note [SyncBatchNorm under torch.compile])
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled() and differentiable is not None:  # create_graph=True
            outputs = differentiable(ctx, *grads)
            if outputs is not None:
                return outputs
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():  # create_graph=False: the usual case
            return outputs
        error = _autograd_functions.DelayedError(_NO_DOUBLE_BACKWARD, len(outputs))

        def differentiable_alias(t):
            if t is None:
                return None
            t = t.detach()
            t.requires_grad_(True)
            return t

        return error(*[differentiable_alias(t) for t in outputs])

    return wrapper


# Note [double backward where torch's layer has one]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.nn.SyncBatchNorm synchronizes only in training with other ranks; otherwise -- eval with
# running statistics, training without a process group or alone in it -- it is
# ``F.batch_norm``, which has a double backward (a gradient penalty through the layer works).
# In those two cases the gradients under ``create_graph=True`` are computed here with
# differentiable torch ops from the saved input and weight: the same values as the kernels' up
# to rounding, and a graph to differentiate again. Synchronized training still refuses (its
# statistics come from a collective, which torch's layer does not differentiate either).
def _channel_sums(t: torch.Tensor) -> torch.Tensor:
    """Per-channel sums (dim 1) over every other dimension, differentiable."""
    return t.sum([d for d in range(t.dim()) if d != 1])


def _running_stats_grads(ctx, dy):
    x, weight, mean, invstd = ctx.saved_tensors
    acc = mean.dtype
    dy_acc = dy.to(acc)
    scale = invstd if weight is None else invstd * weight.to(acc)
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x = (dy_acc * _per_channel(scale, x)).to(x.dtype) if need_x else None
    grad_w = None
    if need_w:
        xhat = (x.to(acc) - _per_channel(mean, x)) * _per_channel(invstd, x)
        grad_w = _channel_sums(dy_acc * xhat).to(weight.dtype)
    grad_b = _channel_sums(dy_acc).to(weight.dtype if weight is not None else acc) if need_b else None
    return grad_x, grad_w, grad_b, None, None, None


def _local_batch_stats_grads(ctx, dy):
    if ctx.comm is not None:
        return None
    x, weight, _, _ = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    wanted = [t for t, need in ((x, need_x), (weight, need_w)) if need]
    grads = iter(torch.autograd.grad(torch.nn.functional.batch_norm(x, None, None, weight, None, True, 0.0, ctx.eps),
                                     wanted, dy, create_graph=True) if wanted else ())
    grad_x = next(grads) if need_x else None
    grad_w = next(grads) if need_w else None
    grad_b = _channel_sums(dy).to(weight.dtype if weight is not None else dy.dtype) if need_b else None
    return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None


def _scale(invstd: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-channel weight * invstd (invstd alone without affine), contiguous for the kernels."""
    return (invstd if weight is None else invstd * weight.to(invstd.dtype)).contiguous()


def _normalize(x: torch.Tensor, layout: NCSLayout, mean: torch.Tensor, invstd: torch.Tensor,
               weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    shift = None if bias is None else bias.to(mean.dtype).contiguous()
    return ops.channel_affine(x, layout, mean, _scale(invstd, weight), b=shift)


def _param_grads(ctx, sums: torch.Tensor, weight: Optional[torch.Tensor]):
    """Local weight/bias gradients, copied out of ``sums`` before it is all-reduced."""
    _, need_w, need_b = ctx.needs_input_grad[:3]
    grad_w = sums[1].to(weight.dtype, copy=True) if need_w else None
    grad_b = sums[0].to(weight.dtype if weight is not None else sums.dtype, copy=True) if need_b else None
    return grad_w, grad_b


def _mark(committed: Optional[list]) -> None:
    """Record that the running statistics took this batch (Note [a raised forward changes
    nothing] in sync_batch_norm.py): from here a raised forward keeps its count."""
    if committed is not None:
        committed.append(True)


def _blend_(buffers: list, values: list, momentum: float) -> None:
    """``buffer = (1 - momentum) * buffer + momentum * value`` in fp64 (``value`` is), rounded
    once to the buffer's dtype, as torch's BatchNorm rounds it: scaling and adding in place
    in fp16/bf16 rounds twice and doubles the drift of half-precision running statistics.
    Both running statistics in one list: each step below is one multi-tensor op for the two."""
    wide = [b.to(v.dtype, copy=True) for b, v in zip(buffers, values)]
    torch._foreach_mul_(wide, 1.0 - momentum)
    torch._foreach_add_(wide, torch._foreach_mul(values, momentum))
    torch._foreach_copy_(buffers, wide)


class BatchStatsNorm(torch.autograd.Function):
    """Normalize with the statistics of the global batch (this rank's alone when ``comm`` is
    None) and update the running statistics with them, if given. ``backward_plan``: this
    rank's, sent to the others (Note [one backward decision for all ranks] in _sync_stats)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps: float, momentum: float,
                comm: Optional[Communicator], num_batches_tracked: Optional[torch.Tensor] = None,
                backward_plan: float = 0.0, committed: Optional[list] = None):
        output_format = torch_output_format(x)
        x, layout = as_ncs(x)
        if comm is None:
            gathered = ops.stats_payload(x, layout).unsqueeze(0)
        else:  # the payload followed by the layer's identity: Note [the same layer on every rank]
            message = ops.stats_payload(x, layout, tail=IDENTITY_LEN)
            write_layer_identity(message[-IDENTITY_LEN:], num_batches_tracked, running_mean, running_var,
                                 backward_plan, torch.finfo(compute_dtype(x.dtype)).bits)
            gathered = gather_messages(message, comm)
        rank_counts, ctx.reduces_grads = read_gather(gathered, layout.C, comm)
        total = sum(rank_counts)
        # Note [the forward's combine in one launch]: after the gather, merging the ranks'
        # statistics, the running statistics' blend and the normalization's per-channel
        # factors are about twenty small device ops, each a launch and its host time on a
        # GPU (where ResNet's late layers spend less on their kernels than that); the Triton
        # path does them in one kernel, the same fp64 arithmetic in the same order.
        fused = ops.combine_ranks(gathered, x, layout.C, total, eps, momentum, weight, bias,
                                  running_mean, running_var) if total > 0 else None
        if fused is not None:
            _mark(committed)  # the running statistics took the batch (in the kernel)
            mean, invstd, scale, shift = fused
            y = ops.channel_affine(x, layout, mean, scale, b=shift)
        else:
            stats = combine(gathered, layout.C, rank_counts)
            acc = compute_dtype(x.dtype)
            var = stats.m2 / stats.count
            mean = stats.mean.to(acc)
            invstd = torch.rsqrt(var + eps).to(acc)
            if running_mean is not None and stats.count > 0:
                # From the gathered statistics, identical on every rank (Note [bit-identical
                # statistics] in _sync_stats); the running variance is the unbiased one. An
                # empty global batch (count 0: mean and var are NaN, y is empty) leaves them
                # alone, as BatchNorm does.
                unbiased = stats.m2 / (stats.count - 1)
                _blend_([running_mean, running_var], [stats.mean, unbiased], momentum)
            _mark(committed)
            y = _normalize(x, layout, mean, invstd, weight, bias)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.layout, ctx.count, ctx.comm, ctx.eps = layout, total, comm, eps
        # Note [the backward's parts agreed in the forward] in _grad_order.py
        ctx.order_token = _grad_order.forwarded(comm) if comm is not None and ctx.reduces_grads else None
        return y.contiguous(memory_format=output_format)

    @staticmethod
    @functools.partial(_first_order_only, differentiable=_local_batch_stats_grads)
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        dy = like_layout(dy, x)
        sums = ops.backward_reduce(dy, x, ctx.layout, mean, invstd)
        grad_w, grad_b = _param_grads(ctx, sums, weight)
        grad_x = None
        # on every rank alike, one that wants no input gradient included: its dy is part of the
        # global sums (Note [one backward decision for all ranks] in _sync_stats.py)
        if ctx.comm is not None and ctx.reduces_grads:
            # no part fingerprints where the forward agreed on them: Note [the backward's parts agreed in the forward]
            agreed = _grad_order.in_forward_order(ctx.comm, ctx.order_token)
            ctx.comm.all_reduce(sums.view(-1), tag=GRAD_TAG, parts_checked=agreed)
        if ctx.needs_input_grad[0]:
            # Note [the backward's factors in the kernel]: on the Triton path the per-channel
            # factors below (six small device ops, each a launch on a GPU) are made by the
            # kernel's programs from the sums, with the same fp32 operations in the same order.
            grad_x = ops.input_grad(dy, x, ctx.layout, sums, mean, invstd, weight, ctx.count)
            if grad_x is not None:
                return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None
            mean_dy, mean_dy_xhat = sums[0] / ctx.count, sums[1] / ctx.count
            k = _scale(invstd, weight)
            grad_x = ops.channel_affine(
                dy, ctx.layout, mean_dy.contiguous(), k,
                v=x, r=mean, t=(-k * invstd * mean_dy_xhat).contiguous(), out_dtype=x.dtype,
            )
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None


class RunningStatsNorm(torch.autograd.Function):
    """Normalize with given (running) statistics: purely local, no collective."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps: float):
        output_format = torch_output_format(x)
        x, layout = as_ncs(x)
        acc = compute_dtype(x.dtype)
        mean = running_mean.to(acc).contiguous()
        invstd = torch.rsqrt(running_var.to(acc) + eps)
        y = _normalize(x, layout, mean, invstd, weight, bias)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.layout = layout
        return y.contiguous(memory_format=output_format)

    @staticmethod
    @functools.partial(_first_order_only, differentiable=_running_stats_grads)
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        dy = like_layout(dy, x)
        need_params = any(ctx.needs_input_grad[1:3])
        grad_w = grad_b = None
        if need_params:
            grad_w, grad_b = _param_grads(ctx, ops.backward_reduce(dy, x, ctx.layout, mean, invstd), weight)
        grad_x = None
        if ctx.needs_input_grad[0]:
            k = _scale(invstd, weight)
            grad_x = ops.channel_affine(dy, ctx.layout, torch.zeros_like(k), k, out_dtype=x.dtype)
        return grad_x, grad_w, grad_b, None, None, None
