"""Test utilities shared by fusedist's tests and benchmarks."""

from .multiprocess import DistributedRunError, run_distributed

__all__ = ["DistributedRunError", "run_distributed"]
