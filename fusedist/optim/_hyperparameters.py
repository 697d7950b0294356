"""Validation and reading of the fused optimizers' hyperparameters, as torch's optimizers
take them: Python numbers, or 1-element tensors (the learning rate and Adam's betas read on the
device by the kernels; the others read when the step runs).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def check_not_text(owner: str, name: str, value: Any) -> None:
    """Refuse a string as a hyperparameter, as torch's optimizers do (their range checks compare
    it with a number). ``lr: 1e-3`` read from a YAML file is the string "1e-3": the checks here
    read values with ``float()``, which parses it, so it was kept and failed at the first step
    with an unrelated TypeError, or on the GPU stepped as a number. (Anything else ``float()``
    takes -- numpy scalars and 0-d arrays -- torch takes too.)"""
    if isinstance(value, (str, bytes, bytearray)):
        raise TypeError(f"{owner}: {name} must be a number or a 1-element tensor, got {type(value).__name__} "
                        f"{value!r}")


def check_finite_hyper(owner: str, **values: Any) -> None:
    """Every value a finite number: a Python number or a 1-element real tensor (Note [tensor
    hyperparameters]; :func:`lr_value` for the learning rate)."""
    for name, value in values.items():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for v in items:
            check_not_text(owner, name, v)
            if isinstance(v, torch.Tensor) and (v.numel() != 1 or v.is_complex() or v.dtype == torch.bool):
                raise ValueError(f"{owner}: a tensor {name} must be one real number, got shape {tuple(v.shape)} "
                                 f"of {v.dtype}")
            if not math.isfinite(float(v)):
                raise ValueError(f"{owner}: hyperparameter {name}={value} is not finite")


# Note [tensor hyperparameters]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's optimizers take eps, weight_decay, momentum and dampening as 1-element tensors too
# (their ops read them as numbers: ``add(p, alpha=wd)`` reads the tensor's value). The fused
# kernels take these as numbers, so ``hyper_number`` reads the value when the step runs, as
# torch does: a scheduler's in-place change is seen, the state dict keeps the tensor, and a
# tensor on an accelerator costs one wait for the device per read, as torch's ``item()`` does.
# (The learning rate and Adam's betas are read on the device instead: Note [a tensor learning
# rate], Note [betas on the device].)
def hyper_number(value: Any) -> Any:
    """``value`` as a Python number where it is a tensor (Note [tensor hyperparameters])."""
    return value.item() if isinstance(value, torch.Tensor) else value


# Note [a tensor learning rate]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's Adam, AdamW and SGD take ``lr`` as a 1-element tensor (given to the constructor, or
# put into a group by the program or a scheduler, which then updates it in place). torch refuses
# one of another size (ValueError "Tensor lr must be 1-element"), and Adam/AdamW refuse it with
# ``foreach=True`` when not capturable: ValueError from the constructor, RuntimeError from
# step(). Otherwise its update is the one for the tensor's value, read when the step runs (its
# CPU fused kernel reads the value; the single-tensor path computes ``lr / bias_correction`` in
# the tensor's dtype, a rounding apart). The fused optimizers do the same: the update runs with
# the tensor's value when the step runs, so a scheduler's in-place change is seen and the state
# dict keeps the tensor as torch's does. The Triton kernels read it on the device (Note [a
# learning rate on the device] in triton_kernels/multi_tensor.py), so a CUDA tensor lr costs no
# host synchronization: its value is checked (finite, >= 0) when the optimizer is built or
# loaded, not at each step, as torch's checks it. The CPU kernels take the number (``lr_value``).


def check_lr(owner: str, lr, read_device_value: bool = True) -> None:
    """Validate the learning rate as torch's optimizers do (Note [a tensor learning rate]): a
    tensor must hold one element; the value must be finite and >= 0 (not read from a tensor
    on an accelerator unless ``read_device_value``: that would wait for the device)."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{owner}: Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        if lr.is_complex() or lr.dtype == torch.bool:
            raise TypeError(f"{owner}: Tensor lr has dtype {lr.dtype}; expected a real number")
        if lr.device.type != "cpu" and not read_device_value:
            return
    check_not_text(owner, "lr", lr)
    value = lr_value(lr)
    if not math.isfinite(value):
        raise ValueError(f"{owner}: hyperparameter lr={value} is not finite")
    if value < 0:
        raise ValueError(f"{owner}: invalid learning rate {value}")


def lr_value(lr) -> float:
    """A group's ``lr`` as the number the update uses (Note [a tensor learning rate])."""
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def check_tensor_betas(owner: str, betas, foreach) -> tuple:
    """``betas`` as torch's Adam takes them: two floats, or two 1-element tensors (kept, 0-d, as
    torch squeezes them; refused with ``foreach=True``), read like a tensor lr at each step."""
    if not any(isinstance(b, torch.Tensor) for b in betas):
        return betas
    if not all(isinstance(b, torch.Tensor) for b in betas):
        raise ValueError(f"{owner}: betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        if foreach:
            raise ValueError(f"{owner}: betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
        if b.numel() != 1:
            raise ValueError(f"{owner}: Tensor betas[{i}] must be 1-element")
    return tuple(b.squeeze() if b.dim() else b for b in betas)
