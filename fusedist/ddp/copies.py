"""Copies of a DistributedDataParallel wrapper (``copy.deepcopy``, ``pickle`` / ``torch.save``).

Note [copies of the wrapper]
    copy.deepcopy of a wrapped model -- torch.optim.swa_utils.AveragedModel(model) and EMA
    helpers do it -- gives a wrapper of its own over the copied module, on the same process
    group, with the same options and placement (``device_ids``, ``output_device``), as torch
    DDP's copy does. torch's copy issues no collective (it may be made on one rank only, e.g.
    to save a snapshot), so neither does this one: no construction checks, no initial broadcast
    (the copy holds the original's values). Its forwards, step checks and gradient reduction
    are those of any wrapper. A communication hook other than torch's averaging ones is not
    copied (it may hold per-model state, as PowerSGD's does): register it on the copy.

Note [a pickled wrapper]
    ``torch.save(ddp_model)`` and ``pickle.dumps`` work on torch's DDP over the default process
    group: its ``__getstate__`` drops the group and the reducer and its ``__setstate__`` builds a
    reducer again over the loaded module, on the default group of the loading process, with no
    collective (a model may be loaded on one rank only, to evaluate it). The same here: the pickle
    holds the module, the options and what a copy keeps (Note [what a copy keeps]: the hooks, the
    gradient-sync flags, attributes); loading builds a wrapper over the
    loaded module as a copy is built (no checks across ranks, no initial broadcast). As torch's,
    a model over another group is refused (a loading process cannot know that group), and so is
    one whose group was destroyed; no communication hook is kept (torch's reducer is rebuilt
    without one: register it again after loading), and the gradients are not in the pickle. A
    loaded ``static_graph=True`` model averages its first backward as any new one does (torch
    2.13's loaded one leaves that backward's gradients rank-local: its pickle keeps the flag
    saying the delayed reduction was queued).
    ``copy.copy(model)`` would be a second wrapper over the same parameters and is refused.

Note [what a copy keeps]
    torch's DDP is copied and pickled through its ``__dict__``: all of it but the group, the
    reducer and the logger. So its copies keep what the user gave the wrapper itself -- its
    nn.Module hooks (forward and forward-pre, backward, state_dict and load_state_dict hooks
    registered on the wrapper), the buffer communication hook (``_register_buffer_comm_hook``,
    its state copied with the rest), ``no_sync``'s flags, ``_set_ddp_sink_clone``'s setting,
    attributes set on it, and the attributes, submodules, parameters and buffers of a subclass
    -- and run no ``__init__`` of a subclass (whose signature may differ). The same here: a copy
    (deep copy or loaded pickle) is built by this wrapper's own constructor, a subclass's skipped,
    then given everything of the original's ``__dict__`` that construction does not make, and the
    hook registries themselves. Hooks are copied as torch copies them: a deep copy deep-copies
    them (a hook that is a method of the wrapper is the copy's method), a pickle needs them
    picklable (a lambda fails to pickle, as with torch's model). One thing is not kept: a model
    compiled in place (``model.compile()``) gives an uncompiled copy -- torch's copy keeps the
    compiled call, which is bound to the original and so runs the original's weights; compile
    the copy again.

Note [a copy under overlapped gathers]
    Under a ZeroRedundancyOptimizer with ``overlap_param_gather=True``, a copy or pickle taken right
    after a step finds the parameter all-gathers of that step in flight. The hooks that wait for them
    are copied with the module and wait as they are copied (Note [a model pickled under overlapped
    gathers] in fusedist/zero/gather.py), but a module's own parameters are copied before its hooks: a
    copy of a model whose root holds parameters kept the other ranks' slices from before the step. So the
    wrapper's copy and pickle first wait for every gather in flight, through the waiters a compiled
    forward calls, and copy the final parameters, as a copy under torch's ZeroRedundancyOptimizer does. A copy
    of the inner module alone (``copy.deepcopy(model.module)``) runs none of this: it copies its parameters
    after the hooks that wait (Note [a copy of the inner module under overlapped gathers] in copied_last.py).
"""

from __future__ import annotations

import contextvars
import copy

import torch.distributed as dist
from torch import nn

_CONSTRUCTION_CHECKS: contextvars.ContextVar = contextvars.ContextVar("fusedist_ddp_construction_checks",
                                                                       default=True)

#: nn.Module's registries of hooks: a copy holds the original's (Note [what a copy keeps])
_HOOK_REGISTRIES = tuple(name for name in vars(nn.Module()) if "hook" in name)
#: nn.Module's registries of children: a copy holds those added beside the wrapped ``module``
_CHILD_REGISTRIES = ("_parameters", "_buffers", "_modules")
#: set on the wrapper by its own forwards, not by its user: a copy starts without them (and without
#: fusedist's marks on objects it runs, named ``_fusedist_...``: a join context's); and
#: ``model.compile()``'s compiled call, bound to the original (Note [what a copy keeps])
_RUNTIME_STATE = frozenset({"_buffer_hook_due", "_buffer_futures", "_compiled_call_impl"})
_RUNTIME_PREFIX = "_fusedist_"

def construction_checks() -> bool:
    """Whether a wrapper being built compares the model and its buckets across ranks (not
    while it is built as a copy)."""
    return _CONSTRUCTION_CHECKS.get()


def twin_arguments(wrapper) -> dict:
    """The keywords that build ``wrapper``'s copy: its group, options and placement -- torch's copy
    keeps ``device_ids`` and ``output_device`` (the copied module is on the same device)."""
    config = wrapper.config
    group = dict(device_mesh=wrapper.device_mesh) if wrapper.device_mesh is not None else dict(
        process_group=wrapper.process_group)
    device_ids = list(wrapper.device_ids) if wrapper.device_ids is not None else None
    return dict(
        dim=wrapper.dim, init_sync=False, bucket_cap_mb=config.bucket_cap_mb,
        find_unused_parameters=config.find_unused_parameters, first_bucket_cap_mb=config.first_bucket_cap_mb,
        gradient_as_bucket_view=config.gradient_as_bucket_view, static_graph=config.static_graph,
        reduce_dtype=config.reduce_dtype, bucket_cap_mb_list=config.bucket_cap_mb_list,
        forward_sync_buffers=config.broadcast_buffers, device_ids=device_ids, output_device=wrapper.output_device,
        **group)


def _built_as_copy(cls, module, options: dict):
    """A wrapper of class ``cls`` over ``module``, built by this wrapper's constructor without the
    checks across ranks -- not by a subclass's ``__init__``, which torch's copies do not run either
    (Note [what a copy keeps])."""
    from .wrapper import DistributedDataParallel

    wrapper = cls.__new__(cls)
    token = _CONSTRUCTION_CHECKS.set(False)
    try:
        DistributedDataParallel.__init__(wrapper, module, **options)
    finally:
        _CONSTRUCTION_CHECKS.reset(token)
    return wrapper


def _kept_state(wrapper, built: frozenset) -> dict:
    """What a copy of ``wrapper`` keeps beyond what its construction makes (Note [what a copy keeps])."""
    state = {name: wrapper.__dict__[name] for name in _HOOK_REGISTRIES if name in wrapper.__dict__}
    state.update((name, value) for name, value in wrapper.__dict__.items()
                 if name not in built and name not in _RUNTIME_STATE and not name.startswith(_RUNTIME_PREFIX))
    children = {registry: {name: child for name, child in wrapper.__dict__[registry].items() if name != "module"}
                for registry in _CHILD_REGISTRIES}
    flags = dict(training=wrapper.training, require_backward_grad_sync=wrapper.require_backward_grad_sync,
                 require_forward_param_sync=wrapper.require_forward_param_sync,
                 _ddp_sink_clone=wrapper._ddp_sink_clone)
    return dict(attributes=state, children=children, flags=flags)


def _restore_kept_state(wrapper, kept: dict) -> None:
    """Give a copy built by :func:`_built_as_copy` what :func:`_kept_state` took."""
    wrapper.__dict__.update(kept["attributes"])
    for registry, children in kept["children"].items():
        wrapper.__dict__[registry].update(children)
    flags = dict(kept["flags"])
    wrapper.train(flags.pop("training"))
    for name, value in flags.items():  # (no_sync's flag is a property)
        setattr(wrapper, name, value)


def _wait_for_gathers_in_flight(wrapper) -> None:
    """Let the parameter all-gathers still in flight land before the module is copied (Note [a copy under
    overlapped gathers])."""
    wrapper._wait_for_params(True)  # (told the forward is traced, a waiter waits for every gather)
    wrapper._wait_for_buffer_futures()  # (a buffer hook's collectives, Note [a buffer hook's futures])


def copy_wrapper(wrapper, memo: dict):
    """A deep copy of ``wrapper`` (Notes [copies of the wrapper], [what a copy keeps])."""
    _wait_for_gathers_in_flight(wrapper)
    for shared in (wrapper.process_group, wrapper.device_mesh):
        if shared is not None:
            memo[id(shared)] = shared  # the same group, not a copy of it
    module = copy.deepcopy(wrapper.module, memo)
    if wrapper._ignored_slots:  # the same slots, at their paths now (Note [ignored entries followed by identity])
        module._ddp_params_and_buffers_to_ignore = wrapper.ignored_names()
    twin = _built_as_copy(type(wrapper), module, twin_arguments(wrapper))
    memo[id(wrapper)] = twin  # (before the hooks are copied: a method of the wrapper becomes the copy's)
    _restore_kept_state(twin, copy.deepcopy(_kept_state(wrapper, twin._names_at_construction), memo))
    return twin


def _refuse_pickling(wrapper, why: str) -> None:
    raise RuntimeError(
        f"fusedist.DistributedDataParallel (rank {wrapper.rank}): cannot pickle this model (torch.save(model), "
        f"pickle.dumps(model)): {why}. As with torch's DistributedDataParallel, only a model over the default "
        "process group can be pickled; save model.module (or model.state_dict()) instead and wrap the loaded "
        "module again")


def pickled_wrapper(wrapper) -> tuple:
    """``wrapper.__reduce_ex__``: what rebuilds it on the loading process's default group (Notes [a
    pickled wrapper], [what a copy keeps]). The kept state is pickle's state, set once the wrapper is
    built, so that a hook referring to the wrapper pickles as a reference to it."""
    group = wrapper.process_group
    if group is None:  # Note [the process group, held weakly]
        _refuse_pickling(wrapper, "its process group was destroyed (torch.distributed.destroy_process_group())")
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    if group is not default:
        _refuse_pickling(wrapper, f"it was built over a process group other than the default one (ranks "
                                  f"{dist.get_process_group_ranks(group)})")
    _wait_for_gathers_in_flight(wrapper)
    options = twin_arguments(wrapper)
    options.pop("process_group", None)
    if wrapper._comm_hook is not None:  # (a compression hook's reduce_dtype: torch keeps no hook either)
        options["reduce_dtype"] = None
    kept = _kept_state(wrapper, wrapper._names_at_construction)
    rebuilt = (type(wrapper), wrapper.module, options, wrapper.ignored_names())
    return (_unpickled_wrapper, rebuilt, kept, None, None, _restore_kept_state)


def _unpickled_wrapper(cls, module, options: dict, ignored):
    """The wrapper :func:`pickled_wrapper` saved, over ``module`` on the default group (pickle then
    gives it the kept state)."""
    if ignored:
        module._ddp_params_and_buffers_to_ignore = ignored
    return _built_as_copy(cls, module, options)


def refuse_shallow_copy(wrapper) -> None:
    """``copy.copy(model)`` (Note [a pickled wrapper])."""
    raise TypeError(
        f"fusedist.DistributedDataParallel (rank {wrapper.rank}): copy.copy(model) would make a second wrapper over "
        "the same parameters, reducing their gradients twice; use copy.deepcopy(model) for a model of its own, "
        "or keep using this one")
