"""torch DDP's logging API (``_get_ddp_logging_data``, ``_set_ddp_runtime_logging_sample_rate``) on
fusedist's wrapper.

Note [torch's DDP logging data]
    torch's DDP answers ``model._get_ddp_logging_data()`` with one flat dict: the constructor's
    settings, the process group and environment it runs in, the bucket sizes, and runtime
    timings sampled at some iterations; torch's docs point scripts at it (the ``static_graph``
    docstring). On fusedist's wrapper the call was an AttributeError. The same keys come back
    here with torch's values for the same model and group: settings as ints (0/1),
    ``output_device`` -1 without one, environment strings ``"N/A"`` when unset, ``static_graph``
    and ``comm_hook`` only once set, ``join_uneven_inputs`` once a join context was entered.
    ``iteration`` follows torch's sampling: the synchronized grad-enabled forwards are counted,
    and the count seen at a forward is kept when it is 1..10 or a multiple of the sample rate
    (100 unless set). ``bucket_sizes`` are fusedist's buckets as built at construction (torch's
    are too; its rebuilt ones are ``rebuilt_bucket_sizes``), the bytes of their parameters
    without alignment padding (with a cap smaller than a layer, fusedist may cut them
    differently from torch). ``has_sync_bn`` counts torch's SyncBatchNorm and fusedist's. torch's timings
    (``avg_backward_comm_time`` and the like, from its C++ reducer's events) have no
    counterpart in this dict: fusedist times the last synchronized backward in
    ``model.comm_stats()``. What was recorded through ``model.logger`` (an error, a hook's name)
    shows too (Note [the model's logger] in ddp_logger.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ddp_logging_data", "bucket_sizes", "check_sample_rate", "sampled_iteration", "DEFAULT_SAMPLE_RATE"]

DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate
_FIRST_SAMPLED = 10  # torch samples every one of the first iterations up to this one

# torch reports the parameters' dtypes by their C++ type names
_TYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
               torch.bfloat16: "c10::BFloat16", torch.complex64: "c10::complex<float>",
               torch.complex128: "c10::complex<double>"}
_ENV = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT",
        "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG", "cuda_visible_devices": "CUDA_VISIBLE_DEVICES"}
_BACKEND_ENV = {
    "gloo": {"gloo_socket_ifname": "GLOO_SOCKET_IFNAME", "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"},
    "nccl": {"nccl_socket_ifname": "NCCL_SOCKET_IFNAME",
             "nccl_blocking_wait": ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"),
             "nccl_async_error_handling": ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"),
             "nccl_debug": "NCCL_DEBUG",
             "nccl_nthreads": "NCCL_NTHREADS", "nccl_ib_timeout": "NCCL_IB_TIMEOUT"},
}


def sampled_iteration(synced_forwards: int, sample_rate: int) -> int:
    """The iteration torch's logger last recorded after ``synced_forwards`` forwards: each forward
    records the count before it when that count is 1..10 or a multiple of ``sample_rate``."""
    last = synced_forwards - 1
    if last <= _FIRST_SAMPLED:
        return max(last, 0)
    return max(_FIRST_SAMPLED, last - last % sample_rate)


def ddp_logging_data(model) -> dict:
    """torch's ``_get_ddp_logging_data()`` dict for the fusedist wrapper ``model`` (Note [torch's
    DDP logging data])."""
    from ..nn.sync_batch_norm import SyncBatchNorm  # (imported late: fusedist.nn imports this package)

    params = [p for _, p in model.synced_parameters() if p.requires_grad]
    backend = dist.get_backend(model.process_group)
    data = {key: _env(names) for key, names in {**_ENV, **_BACKEND_ENV.get(backend, {})}.items()}
    data.update(
        backend_name=backend,
        module_name=type(model.module).__name__,
        dtypes=", ".join(sorted({_TYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
        device_ids=", ".join(str(i) for i in model.device_ids or ()),
        bucket_sizes=model._bucket_sizes_at_construction,
        world_size=model.world_size,
        rank=model.rank,
        iteration=sampled_iteration(model._synced_forwards, model._logging_sample_rate),
        output_device=-1 if model.output_device is None else int(model.output_device),
        is_multi_device_module=0,
        broadcast_buffers=int(model.config.broadcast_buffers),
        bucket_cap_bytes=int(model.config.bucket_cap_mb * 1024 * 1024),
        find_unused_parameters=int(model.config.find_unused_parameters),
        gradient_as_bucket_view=int(model.config.gradient_as_bucket_view),
        has_sync_bn=int(any(isinstance(m, (nn.SyncBatchNorm, SyncBatchNorm)) for m in model.module.modules())),
        num_parameter_tensors=len(params),
        total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in params),
    )
    threads = _gloo_threads(model.process_group) if backend == "gloo" else None
    if threads is not None:
        data["gloo_num_threads"] = threads
    if model.config.static_graph:
        data["static_graph"] = 1
    if model._comm_hook is not None:
        data["comm_hook"] = model._comm_hook
    if model._joined_once:
        data["join_uneven_inputs"] = 1
    data.update(model.logger.recorded)  # Note [the model's logger] in ddp_logger.py
    return data


def bucket_sizes(buckets) -> str:
    """torch's ``bucket_sizes``: each bucket's parameter bytes (no alignment padding), in order."""
    return ", ".join(str(sum(p.numel() * p.element_size() for p in b.params)) for b in buckets)


def check_sample_rate(sample_rate) -> int:
    """torch's rule for ``_set_ddp_runtime_logging_sample_rate``: at least 1."""
    if sample_rate < 1:
        raise ValueError("DDP runtime logging sample rate should be equal or greater than 1, "
                         f"got {sample_rate}")
    return int(sample_rate)


def _env(names) -> str:
    """The first of ``names`` (one, or torch's newer name then its older one) set, else ``"N/A"``."""
    for name in (names,) if isinstance(names, str) else names:
        if name in os.environ:
            return os.environ[name]
    return "N/A"


def _gloo_threads(group):
    """The gloo backend's thread count (torch logs it), or None where the group does not say."""
    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
