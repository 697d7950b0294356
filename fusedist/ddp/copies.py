"""Copies of a DistributedDataParallel wrapper (``copy.deepcopy``).

Note [copies of the wrapper]
    copy.deepcopy of a wrapped model -- torch.optim.swa_utils.AveragedModel(model) and EMA
    helpers do it -- gives a wrapper of its own over the copied module, on the same process
    group, with the same options and placement (``device_ids``, ``output_device``), as torch
    DDP's copy does. torch's copy issues no collective (it may be made on one rank only, e.g.
    to save a snapshot), so neither does this one: no construction checks, no initial broadcast
    (the copy holds the original's values). Its forwards, step checks and gradient reduction
    are those of any wrapper. A communication hook other than torch's averaging ones is not
    copied (it may hold per-model state, as PowerSGD's does): register it on the copy.
    Pickling the wrapper is refused with what to pickle instead.
"""

from __future__ import annotations

import contextvars
import copy

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
