"""torch's distributed-checkpoint names for a fusedist DDP model: without DDP's ``module.``,
as for torch's DDP.

Note [checkpoint names through the DDP wrapper]
    torch's state-dict helpers (``get_state_dict``, ``set_state_dict``,
    ``get_model_state_dict``, ``get_optimizer_state_dict``, ...) name every entry by the
    unwrapped model's path: they drop the ``module.`` that torch's DDP puts in front of its
    module's names, recognizing the wrapper with ``isinstance``. fusedist's wrapper is a
    drop-in, not that class, so its names kept the segment: a DCP checkpoint of a torch DDP,
    FSDP2 or bare model did not load into a fusedist DDP model (``Missing key in checkpoint
    state_dict: model.module.w``), and one saved from a fusedist DDP model loaded into nothing
    else. The helpers find every name through one private function, ``_get_fqns``; building
    a fusedist DDP model wraps it once so that a path through a fusedist wrapper at the root
    (or under ``torch.compile``'s ``_orig_mod`` there), or through one nested inside it below
    plain modules (Note [a module wrapped again] in wrapper.py), is named as through torch's,
    with the same ``skip_ddp_prefix`` / ``skip_compiler_prefix`` switches. A torch without that
    function keeps the segment (``tests/test_ddp_dcp_names.py`` fails there).
    Checkpoints saved with the segment still load with ``fusedist.checkpoint.load``
    (``_without_ddp_prefix`` in ``fusedist/checkpoint/_from_dcp.py``).
"""

from __future__ import annotations

import functools
import inspect

import torch

_INSTALLED = False


def install() -> None:
    """Wrap torch's ``_get_fqns`` once (Note [checkpoint names through the DDP wrapper])."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    try:
        from torch.distributed.checkpoint import state_dict as helpers
    except ImportError:  # a torch without distributed checkpoints: nothing to name
        return
    original = getattr(helpers, "_get_fqns", None)
    if original is None or getattr(original, "_fusedist_ddp_names", False):
        return
    from torch._dynamo.eval_frame import OptimizedModule

    from .wrapper import DistributedDataParallel

    helpers._get_fqns = _through_fusedist_ddp(original, DistributedDataParallel, OptimizedModule)


def _through_fusedist_ddp(original, DistributedDataParallel, OptimizedModule):
    """``original`` (torch's ``_get_fqns``), walking a path through a fusedist DDP wrapper at
    the root, or under ``torch.compile``'s ``_orig_mod`` there, as through torch's DDP."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_fqns(model, name, *args, **kwargs):
        head, dot, rest = name.partition(".")
        compiled = isinstance(model, OptimizedModule) and head == "_orig_mod" and dot
        inner = model._orig_mod if compiled else model
        if compiled:
            head, dot, rest = rest.partition(".")
        if not (isinstance(inner, DistributedDataParallel) and head == "module" and dot):
            nested = None if compiled else _nested_wrapper(model, name, DistributedDataParallel, OptimizedModule)
            if nested is None:
                return original(model, name, *args, **kwargs)
            prefix, wrapper, rest = nested  # Note [a module wrapped again] in wrapper.py: nested inside
            return {f"{prefix}.{fqn}" for fqn in get_fqns(wrapper, rest, *args, **kwargs)}
        options = signature.bind(model, name, *args, **kwargs).arguments
        fqns = get_fqns(inner.module, rest, *args, **kwargs)  # (a wrapper nested further in, too)
        if not options.get("skip_ddp_prefix", True):
            fqns = {f"module.{fqn}" for fqn in fqns}
        if compiled and not options.get("skip_compiler_prefix", True):
            fqns = {f"_orig_mod.{fqn}" for fqn in fqns}
        return fqns

    get_fqns._fusedist_ddp_names = True
    return get_fqns


def _nested_wrapper(model, name: str, DistributedDataParallel, OptimizedModule):
    """``(prefix, wrapper, rest)`` when the path ``name`` passes through a fusedist DDP wrapper
    below the root (``DDP(nn.Sequential(DDP(a), b))``, Note [a module wrapped again] in
    wrapper.py) after plain modules only (``prefix``: their names, which torch keeps), ``rest``
    the path from the wrapper on; else None: torch's own walk names it (a wrapper it knows,
    its DDP, FSDP or a compiled module, on the way)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    parts = name.split(".")
    current = model
    for i, part in enumerate(parts[:-1]):
        if i and isinstance(current, DistributedDataParallel):
            return ".".join(parts[:i]), current, ".".join(parts[i:])
        if isinstance(current, (TorchDDP, FullyShardedDataParallel, OptimizedModule)):
            return None
        current = getattr(current, part, None)
        if not isinstance(current, torch.nn.Module):
            return None
    return None
