"""This process's rank for messages, in one place: 0 in a single-process run (no process group)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["this_rank"]


def this_rank() -> int:
    """This process's rank in the default process group, or 0 where there is none (torch built
    without distributed, or no group initialized): an error message names a rank either way."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
