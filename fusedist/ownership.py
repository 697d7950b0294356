"""Which fusedist object owns a parameter: the explicit registrations between packages.

A user hands fusedist's pieces the same ``model.parameters()``; the pieces find each other
through these registrations, made once at construction by the owner itself, instead of
attributes written onto the user's Parameters:

* **data-parallel owner** -- the :class:`fusedist.DistributedDataParallel` whose gradient
  engine reduces the parameter. A ``ZeroRedundancyOptimizer`` registers with that engine
  (``fusedist/zero/wiring.py``); the optimizer step guard counts steps for it.
* **gradient holder** -- an object that keeps the parameter's gradient somewhere other than
  (or in addition to) ``p.grad``, sharded across ranks: ZeRO stage 2 (only a shard is kept)
  and ``fully_shard`` (``p.grad`` is this rank's shard). It provides
  ``clip_sharded_grads_(params, max_norm, norm_type, error_if_nonfinite) -> total_norm``
  computing the *global* norm (one small all-reduce), so ``fusedist.clip_grad_norm_`` hands
  such parameters to it.

* **step watch** -- the reliability observer of a ``fully_shard`` model
  (``fusedist/reliability/sharded_watch.py``): the optimizer step guard checks and counts
  ``optimizer.step()`` calls over its parameters for the per-step cross-rank check.

The tables hold weak references both ways: a registration never keeps a model alive.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "register_data_parallel", "data_parallel_owner", "register_wrapped_module", "wrapping_owner",
    "register_gradient_holder", "gradient_holder", "any_gradient_holder", "gradient_holders_of", "held_parameters",
    "register_step_watch", "step_watch", "release", "wrapper_dropped",
]

_data_parallel: WeakIdKeyDictionary = WeakIdKeyDictionary()
_wrapping: WeakIdKeyDictionary = WeakIdKeyDictionary()
_gradient_holder: WeakIdKeyDictionary = WeakIdKeyDictionary()
_step_watch: WeakIdKeyDictionary = WeakIdKeyDictionary()
# optimizer -> (parameter count, weak references to the gradient holders of its parameters)
_holders_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _lookup(table: WeakIdKeyDictionary, p) -> Optional[object]:
    if not table:  # the common case, asked per parameter per step: no weak reference made
        return None
    ref = table.get(p)
    return ref() if ref is not None else None


def _register(table: WeakIdKeyDictionary, params: Iterable, obj) -> None:
    ref = weakref.ref(obj)
    for p in params:
        table[p] = ref


def register_data_parallel(params: Iterable, owner) -> None:
    """``owner`` (a DDP wrapper) reduces these parameters' gradients."""
    _register(_data_parallel, params, owner)


def register_wrapped_module(params: Iterable, owner) -> None:
    """``owner`` (a DDP wrapper) wraps the module holding these parameters, frozen ones
    included: it reduces them once they are trainable (Note [trainable set changes])."""
    _register(_wrapping, params, owner)


def wrapping_owner(p) -> Optional[object]:
    """The DDP wrapper whose module holds ``p``, trainable or not (None without one): how a
    ZeroRedundancyOptimizer of a module frozen whole finds its model."""
    return _lookup(_wrapping, p)


def wrapper_dropped(p) -> bool:
    """Whether a DDP wrapper wrapped the module holding ``p`` and nothing holds that wrapper any more
    (its registration outlives it): how a ZeroRedundancyOptimizer tells "dropped" from "never wrapped"."""
    if not _wrapping:
        return False
    ref = _wrapping.get(p)
    return ref is not None and ref() is None


def data_parallel_owner(p) -> Optional[object]:
    """The DDP wrapper reducing ``p`` (None when there is none, or it was dropped)."""
    return _lookup(_data_parallel, p)


def register_gradient_holder(params: Iterable, holder) -> None:
    """``holder`` keeps these parameters' gradients sharded and clips them globally.

    The first registration makes torch's own ``clip_grad_norm_`` / ``get_total_norm`` global
    over such gradients (Note [torch's clip on sharded gradients] in fusedist/optim/torch_clip.py).
    """
    from .optim.torch_clip import install  # (here, not at import: fusedist.optim imports this module)

    install()
    _register(_gradient_holder, params, holder)


def held_parameters() -> list:
    """``(parameter, holder)`` for every live parameter with a gradient holder."""
    found = []
    for p, ref in list(_gradient_holder.items()):
        holder = ref()
        if holder is not None:
            found.append((p, holder))
    return found


def any_gradient_holder() -> bool:
    """Whether any live parameter has a gradient holder: when none does (no sharded optimizer
    in the process), callers skip asking parameter by parameter."""
    return bool(_gradient_holder)


def gradient_holder(p) -> Optional[object]:
    """The object holding ``p``'s sharded gradient (None: ``p.grad`` is the whole gradient)."""
    return _lookup(_gradient_holder, p)


@torch.compiler.disable  # traced (a GradScaler in a compiled step), each lookup recompiled per parameter
def gradient_holders_of(optimizer) -> list:
    """The distinct gradient holders of ``optimizer``'s parameters, looked up once per
    optimizer (again when its parameter count changes): a step's hot path pays one lookup."""
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    cached = _holders_of.get(optimizer)
    if cached is None or cached[0] != count:
        found = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                holder = gradient_holder(p)
                if holder is not None:
                    found.setdefault(id(holder), holder)
        cached = _holders_of[optimizer] = (count, [weakref.ref(h) for h in found.values()])
    return [h for h in (ref() for ref in cached[1]) if h is not None]


def register_step_watch(params: Iterable, watch) -> None:
    """``watch`` counts and checks the optimizer steps over these parameters."""
    _register(_step_watch, params, watch)


def step_watch(p) -> Optional[object]:
    """The reliability observer of the model whose optimizer steps cover ``p`` though it
    reduces no ``p.grad`` (a ``fully_shard`` model's pieces, a DDP model's ignored
    parameters); None: none."""
    return _lookup(_step_watch, p)


def watch_of(p) -> tuple:
    """(the DDP wrapper reducing ``p`` or None, the reliability observer whose checks count what is
    done to ``p``: that wrapper's, else the :func:`step_watch`; None: none)."""
    ddp = data_parallel_owner(p)
    return (ddp, ddp.watch) if ddp is not None else (None, step_watch(p))


def release(params: Iterable, owners: Iterable) -> None:
    """Drop the registrations of ``params`` that name one of ``owners``: a wrapper (and its
    optimizers) retired while the parameters live on, so that torch's optimizers and clips
    treat them as plain parameters again (Lightning's teardown: Note [the wrapper retires at
    teardown] in fusedist/integrations/lightning.py)."""
    retired = {id(owner) for owner in owners if owner is not None}
    params = list(params)
    _return_gradients(params, retired)
    for p in params:
        for table in (_data_parallel, _wrapping, _step_watch, _gradient_holder):
            owner = _lookup(table, p)
            if owner is not None and id(owner) in retired:
                del table[p]


def _return_gradients(params: list, retired: set) -> None:
    """A data-parallel owner that reduces into a retired gradient holder (a stage-2 optimizer
    swapped out: its wrapper retired, or taken over by a newer wrapper, Note [an optimizer over a
    module wrapped again] in fusedist/ddp/succession.py) averages into ``p.grad`` again, as it
    does for plain parameters."""
    seen = set()
    for p in params:
        holder, owner = _lookup(_gradient_holder, p), _lookup(_data_parallel, p)
        if holder is None or owner is None or id(holder) not in retired or id(owner) in seen:
            continue
        seen.add(id(owner))
        release_holder = getattr(owner, "_release_gradient_holder", None)
        if release_holder is not None:
            release_holder(holder)
