"""Gradient clips counted per model, a field of the per-step check.

Note [a clip on some ranks only]
    ``clip_grad_norm_`` called on some ranks only (a clip under ``if rank == 0``, a rank-local "clip
    when my loss spikes") scales those ranks' averaged gradients and not the others': every counter
    of the step check agrees, the step applies different updates, and DDP's replicas drift apart --
    seen only by the parameter digest at its period (``FUSEDIST_PARAM_CHECK_EVERY``); torch's DDP
    trains on silently. So each call of torch's ``clip_grad_norm_`` as fusedist replaces it (Note
    [torch's clip on sharded gradients] in fusedist/optim/torch_clip.py) and of
    ``fusedist.clip_grad_norm_`` is counted on the watch of the model that owns the first trainable
    parameter given -- one ownership lookup per call -- and the count is the step check's ``clips``
    field (Note [step check] in step_check.py): ranks whose counts differ are named at the next
    synchronized backward's verdict, on every rank. Every rank clipping alike is no divergence,
    whatever the coefficient (the averaged gradients, hence their norm, are the same everywhere).
    Where the gradients are sharded (``fully_shard``, ZeRO stage 2) the clip is itself a collective
    (the global norm's all-reduce): one rank's clip leaves it unpaired and the divergence probe names
    it first; the count matters where the clip communicates nothing (DDP's replicated gradients).
    A ``ZeroRedundancyOptimizer``'s own ``clip_grad_norm_`` is counted too: after ``GradScaler.unscale_``
    it reuses the norm the unscale reduced and communicates nothing, so one rank's clip scaled its own
    shard's update alone -- the parameters all-gathered afterwards agree on every rank, and no digest
    could tell (torch's ZeroRedundancyOptimizer, each rank stepping its shard from its own ``p.grad``,
    does the same silently). Without the unscale its all-reduce is unpaired, named by the probe as above.
    A clip with ``max_norm=inf`` scales nothing (the norm taken for logging, often on rank 0 only)
    and is not counted. A clip traced into a compiled region over parameters without a gradient
    holder is torch's own, traced, and is not counted (on any rank).
"""

from __future__ import annotations

import math

import torch

from ..ownership import watch_of

__all__ = ["EXPLAIN", "count_clip"]

#: What a difference in the clip counts means (the step check's words).
#: A ZeRO optimizer's clip counts on its model's watch (a DDP model's too), so the words hold for both.
EXPLAIN = ("clip_grad_norm_ was called on some ranks only: their gradients were scaled and the others' not, so the "
           "optimizer steps applied different updates (DDP's replicas drift apart; under a ZeRO optimizer each "
           "rank's shard was updated as its own rank chose, some clipped and some not, into parameters that agree "
           "across ranks yet follow no one clip); clip on every rank alike (decide from the averaged gradients, or "
           "from a flag all-reduced across ranks)")


def count_clip(params: list, max_norm) -> None:
    """Count a clip of ``params`` to ``max_norm`` on the watch of the model owning the first trainable
    one (Note [a clip on some ranks only]); nothing where no fusedist model owns it, nor for a norm
    measured with ``max_norm=inf`` (which scales nothing: rank 0 logging the norm)."""
    if isinstance(max_norm, (int, float)) and max_norm == math.inf:
        return
    for p in params:
        if isinstance(p, torch.Tensor) and p.requires_grad:
            watch = watch_of(p)[1]
            if hasattr(watch, "clips"):  # (a replicated module's watch before its first forward counts nothing)
                watch.clips += 1
            return
