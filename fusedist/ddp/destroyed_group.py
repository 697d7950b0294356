"""A DDP forward on a process group that torch.distributed destroyed or aborted, or that a failure gave up.

Note [a forward after its group was destroyed]
    torch's DistributedDataParallel holds its process group itself and keeps using it after
    ``destroy_process_group()``; fusedist's communicator lets go of a destroyed group and refuses every later
    collective on it (Note [a released communicator lets go of its group] in fusedist/comm/released_group.py).
    So a training forward after the destroy ran, and the refusal came only at the backward's first bucket,
    naming a communicator and a bucket rather than the model -- or at the forward's buffer broadcast where the
    model had buffers, and not at all for a model without. Now such a forward is refused at once, naming the
    destroyed group and what to do: wrap ``model.module`` again on a live group. "Destroyed" is the
    communicator's own flag, set by the destroy itself (``released``; ``closed`` for the direct NCCL one): one
    attribute read per forward, no collective. A forward that would not communicate -- without gradients and
    with no buffer broadcast due -- runs, as evaluation through ``model.module`` would.

Note [a forward after its group was aborted]
    The same held for a group that was aborted rather than destroyed, and the refusal that came later named a
    destroy that never happened: torch's ``_abort_process_group`` (gloo's abort ends nothing: torch's DDP trains
    on), or fusedist's own abort of a group one of whose collectives failed -- a peer's abort or exit, a
    timeout -- after which every collective of the group is refused (Note [refusing collectives of a given-up
    communicator] in fusedist/comm/torch_comm.py). Now such a forward is refused too, naming the abort: on this
    rank (the communicator's ``ended_by_abort``, set by the abort: Note [a communicator remembers its group's
    abort] in fusedist/comm/group_ends.py), or the failure and the peer it names (``abort_reason``). Each is
    read from the communicator, no collective and no store call; a forward that would not communicate runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm.base import CollectiveError
from ..comm.released_group import which_group


def group_destroyed(comm) -> bool:
    """Whether ``comm``'s process group was destroyed (its communicator released or closed at the destroy)."""
    return getattr(comm, "released", False) or getattr(comm, "closed", False)


def group_aborted(comm) -> Optional[str]:
    """Why ``comm``'s process group can no longer run collectives after an abort (Note [a forward after its group
    was aborted]), or None while it was not aborted."""
    here = getattr(comm, "ended_by_abort", None)
    if here is not None:
        return here
    if getattr(comm, "aborted", False):
        return f"an earlier collective of it failed ({comm.abort_reason or 'no reason recorded'})"
    return None


def refuse_forward_on_destroyed_group(wrapper) -> None:
    """Raise when ``wrapper``'s group was destroyed or aborted and this forward would communicate (it trains, or
    it broadcasts buffers): Note [a forward after its group was destroyed], Note [a forward after its group was
    aborted]."""
    comm = wrapper.comm
    aborted = group_aborted(comm)
    if aborted is None and not group_destroyed(comm):
        return
    if not (torch.is_grad_enabled() or wrapper.will_sync_module_buffers() or wrapper._join_config.enable):
        return
    which = which_group(getattr(comm, "_on_default_group", False))
    if aborted is not None:
        raise CollectiveError(
            f"fusedist.DistributedDataParallel (rank {comm.rank} of {comm.world_size}): forward refused: this "
            f"model's {which} can no longer run collectives: {aborted}; gradients and buffers cannot be "
            "synchronized over it. Re-create the process group on every rank "
            "(torch.distributed.destroy_process_group() + init_process_group(), or a new "
            "torch.distributed.new_group()) and wrap the module again on it -- "
            "fusedist.DistributedDataParallel(model.module, process_group=<the new group>) --, restart the job "
            "(torchrun --max-restarts), or evaluate through model.module", op="forward", rank=comm.rank)
    raise RuntimeError(
        f"fusedist.DistributedDataParallel (rank {comm.rank} of {comm.world_size}): forward refused: this model's "
        f"{which} was destroyed (torch.distributed.destroy_process_group()), so it can no longer synchronize "
        "gradients or buffers. Wrap the module again on a live group -- "
        "fusedist.DistributedDataParallel(model.module, process_group=<a live group>) -- or evaluate through "
        "model.module")
