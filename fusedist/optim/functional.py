"""Functional multi-tensor optimizer API: the contract fused optimizers, ZeRO and the CPU
extension share.

Every function takes parallel lists of tensors and updates them in place. Conventions:

* ``params``: model parameters (fp32, bf16 or fp16; fp64 runs on the reference path).
* ``grads``: same shapes, any float dtype, possibly still loss-scaled.
* optimizer states (``exp_avgs``, ``exp_avg_sqs``, ``momentum_buffers``): fp32 (fp64 for fp64
  parameters).
* ``masters``: None, or a list of fp32 master copies (entries may be None for parameters that
  are their own master). With a master, the update runs on the master and the parameter
  receives the cast of the new master value in the same pass.
* ``inv_scale``, ``clip_coef``, ``found_inf``: None or 1-element fp32 tensors on the
  parameters' device. The gradient used is ``grad * inv_scale * clip_coef``; when
  ``found_inf != 0`` nothing at all is written. The flag is read on the device (Note
  [found-inf masking] in ``triton_kernels/multi_tensor.py``): the CUDA path never
  synchronizes the host.
* ``validate``: check list lengths, shapes, devices and state dtypes (default). Callers that
  created the states themselves and checked the gradients (the fused optimizers) pass False:
  per-tensor checks cost ~1 us each, which adds up over hundreds of small tensors.
* ``step``: the step count *of this update* (already incremented), either one number for all
  tensors or a list of fp32 scalar tensors on the device, one per parameter (what the fused
  optimizers keep, so a skipped step can be undone on the device).

Dispatch: each call is split into buckets of tensors sharing device and dtypes, and each bucket
goes to the backend :func:`fusedist.backend.select_backend` picks: ``triton`` (multi-tensor
kernels; CUDA, or CPU under ``TRITON_INTERPRET=1``), ``cpu_ext`` (the C++ CPU Adam, when built)
or ``torch`` (:mod:`fusedist.optim._reference`, the same math in PyTorch). Tensors the kernels
cannot take (fp64; strided slices; a gradient or state laid out unlike its parameter) always
use the reference. Dense tensors in any memory format (channels_last, transposed) take the
kernels: they are walked as flat memory, so their companions must share their layout.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import operator
from collections import defaultdict
from typing import Optional, Sequence, Union

import torch

from .. import _extension
from ..backend import select_backend
from . import _cpu_sgd, _reference
from ._eager import FUNCTIONAL_REASON, eager_under_compile
from ._negated import memory_views as _memory_views, read_resolved as _read_resolved
from ._negated import refuse_negated as _refuse_negated, scalar_resolved as _scalar_resolved
from .._memory_layout import is_dense, walks_like

Tensor = torch.Tensor
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _kernels():
    # Imported lazily: the module imports triton (see fusedist/backend.py); once, as an import
    # statement costs microseconds on every call of a step's host path.
    from ..triton_kernels import multi_tensor

    return multi_tensor


# ----------------------------------------------------------------------------- cpu_ext hook
#
# Dispatch point of the C++ CPU Adam (``fusedist._cpu_ops``). Its owner adds the adapter module
# ``fusedist/optim/_cpu_adam.py`` exposing
#
#     adam_update(params, grads, exp_avgs, exp_avg_sqs, masters, *, lr, beta1, beta2, eps,
#                 weight_decay, adamw, step, bias_correction, maximize, inv_scale, clip_coef,
#                 found_inf) -> None
#
# with exactly the semantics of :func:`adam_update` for one bucket (CPU tensors of one dtype
# combination). Until both the adapter and the extension exist, ``has_cpu_ext`` is False and
# the backend selector never picks ``cpu_ext``. An adapter that sets ``ACCEPTS_TRUSTED = True``
# also takes ``trusted=True`` on calls whose parameters and gradients were checked (``_trust``).


@functools.lru_cache(maxsize=None)
def _has_cpu_adam() -> bool:
    return (
        importlib.util.find_spec(f"{__package__}._cpu_adam") is not None
        and _extension.is_available("_cpu_ops")
    )


# ----------------------------------------------------------------------------- validation


def _check_scalar_tensor(name: str, t: Optional[Tensor], device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        raise TypeError(f"{name} must be None or a 1-element float32 tensor, got {t!r}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the parameters are on {device}")


def _check_lists(op: str, params: Sequence[Tensor], **lists) -> None:
    n = len(params)
    for name, lst in lists.items():
        if lst is None:
            continue
        if len(lst) != n:
            raise ValueError(f"{op}: {name} has {len(lst)} entries but params has {n}")
    for i, p in enumerate(params):
        if not p.is_floating_point():
            raise TypeError(f"{op}: params[{i}] has dtype {p.dtype}; only floating-point parameters are supported")
        for name, lst in lists.items():
            if lst is None or lst[i] is None:
                continue
            t = lst[i]
            if t.shape != p.shape:
                raise ValueError(f"{op}: {name}[{i}] has shape {tuple(t.shape)} but params[{i}] has {tuple(p.shape)}")
            if t.device != p.device:
                raise ValueError(f"{op}: {name}[{i}] is on {t.device} but params[{i}] is on {p.device}")
            if t.is_sparse:
                raise RuntimeError(f"{op}: {name}[{i}] is sparse; fused optimizers support dense tensors only")


def _check_hyper(op: str, **values) -> None:
    for name, value in values.items():
        if isinstance(value, Tensor) and value.device.type != "cpu":
            continue  # reading it would wait for the device (Note [a learning rate on the device])
        if not math.isfinite(float(value)):
            raise ValueError(f"{op}: hyperparameter {name}={value} is not finite")


def _host(value):
    """A tensor hyperparameter as a number, for the paths that take numbers (the C++ CPU
    kernels, the reference); the Triton kernels read a tensor lr and tensor betas on the device
    instead (Note [a learning rate on the device], Note [betas on the device])."""
    return float(value.item()) if isinstance(value, Tensor) else value


def _effective_factor(inv_scale: Optional[Tensor], clip_coef: Optional[Tensor]) -> Optional[Tensor]:
    if inv_scale is None:
        return clip_coef
    if clip_coef is None:
        return inv_scale
    return (inv_scale.reshape(1) * clip_coef.reshape(1))


# ----------------------------------------------------------------------------- bucketing


def _walkable_together(p: Tensor, companions) -> bool:
    """Whether the kernels may treat ``p`` and its companions (gradient, states, master) as
    flat arrays walked in step: all dense, with one memory layout. Anything else (a strided
    slice, a gradient laid out unlike its parameter) takes the reference path."""
    return is_dense(p) and all(t is None or walks_like(t, p) for t in companions)


def _bucketize(params, grads, masters, state_lists):
    """Group tensor indices by (device, param dtype, grad dtype, has master, kernel-eligible).

    The common case (one device and dtype pair, everything contiguous) is recognized with a few
    list passes; Python overhead per step matters when hundreds of small tensors are stepped.
    Layouts are always checked (a parameter's memory format can change after its states were
    made), and so are the states' and masters' dtypes (Note [states the program replaced])."""
    n = len(params)
    if masters is None:
        has_master = [False] * n
    else:
        has_master = [m is not None for m in masters]
    companions = [lst for lst in (masters, *state_lists) if lst is not None]
    p_dtypes = set(map(_dtype_of, params))
    g_dtypes = set(map(_dtype_of, grads))
    devices = set(map(_device_of, params))
    if (
        len(p_dtypes) == 1 and len(g_dtypes) == 1 and len(devices) == 1
        and len(set(has_master)) == 1
        and p_dtypes <= set(_KERNEL_DTYPES) and g_dtypes <= set(_KERNEL_DTYPES)
        and all(map(_is_contiguous, params)) and all(map(_is_contiguous, grads))
        and all(_all_contiguous_or_none(lst) for lst in companions)
        and _all_fp32(companions)
    ):
        return {(params[0].device, params[0].dtype, grads[0].dtype, has_master[0], True): list(range(n))}
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, (p, g) in enumerate(zip(params, grads)):
        eligible = (
            p.dtype in _KERNEL_DTYPES
            and g.dtype in _KERNEL_DTYPES
            and _walkable_together(p, [g] + [lst[i] for lst in companions])
            and all(lst[i] is None or lst[i].dtype == torch.float32 for lst in companions)
        )
        buckets[(p.device, p.dtype, g.dtype, has_master[i], eligible)].append(i)
    return buckets


# (Unbound methods and getters mapped over a list: a whole-list check without a Python frame per
# tensor; _bucketize runs them over every tensor of every step.)
_is_contiguous = torch.Tensor.is_contiguous
_dtype_of = operator.attrgetter("dtype")
_device_of = operator.attrgetter("device")
_layout_of = operator.attrgetter("layout")
_shape_of = operator.attrgetter("shape")


def _all_contiguous_or_none(lst) -> bool:
    try:
        return all(map(_is_contiguous, lst))
    except TypeError:  # a None among them (a parameter without a master)
        return all(t is None or t.is_contiguous() for t in lst)


# Note [states the program replaced]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The kernels walk a parameter's states and master as fp32 arrays. The fused optimizers make
# them so, but a program may replace one between steps (``optimizer.state[p]["exp_avg"] =
# ...``: a state carried over from torch's optimizer, bf16 for a bf16 parameter, or cast to
# save memory). Handed to the kernels, such a tensor was read and written as fp32 memory it
# does not have -- silently wrong values, or writes past its end. So every call checks the
# dtypes (a whole list at a time, as for the layouts: the shapes and devices, which only a
# program's error could change, are not re-checked at every step), and a tensor of another
# dtype takes the reference path, which computes with it as torch's optimizers do.
_FP32 = {torch.float32}


def _all_fp32(companions) -> bool:
    """Whether every state and master (None entries aside) is fp32 (Note [states the program
    replaced])."""
    for lst in companions:
        try:
            if set(map(_dtype_of, lst)) != _FP32:
                return False
        except AttributeError:  # a None among them (a parameter without a master)
            if any(t is not None and t.dtype != torch.float32 for t in lst):
                return False
    return True


def _take(lst, idx):
    """``lst`` at the indices ``idx`` of one bucket. A bucket of every index (the common case:
    one device and dtype) holds them in order, so ``lst`` itself serves (read only below)."""
    if lst is None:
        return None
    return lst if len(idx) == len(lst) and type(lst) is list else [lst[i] for i in idx]


def _take_step(step, idx):
    return _take(step, idx) if isinstance(step, (list, tuple)) else step


def _trust(adapter, validate: bool) -> dict:
    """``trusted=True`` for an unvalidated call (the fused optimizers, which checked the
    parameters and gradients: Note [checks the caller made] in ``_cpu_adam.py``) when the
    adapter declares it takes the keyword (``ACCEPTS_TRUSTED``); nothing otherwise, so an
    adapter with the plain signature above still plugs in."""
    return {"trusted": True} if not validate and getattr(adapter, "ACCEPTS_TRUSTED", False) else {}


def _indices_by_step(step, n: int) -> dict:
    """Indices 0..n-1 grouped by their step count as an int (one number: all alike). The
    common case, every count equal, is found with one pass in C (``list.count``) instead of a
    dictionary insertion per tensor."""
    if not isinstance(step, (list, tuple)):
        return {int(step): list(range(n))}
    counts = [int(s) for s in step]
    if counts and counts.count(counts[0]) == n:
        return {counts[0]: list(range(n))}
    by_step: dict = {}
    for j, c in enumerate(counts):
        by_step.setdefault(c, []).append(j)
    return by_step


def _backend_for(op: str, device: torch.device, eligible: bool, has_cpu_ext: bool = False) -> str:
    """The backend for one bucket: tensors the kernels cannot walk (``eligible`` False) always
    take the reference path, whichever backend was asked for, so every layout torch's
    optimizers accept steps here too; so do tensors on ``meta``, which have no memory for the
    kernels (the C++ CPU Adam was picked for them, as for any non-CUDA device)."""
    if device.type == "meta":
        return "torch"
    choice = select_backend(op, device, has_cpu_ext=has_cpu_ext)
    return choice if eligible else "torch"


# ----------------------------------------------------------------------------- public API

# Note [the functional API under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A call inside a compiled function (a hand-written optimizer step, as torch's recipe compiles
# ``opt.step``) would be traced: the Triton launches too, whose pointer tables are built from
# data pointers (under the interpreter their pointer arithmetic ran on fake tensors and failed
# at the first step), and the host paths recompiled on each new step count. The entry points
# run eagerly instead, as the fused optimizers' steps do; the updates are in place, so the
# caller's graph sees the result. (With fullgraph=True, dynamo's error gives the reason: Note [a
# fused step under fullgraph=True] in _eager.py.)
_eager_in_compiled_code = eager_under_compile(FUNCTIONAL_REASON)


@_eager_in_compiled_code  # Note [the functional API under torch.compile]
def check_and_norm(grads: Sequence[Tensor], inv_scale: Optional[Tensor] = None, unscale_in_place: bool = False):
    """One read-only pass over ``grads``: returns ``(found_inf, sumsq)``, 1-element fp32 tensors
    (``sumsq`` fp64 when there are fp64 gradients, which keep their precision as in torch's clip).

    ``found_inf`` is 1.0 if any gradient element (as stored, i.e. still scaled) is inf or nan;
    ``sumsq`` is the sum of squares of ``grad * inv_scale`` (the squared global L2 norm of the
    unscaled gradients). No gradient is written and the host is not synchronized.
    ``unscale_in_place``: also write ``grad * inv_scale`` into the gradients, as torch's
    ``GradScaler.unscale_`` does (the Triton kernel in the same pass).
    """
    grads = _memory_views([g for g in grads if g is not None])  # Note [lazily negated tensors] in _negated.py
    if not grads:
        device = inv_scale.device if inv_scale is not None else torch.device("cpu")
        zero = torch.zeros(1, dtype=torch.float32, device=device)
        return zero, zero.clone()
    device = grads[0].device
    _check_scalar_tensor("inv_scale", inv_scale, device)
    inv_scale = _scalar_resolved(inv_scale)
    bads, sumsqs = [], []
    buckets = _one_bucket(grads, device)
    if buckets is None:
        buckets = defaultdict(list)
        for i, g in enumerate(grads):
            if g.is_sparse:
                raise RuntimeError(f"check_and_norm: grads[{i}] is sparse; only dense gradients are supported")
            if not g.is_floating_point():
                raise TypeError(f"check_and_norm: grads[{i}] has dtype {g.dtype}; expected a floating-point gradient")
            if g.device != device:
                raise ValueError(f"check_and_norm: grads[{i}] is on {g.device}, grads[0] on {device}")
            buckets[(g.dtype, g.dtype in _KERNEL_DTYPES and is_dense(g))].append(g)
    for (_, eligible), bucket in buckets.items():
        impl = _kernels() if _backend_for("check_and_norm", device, eligible) == "triton" else _reference
        bad, sumsq = impl.check_and_norm(bucket, inv_scale, unscale_in_place)
        bads.append(bad)
        sumsqs.append(sumsq)
    if len(bads) == 1:
        return bads[0], sumsqs[0]
    return torch.stack(bads).amax().reshape(1), torch.stack(sumsqs).sum().reshape(1)


def _one_bucket(grads: list, device) -> Optional[dict]:
    """check_and_norm's buckets when every gradient is a dense (contiguous) strided tensor of one
    kernel dtype on ``device``: checked a whole list at a time (the unscale of every step runs
    this over every gradient). None otherwise: the per-gradient loop sorts them and names any
    gradient at fault."""
    dtypes = set(map(_dtype_of, grads))
    if (len(dtypes) == 1 and dtypes <= set(_KERNEL_DTYPES) and set(map(_layout_of, grads)) == {torch.strided}
            and set(map(_device_of, grads)) == {device} and all(map(_is_contiguous, grads))):
        return {(grads[0].dtype, True): grads}
    return None


@_eager_in_compiled_code  # Note [the functional API under torch.compile]
def adam_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    masters: Optional[Sequence[Optional[Tensor]]],
    *,
    lr: Union[float, Tensor],
    beta1: Union[float, Tensor],
    beta2: Union[float, Tensor],
    eps: float,
    weight_decay: float,
    adamw: bool,
    step,
    bias_correction: bool = True,
    maximize: bool = False,
    inv_scale: Optional[Tensor] = None,
    clip_coef: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    validate: bool = True,
    max_exp_avg_sqs: Optional[Sequence[Tensor]] = None,
) -> None:
    """Adam (``adamw=False``: L2 decay added to the gradient) or AdamW (decoupled decay) on a
    list of tensors; math of ``torch.optim.Adam``/``AdamW``. ``max_exp_avg_sqs`` (fp32 states,
    the running maximum of ``exp_avg_sq``) turns on AMSGrad, as torch's ``amsgrad=True``."""
    if not params:
        return
    if validate:
        _check_lists("adam_update", params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, masters=masters,
                     max_exp_avg_sqs=max_exp_avg_sqs)
    _check_hyper("adam_update", lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    device = params[0].device
    for name, t in (("inv_scale", inv_scale), ("clip_coef", clip_coef), ("found_inf", found_inf)):
        _check_scalar_tensor(name, t, device)
    _refuse_negated("adam_update", params=params)  # (Note [lazily negated tensors])
    if validate:
        _refuse_negated("adam_update", exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, masters=masters,
                        max_exp_avg_sqs=max_exp_avg_sqs)
    grads = _read_resolved(grads)
    inv_scale, clip_coef, found_inf = map(_scalar_resolved, (inv_scale, clip_coef, found_inf))
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
                 bias_correction=bias_correction, maximize=maximize)
    buckets = _bucketize(params, grads, masters, (exp_avgs, exp_avg_sqs, max_exp_avg_sqs))
    has_cpu_ext = _has_cpu_adam() and max_exp_avg_sqs is None  # the C++ kernel has no AMSGrad
    for (dev, _, _, has_master, eligible), idx in buckets.items():
        b_params, b_grads = _take(params, idx), _take(grads, idx)
        b_masters = _take(masters, idx) if has_master else None
        b_m, b_v, b_step = _take(exp_avgs, idx), _take(exp_avg_sqs, idx), _take_step(step, idx)
        backend = _backend_for("adam_update", dev, eligible, has_cpu_ext)
        b_hyper = hyper if backend == "triton" else dict(hyper, lr=_host(lr), beta1=_host(beta1), beta2=_host(beta2))
        if backend == "cpu_ext":
            from . import _cpu_adam  # the C++ CPU Adam adapter (see the cpu_ext hook above)

            # The C++ kernel takes one step count per call: group tensors by step (they differ
            # only when some parameters skipped steps without a gradient).
            for s, js in _indices_by_step(b_step, len(b_params)).items():
                _cpu_adam.adam_update(_take(b_params, js), _take(b_grads, js), _take(b_m, js), _take(b_v, js),
                                      _take(b_masters, js) if b_masters is not None else None, step=s,
                                      inv_scale=inv_scale, clip_coef=clip_coef, found_inf=found_inf,
                                      **b_hyper, **_trust(_cpu_adam, validate))
            continue
        impl = _kernels() if backend == "triton" else _reference
        impl.adam(b_params, b_grads, b_masters, b_m, b_v, b_step, inv_scale=inv_scale,
                  clip_coef=clip_coef, found_inf=found_inf, max_exp_avg_sqs=_take(max_exp_avg_sqs, idx),
                  **b_hyper)


@_eager_in_compiled_code  # Note [the functional API under torch.compile]
def sgd_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Optional[Sequence[Tensor]],
    masters: Optional[Sequence[Optional[Tensor]]],
    *,
    lr: Union[float, Tensor],
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    step=1,
    inv_scale: Optional[Tensor] = None,
    clip_coef: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    validate: bool = True,
) -> None:
    """SGD with momentum/dampening/nesterov/weight decay, math of ``torch.optim.SGD``.

    ``momentum_buffers`` is required when ``momentum != 0`` (None otherwise). Where ``step``
    equals 1 the buffer is initialized with the gradient, as torch does on a parameter's first
    step, whatever the buffer held.
    """
    if not params:
        return
    if momentum != 0 and momentum_buffers is None:
        raise ValueError("sgd_update: momentum != 0 needs momentum_buffers")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("sgd_update: nesterov momentum requires momentum > 0 and dampening = 0")
    if validate:
        _check_lists("sgd_update", params, grads=grads, momentum_buffers=momentum_buffers, masters=masters)
    _check_hyper("sgd_update", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    device = params[0].device
    for name, t in (("inv_scale", inv_scale), ("clip_coef", clip_coef), ("found_inf", found_inf)):
        _check_scalar_tensor(name, t, device)
    bufs = momentum_buffers if momentum != 0 else None
    _refuse_negated("sgd_update", params=params)  # (Note [lazily negated tensors])
    if validate:
        _refuse_negated("sgd_update", momentum_buffers=bufs, masters=masters)
    grads = _read_resolved(grads)
    inv_scale, clip_coef, found_inf = map(_scalar_resolved, (inv_scale, clip_coef, found_inf))
    hyper = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                 nesterov=nesterov, maximize=maximize)
    buckets = _bucketize(params, grads, masters, (bufs,))
    for (dev, p_dtype, g_dtype, has_master, eligible), idx in buckets.items():
        b_params, b_grads = _take(params, idx), _take(grads, idx)
        b_masters = _take(masters, idx) if has_master else None
        b_bufs, b_step = _take(bufs, idx), _take_step(step, idx)
        triton = _backend_for("sgd_update", dev, eligible) == "triton"
        b_hyper = hyper if triton else dict(hyper, lr=_host(lr))
        if triton:
            impl = _kernels()
        elif _cpu_sgd.applies(dev, p_dtype, g_dtype, has_master, b_bufs):
            _cpu_sgd.sgd(b_params, b_grads, b_bufs, b_step, inv_scale=inv_scale, clip_coef=clip_coef,
                         found_inf=found_inf, **b_hyper)
            continue
        else:
            impl = _reference
        impl.sgd(b_params, b_grads, b_masters, b_bufs, b_step, inv_scale=inv_scale, clip_coef=clip_coef,
                 found_inf=found_inf, **b_hyper)


@_eager_in_compiled_code  # Note [the functional API under torch.compile]
def lamb_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    masters: Optional[Sequence[Optional[Tensor]]],
    *,
    lr: Union[float, Tensor],
    beta1: Union[float, Tensor],
    beta2: Union[float, Tensor],
    eps: float,
    weight_decay: float,
    step,
    bias_correction: bool = True,
    adam_w_mode: bool = True,
    grad_averaging: bool = True,
    max_grad_norm: float = 1.0,
    use_nvlamb: bool = False,
    inv_scale: Optional[Tensor] = None,
    clip_coef: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    global_grad_sumsq: Optional[Tensor] = None,
    validate: bool = True,
) -> None:
    """LAMB with apex ``FusedLAMB`` semantics, in two passes over the parameters.

    1. The global gradient norm (of ``grad * inv_scale * clip_coef`` over *all* tensors of the
       call; pass ``global_grad_sumsq`` to supply it, e.g. reduced across ranks) clips the
       gradient to ``max_grad_norm`` (``<= 0`` disables), then Adam moments and the raw update
       ``u = m_hat / (sqrt(v_hat) + eps) (+ wd * p)`` are formed, with per-tensor ||p||, ||u||.
    2. ``p -= lr * ratio * u`` with the trust ratio ``||p|| / ||u||`` (1 where either is 0, or
       when ``weight_decay == 0`` and not ``use_nvlamb``).
    """
    if not params:
        return
    if validate:
        _check_lists("lamb_update", params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, masters=masters)
    _check_hyper("lamb_update", lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 max_grad_norm=max_grad_norm)
    device = params[0].device
    for name, t in (("inv_scale", inv_scale), ("clip_coef", clip_coef), ("found_inf", found_inf)):
        _check_scalar_tensor(name, t, device)
    _refuse_negated("lamb_update", params=params)  # (Note [lazily negated tensors])
    if validate:
        _refuse_negated("lamb_update", exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, masters=masters)
    grads = _read_resolved(grads)
    inv_scale, clip_coef, found_inf = map(_scalar_resolved, (inv_scale, clip_coef, found_inf))
    global_grad_sumsq = _scalar_resolved(global_grad_sumsq)
    if global_grad_sumsq is None:
        _, global_grad_sumsq = check_and_norm(grads, _effective_factor(inv_scale, clip_coef))
    if max_grad_norm > 0:
        norm = global_grad_sumsq.reshape(1).float().sqrt()  # (fp64 with fp64 gradients)
        # apex: divide by norm / max_norm when the norm exceeds max_norm, else by 1.
        global_div = torch.where(norm > max_grad_norm, norm / max_grad_norm, torch.ones_like(norm))
    else:
        global_div = torch.ones(1, dtype=torch.float32, device=device)
    beta3 = 1.0 - beta1 if grad_averaging else 1.0
    use_ratio = use_nvlamb or weight_decay != 0
    buckets = _bucketize(params, grads, masters, (exp_avgs, exp_avg_sqs))
    for (dev, _, _, has_master, eligible), idx in buckets.items():
        triton = _backend_for("lamb_update", dev, eligible) == "triton"
        impl = _kernels() if triton else _reference
        b_params = _take(params, idx)
        b_masters = _take(masters, idx) if has_master else None
        b_m = _take(exp_avgs, idx)
        updates = [torch.empty_like(m) for m in b_m]
        p2, u2 = impl.lamb_stage1(
            b_params, _take(grads, idx), b_masters, b_m, _take(exp_avg_sqs, idx), updates,
            _take_step(step, idx), global_div, beta1=beta1, beta2=beta2, beta3=beta3, eps=eps,
            weight_decay=weight_decay, adamw=adam_w_mode, bias_correction=bias_correction,
            inv_scale=inv_scale, clip_coef=clip_coef, found_inf=found_inf,
        )
        if use_ratio:
            p_norm, u_norm = p2.sqrt(), u2.sqrt()
            ratios = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm))
        else:
            ratios = torch.ones_like(p2)
        impl.lamb_stage2(b_params, b_masters, updates, ratios, lr=lr if triton else _host(lr), found_inf=found_inf)
