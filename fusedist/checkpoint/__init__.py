"""Checkpoints: per-rank atomic files, a manifest written last, resharding at load.

``save(directory, model, optimizer=None, scaler=None, extra=None)`` and
``load(directory, model, optimizer=None, scaler=None) -> extra``; see :mod:`.api`.
"""

from ._files import CheckpointError
from .api import load, load_per_rank, save

__all__ = ["save", "load", "load_per_rank", "CheckpointError"]  # [resume] load_per_rank
