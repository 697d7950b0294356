"""Adam/AdamW on CPU tensors with the C++ kernel ``fusedist._cpu_ops`` (the ``cpu_ext`` backend).

Why it exists: a CPU optimizer step is memory-bound, so the win is touching each byte once.
One call updates a whole list of tensors in a single pass per element over the FP32 weight
(or master), exp_avg, exp_avg_sq and the gradient (fp32, bf16 or fp16), unscales and clips the
gradient inline, and writes the bf16/fp16 model parameter next to an FP32 master in the same
pass -- 28 bytes per parameter where torch's best equivalent (upcast the gradient, fused AdamW
on the master, copy back) moves about 40.

Guarantees:

* Same math and operation order as ``torch.optim.AdamW``/``Adam`` with ``foreach=True``
  (see Note [operation order] in ``csrc/cpu/adam_impl.h``); results agree with torch to a few
  float32 ulp (torch's vectorized lerp uses an FMA, ours does not).
* The AVX-512, AVX2 and scalar paths give bitwise-identical results; the widest one the CPU
  supports is used unless ``FUSEDIST_CPU_ISA=avx2|scalar|avx512|auto`` asks for another.
* A half-precision parameter written from an FP32 master is exactly ``master.to(dtype)``
  (round to nearest even).
* If ``found_inf`` holds a non-zero (or NaN) value, nothing at all is written.
* Inputs are checked before anything is written; a bad input raises naming the list and index.
* Gradients and scalars that are lazily negated views (torch's negative bit) are read as torch
  reads them (Note [lazily negated tensors] in _negated.py).

Writes go through raw pointers, so tensor version counters are not bumped (as with other
fused optimizer kernels, the step must not run on tensors autograd saved for a pending
backward).
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch

from .. import _extension
from .._memory_layout import is_dense, walks_like
from ._negated import read_resolved, scalar_resolved

__all__ = ["adam_update", "check_hyperparameters", "check_isa_on_every_rank", "is_available", "available_isas",
           "selected_isa", "ISA_ENV"]

ISA_ENV = "FUSEDIST_CPU_ISA"
_ISA_CODES = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NO_COPY = -1


def is_available() -> bool:
    """Whether the C++ CPU extension is built and importable."""
    return _extension.is_available("_cpu_ops")


def available_isas() -> list[str]:
    """Instruction-set paths this build can run on this CPU, narrowest first."""
    return list(_extension.require("_cpu_ops").available_isas())


def _requested_isa() -> int:
    value = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    try:
        return _ISA_CODES[value]
    except KeyError:
        raise ValueError(f"{ISA_ENV}={value!r} is not one of {', '.join(_ISA_CODES)}") from None


def selected_isa() -> str:
    """The path ``adam_update`` runs with now (honouring ``FUSEDIST_CPU_ISA``)."""
    ops = _extension.require("_cpu_ops")
    code = _requested_isa()
    if code < 0:
        return ops.best_isa()
    name = next(k for k, v in _ISA_CODES.items() if v == code)
    if name not in ops.available_isas():
        raise RuntimeError(
            f"{ISA_ENV}={name} but this CPU/build supports only {ops.available_isas()}"
        )
    return name


# Note [a forced ISA on every rank]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# FUSEDIST_CPU_ISA is read per process, and the CPUs of a job need not match (mixed node types, a
# container that hides AVX-512). A path forced on a rank whose CPU or build lacks it failed only
# inside the first host step, on that rank only: the others went on into the step's all-gathers and
# waited for it until the collective timeout. So the ZeRO-Offload construction checks the setting
# of every rank with one small all-reduce -- which path each rank asks for, which ones it can run --
# and every rank raises the same error, naming each rank that cannot and the paths every rank can.
_ISA_UNKNOWN = len(_ISA_CODES)  # (a value of the setting that is not a path at all)


def _isa_row() -> list:
    """This rank's part of the check: [the path it asks for (its code + 1; 0 for auto), a bit per
    path it can run, whether it cannot run the one it asks for]."""
    try:
        code = _requested_isa()
    except ValueError:
        code = _ISA_UNKNOWN
    names = [name for name in _ISA_CODES if name != "auto"]
    usable = set(available_isas())
    mask = sum(1 << _ISA_CODES[name] for name in names if name in usable)
    lacking = code == _ISA_UNKNOWN or (code >= 0 and not mask & (1 << code))
    return [code + 1, mask, int(lacking)]


def _isa_names(mask: int) -> str:
    return ", ".join(name for name, code in _ISA_CODES.items() if code >= 0 and mask & (1 << code)) or "none"


def check_isa_on_every_rank(comm, device, what: str) -> None:
    """Raise RuntimeError on every rank of ``comm`` (None: this process alone) when a rank's
    ``FUSEDIST_CPU_ISA`` asks for a path its CPU or build cannot run, or is not a path at all
    (Note [a forced ISA on every rank]). A collective: every rank calls it at the same point.
    ``device``: where ``comm``'s tensors live; ``what`` names the caller in the error."""
    row = _isa_row()
    world = 1 if comm is None else comm.world_size
    rank = 0 if comm is None else comm.rank
    table = torch.zeros(world * 3, dtype=torch.int64)
    table[rank * 3:rank * 3 + 3] = torch.tensor(row)
    if world > 1:
        table = table.to(device)
        comm.all_reduce(table, op="sum", tag="cpu adam ISA check").wait()
        table = table.cpu()
    rows = table.view(world, 3).tolist()
    failed = [(r, code - 1, mask) for r, (code, mask, lacking) in enumerate(rows) if lacking]
    if not failed:
        return
    common = (1 << _ISA_UNKNOWN) - 1
    for _, mask, _ in rows:
        common &= mask
    problems = "; ".join(
        f"rank {r}: {ISA_ENV} is not one of {', '.join(_ISA_CODES)}" if code == _ISA_UNKNOWN else
        f"rank {r}: {ISA_ENV}={next(k for k, v in _ISA_CODES.items() if v == code)} but its CPU and build run only "
        f"{_isa_names(mask)}"
        for r, code, mask in failed)
    raise RuntimeError(
        f"{what}: the host Adam cannot run the instruction-set path forced on {len(failed)} of {world} rank(s) "
        f"({problems}). Unset {ISA_ENV} (or set it to auto) there, or force a path every rank runs "
        f"({_isa_names(common)}); nothing was updated")


def _scalar_address(tensor: Optional[torch.Tensor], name: str) -> int:
    if tensor is None:
        return 0
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be None or a 1-element float32 tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or tensor.numel() != 1:
        raise ValueError(
            f"{name} must be a 1-element float32 CPU tensor, got shape {tuple(tensor.shape)} "
            f"dtype {tensor.dtype} on {tensor.device}"
        )
    return tensor.data_ptr()


def _describe_bad_tensor(t, what: str, i: int, shape, dtypes) -> Exception:
    if not isinstance(t, torch.Tensor):
        return TypeError(f"{what}[{i}] must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        return ValueError(f"{what}[{i}] is on {t.device}; the cpu_ext Adam kernel needs CPU tensors")
    if t.layout != torch.strided:
        return ValueError(f"{what}[{i}] has layout {t.layout}; only dense tensors are supported")
    if t.is_neg():
        return ValueError(f"{what}[{i}] is a lazily negated view (e.g. ``z.conj().imag``): its memory holds the "
                          "values' negation, and the kernel writes it in place; pass ``.resolve_neg()`` of it")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        return TypeError(f"{what}[{i}] has dtype {t.dtype}; expected one of {allowed}")
    if shape is not None and t.shape != shape:
        return ValueError(f"{what}[{i}] has shape {tuple(t.shape)} but params[{i}] has {tuple(shape)}")
    if what == "params":
        return ValueError(f"params[{i}] (strides {t.stride()}) does not cover its elements densely; "
                          "the kernel walks memory linearly (fusedist.optim.functional routes such "
                          "tensors to the reference path)")
    return ValueError(f"{what}[{i}] has strides {t.stride()}, unlike params[{i}]; the kernel walks "
                      "every tensor of an index in the same memory order")


def _check_list(tensors, what: str, params, dtypes) -> None:
    # One pass per list with the whole test inline: this runs for every tensor on every step
    # (~0.5 us per tensor), so no per-tensor Python calls and no ``t.device`` (~0.4 us alone;
    # is_cpu is false for meta tensors too). The message is built only on failure.
    strided = torch.strided
    Tensor = torch.Tensor
    for i, t in enumerate(tensors):
        p = None if params is None else params[i]
        if not (
            isinstance(t, Tensor)
            and t.dtype in dtypes
            and t.is_cpu
            and t.layout == strided
            and not t.is_neg()
            and (p is None or t.shape == p.shape)
            and ((t.is_contiguous() and (p is None or p.is_contiguous()))
                 or (is_dense(t) if p is None else walks_like(t, p)))
        ):
            raise _describe_bad_tensor(t, what, i, None if p is None else p.shape, dtypes)


def _check_all(params, grads, exp_avgs, exp_avg_sqs, masters) -> None:
    """Every tensor fit for the kernel, which reads and writes them through raw pointers."""
    half_or_float = tuple(_DTYPE_CODES)
    fp32_only = (torch.float32,)
    _check_list(params, "params", None, half_or_float)
    _check_list(grads, "grads", params, half_or_float)
    _check_list(exp_avgs, "exp_avgs", params, fp32_only)
    _check_list(exp_avg_sqs, "exp_avg_sqs", params, fp32_only)
    if masters is not None:
        _check_list(masters, "masters", params, fp32_only)


#: functional.adam_update may pass ``trusted=True`` (Note [checks the caller made]).
ACCEPTS_TRUSTED = True


# Note [checks the caller made]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The kernel gets raw pointers, so every tensor is checked before it runs (dtype, CPU, strided,
# the parameter's shape, a memory walk like the parameter's). Those checks cost ~0.5 us per
# tensor and list, the largest host cost of a step on many small tensors. The fused optimizers'
# path has made most of them already: their step checks each gradient's shape, device and
# dtype, and ``functional._bucketize`` sends only buckets of one CPU device and kernel dtypes
# whose tensors all walk memory like their parameters. What neither saw is the states' dtype,
# device and shape (a program may replace a state tensor), so ``trusted`` checks just those,
# falling back to every check -- and its error -- when one does not fit.
def _states_fit(params, exp_avgs, exp_avg_sqs, masters) -> bool:
    """Whether every state (and master) is an fp32 CPU tensor of its parameter's shape."""
    f32 = torch.float32
    lists = (exp_avgs, exp_avg_sqs) if masters is None else (exp_avgs, exp_avg_sqs, masters)
    for i, p in enumerate(params):
        shape = p.shape
        for lst in lists:
            t = lst[i]
            if not (t.dtype is f32 and t.is_cpu and t.shape == shape):
                return False
    return True


def check_hyperparameters(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """Raise for values the kernel refuses. Separate so that a caller stepping many tensors in
    several calls (the ZeRO-Offload step: one call per bucket, each followed by its all-gather)
    can check every group before the first call, instead of failing after some were updated."""
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"betas must lie in [0, 1), got ({beta1}, {beta2})")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not math.isfinite(lr) or not math.isfinite(weight_decay):
        raise ValueError(f"lr and weight_decay must be finite, got lr={lr}, weight_decay={weight_decay}")


def adam_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    masters: Optional[Sequence[torch.Tensor]],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    step: int,
    bias_correction: bool = True,
    maximize: bool = False,
    inv_scale: Optional[torch.Tensor] = None,
    clip_coef: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    trusted: bool = False,
) -> None:
    """One Adam (``adamw=False``: L2 decay) or AdamW (decoupled decay) step, in place.

    ``params`` are fp32/bf16/fp16 model parameters; ``grads`` match their shapes (fp32, bf16
    or fp16); ``exp_avgs``/``exp_avg_sqs`` are fp32. With ``masters`` (fp32 copies of the
    params) the update runs on the masters and each param receives the new master rounded to
    its dtype; without, half-precision params are widened, updated in fp32 and rounded back.
    The effective gradient is ``grad * inv_scale * clip_coef`` (each None means 1); a non-zero
    ``found_inf`` skips the step entirely. One kernel call per (param dtype, grad dtype) group.
    ``trusted``: the caller has checked the parameters and gradients (Note [checks the caller
    made]); only the states are checked here.
    """
    ops = _extension.require("_cpu_ops")
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if masters is not None:
        lists["masters"] = masters
    for name, seq in lists.items():
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} tensors but params has {n}")
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    check_hyperparameters(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if bias_correction and int(step) < 1:
        raise ValueError(f"step must be >= 1 with bias correction (got {step})")
    isa = _requested_isa()
    # (resolved copies stay referenced here until the kernel has read them: Note [lazily negated
    # tensors] in _negated.py -- the kernel reads raw memory, and the full check refuses written ones)
    inv_scale, clip_coef, found_inf = map(scalar_resolved, (inv_scale, clip_coef, found_inf))
    addresses = (
        _scalar_address(inv_scale, "inv_scale"),
        _scalar_address(clip_coef, "clip_coef"),
        _scalar_address(found_inf, "found_inf"),
    )

    grads = read_resolved(grads)
    if not (trusted and _states_fit(params, exp_avgs, exp_avg_sqs, masters)):
        _check_all(params, grads, exp_avgs, exp_avg_sqs, masters)
    sizes = [p.nelement() for p in params]
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i in range(n):
        if sizes[i]:
            groups.setdefault((params[i].dtype, grads[i].dtype), []).append(i)

    threads = torch.get_num_threads()
    for (param_dtype, grad_dtype), idx in groups.items():
        params_ptrs = [params[i].data_ptr() for i in idx]
        if masters is None:
            weights, copies = params_ptrs, []
            weight_code, copy_code = _DTYPE_CODES[param_dtype], _NO_COPY
        else:
            weights, copies = [masters[i].data_ptr() for i in idx], params_ptrs
            weight_code, copy_code = _DTYPE_CODES[torch.float32], _DTYPE_CODES[param_dtype]
        applied = ops.adam_step(
            weights,
            [grads[i].data_ptr() for i in idx],
            [exp_avgs[i].data_ptr() for i in idx],
            [exp_avg_sqs[i].data_ptr() for i in idx],
            copies,
            [sizes[i] for i in idx],
            weight_code,
            _DTYPE_CODES[grad_dtype],
            copy_code,
            float(lr),
            float(beta1),
            float(beta2),
            float(eps),
            float(weight_decay),
            bool(adamw),
            int(step),
            bool(bias_correction),
            bool(maximize),
            *addresses,
            isa,
            threads,
        )
        if not applied:  # found_inf is set: the same for every group
            return
