"""Checks on ``optimizer.step()`` for optimizers over DistributedDataParallel (or fully_shard) parameters.

Mistakes that make ranks diverge *silently* are caught where they happen, on the rank
that makes them, before the step changes any parameter:

* ``step()`` before any backward pass through the DDP model;
* ``step()`` right after a backward run under ``no_sync()`` (gradients are rank-local sums);
* ``step()`` from a gradient hook, inside a DDP model's backward, before its gradients are
  averaged (Note [a step inside the backward]);
* an optimizer that mixes DDP-owned parameters with trainable parameters the DDP model does
  not own (their gradients are never averaged across ranks).

With ``step(closure)`` the backward runs inside ``step()``, after the hook: the two
backward checks then run when the closure returns (Note [step with a closure]), still before
any parameter changes -- optimizers call the closure before their update.

It also counts optimizer steps per DDP model, which the per-step check (Note [step check])
compares across ranks, so a rank that calls ``step()`` on a different iteration is reported
on every rank.

Implemented with torch's global optimizer step hooks, so it covers every
``torch.optim.Optimizer`` subclass (fusedist's fused optimizers included) without their
cooperation. Parameters are classified once per optimizer (cached until its parameter count
changes); a step then costs a dictionary lookup and a few attribute reads.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .._process_hooks import install_optimizer_step_hooks
from ..ownership import watch_of

_lock = threading.Lock()
# optimizer -> (parameter count, weak references to the owning DDP wrappers, first unowned
# trainable parameter or None, (weak reference, [(group, index) of its parameters]) of the watch
# of every owning model: the DDP wrappers' and fully_shard roots'). Weak: a value that reaches its
# own key keeps the entry alive forever, and a DDP wrapper reaches a ZeroRedundancyOptimizer
# (through its module's hooks). Positions, not parameters: a parameter's hooks may reach it too.
_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _param_at(groups, gi: int, pi: int):
    """The parameter at a cached position (None: the groups were reshaped in place since)."""
    try:
        return groups[gi]["params"][pi]
    except IndexError:
        return None


def _still_valid(optimizer, cached, count) -> bool:
    """The entry is stale once a model it names is gone, or a parameter it found watched has
    another watch now (its module was wrapped again, the older wrapper dropped or not): kept,
    the new model's optimizer steps would go uncounted by the step check and unguarded."""
    if cached[0] != count or cached[2] is not None:
        return False  # (an unowned parameter is looked at again: DDP may have taken it on since)
    if any(ref() is None for ref in cached[1]):
        return False
    groups = optimizer.param_groups
    for ref, positions in cached[3]:  # one lookup per model: its first parameter's watch
        p = _param_at(groups, *positions[0])
        if ref() is None or p is None or watch_of(p)[1] is not ref():
            return False
    return True


def _classify(optimizer):
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    cached = _cache.get(optimizer)
    if cached is not None and _still_valid(optimizer, cached, count):
        return cached
    owners: dict[int, object] = {}
    watches: dict[int, tuple] = {}  # id -> (watch, positions of its parameters in the optimizer)
    unowned = None
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            ddp, watch = watch_of(p)
            if ddp is not None:
                owners[id(ddp)] = ddp
            if watch is not None:
                watches.setdefault(id(watch), (watch, []))[1].append((gi, pi))
            elif p.requires_grad and unowned is None:
                unowned = (gi, pi, tuple(p.shape), str(p.dtype))
    entry = (count, [weakref.ref(ddp) for ddp in owners.values()], unowned,
             [(weakref.ref(w), positions) for w, positions in watches.values()])
    _cache[optimizer] = entry
    return entry


def _owners(entry) -> list:
    return [ddp for ddp in (ref() for ref in entry[1]) if ddp is not None]


def _watches(entry) -> list:
    return [w for w in (ref() for ref, _ in entry[3]) if w is not None]


def watches_of(optimizer) -> list:
    """The watches of the models whose parameters ``optimizer`` steps (cached as the guard classifies it)."""
    return _watches(_classify(optimizer))


def _checked_watches(optimizer, entry) -> list:
    """Note [several models in one optimizer]: one optimizer over two DDP models (an encoder and
    a head wrapped apart, a GAN's two nets) may step while only one of them ran a backward; as
    with torch, the other's parameters have no gradient and the step leaves them alone. So a
    model none of whose parameters here has a gradient is not checked -- unless no model has
    one (the documented single-model refusal of a step before any backward)."""
    groups = optimizer.param_groups
    watches = [(ref(), positions) for ref, positions in entry[3]]
    watches = [(w, positions) for w, positions in watches if w is not None]
    if len(watches) < 2:
        return [w for w, _ in watches]
    with_grad = [w for w, positions in watches
                 if any(getattr(_param_at(groups, gi, pi), "grad", None) is not None for gi, pi in positions)]
    return with_grad or [w for w, _ in watches]


# Note [step with a closure]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``optimizer.step(closure)`` (LBFGS always, any torch optimizer optionally) runs forward and
# backward inside step(), after the pre-step hook: checked there, the first step would raise
# "before any backward pass" and a closure after a no_sync backward would be judged by the
# previous backward. The hook passes step() a closure that calls the user's and then checks;
# optimizers evaluate the closure before their update, so nothing has changed yet when it
# raises. torch lets a pre-step hook return replaced (args, kwargs).
# Note [torch's state-creating step]
# torch.distributed.checkpoint's get_optimizer_state_dict / set_optimizer_state_dict (the
# standard resume: dcp.load into get_state_dict(model, optimizer)) create a fresh optimizer's
# state by one step() with zero gradients and every lr set to 0 (_init_optim_state). That step
# changes no parameter and follows no backward: the guard lets it through and does not count it,
# where it refused it on every rank as a step before any backward.
_state_creating: "weakref.WeakSet" = weakref.WeakSet()


def _is_state_creating(optimizer) -> bool:
    if optimizer.state:
        return False
    for group in optimizer.param_groups:
        if "lr" in group and float(group["lr"]) != 0.0:
            return False
        for p in group["params"]:
            if p.requires_grad and (p.grad is None or bool(p.grad.any())):
                return False
    return True


def _pre_step(optimizer, args, kwargs):
    entry = _classify(optimizer)
    owners, watches = _owners(entry), _watches(entry)
    if not watches:
        return None
    _watch_zero_grad(optimizer)
    if _is_state_creating(optimizer):  # Note [torch's state-creating step]
        _state_creating.add(optimizer)
        return None
    if owners and entry[2] is not None:
        _refuse_unowned(optimizer, owners[0], entry[2])
    # torch passes step()'s own arguments: (optimizer, closure, ...) or closure=...
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is None:
        _check_backward(optimizer, _checked_watches(optimizer, entry))
        _count_cleared_steps(optimizer, entry)
        return None

    def checked_closure():
        loss = closure()
        _check_backward(optimizer, _checked_watches(optimizer, entry))
        return loss

    if len(args) > 1:
        return (args[0], checked_closure, *args[2:]), kwargs
    return args, {**kwargs, "closure": checked_closure}


def _model_words(ddp) -> dict:
    """How the refusals below name the model and what to do: a ``fusedist.replicate`` module is no
    wrapper (it has no ``.module`` and its engine is built at its first forward), so words about a
    wrapper would send its user looking for one."""
    from ..ddp.replicate import ReplicatedModule

    module = ddp.module
    if isinstance(module, ReplicatedModule):
        name = type(module).__mro__[2].__name__  # (ReplicatedClass, ReplicatedModule, original, ...)
        return {
            "model": f"replicated {name} (fusedist.replicate)",
            "built": "its data-parallel engine was built (at its first forward)",
            "forward": f"the replicated {name} (with set_requires_gradient_sync(True))",
            "only": f"that module's parameters() only, or replicate the module that owns that parameter too "
                    f"(or move it into the replicated {name} before its first forward)",
            "changed": f"after its first forward (when replicate built its data-parallel engine): the engine "
                       f"synchronizes the gradients of the Parameters the {name} held then",
            "redo": f"Make such changes before the first forward of the replicated {name}.",
        }
    return {
        "model": "DistributedDataParallel model",
        "built": "the model was wrapped",
        "forward": "the DistributedDataParallel model (outside no_sync())",
        "only": "ddp_model.parameters() only, or wrap the module that owns that parameter too",
        "changed": "after the module was wrapped: the wrapper synchronizes the gradients of the Parameters "
                   "it was built with",
        "redo": "Make such changes before wrapping, or wrap the module again (DistributedDataParallel("
                "model.module, ...)) and run forward through the wrapper.",
    }


def _refuse_unowned(optimizer, ddp, unowned) -> None:
    gi, pi, shape, dtype = unowned
    p = optimizer.param_groups[gi]["params"][pi]
    name = next((n for n, q in ddp.module.named_parameters() if q is p), None)
    change = ddp.reducer.tracker.assigned_since_wrapping(p, name) if name is not None else None
    if change is not None:
        raise _assigned_after_wrapping(optimizer, ddp, name, change)
    words = _model_words(ddp)
    if name is not None:  # Note [trainable set changes] in fusedist/ddp/trainable.py
        if p.grad is None:
            return  # unfrozen since the last backward: nothing to apply yet, as with torch
        raise ValueError(
            f"fusedist (rank {ddp.rank}): {type(optimizer).__name__} holds parameter '{name}' of the "
            f"{words['model']}, which had requires_grad=False when {words['built']}; its "
            "gradient was not averaged across ranks, because no synchronized backward of a training "
            "forward through the model has run since it became trainable (the model takes it on then). "
            f"Run forward and backward through {words['forward']} before optimizer.step()."
        )
    raise ValueError(
        f"fusedist (rank {ddp.rank}): {type(optimizer).__name__} holds parameters of the "
        f"{words['model']} and also param_groups[{gi}]['params'][{pi}] (shape "
        f"{shape}, {dtype}), which that model does not own: its gradient is never averaged "
        "across ranks, so the ranks' copies would diverge. Build the optimizer from "
        f"{words['only']}."
    )


def _assigned_after_wrapping(optimizer, ddp, name: str, change: str) -> ValueError:
    """A parameter of the wrapped module that the wrapper was not built with (Note [parameters
    replaced after wrapping] in fusedist/ddp/trainable.py). A forward through the wrapper
    refuses it; one through ``model.module`` skips the wrapper, so the step is where it shows."""
    how = ("replaced by a new Parameter object (module.weight = nn.Parameter(...), "
           "load_state_dict(..., assign=True), a submodule replaced)" if change == "replaced" else
           "added (a submodule or Parameter assigned into the module, e.g. module.extra = nn.Linear(...))")
    words = _model_words(ddp)
    return ValueError(
        f"fusedist (rank {ddp.rank}): {type(optimizer).__name__} holds parameter '{name}' of the "
        f"{words['model']}, which was {how} {words['changed']}, so this one would train on this "
        f"rank's gradient alone and the ranks would diverge. {words['redo']}"
    )


def _check_backward(optimizer, watches) -> None:
    """Each owning model's watch says how it names itself and what to do (``WatchBase``)."""
    for watch in watches:
        if watch.averaging():
            _refuse_inside_backward(optimizer, watch)
        if getattr(watch, "in_backward", False):
            continue  # stepped from a gradient hook once its reduction landed (optimizer in backward)
        if watch.backward_count() == 0 and torch._C._current_graph_task_id() != -1:
            raise RuntimeError(  # a user's gradient hook: it runs before the model's average
                f"fusedist (rank {watch.rank}): {type(optimizer).__name__}.step() was called from inside a "
                f"backward pass (a gradient hook: an optimizer in backward) before the {watch.owner_name} "
                "averaged the gradients; such hooks run before the average (torch's DDP then lets the ranks "
                "diverge): call optimizer.step() after loss.backward() returns")
        if watch.backward_count() == 0:  # backwards completed, synchronized or not
            raise RuntimeError(
                f"fusedist (rank {watch.rank}): {type(optimizer).__name__}.step() was called before any "
                f"backward pass through the {watch.owner_name}, {watch.no_backward_advice}"
            )
        if not watch.last_backward_synced:
            raise RuntimeError(
                f"fusedist (rank {watch.rank}): {type(optimizer).__name__}.step() after a backward pass "
                f"{_torch_ddp_advice(watch) or watch.unsynced_advice}"
            )


# Note [gradients cleared before the step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``optimizer.zero_grad()`` between ``loss.backward()`` and ``optimizer.step()`` on some ranks only
# (a rank-local "skip this batch" that forgot the others) makes those ranks' step apply nothing
# while the others apply the averaged gradients: every counter of the step check agrees and the
# replicas drift apart, seen only by the parameter digest at its period. So a step of an optimizer
# none of whose parameters of a model holds a gradient after a synchronized backward is counted on
# that model's watch (``cleared_steps``), a field of the step check (``grads_cleared``): ranks
# whose counts differ are named at the next synchronized backward's verdict. The test stops at the
# first parameter with a gradient (a few attribute reads per step in training); the same clearing on
# every rank is no divergence and is not flagged.
#
# ``zero_grad(set_to_none=False)`` zeros the gradients in place: they are still there at the step,
# and telling them apart from real ones would read every gradient's values. So the optimizer's own
# ``zero_grad`` notes, per model it steps, the model's backward count when it ran (an instance
# attribute wrapping the class's method, set at the optimizer's first guarded step: torch has no
# zero_grad hook, and its class is left alone); a step whose optimizer zeroed since the model's last
# backward counts as cleared, whatever the zeroing left (a rank whose pieces are all empty holds no
# gradient either way). Gradients zeroed by other means (``model.zero_grad()``,
# ``p.grad.zero_()``, or the optimizer's zero_grad before its first step) remain the parameter check's.
_zeroed_at: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> {watch: backward count}


def _watch_zero_grad(optimizer) -> None:
    """Give ``optimizer`` a ``zero_grad`` that notes when it ran (once; one set by its user stays theirs)."""
    if "zero_grad" in getattr(optimizer, "__dict__", {"zero_grad": None}):
        return
    optimizer_ref = weakref.ref(optimizer)  # (a strong one would make the optimizer reach itself)

    @torch.compiler.disable
    def zero_grad(*args, **kwargs):
        opt = optimizer_ref()
        if opt is None:  # (the bound method outlived its optimizer: nothing left to zero)
            return None
        result = type(opt).zero_grad(opt, *args, **kwargs)
        entry = _cache.get(opt)
        if entry is not None:
            noted = _zeroed_at.setdefault(opt, weakref.WeakKeyDictionary())
            for watch in _watches(entry):
                noted[watch] = watch.backward_count()
        return result

    zero_grad.__doc__ = type(optimizer).zero_grad.__doc__
    optimizer.zero_grad = zero_grad


def _count_cleared_steps(optimizer, entry) -> None:
    groups = optimizer.param_groups
    zeroed = _zeroed_at.get(optimizer)
    for ref, positions in entry[3]:
        watch = ref()
        if watch is None or not watch.last_backward_synced or getattr(watch, "in_backward", False):
            continue
        if zeroed is not None and zeroed.get(watch) == watch.backward_count():
            watch.cleared_steps += 1  # its zero_grad ran since the last backward (to None or in place)
            continue  # (on every rank alike: whatever gradients a rank's pieces hold)
        if any(getattr(_param_at(groups, gi, pi), "grad", None) is not None for gi, pi in positions):
            continue  # (the common case: stops at the first parameter with a gradient)
        params = (_param_at(groups, gi, pi) for gi, pi in positions)
        # (a rank whose pieces of a fully_shard model are all empty holds no gradient to clear)
        if any(p is not None and p.requires_grad and p.numel() > 0 for p in params):
            watch.cleared_steps += 1


def _torch_ddp_advice(watch):
    """Why the backward was not synchronized where a torch ``DistributedDataParallel`` wraps the
    module a fusedist wrapper still owns (Note [a torch DDP over a fusedist wrapper's module]); None
    otherwise. On the refusal's path only: it scans the live objects."""
    import gc

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from .engine_watch import _wrapper_of

    owner = _wrapper_of(getattr(watch, "_engine", None))
    module = getattr(owner, "module", None)
    if module is None or not any(isinstance(o, TorchDDP) and o.__dict__.get("_modules", {}).get("module") is module
                                 for o in gc.get_objects()):
        return None
    return (f"through torch's DistributedDataParallel, which wraps the {type(module).__name__} module that "
            "fusedist.DistributedDataParallel wrapped before: the fusedist wrapper still owns "
            "its parameters and synchronized nothing in that backward, so the step is refused rather than "
            "applying gradients two wrappers disagree about. Wrap the module in one DistributedDataParallel: to "
            "train it with torch's, drop every reference to the fusedist wrapper (del it, then gc.collect()); "
            "or keep training through the fusedist wrapper alone.")


# Note [a torch DDP over a fusedist wrapper's module]
# A program that wraps its module in fusedist.DistributedDataParallel and then, on the same module,
# in torch's (a second experiment in one process, a library that wraps what it is given) steps
# after a backward through torch's wrapper. The fusedist wrapper still owns the parameters, saw a
# backward that its own forward did not start and calls it unsynchronized: the refusal blamed
# no_sync() or model.module. It now names torch's wrapper and what to do. torch's DDP construction
# now retires the fusedist wrapper (Note [torch's DDP over a fusedist wrapper] in
# fusedist/ddp/torch_wrap.py); this refusal remains for torch's DDP over other ranks, over part of
# the wrapper's parameters, or over a wrapper a ZeroRedundancyOptimizer follows.


def _refuse_inside_backward(optimizer, watch) -> None:
    """Note [a step inside the backward]: a step of an optimizer over a DDP model's parameters
    while that model's backward is still reducing (from a gradient hook: a
    ``register_post_accumulate_grad_hook`` or tensor hook that calls ``step()``)."""
    raise RuntimeError(
        f"fusedist (rank {watch.rank}): {type(optimizer).__name__}.step() was called from inside a backward pass "
        f"through the {watch.owner_name} (a gradient hook), before the model averaged the gradients across "
        "ranks: each rank would step with its own local gradient and the replicas would diverge (torch's DDP "
        "lets them). Call optimizer.step() after loss.backward() returns, or give the parameters optimizers "
        "with torch.distributed.optim._apply_optimizer_in_backward before the first forward: fusedist's DDP "
        "steps those at the end of each synchronized backward, on the averaged gradients")


# Note [a step inside the backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A gradient hook runs on this rank's gradient before the bucket holding it is averaged, so a
# step() from it applies a local gradient, and the ranks drift apart without an error: torch's
# DDP does that. The check for it used to look at the backward count only (the very first
# backward) and missed every later one. The DDP watch says whether its model's backward is
# running (the reducer's flag, one attribute read per step); the optimizers of
# ``_apply_optimizer_in_backward`` are stepped by the reducer after that flag is cleared
# (Note [optimizers applied in backward] in fusedist/ddp/in_backward.py), so they pass.


def _post_step(optimizer, args, kwargs) -> None:
    if optimizer in _state_creating:
        _state_creating.discard(optimizer)
        return
    for watch in _watches(_classify(optimizer)):
        watch.optimizer_steps += 1


def install() -> None:
    """Register the global hooks once per process (idempotent; fusedist/_process_hooks.py)."""
    # Disabled for dynamo: traced inside a compiled optimizer.step() (or a compiled training step),
    # watch_of recompiled once per parameter up to dynamo's recompile limit on the first step.
    install_optimizer_step_hooks("DDP optimizer-step guard", torch.compiler.disable(_pre_step),
                                 torch.compiler.disable(_post_step))


__all__ = ["install"]
