"""Multi-tensor Triton kernels for the optimizer phase: check-and-norm, Adam/AdamW, SGD, LAMB.

One launch covers a whole list of tensors that share a dtype combination, through a chunk table
(``multi_tensor_table.py``). This module holds the launchers, the only public functions; the
kernels live one family per module (``multi_tensor_check.py``, ``multi_tensor_adam.py``,
``multi_tensor_sgd.py``, ``multi_tensor_lamb.py``) and share the ``@triton.jit`` helpers of
``multi_tensor_helpers.py``.

# Note [found-inf masking]
The update kernels never branch on the found-inf flag on the host: each program loads the
flag and folds ``found_inf == 0`` into its load/store mask, so when it is set every load and
store is masked off and nothing is written. This is what keeps the AMP step free of host
synchronization: the decision is made on the device, after the flag has been computed by an
earlier kernel in the same stream.

The math lives in the kernels and, identically, in ``fusedist/optim/_reference.py``
(the pure-PyTorch path and test oracle). Keep the two in step.
"""

from __future__ import annotations

import math
import operator

import torch

from .launch_cache import cached
from .multi_tensor_adam import _adam_kernel
from .multi_tensor_check import _check_and_norm_kernel
from .multi_tensor_lamb import _lamb_stage1_kernel, _lamb_stage2_kernel
from .multi_tensor_sgd import _sgd_kernel
from .multi_tensor_table import chunk_table, launch_config, tl_dtype

_numel = torch.Tensor.numel
_dtype_of = operator.attrgetter("dtype")
_device_of = operator.attrgetter("device")
_FP32 = {torch.float32}


# ----------------------------------------------------------------------------- launchers
#
# Each launcher takes one *bucket*: lists of tensors that share device and dtypes, all
# contiguous. Bucketing and validation happen in fusedist/optim/functional.py.


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else float("-inf")


def _scalar_or_dummy(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    return dummy if t is None else t


# Note [a learning rate on the device]
#     A tensor ``lr`` (torch's optimizers take one; schedulers change it in place) is read by
#     the kernels from device memory: reading its value on the host to pass a number would
#     synchronize the host with the device at every step. The launchers get the tensor and
#     pass a pointer to an fp32 copy on the parameters' device (a copy made without a host
#     wait; none when it is there already), and the kernels form ``1 - lr * weight_decay``
#     in fp32 as torch does on a tensor lr. A float ``lr`` stays a kernel argument.
def _lr_args(lr, device: torch.device, dummy: torch.Tensor) -> tuple:
    """``(pointer operand, host value)`` for the kernels' ``lr_ptr`` and ``lr`` arguments."""
    if isinstance(lr, torch.Tensor):
        on_device = lr.detach().reshape(1).to(device=device, dtype=torch.float32, non_blocking=True)
        return on_device, 0.0
    return dummy, float(lr)


# Note [betas on the device]
#     Tensor ``betas`` (torch's Adam takes two 1-element tensors, e.g. for a beta schedule
#     under ``torch.compile``) are read by the Adam kernel from a 2-element fp32 copy on the
#     parameters' device, for the reason a tensor lr is (Note [a learning rate on the device]).
#     The kernel forms ``log2(beta)`` in fp64 from the fp32 value and rounds it to fp32, as
#     the host's double reaches the kernel as an fp32 argument, so the bias corrections (the
#     comment on ``_bias_correction``) and the update equal those of float betas holding the
#     tensors' values (and the branch keeps the argument's type, as Triton requires).
def _betas_args(beta1, beta2, device: torch.device, dummy: torch.Tensor) -> tuple:
    """``(pointer operand, beta1, beta2, log2 beta1, log2 beta2, 1 - beta1, 1 - beta2)`` for the
    Adam kernel: the host numbers are placeholders when the betas are tensors. ``1 - beta`` is
    formed here in double and rounded once, as torch rounds its Python-float ``1 - beta``: in the
    kernel it would be ``1 - fp32(beta)``, off by up to 2^-24 / (1 - beta) relative (1.7e-4 for
    beta2 = 0.9999) on a GPU, where float arguments arrive as fp32."""
    if isinstance(beta1, torch.Tensor):
        on_device = torch.cat([b.detach().reshape(1).to(device=device, dtype=torch.float32, non_blocking=True)
                               for b in (beta1, beta2)])
        return on_device, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    return dummy, float(beta1), float(beta2), _log2(beta1), _log2(beta2), 1.0 - float(beta1), 1.0 - float(beta2)


def check_and_norm(grads, inv_scale, unscale_in_place=False):
    """Return (bad, sumsq) fp32 1-element tensors for one bucket; reads the grads only, or with
    ``unscale_in_place`` also writes ``grad * inv_scale`` back in the same pass."""
    device = grads[0].device
    block, iters, warps = launch_config()
    table = chunk_table([grads], list(map(_numel, grads)), block * iters, device)
    if table.n_chunks == 0:  # only empty tensors
        zero = torch.zeros(1, dtype=torch.float32, device=device)
        return zero, zero.clone()
    partial_bad = torch.empty(table.n_chunks, dtype=torch.float32, device=device)
    partial_sumsq = torch.empty(table.n_chunks, dtype=torch.float32, device=device)
    cached(_check_and_norm_kernel)[(table.n_chunks,)](
        table.ptrs, table.numels, table.chunk_t, table.chunk_start, table.n_tensors,
        _scalar_or_dummy(inv_scale, partial_bad), partial_bad, partial_sumsq,
        GRAD_DTYPE=tl_dtype(grads[0].dtype), HAS_INV_SCALE=inv_scale is not None,
        WRITE_BACK=unscale_in_place and inv_scale is not None,
        ALIGNED=table.aligned, BLOCK=block, ITERS=iters, num_warps=warps,
    )
    return partial_bad.amax(0, keepdim=True), partial_sumsq.sum(0, keepdim=True)  # (1-element: no reshape)


def _step_role(step, n_roles_before: int, device: torch.device):
    """Steps are either one host number for the bucket or a list of fp32 device tensors."""
    if isinstance(step, (list, tuple)):
        return _fp32_steps(step, device), n_roles_before, 0.0
    return None, -1, float(step)


def _fp32_steps(steps, device: torch.device):
    """The step counts as the kernels read them: fp32 tensors on ``device``, which is how the
    optimizers keep them. A count the program put in a state itself (an fp64 tensor, one on
    the CPU as torch's Adam keeps them) is read through an fp32 copy on ``device`` -- its memory
    read as fp32, or from another device, gave a wrong bias correction or a fault. (The kernels
    only read the counts: a copy loses no write.)"""
    if set(map(_dtype_of, steps)) == _FP32 and set(map(_device_of, steps)) == {device}:
        return steps
    return [s.detach().reshape(()).to(device=device, dtype=torch.float32) for s in steps]


def adam(params, grads, masters, exp_avgs, exp_avg_sqs, step, *, lr, beta1, beta2, eps,
         weight_decay, adamw, bias_correction, maximize, inv_scale, clip_coef, found_inf,
         max_exp_avg_sqs=None):
    device = params[0].device
    block, iters, warps = launch_config()
    steps, step_role, step_scalar = _step_role(step, 6, device)
    roles = [grads, params, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs]
    if steps is not None:
        roles.append(steps)
    table = chunk_table(roles, list(map(_numel, params)), block * iters, device)
    if table.n_chunks == 0:
        return
    dummy = exp_avgs[0]
    lr_ptr, lr_host = _lr_args(lr, device, dummy)
    betas_ptr, *betas_host = _betas_args(beta1, beta2, device, dummy)
    cached(_adam_kernel)[(table.n_chunks,)](
        table.ptrs, table.numels, table.chunk_t, table.chunk_start, table.n_tensors,
        _scalar_or_dummy(inv_scale, dummy), _scalar_or_dummy(clip_coef, dummy),
        _scalar_or_dummy(found_inf, dummy), lr_ptr, betas_ptr,
        lr_host, *betas_host, float(eps), float(weight_decay),
        1.0 - lr_host * float(weight_decay), step_scalar,
        GRAD_DTYPE=tl_dtype(grads[0].dtype), PARAM_DTYPE=tl_dtype(params[0].dtype),
        HAS_MASTER=masters is not None, HAS_INV_SCALE=inv_scale is not None,
        HAS_CLIP=clip_coef is not None, HAS_FOUND_INF=found_inf is not None,
        STEP_ROLE=step_role, LR_ON_DEVICE=isinstance(lr, torch.Tensor),
        BETAS_ON_DEVICE=isinstance(beta1, torch.Tensor), ADAMW=bool(adamw), BIAS_CORRECTION=bool(bias_correction),
        MAXIMIZE=bool(maximize), AMSGRAD=max_exp_avg_sqs is not None, ALIGNED=table.aligned,
        BLOCK=block, ITERS=iters, num_warps=warps,
    )


def sgd(params, grads, masters, momentum_buffers, step, *, lr, momentum, dampening,
        weight_decay, nesterov, maximize, inv_scale, clip_coef, found_inf):
    device = params[0].device
    block, iters, warps = launch_config()
    steps, step_role, step_scalar = _step_role(step, 4, device)
    roles = [grads, params, masters, momentum_buffers]
    if steps is not None:
        roles.append(steps)
    table = chunk_table(roles, list(map(_numel, params)), block * iters, device)
    if table.n_chunks == 0:
        return
    dummy = torch.empty(1, dtype=torch.float32, device=device)
    cached(_sgd_kernel)[(table.n_chunks,)](
        table.ptrs, table.numels, table.chunk_t, table.chunk_start, table.n_tensors,
        _scalar_or_dummy(inv_scale, dummy), _scalar_or_dummy(clip_coef, dummy),
        _scalar_or_dummy(found_inf, dummy), *_lr_args(lr, device, dummy),
        float(momentum), 1.0 - float(dampening), float(weight_decay), step_scalar,
        GRAD_DTYPE=tl_dtype(grads[0].dtype), PARAM_DTYPE=tl_dtype(params[0].dtype),
        HAS_MASTER=masters is not None, HAS_INV_SCALE=inv_scale is not None,
        HAS_CLIP=clip_coef is not None, HAS_FOUND_INF=found_inf is not None,
        STEP_ROLE=step_role, LR_ON_DEVICE=isinstance(lr, torch.Tensor), HAS_MOMENTUM=momentum_buffers is not None,
        NESTEROV=bool(nesterov), MAXIMIZE=bool(maximize),
        ALIGNED=table.aligned, BLOCK=block, ITERS=iters, num_warps=warps,
    )


def lamb_stage1(params, grads, masters, exp_avgs, exp_avg_sqs, updates, step, global_div, *,
                beta1, beta2, beta3, eps, weight_decay, adamw, bias_correction,
                inv_scale, clip_coef, found_inf):
    """Moments + raw update ``u`` into ``updates``; returns per-tensor (||p||^2, ||u||^2)."""
    device = params[0].device
    block, iters, warps = launch_config()
    steps, step_role, step_scalar = _step_role(step, 6, device)
    roles = [grads, params, masters, exp_avgs, exp_avg_sqs, updates]
    if steps is not None:
        roles.append(steps)
    table = chunk_table(roles, list(map(_numel, params)), block * iters, device)
    if table.n_chunks == 0:
        zeros = torch.zeros(table.n_tensors, dtype=torch.float32, device=device)
        return zeros, zeros.clone()
    partial_p2 = torch.empty(table.n_chunks, dtype=torch.float32, device=device)
    partial_u2 = torch.empty(table.n_chunks, dtype=torch.float32, device=device)
    dummy = partial_p2
    cached(_lamb_stage1_kernel)[(table.n_chunks,)](
        table.ptrs, table.numels, table.chunk_t, table.chunk_start, table.n_tensors,
        _scalar_or_dummy(inv_scale, dummy), _scalar_or_dummy(clip_coef, dummy),
        _scalar_or_dummy(found_inf, dummy), global_div, partial_p2, partial_u2,
        float(beta1), float(beta2), _log2(beta1), _log2(beta2), 1.0 - float(beta2), float(beta3),
        float(eps), float(weight_decay),
        step_scalar,
        GRAD_DTYPE=tl_dtype(grads[0].dtype), PARAM_DTYPE=tl_dtype(params[0].dtype),
        HAS_MASTER=masters is not None, HAS_INV_SCALE=inv_scale is not None,
        HAS_CLIP=clip_coef is not None, HAS_FOUND_INF=found_inf is not None,
        STEP_ROLE=step_role, ADAMW=bool(adamw), BIAS_CORRECTION=bool(bias_correction),
        ALIGNED=table.aligned, BLOCK=block, ITERS=iters, num_warps=warps,
    )
    chunk_t = table.chunk_t
    p2 = torch.zeros(table.n_tensors, dtype=torch.float32, device=device).index_add_(0, chunk_t, partial_p2)
    u2 = torch.zeros(table.n_tensors, dtype=torch.float32, device=device).index_add_(0, chunk_t, partial_u2)
    return p2, u2


def lamb_stage2(params, masters, updates, ratios, *, lr, found_inf):
    device = params[0].device
    block, iters, warps = launch_config()
    table = chunk_table([params, masters, updates], list(map(_numel, params)), block * iters, device)
    if table.n_chunks == 0:
        return
    cached(_lamb_stage2_kernel)[(table.n_chunks,)](
        table.ptrs, table.numels, table.chunk_t, table.chunk_start, table.n_tensors,
        _scalar_or_dummy(found_inf, ratios), ratios, *_lr_args(lr, device, ratios),
        PARAM_DTYPE=tl_dtype(params[0].dtype), HAS_MASTER=masters is not None,
        HAS_FOUND_INF=found_inf is not None, LR_ON_DEVICE=isinstance(lr, torch.Tensor),
        ALIGNED=table.aligned, BLOCK=block, ITERS=iters, num_warps=warps,
    )
