"""A DDP forward on a process group that torch.distributed destroyed.

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
"""

from __future__ import annotations

import torch


def group_destroyed(comm) -> bool:
    """Whether ``comm``'s process group was destroyed (its communicator released or closed at the destroy)."""
    return getattr(comm, "released", False) or getattr(comm, "closed", False)


def refuse_forward_on_destroyed_group(wrapper) -> None:
    """Raise when ``wrapper``'s group was destroyed and this forward would communicate (it trains, or it
    broadcasts buffers): Note [a forward after its group was destroyed]."""
    if not group_destroyed(wrapper.comm):
        return
    if not (torch.is_grad_enabled() or wrapper.will_sync_module_buffers() or wrapper._join_config.enable):
        return
    comm = wrapper.comm
    which = "default process group" if getattr(comm, "_on_default_group", False) else "process group"
    raise RuntimeError(
        f"fusedist.DistributedDataParallel (rank {comm.rank} of {comm.world_size}): forward refused: this model's "
        f"{which} was destroyed (torch.distributed.destroy_process_group()), so it can no longer synchronize "
        "gradients or buffers. Wrap the module again on a live group -- "
        "fusedist.DistributedDataParallel(model.module, process_group=<a live group>) -- or evaluate through "
        "model.module")
