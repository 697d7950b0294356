"""Helpers over nested containers (dicts, lists, tuples) of tensors, as state dicts are."""

from __future__ import annotations

import torch

from ._wrapper import values_of


def to_cpu(obj):
    """``obj`` with every tensor detached and moved to the CPU (tensors already there are
    not copied); containers are rebuilt with their own types, anything else is returned as
    is. State dicts go through it before they are saved or gathered as objects."""
    if isinstance(obj, torch.Tensor):
        return values_of(obj).detach().cpu()  # (a float8 training weight: its fp32 values)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
