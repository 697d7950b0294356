"""Distributed data parallelism: the wrapper, its bucket layout and the gradient reducer."""

from .config import DDPConfig
from .strategy import AllReduceAverage, GradSyncStrategy
from .wrapper import DistributedDataParallel

__all__ = ["DDPConfig", "DistributedDataParallel", "GradSyncStrategy", "AllReduceAverage"]
