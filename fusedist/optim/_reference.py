"""Pure-PyTorch reference of the multi-tensor optimizer kernels.

Same math, same operation order as the kernels of ``triton_kernels/multi_tensor_*.py``; it runs on CPU tensors
when the interpreter is off, on tensors the kernels do not take (float64, non-contiguous),
and it is the oracle the kernel tests compare against. Each function takes one list per role
(see :mod:`fusedist.optim.functional` for the meaning of the arguments).

Skipping on overflow (``found_inf != 0``) writes nothing. On CPU the flag is read directly
(free there); on other devices the new values are selected with ``torch.where`` so that this
path never synchronizes the host either.
"""

from __future__ import annotations

import torch

from .._dtypes import compute_dtype


def skip_now(found_inf: torch.Tensor | None) -> tuple[bool, torch.Tensor | None]:
    """(skip everything, per-element mask to apply) for a found-inf flag."""
    if found_inf is None:
        return False, None
    if found_inf.device.type == "cpu":
        return bool(found_inf.reshape(()).item() != 0), None
    return False, found_inf.reshape(()).ne(0)


def _commit(dst: torch.Tensor, new: torch.Tensor, skip_mask: torch.Tensor | None) -> None:
    if skip_mask is not None:
        new = torch.where(skip_mask, dst, new.to(dst.dtype))
    dst.copy_(new)


def grad_factor(inv_scale, clip_coef):
    factor = None
    for t in (inv_scale, clip_coef):
        if t is not None:
            t = t.reshape(()).float()
            factor = t if factor is None else factor * t
    return factor


def _scaled_grad(grad: torch.Tensor, factor, maximize: bool, dtype: torch.dtype) -> torch.Tensor:
    """The gradient in ``dtype``, times the unscale/clip ``factor`` (None: 1), negated to maximize."""
    g = grad.to(dtype)
    if factor is not None:
        g = g * factor.to(dtype)
    return -g if maximize else g


def _compute_dtype(state: torch.Tensor) -> torch.dtype:
    return state.dtype  # fp32, or fp64 for fp64 parameters


def _step_value(step, i: int):
    """Step count of tensor i as a float64 scalar (tensor or number)."""
    if isinstance(step, (list, tuple)):
        return step[i].double()
    return float(step)


def _host_steps(step, n: int) -> list:
    """The step counts as Python floats, from CPU tensors or one number. (``item()`` of an fp32
    count is the value ``double()`` gives, for one call per count instead of two.)"""
    if isinstance(step, (list, tuple)):
        return [float(s.item()) if isinstance(s, torch.Tensor) else float(s) for s in step]
    return [float(step)] * n


def _plus_decay(x: torch.Tensor, p: torch.Tensor, weight_decay) -> torch.Tensor:
    """``x + weight_decay * p``, left out when ``weight_decay`` is 0 as torch leaves it out: ``0 * p``
    is nan for an inf or nan parameter and would turn a finite gradient and the states into nan."""
    return x + weight_decay * p if weight_decay != 0 else x


def check_and_norm(grads, inv_scale, unscale_in_place=False):
    device = grads[0].device
    # In fp32, or fp64 for fp64 gradients (foreach_norm refuses to narrow them, and their norm
    # keeps its precision: torch's clip measures them in fp64).
    dtype = compute_dtype(grads[0].dtype)
    norms = torch.stack(torch._foreach_norm(list(grads), 2, dtype=dtype))
    if inv_scale is not None:
        norms = norms * inv_scale.reshape(()).to(dtype)
    sumsq = (norms * norms).sum()
    # A non-finite norm can also come from squares overflowing fp32 (|g| > 1.8e19, bf16 only),
    # so the flag looks at the elements, as the kernel does.
    if device.type == "cpu" and bool(torch.isfinite(norms).all()):
        bad = torch.zeros((), dtype=torch.float32)
    else:
        bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float()
    if unscale_in_place and inv_scale is not None:
        torch._foreach_mul_(list(grads), inv_scale.reshape(()))
    return bad.reshape(1), sumsq.reshape(1)


def adam(params, grads, masters, exp_avgs, exp_avg_sqs, step, *, lr, beta1, beta2, eps,
         weight_decay, adamw, bias_correction, maximize, inv_scale, clip_coef, found_inf,
         max_exp_avg_sqs=None):
    skip, skip_mask = skip_now(found_inf)
    if skip:
        return
    factor = grad_factor(inv_scale, clip_coef)
    # (``is_cpu``, not ``device.type``: this runs for every step count on every step.)
    if skip_mask is None and not any(isinstance(s, torch.Tensor) and not s.is_cpu
                                     for s in (step if isinstance(step, (list, tuple)) else [step])):
        return _adam_foreach(params, grads, masters, exp_avgs, exp_avg_sqs, step, factor, lr=lr, beta1=beta1,
                             beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
                             bias_correction=bias_correction, maximize=maximize,
                             max_exp_avg_sqs=max_exp_avg_sqs)
    for i, (param, grad, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        master = None if masters is None else masters[i]
        dtype = _compute_dtype(m)
        g = _scaled_grad(grad, factor, maximize, dtype)
        p = (master if master is not None else param).to(dtype)
        if adamw:
            p = p * (1.0 - lr * weight_decay)
        else:
            g = _plus_decay(g, p, weight_decay)
        s = _step_value(step, i)
        if bias_correction:
            step_size = lr / (1.0 - beta1 ** s)
            bc2_sqrt = (1.0 - beta2 ** s) ** 0.5
        else:
            step_size, bc2_sqrt = lr, 1.0
        if isinstance(step_size, torch.Tensor):
            step_size, bc2_sqrt = step_size.to(dtype), bc2_sqrt.to(dtype)
        m_new = m + (1.0 - beta1) * (g - m)
        v_new = v * beta2 + ((1.0 - beta2) * g) * g  # torch's addcmul order (g * g alone overflows)
        if max_exp_avg_sqs is not None:  # AMSGrad: the running maximum of v
            vmax_new = torch.maximum(max_exp_avg_sqs[i], v_new)
            _commit(max_exp_avg_sqs[i], vmax_new, skip_mask)
            denom = vmax_new.sqrt() / bc2_sqrt + eps
        else:
            denom = v_new.sqrt() / bc2_sqrt + eps
        p = p - step_size * (m_new / denom)
        _commit(m, m_new, skip_mask)
        _commit(v, v_new, skip_mask)
        if master is not None:
            _commit(master, p, skip_mask)
        _commit(param, p, skip_mask)


def _adam_foreach(params, grads, masters, exp_avgs, exp_avg_sqs, step, factor, *, lr, beta1, beta2, eps,
                  weight_decay, adamw, bias_correction, maximize, max_exp_avg_sqs=None):
    """The same math with torch's foreach ops (the fast CPU fallback); the step counts are
    host-readable here, so the bias corrections are host doubles, exactly as torch computes them."""
    dtype = exp_avgs[0].dtype
    weights = list(masters) if masters is not None else list(params)
    in_place = all(w.dtype == dtype for w in weights)
    p = weights if in_place else [w.to(dtype) for w in weights]
    g = [x if x.dtype == dtype else x.to(dtype) for x in grads]
    if factor is not None:
        g = torch._foreach_mul(g, factor.to(dtype))
    if maximize:
        g = torch._foreach_neg(g)
    if adamw:
        torch._foreach_mul_(p, 1.0 - lr * weight_decay)
    elif weight_decay != 0:
        g = torch._foreach_add(g, torch._foreach_mul(p, weight_decay))
    steps = _host_steps(step, len(params))
    if bias_correction:
        step_sizes = [-(lr / (1.0 - beta1 ** s)) for s in steps]
        bc2_sqrt = [(1.0 - beta2 ** s) ** 0.5 for s in steps]
    else:
        step_sizes, bc2_sqrt = [-lr] * len(steps), [1.0] * len(steps)
    torch._foreach_lerp_(exp_avgs, g, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, 1.0 - beta2)
    if max_exp_avg_sqs is not None:  # AMSGrad: the running maximum of v
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        denom = torch._foreach_sqrt(max_exp_avg_sqs)
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(p, exp_avgs, denom, step_sizes)
    if not in_place:
        torch._foreach_copy_(weights, p)
    if masters is not None:
        torch._foreach_copy_(list(params), weights)


def sgd(params, grads, masters, momentum_buffers, step, *, lr, momentum, dampening,
        weight_decay, nesterov, maximize, inv_scale, clip_coef, found_inf):
    skip, skip_mask = skip_now(found_inf)
    if skip:
        return
    factor = grad_factor(inv_scale, clip_coef)
    for i, (param, grad) in enumerate(zip(params, grads)):
        master = None if masters is None else masters[i]
        dtype = compute_dtype(param.dtype)
        d = _scaled_grad(grad, factor, maximize, dtype)
        p = (master if master is not None else param).to(dtype)
        d = _plus_decay(d, p, weight_decay)
        if momentum_buffers is not None:
            buf = momentum_buffers[i]
            first = torch.as_tensor(_step_value(step, i) == 1.0, device=param.device)
            buf_new = torch.where(first, d, buf * momentum + (1.0 - dampening) * d)
            _commit(buf, buf_new, skip_mask)
            d = d + momentum * buf_new if nesterov else buf_new
        p = p - lr * d
        if master is not None:
            _commit(master, p, skip_mask)
        _commit(param, p, skip_mask)


def lamb_stage1(params, grads, masters, exp_avgs, exp_avg_sqs, updates, step, global_div, *,
                beta1, beta2, beta3, eps, weight_decay, adamw, bias_correction,
                inv_scale, clip_coef, found_inf):
    device = params[0].device
    n = len(params)
    p2 = torch.zeros(n, dtype=torch.float32, device=device)
    u2 = torch.zeros(n, dtype=torch.float32, device=device)
    skip, skip_mask = skip_now(found_inf)
    if skip:
        return p2, u2
    factor = grad_factor(inv_scale, clip_coef)
    factor = (1.0 if factor is None else factor) / global_div.reshape(())
    for i, (param, grad, m, v, u) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, updates)):
        master = None if masters is None else masters[i]
        dtype = _compute_dtype(m)
        g = grad.to(dtype) * factor.to(dtype)
        p = (master if master is not None else param).to(dtype)
        s = _step_value(step, i)
        bc1, bc2 = (1.0 - beta1 ** s, 1.0 - beta2 ** s) if bias_correction else (1.0, 1.0)
        if isinstance(bc1, torch.Tensor):
            bc1, bc2 = bc1.to(dtype), bc2.to(dtype)
        if not adamw:
            g = _plus_decay(g, p, weight_decay)
        m_new = m * beta1 + beta3 * g
        v_new = v * beta2 + ((1.0 - beta2) * g) * g  # torch's addcmul order (g * g alone overflows)
        u_new = (m_new / bc1) / ((v_new / bc2).sqrt() + eps)
        if adamw:
            u_new = _plus_decay(u_new, p, weight_decay)
        _commit(m, m_new, skip_mask)
        _commit(v, v_new, skip_mask)
        u.copy_(u_new)
        p2[i] = (p.float() * p.float()).sum()
        u2[i] = (u_new.float() * u_new.float()).sum()
    return p2, u2


def lamb_stage2(params, masters, updates, ratios, *, lr, found_inf):
    skip, skip_mask = skip_now(found_inf)
    if skip:
        return
    for i, (param, u) in enumerate(zip(params, updates)):
        master = None if masters is None else masters[i]
        p = (master if master is not None else param).to(u.dtype)
        p = p - (lr * ratios[i].to(u.dtype)) * u
        if master is not None:
            _commit(master, p, skip_mask)
        _commit(param, p, skip_mask)
