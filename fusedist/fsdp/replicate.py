"""HSDP's second reduction: a unit's gradient shard all-reduced across the replicate group.

Note [replicate all-reduce]
    On a 2-D mesh (``mesh.py``) a unit's shard group holds the parameter pieces and the
    replicate group holds R copies of that shard group. Gathers and reduce-scatters run
    within the shard group as on a 1-D mesh; each reduce-scatter's output (this rank's
    gradient shard, ``reduce_dtype``) is then all-reduced across the replicate group, in
    place, before the all-reduce hook, the division left after the sum and the pieces'
    ``.grad`` -- torch FSDP2's order (``foreach_reduce``), so a hook sees the all-reduced
    shard, as FSDP2's does on HSDP.

    The averaging divides by R*S in total (``grads.reduce_factors`` with ``replicas=R``):
    fp32 and bf16 reduce with ``avg`` twice (over S, then over R, as FSDP2); a
    ``set_gradient_divide_factor`` F, or ``set_force_sum_reduction_for_comms``, sums twice
    and divides by F (default R*S) after; an fp16 ``reduce_dtype`` divides by FSDP2's
    ``pre`` (about sqrt(F)) before the reduce-scatter and the rest after the all-reduce, so
    the fp16 sum over all R*S ranks stays away from overflow (Note [fp16 reduction] in
    grads.py).

    When: a reduction is in two stages, each started at a point every rank reaches in the
    same order. The all-reduce is started (``grads.advance``: wait for the reduce-scatter,
    then issue the all-reduce asynchronously) when the next unit's reductions are issued
    (``UnitGrads.reduce``, in the units' fixed reduction order: Note [rank-independent
    reductions] in grads.py), or at the reduction's finish if none came; it is waited for
    where the reduction is finished, which for a replicated unit is never "because it
    happened to land" -- as for a hooked one, only the oldest-first waits of the in-flight
    cap and the end of backward finish it (``PendingReduce.ready``). So the all-reduce of
    one unit runs while the next unit's backward computes and its reduce-scatter is in
    flight, as FSDP2's all-reduce runs on its own stream, instead of the backward stopping
    for it; replica peers pair the all-reduces up by that shared order, and hooks (which may
    issue collectives) still run at fixed points. It goes through the replicate group's
    communicator, tagged with the unit, so a stalled peer is reported by the same bounded
    waits and stall reports as a stalled reduce-scatter.

    ``set_requires_all_reduce(False)`` (FSDP2's micro-batching switch for HSDP): the
    reduce-scatter runs, the all-reduce does not; the output (pre-divided, not yet
    post-divided, ``reduce_dtype``) is added to a per-section partial sum and the pieces get
    no ``.grad`` (FSDP2 returns before making them). The next backward that all-reduces adds
    the partial sum to its own output first, so one all-reduce carries every micro-batch
    since. ``set_requires_gradient_sync`` sets both switches, as FSDP2's.
    ``reset_iter_state`` drops the partial sums (FSDP2 loses them likewise).

    Global quantities over the pieces need no replicate reduction: after the all-reduce the
    replicas hold the same gradient shard, so a clip's norm is the shard group's (a DTensor
    norm over ``(Replicate(), Shard(0))`` is the same); only GradScaler's found-inf flag is
    also max-reduced across replicas (``holder.py``), so a flag raised on any rank skips the
    step everywhere whatever the values.
"""

from __future__ import annotations

import torch

from .._dtypes import real_pairs
from .memory import COUNTERS

__all__ = ["start_across_replicas"]


@torch.no_grad()
def start_across_replicas(p, out: torch.Tensor):
    """The landed reduce-scatter output ``out`` of ``p`` (a ``grads.PendingReduce`` of a
    replicated unit), with the partial sum of earlier backwards added, and the handle of its
    all-reduce across the replicate group, started here; or ``(None, None)`` when ``p`` was
    issued under ``set_requires_all_reduce(False)`` and ``out`` went into the partial sum
    instead (Note [replicate all-reduce])."""
    grads = p.grads
    if not p.all_reduce:
        grads.keep_partial(p.section, out, p.with_grad)
        return None, None
    partial = grads.take_partial(p.section)
    if partial is not None:
        total, with_grad = partial
        out.add_(total)
        COUNTERS.add_scratch(-total.numel() * total.element_size())
        p.with_grad = sorted(set(p.with_grad).union(with_grad))
    handle = grads.replicate.all_reduce(real_pairs(out), op=p.op, async_op=True,  # (complex: as its real pairs)
                                        tag=f"fully_shard all-reduce {grads.unit.label}")
    return out, handle
