"""Tensor subclasses that wrap one tensor of their own shape and dtype.

torchao's float8 training weights (and its int8 mixed-precision and BitNet ones) are such
wrappers: every op unwraps them, so an in-place update of the wrapper is an update of the
tensor it holds. fusedist's units shard that tensor (Note [all-gather extension] in
fsdp/extension.py) and its fused optimizers step it (``optim/_base.py``: a wrapper has no
memory of its own, its data pointer is null). Other inner tensors a wrapper may carry
(torchao's precomputed float8 scale) are not parameter values and are left alone.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["wrapped_name", "values_of", "plain_parts"]


#: The tensor types that are never wrappers: every check per parameter per step asks this first.
PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))


def wrapped_name(p: torch.Tensor) -> Optional[str]:
    """The attribute holding the one plain tensor of ``p``'s shape and dtype that ``p`` wraps
    (``__tensor_flatten__``'s names), or None when ``p`` is not such a wrapper."""
    if type(p) in PLAIN_TYPES:  # the common case, asked per parameter per optimizer step
        return None
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(p):
        return None
    names = p.__tensor_flatten__()[0]
    same = [n for n in names if _plain(getattr(p, n, None)) and getattr(p, n).shape == p.shape
            and getattr(p, n).dtype == p.dtype]
    return same[0] if len(same) == 1 else None


def _plain(t) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t)


def values_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a plain tensor: the tensor a wrapper wraps, else ``t``. What files
    hold (a checkpoint's model state): loading copies them into the wrapper, and no reader needs
    the subclass to unpickle them."""
    name = wrapped_name(t)
    return getattr(t, name) if name is not None else t


def plain_parts(t: torch.Tensor) -> list:
    """The plain tensors that hold ``t``'s data: ``t`` itself, or every inner tensor of a
    traceable subclass (``__tensor_flatten__``, recursively) -- what a copy from another rank
    must fill. A wrapper's one tensor, and all of quantized storage's (NF4's codes, scales and
    constants), which no view of the subclass itself would reach."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    return [part for name in t.__tensor_flatten__()[0] for part in plain_parts(getattr(t, name))]
