"""The re-bucketing at the end of the synchronized backward after ``requires_grad`` flags changed
(Note [trainable set changes] in trainable.py): the ranks agree, the newly trainable parameters'
gradients are averaged once outside the buckets, and the layout grows or is rebuilt."""

from __future__ import annotations

import zlib
from collections import OrderedDict

import torch

from ..ownership import register_data_parallel
from .._dtypes import real_pairs
from .layout import alias_of, append_buckets, layout_of, sparse_gradient_error
from .strategy import bucket_divide_factors, from_wire, to_wire


def apply_change(reducer) -> None:
    """At the end of the synchronized backward after the flags changed: agree, average the
    newly trainable parameters' gradients, re-bucket (Note [trainable set changes])."""
    tracker = reducer.tracker
    flags = tracker.target
    for observer in reducer.observers:  # raises RankMismatchError if the ranks changed different sets
        observer.agreement_point(reducer)
    names = dict(zip(tracker.params, tracker.names))
    wanted = [p for p, f in zip(tracker.params, flags) if f]
    newly = [p for p in wanted if not reducer.is_active(p)]
    _average(reducer, newly, names)
    reducer.params_without_grad += [p for p in newly if p.grad is None]
    if reducer.append_only or reducer.strategy.keeps_buckets:
        _grow(reducer, wanted, newly, names)
    else:
        _rebuild(reducer, wanted, names)
    reducer.caught_up = newly
    reducer.frozen_now = set()
    tracker.layout_flags, tracker.layout_crc = flags, tracker.target_crc
    tracker.target = None
    owner = tracker.owner()
    register_data_parallel(newly, owner)  # the optimizer guard and ZeRO find the wrapper
    reducer.timeline.instant("trainable set changed", added=len(newly))
    for listener in reducer.layout_listeners:
        listener(reducer.layout)


@torch.no_grad()
def _average(reducer, params: list, names: dict) -> None:
    """Average ``params``' local gradients across ranks (None where no rank has one)."""
    if not params:
        return
    comm, world = reducer.comm, reducer.world_size
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise sparse_gradient_error(comm.rank, names[p])
    # The used map, and each parameter's size and dtype as [v, -v] (MAX gives every rank max and min):
    # the averages below then carry parts every rank has compared, so they post no fingerprints.
    shapes = [v for p in params for v in (p.numel(), _dtype_code(p.dtype))]
    has = torch.tensor([p.grad is not None for p in params] + shapes + [-v for v in shapes], dtype=torch.int64,
                       device=comm.device)
    if world > 1:
        comm.all_reduce(has, op="max", tag="ddp unfrozen used-map")
    reduced = has.tolist()
    used = [bool(v) for v in reduced[:len(params)]]
    _refuse_different_parameters(params, names, reduced[len(params):], comm.rank)
    by_dtype: "OrderedDict[torch.dtype, list]" = OrderedDict()
    for p, u in zip(params, used):
        if u:
            by_dtype.setdefault(p.dtype, []).append(p)
        else:
            p.grad = None
    for dtype, group in by_dtype.items():
        reduce_dtype = reducer.config.reduce_dtype or dtype
        pre, post = bucket_divide_factors(reducer, reduce_dtype)  # as the buckets (join may change it)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group])
        flat = flat.to(comm.device)  # a fresh tensor: reduced in place unless converted
        wire = to_wire(flat, reduce_dtype).div_(pre)  # (Note [complex buckets] in strategy.py)
        if world > 1:  # (sizes and dtypes compared above: Note [parts a caller checked] in fusedist/comm/base.py)
            comm.all_reduce(real_pairs(wire), tag=f"ddp unfrozen gradients {dtype}", parts_checked=True)
        if post != 1.0:
            wire.div_(post)
        from_wire(flat, wire)
        offset = 0
        for p in group:
            average = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
            if p.grad is not None and p.grad.shape == p.shape:  # the same tensor, as torch keeps p.grad
                p.grad.copy_(average)
            else:
                p.grad = average.to(device=p.device, copy=True)


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


def _refuse_different_parameters(params: list, names: dict, bounds: list, rank: int) -> None:
    """Raise on every rank (each holds the same bounds) where the ranks' newly trainable parameters
    differ in size or dtype: their averages would not pair (gloo ends the processes on another size)."""
    half = len(bounds) // 2
    differ = []
    for j, p in enumerate(params):
        high, low = bounds[2 * j:2 * j + 2], [-v for v in bounds[half + 2 * j:half + 2 * j + 2]]
        if high[0] != low[0]:
            differ.append(f"'{names[p]}' ({p.numel()} elements here, {low[0]}..{high[0]} across ranks)")
        elif high[1] != low[1]:
            differ.append(f"'{names[p]}' ({p.dtype} here, another dtype on some ranks)")
    if differ:
        raise RuntimeError(
            f"fusedist.DistributedDataParallel (rank {rank}): the parameters that became trainable differ in size or "
            f"dtype across ranks: {', '.join(differ[:10])}: different parameters were unfrozen on different ranks "
            "(with FUSEDIST_CHECKS=0 the step check that names them is off), or they were replaced on some ranks. "
            "Change requires_grad of the same parameters on every rank")


def _carry(reducer, old, new, params) -> None:
    """Move gradient values from ``old`` to ``new`` for ``params`` (views follow)."""
    as_view = reducer.config.gradient_as_bucket_view
    for p in params:
        if p not in new.slots:
            continue
        bucket = new.slots[p].bucket
        src = None
        if p in reducer.caught_up_now:
            src = p.grad
        elif p in old.slots and old.is_allocated(old.slots[p].bucket):
            src = old.grad_view(p)
        if src is None:
            continue
        if not new.is_allocated(bucket):
            if p in reducer.caught_up_now:
                continue  # per-bucket storage (ZeRO stage 2): the averaged gradient stays in p.grad
            new.allocate(bucket)
        view = new.grad_view(p)
        was_view = p.grad is not None and p.grad.data_ptr() == src.data_ptr()
        view.copy_(src)
        if as_view and was_view:
            _move_onto(p.grad, view, old.slots.get(p), new.slots[p])


def _grow(reducer, wanted: list, newly: list, names: dict) -> None:
    """Append-only: new buckets for parameters not in the layout; frozen ones go inactive."""
    old = reducer.layout
    wanted_set = set(wanted)
    joining = [p for p in newly if p not in reducer.index_of]
    buckets = append_buckets(old.buckets, list(reversed(joining)), [names[p] for p in reversed(joining)],
                             bucket_cap_bytes=reducer.config.bucket_caps_bytes()[-1],
                             world_size=reducer.world_size)
    new = layout_of(buckets, reducer.device, old.bucket_storage)
    reducer.add_params(joining, [names[p] for p in joining])
    reducer.caught_up_now = set(newly)
    _carry(reducer, old, new, reducer.params)
    reducer.caught_up_now = set()
    reducer.layout = new
    reducer.inactive = {p for p in reducer.params if p not in wanted_set}
    _zero_inactive(reducer)


def _zero_inactive(reducer) -> None:
    """Inactive slots must read as zero in the bucket collectives; their gradients stay the
    user's (a view into the bucket is replaced by a copy first)."""
    layout = reducer.layout
    for p in reducer.inactive:
        if not layout.is_allocated(layout.slots[p].bucket):
            continue
        _move_off(p, layout.slots[p])
        layout.grad_view(p).zero_()


def _move_onto(grad: torch.Tensor, view: torch.Tensor, old_slot, new_slot) -> None:
    """Make ``grad`` (``p.grad``, on its old slot's memory) the tensor of ``new_slot`` (whose tensor
    is ``view``, holding the values): the same object stays ``p.grad``, as torch keeps it across
    steps, so a reference an optimizer or the user holds sees the next averages. The old layout
    keeps a tensor of its own (two holders would count as the user's: Note [gradients the user
    holds] in held_grads.py)."""
    if old_slot is not None and old_slot.view is grad:
        old_slot.view = alias_of(grad)
    with torch.no_grad():
        grad.set_(view)
    new_slot.view = grad


def _move_off(p, slot) -> None:
    """Move ``p.grad``, where it is on ``slot``'s memory, onto a copy of its own (the same object:
    a frozen parameter's gradient is the user's, as torch leaves it); the slot gets a tensor of its own."""
    grad = p.grad
    if grad is None or slot.view is None or grad.data_ptr() != slot.view.data_ptr():
        return
    if slot.view is grad:
        slot.view = alias_of(grad)
    with torch.no_grad():
        grad.set_(grad.clone())


def _rebuild(reducer, wanted: list, names: dict) -> None:
    """Plain DDP: a layout over the trainable parameters only, in the current bucket order
    with the new ones last; the readiness order is observed again at the next backward."""
    old = reducer.layout
    wanted_set = set(wanted)
    for p in reducer.params:  # a frozen gradient would keep the old buffers alive
        if p not in wanted_set and p in old.slots:
            _move_off(p, old.slots[p])
    order = [p for b in old.buckets for p in b.params if p in wanted_set]
    placed = set(order)
    order += [p for p in reversed(wanted) if p not in placed]
    reducer.caught_up_now = {p for p in wanted if not reducer.is_active(p)}
    reducer.set_params(list(reversed(order)), [names[p] for p in reversed(order)])
    new = reducer.build_in_order(list(reversed(range(len(order)))), bucket_storage=old.bucket_storage)
    _carry(reducer, old, new, reducer.params)
    reducer.caught_up_now = set()
    reducer.layout = new
    reducer.inactive = set()
    reducer.layout_final = False
