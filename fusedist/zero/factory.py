"""The optimizer class behind a ZeroRedundancyOptimizer's ``optimizer_class`` argument.

Kept apart from the optimizer because it answers one question -- which class will step the
shards -- that the elementwise check, the offload check, state-dict metadata and error messages
all read, whatever the caller passed (a class, a ``functools.partial``, a lambda).
"""

from __future__ import annotations

import functools

import torch
from torch.optim import Optimizer


def default_optimizer_class():
    """FusedAdamW, the drop-in default; a clear error where this installation lacks it, naming the
    rank (a host of its own may lack it: the constructor raises it after the ranks' comparison, so
    every rank fails at once, Note [refusals of one rank's own arguments] in param_checks.py)."""
    try:
        from ..optim import FusedAdamW
    except ImportError as exc:  # fusedist.optim not built into this installation
        from .._rank import this_rank

        raise TypeError(
            f"ZeroRedundancyOptimizer (rank {this_rank()}): optimizer_class not given and "
            "fusedist.optim.FusedAdamW is unavailable on this host; pass optimizer_class=torch.optim.AdamW "
            f"(or another optimizer) on every rank (the import said: {exc})"
        ) from exc
    return FusedAdamW


def optimizer_type(factory, defaults: dict):
    """The optimizer class behind ``optimizer_class``: itself, the class a ``functools.partial``
    wraps (nested partials included), or the class of what any other factory (a lambda, a
    function) builds, probed over one element with ``defaults``. torch's
    ZeroRedundancyOptimizer only calls what it is given, so a factory works there; here the
    class is also what the elementwise check, the offload check, state-dict metadata and error
    messages read, so it must be the class, not the factory (a partial has no ``__name__``:
    consolidate_state_dict failed on it; a lambda building AdamW was warned about as an
    optimizer of unknown kind, and refused by ``offload="cpu"``). A factory that cannot be
    probed this way stays itself (the elementwise check then warns about it)."""
    inner = factory
    while isinstance(inner, functools.partial):
        inner = inner.func
    if isinstance(inner, type) or not callable(factory):
        return inner
    try:
        built = factory([{"params": [torch.zeros(1, requires_grad=True)]}], **defaults)
    except Exception:  # noqa: BLE001 - a factory of its own kind: the checks take it as it is
        return inner
    return type(built) if isinstance(built, Optimizer) else inner
