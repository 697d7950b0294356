"""ZeRO stage 1 and 2: optimizer state, master weights and gradients sharded over flat buffers."""

from .optimizer import ZeroRedundancyOptimizer
from .state import StateDictError

__all__ = ["ZeroRedundancyOptimizer", "StateDictError"]
