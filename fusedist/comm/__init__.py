"""Collectives behind one interface: torch.distributed or direct NCCL (CUDA extension)."""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .base import CollectiveError, CommHandle, Communicator
from .torch_comm import TorchCommunicator

__all__ = [
    "CollectiveError",
    "CommHandle",
    "Communicator",
    "TorchCommunicator",
    "get_communicator",
    "register_cuda_communicator",
]

_cache: dict = {}
_cuda_factory: Optional[Callable] = None


def register_cuda_communicator(factory: Callable) -> None:
    """Install the factory ``factory(process_group) -> Communicator`` used for CUDA tensors
    when ``FUSEDIST_COMM`` is not ``torch`` (the CUDA extension registers itself here)."""
    global _cuda_factory
    _cuda_factory = factory


def get_communicator(process_group=None, device: torch.device | str | None = None) -> Communicator:
    """The communicator for ``process_group`` and tensors on ``device`` (cached).

    CUDA tensors use the direct-NCCL communicator when the extension is built (unless
    ``FUSEDIST_COMM=torch``); everything else uses ``torch.distributed``.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    choice = os.environ.get("FUSEDIST_COMM", "auto").lower()
    if choice not in ("auto", "torch", "nccl"):
        raise ValueError(f"FUSEDIST_COMM must be auto, torch or nccl, got {choice!r}")
    use_nccl = device.type == "cuda" and choice != "torch" and _cuda_factory is not None
    if choice == "nccl" and not use_nccl:
        raise RuntimeError(
            "FUSEDIST_COMM=nccl but the direct-NCCL communicator is unavailable for "
            f"{device.type} tensors (fusedist.cuda_ext_error() says why)"
        )
    # Key on the group object itself (the default group resolved), so a destroyed and
    # re-created process group gets a fresh communicator. The cache holds the group alive,
    # which keeps its id from being reused.
    group_obj = process_group if process_group is not None else dist.group.WORLD
    key = (id(group_obj), "nccl" if use_nccl else "torch")
    entry = _cache.get(key)
    if entry is None or entry[0] is not group_obj:
        comm = _cuda_factory(process_group) if use_nccl else TorchCommunicator(process_group)
        entry = _cache[key] = (group_obj, comm)
    return entry[1]


def _register_direct_nccl() -> None:
    # Guarded: only when the CUDA extension imported (importing it touches no driver). The
    # factory itself falls back to torch.distributed, on all ranks together, when NCCL or a
    # GPU is missing at run time.
    from .._extension import cuda_ext_available

    if cuda_ext_available():
        from .nccl_comm import make_nccl_communicator

        register_cuda_communicator(make_nccl_communicator)


_register_direct_nccl()
