"""Gradients compared across ranks at every step without a DDP model, on a parameter all-gather's tail.

Note [gradients compared at every step]
    The first step's comparison (Note [gradients nobody averaged] in grad_agreement.py) catches a
    program that never averages its gradients. One that averaged at first and then stopped -- gradient
    accumulation under torch DDP's ``no_sync()`` on every micro-batch, the last one included, or
    ``require_backward_grad_sync`` left False -- has each shard stepped with its owner's local gradient.
    The all-gathers hand every rank the same parameters, so the ranks stay identical and nothing else
    ever notices that the training went elsewhere. So every later step compares a fingerprint of each
    parameter's gradient (Note [the fingerprint of every step]), without a collective of its own: each
    rank appends its rows -- float64 values, as bytes -- to its slice of one parameter all-gather the
    step makes anyway, the smallest bucket's, and reads every rank's rows from the gathered tail. A
    gather copies, so the rows' bytes, sent as elements of the bucket's dtype, arrive exact; its cost is that bucket
    copied next to the tail and back, which is why a bucket over ``MAX_CARRIER_ELEMENTS`` does not carry
    them: the rows then take an all-gather of their own (a step over buckets that large hides one more
    small round).

    Every rank holds every rank's rows, so every rank reaches the same verdict with no further exchange
    and raises the same error -- naming the step, the parameters and two ranks -- once the gathers have
    landed, at the end of the step: the update is applied by then (the error says so). Every rank must
    agree on whether a step carries rows, or the gathers differ in size: the choice depends only on
    what the ranks agree on (the first comparison's verdict, the layout, ``FUSEDIST_CHECKS``).

    Host (gloo) gradients only: the rows are made and judged on the host, which for CUDA gradients
    would synchronize the host with the device twice a step (the norms, the gathered tail). On CUDA the
    first step's comparison stands alone; a device-side verdict read once it is ready (as the pipeline's
    step check is read) would extend it there.

Note [the fingerprint of every step]
    The first comparison's fingerprint (float64 sums and a projection on a hashed +-1 pattern) costs
    about ten passes over every gradient: as much as the optimizer's own step, every step. Here each
    parameter's fingerprint is its gradient's L2 norm, accumulated in float32 (float64 for float64
    gradients), all of one dtype in one ``_foreach_norm``: one pass. Averaged gradients are bitwise
    equal on every rank, so their norms differ at most by the summation order (``NORM_RTOL``, also
    for half-precision gradients, whose norms are float32 sums too); gradients of different batches
    differ in norm by far more. Given up against the first comparison: two different gradients of the
    same norm (within ``NORM_RTOL``) pass as alike -- the first step, which has the projection, catches
    a program that never averages.

Note [the fixed cost of the fingerprints]
    On a small model the Python around the norms cost about as much as the norms: a list per parameter
    filled in a loop and made a tensor, and every rank's gathered rows turned back into lists
    (``.tolist()``) to be compared in Python at every step. The rows are now one flat list made a tensor
    at once, and the gathered rows are compared as bytes first: every rank's the same (averaged gradients'
    norms are bitwise equal) is the verdict, and only rows that differ are read into Python to say how.
    (20 parameters, 2 ranks, a shared host: the rows ~150 -> ~110 us, the gathered rows' reading ~15-40
    -> ~8 us; most of what is left is the one ``_foreach_norm``, a kernel per gradient.)
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import grad_agreement as ga

#: Largest bucket (elements) whose all-gather carries the rows; above it they are gathered on their own.
MAX_CARRIER_ELEMENTS = 1 << 20
#: How far apart (relative to the larger) the norms of alike gradients may lie: float32 sums in another order.
NORM_RTOL = 1e-4
#: Parameters named in the error (the rest counted).
NAMED = 4


@torch.no_grad()
def local_rows(zero) -> torch.Tensor:
    """This rank's ``[present, non-finite, norm, 0]`` of each parameter's gradient (float64, host): the
    norms of each dtype's gradients in one ``_foreach_norm`` (Note [the fingerprint of every step]),
    written into one flat list made a tensor at once (Note [the fixed cost of the fingerprints])."""
    params = zero._params
    flat = [0.0] * (len(params) * ga.WIDTH)
    by_dtype: dict = {}
    for index in zero._trainable:  # (as the first comparison: the sharded parameters only)
        grad = params[index].grad
        if grad is None:
            continue
        flat[index * ga.WIDTH + ga.PRESENT] = 1.0
        if not grad.is_sparse:  # (a sparse one is refused by the step on every rank: nothing to compare)
            by_dtype.setdefault(grad.dtype, []).append((index, grad))
    for dtype, members in by_dtype.items():
        grads = [g for _, g in members]
        if dtype.is_complex:
            grads = [torch.view_as_real(g.resolve_conj()) for g in grads]
        real = dtype.to_real() if dtype.is_complex else dtype  # (a complex128 gradient's norm in float64)
        accumulate = torch.float64 if real == torch.float64 else torch.float32
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=accumulate)).tolist()
        for (index, _), norm in zip(members, norms):
            if math.isfinite(norm):
                flat[index * ga.WIDTH + ga.NORM] = norm
            else:
                flat[index * ga.WIDTH + ga.NONFINITE] = 1.0
    return torch.tensor(flat, dtype=torch.float64).reshape(len(params), ga.WIDTH)


def verdict(zero, step: int, every: list) -> Optional[RuntimeError]:
    """The error every rank raises where the gathered rows (``every[rank][param]``) of ``step`` differ, or None."""
    if all(rows == every[0] for rows in every[1:]):  # (the common case, read without comparing fields)
        return None
    differing = []
    for index in range(len(zero._params)):
        per_rank = [rows[index] for rows in every]
        high = [max(column) for column in zip(*per_rank)]
        low = [min(column) for column in zip(*per_rank)]
        rtol = NORM_RTOL  # (norms in float32 at least, of bitwise-equal gradients: the half types' too)
        why = ga._differs(high, low, rtol)
        if why is not None:
            differing.append((index, why, ga._pair(per_rank, rtol)))
    if not differing:
        return None
    index, why, (a, b) = differing[0]
    named = [zero._param_name(i) for i, _, _ in differing[:NAMED]]
    more = f" and {len(differing) - NAMED} more" if len(differing) > NAMED else ""
    return RuntimeError(
        f"ZeroRedundancyOptimizer (rank {zero.rank}): at step {step} the gradients differ across ranks "
        f"at {len(differing)} parameter(s): {'; '.join(named)}{more} (the first: {why}: rank {a} has "
        f"{ga._describe(every[a][index])}, rank {b} {ga._describe(every[b][index])}). They were alike at the "
        "first step, so something stopped averaging them: this step has been applied with each rank's own "
        "gradients on the slice it owns, so the parameters are now a mix of several ranks' updates. Under "
        "torch's DistributedDataParallel, run the last micro-batch's backward of each step outside "
        "no_sync() (and leave require_backward_grad_sync True for it); if you average the gradients "
        "yourself, do so before every step(). Restore the last checkpoint before this step to go on.")


class CarriedRows:
    """This rank's fingerprints for one step's gathers, and what the gathered rows say."""

    def __init__(self, zero, step: int):
        self.zero = zero
        self.rows = local_rows(zero)  # [parameters, WIDTH]
        self.step = step
        shards = zero._partition.bucket_shards
        smallest = min(shards, key=lambda bs: (bs.bucket.numel, bs.bucket.index)) if shards else None
        fits = smallest is not None and smallest.bucket.numel <= MAX_CARRIER_ELEMENTS
        self.carrier = smallest.bucket.index if fits else None  # None: the rows' own all-gather

    def gather_with(self, comm, world_size: int, output: torch.Tensor, shard: torch.Tensor, tag: str,
                    buffers: dict):
        """Start the all-gather of ``shard`` into ``output`` with this rank's rows behind the shard (their
        bytes as the shard's dtype: the gather's messages are as they would be, a few elements longer)."""
        shard = shard.reshape(-1)
        tail = self.rows.reshape(-1).view(torch.uint8).view(shard.dtype)
        width = shard.numel() + tail.numel()
        received = _buffer(buffers, world_size * width, shard.dtype, shard.device)
        sent = received[comm.rank * width:(comm.rank + 1) * width]  # (in place, as the bucket's own gather)
        sent[:shard.numel()].copy_(shard)
        sent[shard.numel():].copy_(tail)
        handle = comm.all_gather(received, sent, async_op=True, tag=tag)
        return _CarriedGather(self, handle, received, output, shard.numel(), world_size)

    def gather_alone(self, comm, world_size: int, buffers: dict):
        """Start the rows' own all-gather (no bucket small enough to carry them)."""
        width = self.rows.numel()
        received = _buffer(buffers, world_size * width, self.rows.dtype, comm.device)
        sent = received[comm.rank * width:(comm.rank + 1) * width]
        sent.copy_(self.rows.reshape(-1))
        handle = comm.all_gather(received, sent, async_op=True, tag="zero gradient fingerprints")
        return _CarriedGather(self, handle, received, None, 0, world_size)

    def verdict(self, every: list) -> Optional[RuntimeError]:
        """:func:`verdict` on the rows every rank sent for this step."""
        return verdict(self.zero, self.step, every)


def _buffer(buffers: dict, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The gather's landing buffer, kept from step to step (the layout is fixed: the same size every
    step), as the bucket's own gather lands in the same parameters: a fresh buffer each step made the
    carrying gather measurably slower on the host (about 1 ms a step, 2 ranks)."""
    key = (numel, dtype, device)
    if key not in buffers:
        buffers.clear()  # (the layout grew: the old one is not used again)
        buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffers[key]


class _CarriedGather:
    """An all-gather in flight with rows behind each rank's slice: its ``wait`` puts the slices in place
    and records the verdict on the rows (Note [gradients compared at every step])."""

    def __init__(self, rows: CarriedRows, handle, received, output, shard_numel: int, world_size: int):
        self.rows, self.handle, self.received, self.output = rows, handle, received, output
        self.shard_numel, self.world_size = shard_numel, world_size

    def wait(self) -> None:
        self.handle.wait()
        per_rank = self.received.view(self.world_size, -1)
        if self.output is not None:
            self.output.view(self.world_size, -1).copy_(per_rank[:, :self.shard_numel])
        tails = per_rank[:, self.shard_numel:].cpu()
        raw = tails.view(torch.uint8)  # (Note [the fixed cost of the fingerprints]: alike rows compared as bytes)
        if all(torch.equal(raw[0], raw[r]) for r in range(1, self.world_size)):
            self.rows.zero._gatherer.refusal = None
            return
        every = tails.contiguous().view(torch.uint8).view(torch.float64).view(self.world_size, -1, ga.WIDTH)
        self.rows.zero._gatherer.refusal = self.rows.verdict(every.tolist())
