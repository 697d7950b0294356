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
    holds the module, the options and the gradient-sync flags; loading builds a wrapper over the
    loaded module as a copy is built (no checks across ranks, no initial broadcast). As torch's,
    a model over another group is refused (a loading process cannot know that group), and so is
    one whose group was destroyed; no communication hook is kept (torch's reducer is rebuilt
    without one: register it again after loading; a buffer hook too), and the gradients are not
    in the pickle. A loaded ``static_graph=True`` model averages its first backward as any new
    one does (torch 2.13's loaded one leaves that backward's gradients rank-local: its pickle
    keeps the flag saying the delayed reduction was queued).
    ``copy.copy(model)`` would be a second wrapper over the same parameters and is refused.
"""

from __future__ import annotations

import contextvars
import copy

import torch.distributed as dist

_CONSTRUCTION_CHECKS: contextvars.ContextVar = contextvars.ContextVar("fusedist_ddp_construction_checks",
                                                                       default=True)


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


def copy_wrapper(wrapper, memo: dict):
    """A deep copy of ``wrapper`` (Note [copies of the wrapper])."""
    for shared in (wrapper.process_group, wrapper.device_mesh):
        if shared is not None:
            memo[id(shared)] = shared  # the same group, not a copy of it
    module = copy.deepcopy(wrapper.module, memo)
    if wrapper._ignored_slots:  # the same slots, at their paths now (Note [ignored entries followed by identity])
        module._ddp_params_and_buffers_to_ignore = wrapper.ignored_names()
    token = _CONSTRUCTION_CHECKS.set(False)
    try:
        twin = type(wrapper)(module, **twin_arguments(wrapper))
    finally:
        _CONSTRUCTION_CHECKS.reset(token)
    twin.train(wrapper.training)
    memo[id(wrapper)] = twin
    return twin


def _refuse_pickling(wrapper, why: str) -> None:
    raise RuntimeError(
        f"fusedist.DistributedDataParallel (rank {wrapper.rank}): cannot pickle this model (torch.save(model), "
        f"pickle.dumps(model)): {why}. As with torch's DistributedDataParallel, only a model over the default "
        "process group can be pickled; save model.module (or model.state_dict()) instead and wrap the loaded "
        "module again")


def pickled_wrapper(wrapper) -> tuple:
    """``wrapper.__reduce_ex__``: what rebuilds it on the loading process's default group (Note [a
    pickled wrapper])."""
    group = wrapper.process_group
    if group is None:  # Note [the process group, held weakly]
        _refuse_pickling(wrapper, "its process group was destroyed (torch.distributed.destroy_process_group())")
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    if group is not default:
        _refuse_pickling(wrapper, f"it was built over a process group other than the default one (ranks "
                                  f"{dist.get_process_group_ranks(group)})")
    options = twin_arguments(wrapper)
    options.pop("process_group", None)
    if wrapper._comm_hook is not None:  # (a compression hook's reduce_dtype: torch keeps no hook either)
        options["reduce_dtype"] = None
    flags = dict(training=wrapper.training, grad_sync=wrapper.require_backward_grad_sync,
                 forward_sync=wrapper.require_forward_param_sync, ignored=wrapper.ignored_names())
    return _unpickled_wrapper, (type(wrapper), wrapper.module, options, flags)


def _unpickled_wrapper(cls, module, options: dict, flags: dict):
    """The wrapper :func:`pickled_wrapper` saved, over ``module`` on the default group."""
    if flags["ignored"]:
        module._ddp_params_and_buffers_to_ignore = flags["ignored"]
    token = _CONSTRUCTION_CHECKS.set(False)
    try:
        wrapper = cls(module, **options)
    finally:
        _CONSTRUCTION_CHECKS.reset(token)
    wrapper.train(flags["training"])
    wrapper.require_backward_grad_sync = flags["grad_sync"]
    wrapper.require_forward_param_sync = flags["forward_sync"]
    return wrapper


def refuse_shallow_copy(wrapper) -> None:
    """``copy.copy(model)`` (Note [a pickled wrapper])."""
    raise TypeError(
        f"fusedist.DistributedDataParallel (rank {wrapper.rank}): copy.copy(model) would make a second wrapper over "
        "the same parameters, reducing their gradients twice; use copy.deepcopy(model) for a model of its own, "
        "or keep using this one")
