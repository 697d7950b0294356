"""Test utilities shared by fusedist's tests and benchmarks."""

from .multiprocess import DistributedRunError, run_distributed
from .shared_gpu import RANKS_PER_GPU_ENV, device_for_rank, rank_environment, rank_slots, ranks_per_gpu_setting

__all__ = [
    "DistributedRunError",
    "RANKS_PER_GPU_ENV",
    "device_for_rank",
    "rank_environment",
    "rank_slots",
    "ranks_per_gpu_setting",
    "run_distributed",
]
