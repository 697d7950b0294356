"""Distributed layers: ``SyncBatchNorm`` (drop-in for ``torch.nn.SyncBatchNorm``)."""

from .sync_batch_norm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
