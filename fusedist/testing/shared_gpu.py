"""Several ranks on one GPU, for tests: the per-rank environment that lets NCCL accept it.

One setting, ``FUSEDIST_TEST_RANKS_PER_GPU=N``, makes :func:`fusedist.testing.run_distributed`
and the torchrun-based test launcher place ``N`` consecutive ranks on each GPU, so every
multi-rank NCCL path can run on a machine with a single GPU.

Note [several ranks on one GPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"): it
compares each rank's host hash and the GPU's bus id. The host hash is made from the host name
and boot id unless ``NCCL_HOSTID`` is set, so a distinct ``NCCL_HOSTID`` per rank makes each
rank count as a node of its own. Between "nodes" NCCL uses neither P2P nor shared memory, only
its NET transport; ``NCCL_SOCKET_IFNAME=lo`` and ``NCCL_IB_DISABLE=1`` make that the socket
transport over loopback, which every machine has (a GPU test machine may have no network at
all). NCCL reads these variables once, at its first call in the process, so they must be in
the environment before that: the launchers set them before the rank's code runs.

Both torch's ProcessGroupNCCL and fusedist's direct-NCCL communicator read them, so the two
compared at the same world size run over the same transport: ratios between them are fair,
absolute bandwidths are not those of NVLink. The ranks' kernels time-share the GPU.

The device of a rank is ``local_rank // N``, and it is handed to the rank as its
``LOCAL_RANK``: scripts (and :func:`fusedist.init_distributed`) bind to GPU ``LOCAL_RANK``, and
with several ranks per GPU that has to name the shared GPU rather than the process's slot.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["RANKS_PER_GPU_ENV", "ranks_per_gpu_setting", "rank_environment", "rank_slots", "device_for_rank"]

#: The one setting: how many ranks share each GPU (unset: one rank per GPU, no NCCL changes).
RANKS_PER_GPU_ENV = "FUSEDIST_TEST_RANKS_PER_GPU"


def ranks_per_gpu_setting(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The value of ``FUSEDIST_TEST_RANKS_PER_GPU`` in ``environ`` (default ``os.environ``), or
    None when it is unset or empty. Raises ``ValueError`` for anything but a positive integer,
    so a typo does not silently run one rank per GPU."""
    raw = (os.environ if environ is None else environ).get(RANKS_PER_GPU_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{RANKS_PER_GPU_ENV} must be a positive integer, got {raw!r}")
    return value


def rank_environment(rank: int, ranks_per_gpu: int, *, local_rank: Optional[int] = None,
                     gpu_count: Optional[int] = None) -> dict[str, str]:
    """The environment variables rank ``rank`` needs to share its GPU with ``ranks_per_gpu - 1``
    other ranks (Note [several ranks on one GPU]). Pure: reads and changes nothing.

    Args:
        rank: the global rank (names the rank's NCCL host id: distinct per rank).
        ranks_per_gpu: ranks per GPU; 1 leaves NCCL's settings alone.
        local_rank: the rank's slot on this machine (default ``rank``: one machine).
        gpu_count: when given, a rank whose device would not exist raises ``ValueError``.

    Returns ``LOCAL_RANK`` (the device index, ``local_rank // ranks_per_gpu``) and, with more
    than one rank per GPU, ``NCCL_HOSTID``, ``NCCL_SOCKET_IFNAME=lo`` and ``NCCL_IB_DISABLE=1``.
    """
    if ranks_per_gpu < 1:
        raise ValueError(f"ranks_per_gpu must be >= 1, got {ranks_per_gpu}")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    slot = rank if local_rank is None else local_rank
    device = slot // ranks_per_gpu
    if gpu_count is not None and device >= gpu_count:
        raise ValueError(
            f"local rank {slot} would use cuda:{device}, but {gpu_count} GPU(s) are visible: at "
            f"{ranks_per_gpu} rank(s) per GPU this machine holds {rank_slots(gpu_count, ranks_per_gpu)} "
            f"ranks (raise {RANKS_PER_GPU_ENV} or lower the world size)")
    env = {"LOCAL_RANK": str(device)}
    if ranks_per_gpu > 1:
        env.update({
            "NCCL_HOSTID": f"fusedist-rank{rank}",
            "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_IB_DISABLE": "1",
        })
    return env


def rank_slots(gpu_count: int, ranks_per_gpu: Optional[int]) -> int:
    """How many ranks a machine with ``gpu_count`` GPUs runs (``ranks_per_gpu`` None: one each)."""
    return gpu_count * (ranks_per_gpu or 1)


def device_for_rank(local_rank: int, ranks_per_gpu: Optional[int] = None) -> int:
    """The CUDA device index of local rank ``local_rank`` (``ranks_per_gpu`` None: read the
    setting). For tests that bind devices themselves instead of reading ``LOCAL_RANK``."""
    per_gpu = ranks_per_gpu if ranks_per_gpu is not None else ranks_per_gpu_setting()
    return local_rank // (per_gpu or 1)
