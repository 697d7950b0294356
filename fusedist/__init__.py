"""fusedist: fused distributed-training ops for PyTorch.

A drop-in layer over ``torch.distributed``: swap one import and keep the numerics.

Public surface (everything else is private)::

    fusedist.init_distributed          # torchrun env -> process group (+ device binding)
    fusedist.DistributedDataParallel   # bucketed, overlapped gradient all-reduce
    fusedist.Join                      # uneven inputs: torch's Join on fusedist's communicator
    fusedist.ZeroRedundancyOptimizer   # ZeRO stage 1/2 on flat buffers
    fusedist.fully_shard               # ZeRO stage 3 with torch FSDP2's signature
    fusedist.MixedPrecisionPolicy / CPUOffloadPolicy / OffloadPolicy
    fusedist.FSDPModule / UnshardHandle  # what a fully_shard module is, what unshard(async_op) returns
    fusedist.clip_grad_norm_           # global grad norm clip, fused with the optimizer
    fusedist.optim.FusedAdam / FusedAdamW / FusedSGD / FusedLAMB
    fusedist.amp.GradScaler
    fusedist.nn.SyncBatchNorm
    fusedist.checkpoint.save / load
    fusedist.pipelining.PipelineStage  # torch's, one gradient reduction per step (fully_shard or DDP stages)
    fusedist.RankMismatchError          # ranks disagree (model, bucket layout, steps taken)
    fusedist.cuda_ext_available / cuda_ext_error

Heavy submodules load on first use, so ``import fusedist`` is cheap and never fails because
an optional compiled extension is missing.
"""

from __future__ import annotations

import importlib

from ._extension import cuda_ext_available, cuda_ext_error
from .distributed import DistributedInfo, init_distributed

__version__ = "0.1.0"

# name -> (module, attribute); attribute None means the module itself.
_LAZY = {
    "DistributedDataParallel": ("fusedist.ddp", "DistributedDataParallel"),
    "Join": ("fusedist.ddp.join", "Join"),
    "replicate": ("fusedist.ddp.replicate", "replicate"),
    "ZeroRedundancyOptimizer": ("fusedist.zero", "ZeroRedundancyOptimizer"),
    "fully_shard": ("fusedist.fsdp", "fully_shard"),
    "register_fsdp_forward_method": ("fusedist.fsdp", "register_fsdp_forward_method"),
    "share_comm_ctx": ("fusedist.fsdp", "share_comm_ctx"),
    "FSDPModule": ("fusedist.fsdp", "FSDPModule"),
    "UnshardHandle": ("fusedist.fsdp", "UnshardHandle"),
    "OffloadPolicy": ("fusedist.fsdp", "OffloadPolicy"),
    "MixedPrecisionPolicy": ("fusedist.fsdp", "MixedPrecisionPolicy"),
    "CPUOffloadPolicy": ("fusedist.fsdp", "CPUOffloadPolicy"),
    "fsdp": ("fusedist.fsdp", None),
    "clip_grad_norm_": ("fusedist.optim", "clip_grad_norm_"),
    "optim": ("fusedist.optim", None),
    "amp": ("fusedist.amp", None),
    "nn": ("fusedist.nn", None),
    "checkpoint": ("fusedist.checkpoint", None),
    "pipelining": ("fusedist.pipelining", None),
    "comm": ("fusedist.comm", None),
    "RankMismatchError": ("fusedist._consistency", "RankMismatchError"),
}

__all__ = [
    "DistributedInfo",
    "init_distributed",
    "cuda_ext_available",
    "cuda_ext_error",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'fusedist' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
