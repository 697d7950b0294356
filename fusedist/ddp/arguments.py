"""``fusedist.DistributedDataParallel``'s constructor arguments, read as torch's DDP reads them:
which group, which device, which buffers are broadcast when, and the torch options that only
change how torch schedules its own reduction."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

from .._rank import this_rank

__all__ = ["TORCH_ONLY_OPTIONS", "buffer_sync_settings", "check_device_ids", "device_attributes", "group_of",
           "module_device", "reduce_dtype_from_mixed_precision",
           "refuse_dtensors", "refuse_mixed_precision_casts"]

#: torch options that change only how torch schedules its own reduction: accepted and ignored
#: (the gradients come out the same). ``device_mesh`` chooses the group, so it is honoured.
TORCH_ONLY_OPTIONS = {"check_reduction", "delay_all_reduce_named_params",
                      "param_to_hook_all_reduce", "skip_all_reduce_unused_params", "batched_grad_copy"}


def buffer_sync_settings(broadcast_buffers: Optional[bool], forward_sync_buffers: Optional[bool]) -> tuple[bool, bool]:
    """(sync buffers at forward, broadcast buffers at construction), by torch's rules:
    ``forward_sync_buffers`` (torch 2.13) governs the forward only, buffers are broadcast at
    construction regardless; the deprecated ``broadcast_buffers=False`` turns off both (code
    that keeps rank-local buffers relies on that). Both default to True."""
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            warnings.warn("fusedist.DistributedDataParallel: both broadcast_buffers and forward_sync_buffers "
                          "were given; broadcast_buffers is deprecated and ignored", FutureWarning, stacklevel=3)
        else:
            warnings.warn("fusedist.DistributedDataParallel: broadcast_buffers is deprecated (as in torch); use "
                          "forward_sync_buffers. Unlike broadcast_buffers=False, forward_sync_buffers=False still "
                          "broadcasts the buffers at construction", FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    sync = True if broadcast_buffers is None else bool(broadcast_buffers)
    return sync, sync


def reduce_dtype_from_mixed_precision(mixed_precision, reduce_dtype):
    """torch's (experimental) ``mixed_precision=_MixedPrecision(...)``: its ``reduce_dtype``
    is fusedist's; its ``param_dtype``/``buffer_dtype`` are checked by :func:`refuse_mixed_precision_casts`."""
    if mixed_precision is None:
        return reduce_dtype
    fields = ("param_dtype", "reduce_dtype", "buffer_dtype")
    if not all(hasattr(mixed_precision, f) for f in fields):
        # (read with defaults, a string or a dict passed its reduce_dtype by without a word; torch's
        # DDP fails on it with an AttributeError)
        raise TypeError(
            f"fusedist.DistributedDataParallel (rank {this_rank()}): mixed_precision must be torch's "
            f"torch.nn.parallel.distributed._MixedPrecision (attributes {', '.join(fields)}), got "
            f"{type(mixed_precision).__name__} {mixed_precision!r:.80}; for a narrower gradient reduction "
            "pass mixed_precision=_MixedPrecision(reduce_dtype=torch.bfloat16) or reduce_dtype=torch.bfloat16"
        )
    mp_reduce = mixed_precision.reduce_dtype
    if reduce_dtype is not None and mp_reduce is not None and mp_reduce != reduce_dtype:
        raise ValueError(f"fusedist.DistributedDataParallel: reduce_dtype={reduce_dtype} and "
                         f"mixed_precision.reduce_dtype={mp_reduce} disagree; pass one of them")
    return reduce_dtype if reduce_dtype is not None else mp_reduce


def refuse_mixed_precision_casts(mixed_precision, named_params: list, named_buffers: list) -> None:
    """``_MixedPrecision(param_dtype=..., buffer_dtype=...)`` runs the forward in a cast copy of
    the floating parameters and buffers (torch's documented rule: only floating tensors are
    cast). A dtype they already have casts nothing, as in torch, so it is accepted; a real cast
    is refused, naming the first tensor it would change."""
    if mixed_precision is None:
        return
    for kind, target, named in (("param", mixed_precision.param_dtype, named_params),
                                ("buffer", mixed_precision.buffer_dtype, named_buffers)):
        if target is None:
            continue
        cast = [(n, t) for n, t in named if t.is_floating_point() and t.dtype != target]
        if not cast:
            continue
        name, t = cast[0]
        more = f" (and {len(cast) - 1} more)" if len(cast) > 1 else ""
        raise NotImplementedError(
            f"fusedist.DistributedDataParallel (rank {this_rank()}): mixed_precision with {kind}_dtype={target} "
            f"would cast {'parameter' if kind == 'param' else 'buffer'} '{name}'{more} from {t.dtype} (a forward "
            "in a cast copy of the parameters), which is not supported; run the forward under torch.autocast, "
            "or cast the module and keep FP32 master weights in the optimizer "
            "(fusedist.optim.FusedAdamW(master_weights=True)). A dtype the tensors already have is accepted; "
            "its reduce_dtype maps to reduce_dtype=."
        )


def group_of(process_group, device_mesh):
    """The data-parallel group given as a group or, as torch's DDP also takes it, a 1-D mesh."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise ValueError("fusedist.DistributedDataParallel: pass process_group or device_mesh, not both")
    if device_mesh.ndim != 1:
        raise ValueError(
            f"fusedist.DistributedDataParallel: device_mesh must be 1-D (the data-parallel dimension, "
            f"e.g. mesh['dp']), got {device_mesh.ndim} dimensions"
        )
    return device_mesh.get_group(mesh_dim=0)


_DDP_WHY = ("the module is tensor-parallel (or sharded by torch's fully_shard), and fusedist's "
            "DistributedDataParallel takes plain tensors")
_DDP_TORCH_WAY = "torch.nn.parallel.DistributedDataParallel(model, device_mesh=mesh['dp'])"


def refuse_dtensors(named_params: list, named_buffers: list, *, who: str = "fusedist.DistributedDataParallel",
                    why: str = _DDP_WHY, torch_way: str = _DDP_TORCH_WAY) -> None:
    """Note [DDP over a tensor-parallel model]: DTensor parameters or buffers are refused, by name,
    before any collective. ``who``, ``why`` and ``torch_way`` word it for the caller (the wrapper,
    or ``fusedist.replicate``)."""
    from torch.distributed.tensor import DTensor

    found = [("parameter", n, t) for n, t in named_params if isinstance(t, DTensor)]
    found += [("buffer", n, t) for n, t in named_buffers if isinstance(t, DTensor)]
    if not found:
        return
    kind, name, t = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    dims = t.device_mesh.mesh_dim_names or tuple(range(t.device_mesh.ndim))
    raise NotImplementedError(
        f"{who} (rank {this_rank()}): {kind} '{name}'{more} is a DTensor (placements {tuple(t.placements)} over "
        f"mesh dims {dims}, local shape {tuple(t.to_local().shape)}): {why}. For data parallelism over a "
        "tensor-parallel model use fusedist.fully_shard(model, mesh=mesh['dp']) (it composes with tensor "
        f"parallelism), or {torch_way} (build the optimizer before its first forward: the module's parameters() "
        "and state_dict() are empty after it, on torch 2.13)."
    )


# Note [DDP over a tensor-parallel model]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's DDP, given a ``device_mesh`` sliced from a larger mesh, runs
# ``_pre_dp_module_transform``: each DTensor parameter is replaced by a Parameter over its local
# shard, and forward hooks swap DTensors back in for the forward. On torch 2.13 the pre-forward
# swap assigns DTensors that are not Parameters, so after the first forward the module has no
# parameters at all (``parameters()`` and ``state_dict()`` are empty; an optimizer built then gets
# nothing; one built before it trains, and the dp replicas stay equal). Reducing DTensors needs
# their placements and meshes, which the flat buckets do not carry; fully_shard's units do (it
# composes with tensor parallelism). So the wrapper
# refuses DTensors by name at construction, where they used to fail inside the first broadcast
# ("'DeviceMesh' object has no attribute 'dtype'", from the DTensor's flattened parts).


def module_device(module: nn.Module) -> torch.device:
    """The one device of the module's parameters (CPU for a module without any)."""
    devices = {}
    for name, p in module.named_parameters():
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        listing = ", ".join(f"{d} (e.g. '{n}')" for d, n in devices.items())
        raise ValueError(
            f"fusedist.DistributedDataParallel (rank {this_rank()}): "
            f"the module's parameters live on several devices: {listing}. Move the whole module to one device "
            "(module.to(device)) before wrapping."
        )
    return next(iter(devices)) if devices else torch.device("cpu")


def check_device_ids(device: torch.device, device_ids, output_device) -> None:
    """``device_ids`` as torch takes them for a single-device module: None on CPU, the
    module's own device on CUDA. ``output_device`` without ``device_ids`` (or on CPU) is refused
    as torch refuses it (where it was ignored), by torch's test: ``output_device=0`` passes it."""
    if device.type == "cpu" or not device_ids:  # (torch reads device_ids=[] as None)
        if device_ids or output_device:
            where = ("pass device_ids=None for CPU modules" if device.type == "cpu"
                     else f"pass device_ids=[{device.index}] with it, or leave output_device out")
            raise ValueError(
                f"fusedist.DistributedDataParallel (rank {this_rank()}): device_ids={device_ids} and "
                f"output_device={output_device} given for a module on {device}; {where} (as torch's DDP, "
                "which refuses them too)"
            )
        return
    if device_ids is not None:
        ids = [torch.device(d if not isinstance(d, int) else f"cuda:{d}") for d in device_ids]
        if len(ids) != 1 or ids[0] != device:
            raise ValueError(
                f"fusedist.DistributedDataParallel: device_ids={device_ids} but the module is on "
                f"{device}; single-device modules take device_ids=[their device]"
            )


def device_attributes(device: torch.device, device_ids, output_device) -> tuple:
    """torch DDP's ``(device_ids, output_device)`` attributes once :func:`check_device_ids`
    passed: ``(None, None)`` without ``device_ids`` or on CPU; else the module's device index
    and the ``output_device`` the user gave (as its index), defaulting to ``device_ids[0]``, as
    ``DistributedDataParallel.__init__`` keeps it (it does not check it against the module)."""
    if not device_ids or device.type == "cpu":
        return None, None
    from torch._utils import _get_device_index

    kept = device.index if output_device is None else _get_device_index(output_device, True)
    return [device.index], kept
