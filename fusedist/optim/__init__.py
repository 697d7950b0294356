"""Fused optimizers: torch's constructor keywords, one multi-tensor launch per dtype bucket,
optional FP32 master weights, and a GradScaler step with no unscale pass and no host sync.

Public surface::

    FusedAdam, FusedAdamW, FusedSGD, FusedLAMB   # torch.optim.Optimizer subclasses
    clip_grad_norm_                              # torch's, free between unscale_ and step
    functional                                   # the multi-tensor contract (adam_update, ...)
"""

from . import functional
from .adam import FusedAdam, FusedAdamW
from .clip import clip_grad_norm_
from .lamb import FusedLAMB
from .sgd import FusedSGD

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD", "FusedLAMB", "clip_grad_norm_", "functional"]
