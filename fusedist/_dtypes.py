"""The precision rule shared by the optimizers and SyncBatchNorm."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that math on ``dtype`` tensors runs and accumulates in, and that optimizer
    state for them is kept in: fp64 stays fp64, every other floating dtype (fp32, fp16, bf16)
    widens to fp32.

    Sums of many fp16/bf16 terms and Adam's small per-step updates are lost below fp32's
    precision, so nothing narrower is used; a model trained in fp64 asked for fp64 and keeps
    it, as torch's optimizers and batch norm do."""
    return torch.float64 if dtype == torch.float64 else torch.float32
