"""Re-bucketing a DDP model's gradients by the order they became ready in its first backward.

Note [layout fixed by a sharded consumer]
    The buckets are built when the model is wrapped, in reverse registration order (the last
    layers' gradients come first). A plain DDP model re-buckets once, after its first
    synchronized backward, by the readiness order rank 0 observed (as torch DDP does); that
    stays inside the reducer: gradient views move with it and nobody else is told. A consumer
    whose own state follows the buckets -- a ZeroRedundancyOptimizer, whose shards are ranges
    of them -- registers with :meth:`Reducer.fix_layout` at its construction: from then on the
    layout is final (Megatron-Core's buffers are never re-bucketed either) and changes only by
    appending buckets for parameters that become trainable (Note [trainable set changes]), so
    the consumer's shards exist from its construction and its first backward is like every
    other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .layout import alias_of

if TYPE_CHECKING:
    from .reducer import Reducer


def rebuild_from_observed(reducer: "Reducer", observed: list[int]) -> None:
    """Re-bucket by the readiness order rank 0 observed, carrying gradient values over.

    Rank 0's order is broadcast so every rank builds the identical layout (ranks can
    observe different orders, and the layouts must match for the collectives to pair).
    """
    n = len(reducer.params)
    order = torch.full((n,), -1, dtype=torch.int64, device=reducer.comm.device)
    seen = list(dict.fromkeys(observed))
    order[: len(seen)] = torch.tensor(seen, dtype=torch.int64)
    reducer.comm.broadcast(order, src=0, tag="ddp bucket rebuild")
    chosen = [i for i in order.tolist() if i >= 0]
    chosen_set = set(chosen)
    rest = [i for i in reversed(range(n)) if i not in chosen_set]
    new_order = chosen + rest
    old = reducer.layout
    new = reducer.build_in_order(new_order, bucket_storage=old.bucket_storage)
    switch_layout(reducer, new)


def switch_layout(reducer: "Reducer", new, notify: bool = True, final: bool = True) -> None:
    """Make ``new`` the reducer's layout, carrying gradient values over (gradient views follow)
    and, with ``notify``, telling the layout's listeners; nothing happens if it has the same
    buckets. ``final=False``: a communication hook's first buckets, rebuilt after the first
    synchronized backward (Note [a hook's first buckets] in comm_hook.py)."""
    old = reducer.layout
    reducer.provisional_layout = not final
    if new.fingerprint() == old.fingerprint():
        reducer.layout_final = final
        return
    for p in reducer.params:
        if not old.is_allocated(old.slots[p].bucket):
            continue  # a released bucket reads as zero, as a newly allocated one does
        new.allocate(new.slots[p].bucket)
        slot = old.grad_view(p)
        view = new.grad_view(p)
        view.copy_(slot)
        grad = p.grad  # the slot follows (a gradient of the user's own stays: Note [gradients the user holds])
        if grad is not None and reducer.config.gradient_as_bucket_view and grad.data_ptr() == slot.data_ptr():
            if grad is slot:  # the same tensor moves onto the new slot: one cached before the rebuild
                old.slots[p].view = alias_of(slot)  # (a no_sync backward first) stays p.grad, as torch's
                with torch.no_grad():  # default ones do; the old layout keeps a tensor of its own (two
                    slot.set_(view)  # holders would count as the user's: Note [gradients the user holds])
                new.slots[p].view = slot
            else:
                p.grad = view
    reducer.layout = new
    reducer.layout_final = final
    reducer._observed_order = None
    reducer.timeline.instant("buckets rebuilt", buckets=len(new.buckets))
    for listener in reducer.layout_listeners if notify else ():
        listener(new)
