"""Cross-rank BatchNorm statistics: one all-gather of (count, mean, M2), a fixed-order
parallel-Welford combine, and the once-per-layer channel-count agreement check.

Note [bit-identical statistics]
Every rank gathers the same ``(world_size, 2C + 1)`` fp64 tensor and runs the same
reductions on it, so every rank computes the same global mean/variance bit for bit -- which
keeps the running statistics identical across ranks without a broadcast. The combine is the
k-way form of Chan et al.'s parallel update:

    n = sum n_r,   mean = sum n_r mean_r / n,   M2 = sum M2_r + sum n_r (mean_r - mean)^2

which works for any per-rank counts, including 0 (an empty batch contributes nothing) and 1.

Note [the same layer on every rank]
Each gather pairs the ranks' payloads by arrival order only, so ranks that call the layers in
a different order or a different number of times (a layer skipped on some ranks, two layers
of one width called in another order) combine one layer's statistics with another's, without
any error -- torch.nn.SyncBatchNorm does the same. The statistics a training layer has
accumulated name it across ranks: by that note its running statistics and
``num_batches_tracked`` are bit-identical on every rank, and a data-parallel wrapper
broadcasts them besides. So the payload carries a short identity -- ``[1,
num_batches_tracked, sum(|running_mean|), sum(running_var)]`` -- and :func:`combine` refuses,
on every rank alike (they all read the same gathered tensor), a gather whose ranks carry
different ones: counts that differ, or sums more than 0.1% apart. The sums are compared with
that margin, not bit for bit, because a sum over the channels may be associated differently
on different hardware, and half-precision buffers round at 0.1%; two different layers' sums
of absolute values (no cancellation) are much further apart. Layers still at their initial
statistics look alike, so a mix-up is caught from the second training step of the layers
involved. A payload without an identity (a layer
with ``track_running_stats=False``, or the empty batch a rank that ran out of inputs
contributes under ``join()``) starts with 0 and is compared with nothing. The identity rides
in the same message and is read to the host with the counts, which ``combine`` reads anyway.

Note [one backward decision for all ranks]
The backward all-reduces the per-channel sums only when the input gradient is wanted, and a
rank used to decide that from its own input alone. Ranks can differ there: a rank with no
samples hands the layer a fresh ``x.new_zeros(0, C)``, which requires no gradient, while the
others' inputs do. That rank skipped the all-reduce the others waited in (a stall until the
timeout), and its ``dy`` was missing from their sums. So every rank sends, after its
identity, its backward plan: 1 (its input wants a gradient), -1 (no backward will run through
this layer here: grad mode is off, or neither the input nor a parameter requires grad) or 0
(a backward for the parameters only; also what a rank that ran out of inputs sends under
``join()``). Every rank whose backward runs all-reduces when any rank sent 1, contributing its
own sums; a gather with both a 1 and a -1 is refused on every rank in the forward, because the
-1 rank would never join the others' all-reduce.

Note [one width for the backward's sums]
The all-reduced sums are in the input's compute dtype: fp64 for an fp64 input, fp32 for the
others. Ranks whose layers disagree there (a model made ``.double()`` on some ranks only) met
in an all-reduce of different element sizes, which gloo and NCCL cannot match: the ranks
waited out the collective timeout (600 s by default) and failed naming neither the layer nor
the cause. The message's last element is therefore the width in bits of this rank's sums, and
a gather whose ranks will all-reduce with different widths is refused in the forward, on every
rank, naming them. A message without one (0: a rank that ran out of inputs under ``join()``,
which all-reduces in the width its trace recorded) is compared with nothing.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ..comm import Communicator
from ..comm.base import global_note, global_ranks
from ._refusal import check_no_refusal

STATS_TAG = "sync_batch_norm.stats"
GRAD_TAG = "sync_batch_norm.grad"
CHECK_TAG = "sync_batch_norm.check"
# [1, num_batches_tracked, sum(|running_mean|), sum(running_var)]: Note [the same layer on every rank],
# then the backward plan: Note [one backward decision for all ranks], then the width of the backward's
# sums: Note [one width for the backward's sums]
IDENTITY_LEN = 6
WANTS_INPUT_GRAD, NO_BACKWARD = 1.0, -1.0  # backward plans (0.0: a backward for the parameters only)
SUM_MARGIN = 1e-3  # relative: Note [the same layer on every rank]


class GlobalStats(NamedTuple):
    """Statistics of the global batch (fp64, C elements each) and the per-rank counts."""

    count: int
    mean: torch.Tensor
    m2: torch.Tensor
    rank_counts: list[int]


def write_layer_identity(tail: torch.Tensor, num_batches_tracked, running_mean, running_var,
                         backward_plan: float = 0.0, sum_bits: float = 0.0) -> None:
    """Write the identity a training layer sends with its statistics (Note [the same layer on
    every rank]) into ``tail``, the last ``IDENTITY_LEN`` fp64 elements of its message: zeros,
    compared with nothing, when it keeps no running statistics; then this rank's backward plan
    (Note [one backward decision for all ranks]) and the width of its backward's sums (Note [one
    width for the backward's sums]). In place, the sums converting as they
    reduce: a few small device ops instead of a dozen and a concatenation, once per layer and
    forward."""
    tail[4:5].fill_(backward_plan)
    tail[5:6].fill_(sum_bits)
    if num_batches_tracked is None or running_mean is None or running_var is None:
        tail[:4].zero_()
        return
    tail[:1].fill_(1.0)
    tail[1:2].copy_(num_batches_tracked.reshape(1))
    torch.sum(running_mean.abs(), 0, True, dtype=torch.float64, out=tail[2:3])
    torch.sum(running_var, 0, True, dtype=torch.float64, out=tail[3:4])


def gather_messages(message: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """All ranks' messages (a payload and its identity, Note [the same layer on every rank]) as
    a ``(world_size, len)`` tensor, rank order."""
    gathered = torch.empty(comm.world_size * message.numel(), dtype=message.dtype, device=message.device)
    comm.all_gather(gathered, message, tag=STATS_TAG)
    return gathered.view(comm.world_size, message.numel())


def combine(gathered: torch.Tensor, num_features: int, rank_counts: Optional[list] = None) -> GlobalStats:
    """Merge per-rank payloads with the parallel Welford formula (see the note above).

    Reads the per-rank counts to the host (one small device-to-host copy, as torch's
    SyncBatchNorm does) so that a global batch of exactly 1 value per channel fails on every
    rank with the same message instead of producing inf/nan. A global batch of 0 values is
    not an error: BatchNorm returns an empty output for an empty batch (detection heads
    without proposals rely on it), so the caller gets ``count == 0`` and must not use the
    (undefined) mean and M2.
    """
    C = num_features
    if rank_counts is None:  # (else read and checked by the caller: checked_counts)
        rank_counts = checked_counts(gathered, C)
    total = sum(rank_counts)
    means, m2s = gathered[:, 1:C + 1], gathered[:, C + 1:2 * C + 1]
    weights = gathered[:, 0].unsqueeze(1)
    mean = (weights * means).sum(0) / total
    m2 = m2s.sum(0) + (weights * (means - mean).square()).sum(0)
    return GlobalStats(total, mean, m2, rank_counts)


def checked_counts(gathered: torch.Tensor, num_features: int) -> list[int]:
    """The per-rank counts of a gather, read on the host, after the checks :func:`combine`
    describes (the layer identities, a global batch of one value per channel)."""
    return read_gather(gathered, num_features)[0]


def read_gather(gathered: torch.Tensor, num_features: int, comm: Optional[Communicator] = None
                ) -> tuple[list[int], bool]:
    """:func:`checked_counts` and whether the backward all-reduces (Note [one backward decision
    for all ranks]; False for a gather without identities), from one read to the host. ``comm``
    (the gather's) lets errors add global ranks to the group's."""
    C = num_features
    identified = gathered.shape[1] == 2 * C + 1 + IDENTITY_LEN
    host = (gathered[:, [0, *range(2 * C + 1, 2 * C + 1 + IDENTITY_LEN)]] if identified else gathered[:, :1]).tolist()
    check_no_refusal(gathered, [row[0] for row in host], C, comm)  # Note [a refusal on one rank reaches every rank]
    if identified:
        _check_same_layer([row[1:] for row in host], C)
    rank_counts = [int(row[0]) for row in host]
    total = sum(rank_counts)
    if total == 1:
        raise ValueError(
            "SyncBatchNorm: expected more than 1 value per channel when training, got "
            f"{total} over all ranks (per-rank values per channel: {rank_counts})"
        )
    reduces = identified and _reduces_grads([row[5] for row in host], C, comm)
    if reduces:
        _check_sum_widths([row[6] for row in host], C, comm)
    return rank_counts, reduces


def _check_sum_widths(widths: list, num_features: int, comm: Optional[Communicator]) -> None:
    """Raise when the ranks' backward all-reduce would pair sums of different widths (Note [one
    width for the backward's sums])."""
    known = {int(w) for w in widths if w}
    if len(known) <= 1:
        return
    named = global_ranks(comm) if comm is not None else None
    shown = "; ".join(f"ranks {ranks}{global_note(ranks, named)}: {bits}-bit"
                      for bits in sorted(known) for ranks in [[r for r, w in enumerate(widths) if int(w) == bits]])
    raise ValueError(
        f"SyncBatchNorm({num_features}): the ranks' backwards would all-reduce this layer's gradient sums in "
        f"different precisions ({shown}): a float64 input sums in float64, the others in float32. Give the "
        "layer and its input the same dtype on every rank (e.g. model.double() on all ranks or none)."
    )


def _reduces_grads(plans: list, num_features: int, comm: Optional[Communicator]) -> bool:
    """Whether the ranks' backwards all-reduce, refusing plans that would leave ranks waiting
    (Note [one backward decision for all ranks])."""
    wanting = [r for r, plan in enumerate(plans) if plan == WANTS_INPUT_GRAD]
    idle = [r for r, plan in enumerate(plans) if plan == NO_BACKWARD]
    if wanting and idle:
        named = global_ranks(comm) if comm is not None else None
        raise ValueError(
            f"SyncBatchNorm({num_features}): ranks {wanting}{global_note(wanting, named)} want this layer's "
            "input gradient, whose backward all-reduces over every rank of its group, but ranks "
            f"{idle}{global_note(idle, named)} will run no backward through it "
            "(there grad mode is off, or neither the input nor the layer's weight and bias require grad). "
            "Give every rank an input that requires grad (e.g. an empty batch made with new_zeros: "
            "call .requires_grad_() on it), or run the layer under torch.no_grad() on every rank."
        )
    return bool(wanting)


def _same(a: list, b: list) -> bool:
    """Two identities ``[1, count, sum, sum]``: the same count, sums within the margin (NaN
    statistics, a poisoned batch, are alike)."""
    if a[1] != b[1]:
        return False
    for x, y in zip(a[2:4], b[2:4]):  # (a[4:]: the backward plan and width, not part of the identity)
        if not (math.isfinite(x) and math.isfinite(y)):
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                return False
        elif abs(x - y) > SUM_MARGIN * max(abs(x), abs(y)):
            return False
    return True


def _check_same_layer(identities: list, num_features: int) -> None:
    """Raise when the ranks that sent an identity sent different ones (Note [the same layer
    on every rank])."""
    sent = [(r, ident) for r, ident in enumerate(identities) if ident[0] == 1.0]
    if all(_same(ident, sent[0][1]) for _, ident in sent[1:]):
        return
    shown = "; ".join(f"rank {r}: num_batches_tracked={int(ident[1])}, sum(|running_mean|)={ident[2]:.6g}, "
                      f"sum(running_var)={ident[3]:.6g}" for r, ident in sent)
    raise ValueError(
        f"SyncBatchNorm({num_features}): the ranks are not normalizing the same layer in this exchange: "
        f"their layers' running statistics differ ({shown}). Every rank must call the SyncBatchNorm "
        "layers in the same order and the same number of times per training forward (a layer skipped, "
        "repeated or called in another order on some ranks pairs its statistics with another layer's); "
        "or the running statistics were changed on some ranks only (loaded or reset there); or the layer's "
        "momentum differs between ranks (each rank blends the same batch statistics with its own momentum)."
    )


def check_channels_agree(comm: Communicator, num_features: int, device: torch.device,
                         path: Optional[str] = None) -> None:
    """Raise on every rank if the ranks' layers disagree on the channel count; ``path``: the
    layer's name in the converted model, where known, for the message.

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
            f"SyncBatchNorm{'' if not path else f' {path!r}'}: ranks disagree on the number of channels "
            f"(per rank: {channels}; "
            f"rank {comm.rank} has {num_features}). Every rank must run the same layers in the "
            "same order with the same num_features."
        )
