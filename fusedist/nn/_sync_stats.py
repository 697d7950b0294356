"""Cross-rank BatchNorm statistics: one all-gather of (count, mean, M2), a fixed-order
parallel-Welford combine, and the once-per-layer channel-count agreement check.

Note [bit-identical statistics]
Every rank gathers the same ``(world_size, 2C + 1)`` fp64 tensor and runs the same
reductions on it, so every rank computes the same global mean/variance bit for bit -- which
keeps the running statistics identical across ranks without a broadcast. The combine is the
k-way form of Chan et al.'s parallel update:

    n = sum n_r,   mean = sum n_r mean_r / n,   M2 = sum M2_r + sum n_r (mean_r - mean)^2

which works for any per-rank counts, including 0 (an empty batch contributes nothing) and 1.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..comm import Communicator

STATS_TAG = "sync_batch_norm.stats"
GRAD_TAG = "sync_batch_norm.grad"
CHECK_TAG = "sync_batch_norm.check"


class GlobalStats(NamedTuple):
    """Statistics of the global batch (fp64, C elements each) and the per-rank counts."""

    count: int
    mean: torch.Tensor
    m2: torch.Tensor
    rank_counts: list[int]


def gather_payloads(payload: torch.Tensor, comm: Optional[Communicator]) -> torch.Tensor:
    """All ranks' ``[count, mean, M2]`` payloads as a ``(world_size, len)`` tensor, rank order.
    Without a communicator (one process) it is this rank's payload alone."""
    if comm is None:
        return payload.unsqueeze(0)
    gathered = torch.empty(comm.world_size * payload.numel(), dtype=payload.dtype, device=payload.device)
    comm.all_gather(gathered, payload, tag=STATS_TAG)
    return gathered.view(comm.world_size, payload.numel())


def combine(gathered: torch.Tensor, num_features: int) -> GlobalStats:
    """Merge per-rank payloads with the parallel Welford formula (see the note above).

    Reads the per-rank counts to the host (one small device-to-host copy, as torch's
    SyncBatchNorm does) so that a global batch of exactly 1 value per channel fails on every
    rank with the same message instead of producing inf/nan. A global batch of 0 values is
    not an error: BatchNorm returns an empty output for an empty batch (detection heads
    without proposals rely on it), so the caller gets ``count == 0`` and must not use the
    (undefined) mean and M2.
    """
    C = num_features
    counts = gathered[:, 0]
    rank_counts = [int(c) for c in counts.tolist()]
    total = sum(rank_counts)
    if total == 1:
        raise ValueError(
            "SyncBatchNorm: expected more than 1 value per channel when training, got "
            f"{total} over all ranks (per-rank values per channel: {rank_counts})"
        )
    means, m2s = gathered[:, 1:C + 1], gathered[:, C + 1:]
    weights = counts.unsqueeze(1)
    mean = (weights * means).sum(0) / total
    m2 = m2s.sum(0) + (weights * (means - mean).square()).sum(0)
    return GlobalStats(total, mean, m2, rank_counts)


def check_channels_agree(comm: Communicator, num_features: int, device: torch.device) -> None:
    """Raise on every rank if the ranks' layers disagree on the channel count.

    The stats payload's length depends on C, and a collective whose sizes differ between
    ranks aborts the process (gloo) or is undefined (NCCL). So each layer, on its first
    synchronized forward per communicator, gathers a fixed-size header first; after that the
    layer's C is fixed and the single stats gather is safe.
    """
    mine = torch.tensor([num_features], dtype=torch.int64, device=device)
    everyone = torch.empty(comm.world_size, dtype=torch.int64, device=device)
    comm.all_gather(everyone, mine, tag=CHECK_TAG)
    channels = everyone.tolist()
    if any(c != num_features for c in channels):
        raise ValueError(
            f"SyncBatchNorm: ranks disagree on the number of channels (per rank: {channels}; "
            f"rank {comm.rank} has {num_features}). Every rank must run the same layers in the "
            "same order with the same num_features."
        )
