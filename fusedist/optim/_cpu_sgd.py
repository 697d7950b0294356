"""SGD on CPU tensors with torch's list operations, in the order of torch's foreach SGD.

Why: the reference path (``_reference.sgd``, the kernels' oracle) runs a handful of tensor
operations per parameter, so a CPU step over many small parameters cost ~26 us per parameter,
7x torch's ``SGD(foreach=True)``. Here each operation is one call over all the parameters, done
in place where torch does it in place, with torch's ``alpha`` forms -- so a FusedSGD step on
CPU gives torch's SGD bits. fusedist's own inputs come first: the unscale/clip ``factor``
multiplies a copy of the gradients (``p.grad`` is never written), and a momentum buffer whose
step count is 1 starts as the gradient (torch's "no buffer yet"), whatever it held.
"""

from __future__ import annotations

import torch

from .._dtypes import compute_dtype
from ._reference import grad_factor, skip_now


def applies(device: torch.device, param_dtype: torch.dtype, grad_dtype: torch.dtype, has_master: bool,
            momentum_buffers) -> bool:
    """Whether one bucket of a CPU SGD call (``functional._bucketize``'s key: one device, one
    parameter and one gradient dtype, masters or not) can take this path: every tensor in the
    parameters' compute dtype (fp32 or fp64 parameters, no FP32 masters), so no tensor needs a
    cast."""
    if device.type != "cpu" or has_master or compute_dtype(param_dtype) != param_dtype or grad_dtype != param_dtype:
        return False
    return all(t.dtype == param_dtype for t in momentum_buffers or ())


def _first_steps(step, n: int) -> list:
    if isinstance(step, (list, tuple)):
        try:
            counts = torch.stack(list(step))  # the optimizers' step counts: one shape and dtype
        except RuntimeError:
            counts = torch.stack([s.reshape(()).double() for s in step])
        return (counts.reshape(-1) == 1).tolist()
    return [float(step) == 1.0] * n


def sgd(params, grads, momentum_buffers, step, *, inv_scale, clip_coef, found_inf, lr, momentum, dampening,
        weight_decay, nesterov, maximize) -> None:
    skip, _ = skip_now(found_inf)  # (a CPU flag is read: nothing to keep asynchronous)
    if skip:
        return
    factor = grad_factor(inv_scale, clip_coef)
    params = list(params)
    d, own = list(grads), False  # own: d holds copies this function may write
    if factor is not None:
        d, own = torch._foreach_mul(d, factor.to(params[0].dtype)), True
    if maximize:
        d, own = torch._foreach_neg(d), True
    if weight_decay != 0:
        if own:
            torch._foreach_add_(d, params, alpha=weight_decay)
        else:
            d, own = torch._foreach_add(d, params, alpha=weight_decay), True
    if momentum_buffers is not None:
        bufs = list(momentum_buffers)
        first = _first_steps(step, len(bufs))
        fresh = [i for i, f in enumerate(first) if f]
        decayed = [i for i, f in enumerate(first) if not f]
        if fresh:
            torch._foreach_copy_([bufs[i] for i in fresh], [d[i] for i in fresh])
        if decayed:
            old = [bufs[i] for i in decayed]
            torch._foreach_mul_(old, momentum)
            torch._foreach_add_(old, [d[i] for i in decayed], alpha=1 - dampening)
        if not nesterov:
            d = bufs
        elif own:
            torch._foreach_add_(d, bufs, alpha=momentum)
        else:
            d = torch._foreach_add(d, bufs, alpha=momentum)
    torch._foreach_add_(params, d, alpha=-lr)
