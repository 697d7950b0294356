"""Process-group initialization from ``torchrun``'s environment, and the timeout policy.

fusedist never ships a launcher or rendezvous of its own: ``torchrun`` sets the environment,
``torch.distributed`` does the rest. This module only adds the checks and defaults a user
would otherwise get wrong (device binding, a finite timeout, a readable error when the
environment is incomplete).
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

# Note [binding torch.distributed.nn early]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.distributed.nn.functional writes ``group=group.WORLD`` as default arguments, which
# Python evaluates once, when the module is first imported. Imported after
# init_process_group -- torch.optim's first optimizer imports it, through torch._dynamo --
# those ten defaults hold the default process group for the rest of the process:
# destroy_process_group() can no longer free it, and it is left to interpreter shutdown,
# where freeing a gloo group can abort the process (Note [releasing destroyed groups] in
# fusedist/comm/__init__.py). Imported here, before fusedist can have created a group, they
# hold None. (3 ms.)
if dist.is_available():
    import torch.distributed.nn  # noqa: F401

#: Default timeout of every collective fusedist waits on. Finite on purpose: a rank that dies or
#: diverges must turn into an error on the others, not a hang. Override with
#: ``FUSEDIST_TIMEOUT_S`` or ``init_distributed(timeout=...)``.
DEFAULT_TIMEOUT_S = 600.0

_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    """What ``init_distributed`` set up."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def collective_timeout() -> datetime.timedelta:
    """The timeout applied to each collective wait (``FUSEDIST_TIMEOUT_S`` overrides)."""
    seconds = float(os.environ.get("FUSEDIST_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if not seconds > 0:
        raise ValueError(f"FUSEDIST_TIMEOUT_S must be a positive number of seconds, got {seconds}")
    return datetime.timedelta(seconds=seconds)


def _as_timedelta(timeout) -> datetime.timedelta:
    if timeout is None:
        return collective_timeout()
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _current_info() -> DistributedInfo:
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if backend == "nccl" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return DistributedInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


def init_distributed(backend: str | None = None, timeout=None) -> DistributedInfo:
    """Initialize ``torch.distributed`` from the environment ``torchrun`` provides.

    Picks ``nccl`` when CUDA is available and ``gloo`` otherwise, binds this process to GPU
    ``LOCAL_RANK``, and applies a finite ``timeout`` (seconds or timedelta; default
    :func:`collective_timeout`). Calling it again returns the existing setup.

    Raises:
        RuntimeError: the launch environment is incomplete (names the missing variables), or
            LOCAL_RANK names a GPU this machine does not have.
    """
    if dist.is_available() and dist.is_initialized():
        info = _current_info()
        if backend is not None and backend != info.backend:
            raise RuntimeError(
                f"torch.distributed is already initialized with backend {info.backend!r}; "
                f"init_distributed(backend={backend!r}) cannot change it"
            )
        return info

    missing = [name for name in _REQUIRED_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            "fusedist.init_distributed: the launch environment is incomplete, missing "
            + ", ".join(missing)
            + ". Launch with torchrun (e.g. `torchrun --nproc_per_node=2 train.py`), which sets "
            "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, or set them yourself."
        )
    try:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError as exc:
        raise RuntimeError(f"fusedist.init_distributed: malformed launch environment: {exc}") from None
    if not 0 <= rank < world_size:
        raise RuntimeError(f"fusedist.init_distributed: RANK={rank} is outside WORLD_SIZE={world_size}")

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    kwargs = {}
    if backend == "nccl":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"fusedist.init_distributed: rank {rank} has LOCAL_RANK={local_rank} but this "
                f"node has {count} GPU(s); use --nproc_per_node <= {count}"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        kwargs["device_id"] = device
    dist.init_process_group(backend=backend, timeout=_as_timedelta(timeout), **kwargs)
    return DistributedInfo(rank, world_size, local_rank, backend, device)
